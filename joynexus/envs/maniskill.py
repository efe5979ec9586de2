"""ManiSkill3 adapter: CPU physics (``physx_cpu``), one environment per process.

Observation modes (mani-skill 3.0.1):

* no cameras  -> ``obs_mode="state_dict"``: state = agent proprioception (qpos, qvel) + the task's
  extras *including* privileged object poses, because a state-only policy cannot see the cube.
* cameras     -> ``obs_mode="rgb"``: state = proprioception + the task's non-privileged extras
  (tcp pose, goal position, ...), as ManiSkill gives visual policies; objects come from pixels.

``state_dim`` in the spec says which one a session got.

Assets: some tasks (YCB objects, ReplicaCAD scenes, partnet-mobility, some robots) need a download,
and ManiSkill then asks ``(y|n)`` on stdin. A service must never do that: `missing_assets` checks
ManiSkill's own asset registry (the env spec's and the default robot's ``asset_download_ids``)
before anything is built, and while building, ManiSkill's prompt is replaced by a function that
raises `AssetDownloadRefused` and a missing file under ManiSkill's asset dir is reported the same
way. Nothing here ever downloads.

SAPIEN creates a Vulkan device even for state observations; see scripts/install-system-deps.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from joynexus.envs.base import (
    AssetDownloadRefused,
    EnvObservation,
    SimulatorAdapter,
    SimulatorConfig,
    SimulatorSpec,
    SimulatorUnavailable,
    StepResult,
    hwc_uint8_to_chw_float,
    register_simulator,
    scalar_info,
)

__all__ = ["MANISKILL_INSTRUCTIONS", "ManiSkillAdapter", "missing_assets", "no_asset_prompts"]

# Natural-language instructions per task. Other asset-free tasks run with one derived from the id.
MANISKILL_INSTRUCTIONS: dict[str, str] = {
    "PickCube-v1": "pick up the red cube and move it to the green goal position",
    "PushCube-v1": "push the cube to the goal region",
    "PullCube-v1": "pull the cube back to the goal region",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "PokeCube-v1": "use the peg to poke the cube to the goal region",
    "PlaceSphere-v1": "place the sphere into the bin",
    "PegInsertionSide-v1": "insert the peg into the hole in the box",
    "LiftPegUpright-v1": "lift the peg and stand it upright",
    "PullCubeTool-v1": "use the tool to pull the cube closer",
    "PlugCharger-v1": "plug the charger into the receptacle",
    "RollBall-v1": "roll the ball to the goal region",
    "StackPyramid-v1": "stack the cubes into a pyramid",
    "PushT-v1": "push the T-shaped block onto the target",
}

_DOWNLOAD_HINT = (
    " (or have an operator pre-install them with `python -m mani_skill.utils.download_asset <id>` into "
    "$MS_ASSET_DIR, default ~/.maniskill/data)"
)
_VULKAN_HINT = (
    "ManiSkill3 (SAPIEN) needs a Vulkan device even for state observations; on a CPU-only Debian "
    "bookworm host run scripts/install-system-deps (Mesa >= 25 lavapipe from bookworm-backports; "
    "bookworm's own Mesa 22.3.6 is rejected)"
)


def _instruction_for(task: str) -> str:
    if task in MANISKILL_INSTRUCTIONS:
        return MANISKILL_INSTRUCTIONS[task]
    words = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", task.split("-v")[0]).lower()
    return f"{words} task"


def _registered_envs() -> dict[str, Any]:
    import mani_skill.envs  # noqa: F401  (registers every task)
    from mani_skill.utils.registration import REGISTERED_ENVS

    return REGISTERED_ENVS


def _default_robot_uids(env_cls: type) -> list[str]:
    param = inspect.signature(env_cls.__init__).parameters.get("robot_uids")
    if param is None or param.default is inspect.Parameter.empty or param.default is None:
        return []
    default = param.default
    return [default] if isinstance(default, str) else [u for u in default if isinstance(u, str)]


def missing_assets(task: str) -> list[str]:
    """Asset ids (or files) `task` needs that are not on disk, per ManiSkill's own asset registry.

    Raises ValueError for a task ManiSkill does not know.
    """
    envs = _registered_envs()
    if task not in envs:
        raise ValueError(f"task={task!r} is not a ManiSkill task; known tasks include {sorted(envs)[:12]} ...")
    from mani_skill.agents.registration import REGISTERED_AGENTS
    from mani_skill.utils import assets

    def expand(asset_id: str) -> list[str]:
        if asset_id in assets.DATA_GROUPS:
            return assets.expand_data_group_into_individual_data_source_ids(asset_id)
        return [asset_id]

    spec = envs[task]
    ids = [i for a in (spec.asset_download_ids or []) for i in expand(a)]
    missing_files: list[str] = []
    for uid in _default_robot_uids(spec.cls):
        agent = REGISTERED_AGENTS.get(uid)
        if agent is None:
            continue
        ids += [i for a in (agent.asset_download_ids or []) for i in expand(a)]
        path = getattr(agent.agent_cls, "urdf_path", None) or getattr(agent.agent_cls, "mjcf_path", None)
        if path and not os.path.exists(str(path)):
            missing_files.append(f"robot {uid} ({path})")
    missing = sorted({i for i in ids if i in assets.DATA_SOURCES and not assets.is_data_source_downloaded(i)})
    return missing + missing_files


@contextlib.contextmanager
def no_asset_prompts(task: str) -> Iterator[None]:
    """While active, ManiSkill's ``(y|n)`` download prompt raises `AssetDownloadRefused` instead of
    reading stdin, and a missing file under ManiSkill's asset dir is reported the same way."""
    from mani_skill import ASSET_DIR
    from mani_skill.utils import download_asset

    def refuse(message: str) -> bool:
        raise AssetDownloadRefused("maniskill", task, [message.split(" Would you like")[0].strip()], _DOWNLOAD_HINT)

    original = download_asset.prompt_yes_no
    download_asset.prompt_yes_no = refuse  # base_agent and registration call it through the module
    try:
        yield
    except FileNotFoundError as exc:
        # Scene datasets (ReplicaCAD, AI2THOR) are opened without a prompt and simply fail.
        path = str(exc.filename or exc)
        if str(ASSET_DIR) in path:
            raise AssetDownloadRefused("maniskill", task, [path], _DOWNLOAD_HINT) from None
        raise
    except RuntimeError as exc:
        # e.g. "Partnet Mobility dataset not found. Download it by running python -m mani_skill..."
        text = str(exc)
        if "not found" in text and "download" in text.lower():
            raise AssetDownloadRefused("maniskill", task, [text], _DOWNLOAD_HINT) from None
        raise
    finally:
        download_asset.prompt_yes_no = original


@register_simulator("maniskill")
class ManiSkillAdapter(SimulatorAdapter):
    def __init__(self, config: SimulatorConfig) -> None:
        super().__init__(config)
        task = config.task
        missing = missing_assets(task)  # also rejects unknown tasks
        if missing:
            raise AssetDownloadRefused("maniskill", task, missing, _DOWNLOAD_HINT)
        env_spec = _registered_envs()[task]
        supported = getattr(env_spec.cls, "SUPPORTED_REWARD_MODES", ("normalized_dense", "dense", "sparse"))
        if config.reward_mode is not None and config.reward_mode not in supported:
            raise ValueError(f"reward_mode={config.reward_mode!r} is not supported by {task}; supported: {supported}")
        height, width = config.image_size
        kwargs: dict[str, Any] = dict(
            obs_mode="rgb" if config.cameras else "state_dict",
            sim_backend="physx_cpu",
            num_envs=1,
            # Evaluation videos render through ManiSkill's render camera; rollouts render nothing extra.
            render_mode="rgb_array" if config.record_frames else None,
        )
        import torch

        if not torch.cuda.is_available():
            # Say "cpu" up front instead of letting ManiSkill try sapien_cuda and warn on every build.
            kwargs["render_backend"] = "cpu"
        if config.cameras:
            kwargs["sensor_configs"] = dict(width=width, height=height)
        if config.reward_mode is not None:
            kwargs["reward_mode"] = config.reward_mode
        if config.control_mode is not None:
            kwargs["control_mode"] = config.control_mode
        try:
            with no_asset_prompts(task):
                # The bare env, not gym.make: no gym wrappers (we apply the horizon ourselves).
                self._env = env_spec.make(**kwargs)
        except AssertionError as exc:
            if config.control_mode is not None and "supported modes" in str(exc):
                raise ValueError(f"control_mode={config.control_mode!r}: {exc}") from None
            raise
        except RuntimeError as exc:
            text = str(exc)
            if "vk::" in text or "rendering device" in text or "physical device" in text:
                raise SimulatorUnavailable(f"{text}. {_VULKAN_HINT}") from exc
            raise
        env = self._env
        available = list(env._sensors)
        unknown = [c for c in config.cameras if c not in available]
        if unknown:
            env.close()
            raise ValueError(f"cameras: {unknown} not available in {task}; available cameras: {available}")
        action_space = env.single_action_space
        if not hasattr(action_space, "low") or len(action_space.shape) != 1:
            env.close()
            raise ValueError(f"task={task!r} has a {type(action_space).__name__} action space; need a flat Box")
        max_steps = config.max_episode_steps or env_spec.max_episode_steps or 200
        self._sim_reset(config.seed)  # the first observation fixes state_dim
        self.spec = SimulatorSpec(
            simulator=self.name,
            task=task,
            instruction=_instruction_for(task),
            cameras=tuple(config.cameras),
            image_size=(height, width),
            state_dim=int(self._first_obs.state.shape[0]),
            action_dim=int(action_space.shape[0]),
            action_low=tuple(float(x) for x in action_space.low),
            action_high=tuple(float(x) for x in action_space.high),
            max_episode_steps=int(max_steps),
            reward_mode=str(env.reward_mode),
            control_mode=str(env.control_mode),
        )

    def _convert(self, raw: dict[str, Any]) -> EnvObservation:
        from mani_skill.utils.common import flatten_state_dict

        # Everything but the camera data: agent proprioception + task extras (some tasks, e.g. the
        # MS-Hopper family, put their extras at the top level instead of under "extra").
        low_dim = {k: v for k, v in raw.items() if k not in ("sensor_data", "sensor_param")}
        state = flatten_state_dict(low_dim, use_torch=True)
        images = {cam: hwc_uint8_to_chw_float(raw["sensor_data"][cam]["rgb"]) for cam in self.config.cameras}
        return EnvObservation(
            images=images,
            state=np.asarray(state.reshape(-1).cpu().numpy(), dtype=np.float32),
            instruction=_instruction_for(self.config.task),
        )

    def _sim_reset(self, seed: int | None) -> EnvObservation:
        raw, _ = self._env.reset(seed=seed)
        self._first_obs = self._convert(raw)
        return self._first_obs

    def _reset(self, seed: int | None) -> EnvObservation:
        return self._sim_reset(seed)

    def _step(self, action: np.ndarray) -> StepResult:
        import torch

        raw, reward, terminated, truncated, info = self._env.step(torch.from_numpy(action[None, :]))
        info = scalar_info(info)
        return StepResult(
            observation=self._convert(raw),
            reward=float(reward.reshape(-1)[0]),
            terminated=bool(terminated.reshape(-1)[0]),
            truncated=bool(truncated.reshape(-1)[0]),
            success=bool(info.get("success", False)),
            info=info,
        )

    def render_frame(self) -> np.ndarray:
        frame = self._env.render()
        frame = frame.cpu().numpy() if hasattr(frame, "cpu") else np.asarray(frame)
        return np.ascontiguousarray(frame.reshape(frame.shape[-3:]), dtype=np.uint8)

    def close(self) -> None:
        env = getattr(self, "_env", None)
        if env is not None:
            self._env = None
            env.close()
