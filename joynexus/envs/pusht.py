"""gym-pusht adapter (``gym_pusht/PushT-v0``): 2-D pushing, action = target (x, y) of the pusher in [0, 512].

* no cameras   -> ``obs_type="state"``: state = [agent x, agent y, block x, block y, block angle].
* camera "top" -> ``obs_type="pixels_agent_pos"``: the top-down image, state = [agent x, agent y].

Rewards: gym-pusht's own reward is the goal coverage scaled to [0, 1] (so "dense" and
"normalized_dense" are the same signal); "sparse" is 1.0 on success, else 0.0.

``PushT-reach-v0`` is the same simulation with an easier, shaped objective — move the pusher to
the T-shaped block — so RL can show learning within minutes on a CPU: state = [agent x, agent y,
block x, block y] scaled to [-1, 1] (with or without the camera), dense reward = minus the
pusher-block distance / 512 per step, success (and episode end) within 40 px. 50 steps by default.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from joynexus.envs.base import (
    EnvObservation,
    SimulatorAdapter,
    SimulatorConfig,
    SimulatorSpec,
    StepResult,
    hwc_uint8_to_chw_float,
    register_simulator,
    scalar_info,
)

__all__ = ["PUSHT_INSTRUCTION", "PushTAdapter"]

PUSHT_INSTRUCTION = "push the T-shaped block onto the target"
REACH_TASK = "PushT-reach-v0"
REACH_INSTRUCTION = "move the pusher to the T-shaped block"
_REACH_SUCCESS_PX = 40.0
_TASKS = ("PushT-v0", "gym_pusht/PushT-v0", REACH_TASK)
_CAMERAS = ("top",)
_DEFAULT_MAX_STEPS = 300  # gym-pusht's registered horizon
_REWARD_MODES = ("dense", "normalized_dense", "sparse")
_VIDEO_SIDE = 256  # render() frame side (gym-pusht's default 680 is 1.4 MB a frame)


@register_simulator("pusht")
class PushTAdapter(SimulatorAdapter):
    def __init__(self, config: SimulatorConfig) -> None:
        super().__init__(config)
        if config.task not in _TASKS:
            raise ValueError(f"task={config.task!r} is not a gym-pusht task; allowed tasks: {list(_TASKS)}")
        unknown = [c for c in config.cameras if c not in _CAMERAS]
        if unknown:
            raise ValueError(f"cameras: {unknown} not available in {config.task}; available cameras: {list(_CAMERAS)}")
        if config.control_mode is not None:
            raise ValueError(f"control_mode={config.control_mode!r}: gym-pusht has one controller; leave it None")
        self._reach = config.task == REACH_TASK
        self._reward_mode = config.reward_mode or "dense"
        if self._reward_mode not in _REWARD_MODES:
            raise ValueError(f"reward_mode={self._reward_mode!r} is not supported by pusht; supported: {_REWARD_MODES}")

        os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pygame's pkg_resources deprecation notice
            from gym_pusht.envs import PushTEnv

        height, width = config.image_size
        # The bare env class, not gym.make: no gym wrappers (we apply the horizon ourselves).
        self._env = PushTEnv(
            obs_type="pixels_agent_pos" if config.cameras else "state",
            observation_width=width,
            observation_height=height,
            visualization_width=_VIDEO_SIDE,  # render(): evaluation videos' frames
            visualization_height=_VIDEO_SIDE,
        )
        space = self._env.action_space
        self.spec = SimulatorSpec(
            simulator=self.name,
            task=REACH_TASK if self._reach else "PushT-v0",
            instruction=REACH_INSTRUCTION if self._reach else PUSHT_INSTRUCTION,
            cameras=tuple(config.cameras),
            image_size=(height, width),
            state_dim=4 if self._reach else (2 if config.cameras else 5),
            action_dim=int(space.shape[0]),
            action_low=tuple(float(x) for x in space.low),
            action_high=tuple(float(x) for x in space.high),
            max_episode_steps=int(config.max_episode_steps or (50 if self._reach else _DEFAULT_MAX_STEPS)),
            reward_mode=self._reward_mode,
            control_mode=None,
        )

    def _convert(self, raw: Any) -> EnvObservation:
        if self.config.cameras:
            images = {cam: hwc_uint8_to_chw_float(raw["pixels"]) for cam in self.config.cameras}
            state = raw["agent_pos"]
        else:
            images, state = {}, raw
        if self._reach:
            positions = np.asarray([*self._env.agent.position, *self._env.block.position], dtype=np.float32)
            return EnvObservation(images=images, state=positions / 256.0 - 1.0, instruction=REACH_INSTRUCTION)
        return EnvObservation(images=images, state=np.asarray(state, dtype=np.float32), instruction=PUSHT_INSTRUCTION)

    def _reach_distance(self) -> float:
        agent, block = self._env.agent.position, self._env.block.position
        return float(np.hypot(agent[0] - block[0], agent[1] - block[1]))

    def _reset(self, seed: int | None) -> EnvObservation:
        raw, _ = self._env.reset(seed=seed)
        return self._convert(raw)

    def _step(self, action: np.ndarray) -> StepResult:
        raw, reward, terminated, truncated, info = self._env.step(action.astype(np.float64))
        success = bool(info.get("is_success", False))
        if self._reach:
            distance = self._reach_distance()
            success = distance < _REACH_SUCCESS_PX
            terminated = terminated or success
            reward = -distance / 512.0
            info = {**info, "reach_distance": distance}
        if self._reward_mode == "sparse":
            reward = 1.0 if success else 0.0
        return StepResult(
            observation=self._convert(raw),
            reward=float(reward),
            terminated=bool(terminated),
            truncated=bool(truncated),
            success=success,
            info=scalar_info(info),
        )

    def render_frame(self) -> np.ndarray:
        return np.ascontiguousarray(self._env.render(), dtype=np.uint8)

    def close(self) -> None:
        env = getattr(self, "_env", None)
        if env is not None:
            self._env = None
            env.close()
