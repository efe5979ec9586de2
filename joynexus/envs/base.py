"""One interface over the simulators the Environment Service can run (paper 4.1.2).

A LeRobot-style registry maps a config's ``simulator`` name to an adapter class, so adding a
simulator is one decorated class. Adapters import their simulator lazily (in ``__init__``), so the
registry itself is cheap to import: the service's parent process never loads a physics engine.

Every adapter speaks the same observation format, whatever the simulator gives natively:
images are float32 CHW in [0, 1] keyed by camera name, state is a flat float32 vector, and each
task carries a natural-language instruction.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

import numpy as np
import pydantic

from joynexus.extensions import Registry

__all__ = [
    "SIMULATORS",
    "AssetDownloadRefused",
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGE_SIDE",
    "MAX_OBSERVATION_BYTES",
    "EnvObservation",
    "RewardMode",
    "SimulatorAdapter",
    "SimulatorConfig",
    "SimulatorSpec",
    "StepResult",
    "SimulatorUnavailable",
    "available_simulators",
    "build_simulator",
    "hwc_uint8_to_chw_float",
    "image_size_problem",
    "observation_bytes",
    "register_simulator",
    "scalar_info",
    "unit_to_bounds",
    "validate_action",
]

RewardMode = Literal["dense", "sparse", "normalized_dense"]

# Limits on what a session renders (issue 11): a tenant's image size must not exhaust a worker's
# memory, the pipe, or the batches its observations feed. Per camera (each side, and the pixel
# count), and over all cameras of one observation as delivered: float32 (3, H, W) per camera.
# The Environment Service's defaults (configurable there) and what workload specs are checked against.
MAX_IMAGE_SIDE = 1024
MAX_IMAGE_PIXELS = 512 * 512
MAX_OBSERVATION_BYTES = 8 * 1024 * 1024


class AssetDownloadRefused(ValueError):
    """The task needs assets that are not on disk; we never download (or prompt) on a service host."""

    def __init__(self, simulator: str, task: str, missing: list[str] | tuple[str, ...], hint: str = "") -> None:
        self.simulator, self.task, self.missing, self.hint = simulator, task, tuple(missing), hint
        shown = list(self.missing[:5]) + ([f"and {len(self.missing) - 5} more"] if len(self.missing) > 5 else [])
        what = ", ".join(shown) or "unknown assets"
        super().__init__(
            f"task={task!r} of simulator {simulator!r} needs an asset download ({what}), which this service "
            f"refuses: pick a task whose assets ship with the package{hint}"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # pickles with its own arguments (Ray, multiprocessing)
        return (type(self), (self.simulator, self.task, self.missing, self.hint))


class SimulatorUnavailable(RuntimeError):
    """The simulator cannot run on this host (missing system library, no Vulkan device, ...)."""


class SimulatorConfig(pydantic.BaseModel):
    """What a session runs. Frozen so it can be stored and shipped to a worker as JSON."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    simulator: str
    task: str = pydantic.Field(min_length=1, description="the simulator's task id, e.g. PushCube-v1")
    seed: int = pydantic.Field(default=0, ge=0, description="seed of the first reset() without a seed")
    image_size: tuple[pydantic.PositiveInt, pydantic.PositiveInt] = pydantic.Field(
        default=(64, 64), description="(H, W) of every camera image"
    )
    cameras: tuple[str, ...] = pydantic.Field(default=(), description="cameras to render; empty = state only")
    max_episode_steps: pydantic.PositiveInt | None = pydantic.Field(
        default=None, description="truncation horizon; None = the task's own default"
    )
    reward_mode: RewardMode | None = pydantic.Field(default=None, description="None = the simulator's default")
    control_mode: str | None = pydantic.Field(
        default=None, description="simulator controller (ManiSkill e.g. pd_ee_delta_pose); None = default"
    )
    # Evaluation videos: every observation also carries the simulator renderer's RGB frame (`frame`).
    record_frames: bool = pydantic.Field(default=False, description="attach the renderer's frame to observations")
    # A vectorized session (`envs.vector`): this many environments in the one worker, addressed as
    # "<session id>#<slot>" and stepped together by `EnvironmentService.batch_step`.
    num_envs: int = pydantic.Field(default=1, ge=1, le=64, description="environments in this session's worker")

    @pydantic.field_validator("simulator")
    @classmethod
    def _simulator_registered(cls, value: str) -> str:
        SIMULATORS.get(value)  # an unknown name raises, naming the allowed ones
        return value

    @pydantic.field_validator("cameras")
    @classmethod
    def _cameras_unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"cameras={list(value)!r} lists a camera twice")
        return value


def observation_bytes(cameras: int, image_size: tuple[int, int]) -> int:
    """Bytes of one observation's images as a session delivers them: float32 (3, H, W) per camera."""
    height, width = image_size
    return int(cameras) * 3 * int(height) * int(width) * np.dtype(np.float32).itemsize


def _mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB"


def image_size_problem(
    image_size: tuple[int, int],
    cameras: int,
    *,
    max_image_side: int = MAX_IMAGE_SIDE,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    max_observation_bytes: int = MAX_OBSERVATION_BYTES,
) -> str | None:
    """Why `cameras` images of `image_size` (H, W) are over the limits, naming the limit; None if
    within them. The caller puts the field name in front. Side and pixel limits hold even with no
    camera (the simulator is still built with that size); the bytes limit counts the cameras."""
    height, width = (int(v) for v in image_size)
    if max(height, width) > max_image_side:
        return f"{height}x{width} has a side over the limit of {max_image_side} pixels (max_image_side)"
    if height * width > max_image_pixels:
        return (
            f"{height}x{width} is {height * width} pixels per camera, over the limit of {max_image_pixels} "
            "(max_image_pixels)"
        )
    total = observation_bytes(cameras, (height, width))
    if total > max_observation_bytes:
        return (
            f"{cameras} cameras of 3x{height}x{width} float32 are {_mib(total)} per observation, over the "
            f"limit of {_mib(max_observation_bytes)} (max_observation_bytes); use smaller images or fewer cameras"
        )
    return None


@dataclass(frozen=True)
class SimulatorSpec:
    """The model-facing interface of one session: what observations look like and what actions it takes."""

    simulator: str
    task: str
    instruction: str
    cameras: tuple[str, ...]
    image_size: tuple[int, int]
    state_dim: int
    action_dim: int
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]
    max_episode_steps: int
    reward_mode: str
    control_mode: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (lists instead of tuples)."""
        return {
            "simulator": self.simulator,
            "task": self.task,
            "instruction": self.instruction,
            "cameras": list(self.cameras),
            "image_size": list(self.image_size),
            "state_dim": self.state_dim,
            "action_dim": self.action_dim,
            "action_low": list(self.action_low),
            "action_high": list(self.action_high),
            "max_episode_steps": self.max_episode_steps,
            "reward_mode": self.reward_mode,
            "control_mode": self.control_mode,
        }


@dataclass
class EnvObservation:
    images: dict[str, np.ndarray]  # camera -> float32 (3, H, W) in [0, 1]
    state: np.ndarray  # float32 (state_dim,)
    instruction: str
    frame: np.ndarray | None = None  # uint8 (H, W, 3) from the renderer, with config.record_frames only

    def to_dict(self) -> dict[str, Any]:
        out = {"images": dict(self.images), "state": self.state, "instruction": self.instruction}
        if self.frame is not None:
            out["frame"] = self.frame
        return out


@dataclass
class StepResult:
    observation: EnvObservation
    reward: float
    terminated: bool
    truncated: bool
    success: bool
    info: dict[str, bool | int | float | str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "observation": self.observation.to_dict(),
            "reward": self.reward,
            "terminated": self.terminated,
            "truncated": self.truncated,
            "success": self.success,
            "info": dict(self.info),
        }


def hwc_uint8_to_chw_float(image: Any) -> np.ndarray:
    """(H, W, 3) uint8 (numpy or torch, optionally with a leading batch of 1) -> (3, H, W) float32 in [0, 1]."""
    arr = image.cpu().numpy() if hasattr(image, "cpu") else np.asarray(image)
    if arr.ndim == 4 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 3 or arr.shape[-1] < 3:
        raise ValueError(f"expected an (H, W, 3) image, got shape {arr.shape}")
    return np.ascontiguousarray(arr[..., :3].transpose(2, 0, 1), dtype=np.float32) / np.float32(255.0)


def unit_to_bounds(action: Any, low: Any, high: Any) -> np.ndarray:
    """Map a policy action in [-1, 1] per dimension (clipped) affinely onto a simulator's bounds.
    JoyNexus policies act in the unit range; e.g. gym-pusht takes pixel targets in [0, 512]."""
    unit = np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)
    low, high = np.asarray(low, dtype=np.float32), np.asarray(high, dtype=np.float32)
    return low + (unit + 1.0) * 0.5 * (high - low)


def validate_action(action: Any, action_dim: int) -> np.ndarray:
    """Coerce to float32 (action_dim,), or raise ValueError naming what was expected and what came."""
    expected = f"expected a finite float vector of shape ({action_dim},)"
    try:
        arr = np.asarray(action, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"action: {expected}, got {type(action).__name__} that is not numeric ({exc})") from None
    if arr.shape != (action_dim,):
        raise ValueError(f"action: {expected}, got shape {arr.shape}")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise ValueError(f"action: {expected}, got non-finite values at indices {bad.tolist()}: {arr[bad].tolist()}")
    return arr.astype(np.float32)


def scalar_info(info: Mapping[str, Any]) -> dict[str, bool | int | float | str]:
    """Keep the JSON-able scalars of a simulator's info dict (1-element tensors/arrays included)."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in info.items():
        if hasattr(value, "cpu"):  # torch tensor, without importing torch here
            value = value.cpu().numpy()
        if isinstance(value, np.ndarray):
            if value.size != 1:
                continue
            value = value.reshape(()).item()
        elif isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, bool | int | str):
            out[str(key)] = value
        elif isinstance(value, float) and math.isfinite(value):
            out[str(key)] = value
    return out


class SimulatorAdapter(abc.ABC):
    """One simulator instance running one task, speaking `EnvObservation` / `StepResult`.

    Subclasses implement `_reset` / `_step` on a validated, clipped action; this base class counts
    steps, applies the episode horizon, and checks the action against the spec.
    """

    name: ClassVar[str] = ""
    spec: SimulatorSpec

    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self._seeded = False
        self._elapsed = 0
        self._needs_reset = True

    def renew(self) -> None:
        """Start over for a new session on this same simulator (a warm worker of the Environment
        Service): a step needs a reset first, and the next unseeded reset uses the config's seed
        again, as on a freshly built simulator."""
        self._seeded = False
        self._elapsed = 0
        self._needs_reset = True

    def reset(self, seed: int | None = None) -> EnvObservation:
        # The first reset without a seed uses the config's, so a session is reproducible by default;
        # later unseeded resets continue the simulator's own RNG stream (gymnasium semantics).
        if seed is None and not self._seeded:
            seed = self.config.seed
        if seed is not None:
            if not isinstance(seed, int | np.integer) or isinstance(seed, bool) or seed < 0:
                raise ValueError(f"seed: expected a non-negative int or None, got {seed!r}")
            seed = int(seed)
            self._seeded = True
        obs = self._reset(seed)
        self._elapsed = 0
        self._needs_reset = False
        if self.config.record_frames:
            obs.frame = self.render_frame()
        return obs

    def step(self, action: np.ndarray) -> StepResult:
        if self._needs_reset:
            raise RuntimeError(f"{self.name} {self.spec.task}: call reset() before step()")
        act = validate_action(action, self.spec.action_dim)
        # Policies (e.g. Gaussian samples) overshoot the bounds; clip like the simulators' controllers do.
        act = np.clip(act, np.asarray(self.spec.action_low, np.float32), np.asarray(self.spec.action_high, np.float32))
        result = self._step(act)
        if self.config.record_frames:
            result.observation.frame = self.render_frame()
        self._elapsed += 1
        result.info["elapsed_steps"] = self._elapsed
        if self._elapsed >= self.spec.max_episode_steps:
            result.truncated = True
        return result

    def render_frame(self) -> np.ndarray:
        """The simulator renderer's view of the scene now, uint8 (H, W, 3) (evaluation videos)."""
        raise NotImplementedError(f"simulator {self.name!r} renders no frames; record_frames is not available")

    @abc.abstractmethod
    def _reset(self, seed: int | None) -> EnvObservation: ...

    @abc.abstractmethod
    def _step(self, action: np.ndarray) -> StepResult: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> SimulatorAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_A = TypeVar("_A", bound="type[SimulatorAdapter]")

# Filled by @register_simulator where each adapter is defined.
SIMULATORS: Registry[SimulatorAdapter] = Registry(
    SimulatorAdapter, field="simulator", noun="simulator", plural="simulators", name_attribute="name"
)


def register_simulator(name: str) -> Callable[[_A], _A]:
    """Class decorator: make ``cls`` buildable from ``SimulatorConfig(simulator=name)``."""
    return SIMULATORS.register(name)


def available_simulators() -> list[str]:
    """Registered simulator names, sorted."""
    return SIMULATORS.available()


def build_simulator(config: SimulatorConfig | Mapping[str, Any]) -> SimulatorAdapter:
    """Instantiate the registered adapter for ``config.simulator`` (this loads the simulator)."""
    if not isinstance(config, SimulatorConfig):
        config = SimulatorConfig.model_validate(config)
    return SIMULATORS.get(config.simulator)(config)
