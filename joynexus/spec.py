"""Workload specification: what a tenant declares (paper section 4.1, "user-facing workload specifications").

These are pydantic models so that a bad value is reported with its field path and the reason. They
check only what can be checked without the backend; `joynexus.master.tenant_creator` checks the
rest (known base model, camera slots, dimension limits, dataset contents).
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from joynexus.data.normalization import check_modes
from joynexus.envs.base import image_size_problem
from joynexus.protocol.spec_yaml import load_spec_yaml
from joynexus.schema import VLASchema

TENANT_ID_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
CAMERA_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_]{1,32}$")
# The training seed goes to torch.manual_seed (at most 2**64 - 1) and to numpy's default_rng
# (non-negative only) in the SFT producer.
MAX_TRAINING_SEED = 2**64 - 1
# An environment session is seeded with environment.seed plus a session/evaluation offset (up to
# ~10_000 + num_envs, and + episode for recorded demonstrations); ManiSkill seeds numpy's
# RandomState, which takes 0..2**32 - 1. 2**31 - 1 leaves ample room for the offsets.
MAX_ENVIRONMENT_SEED = 2**31 - 1
# Counts stored in the control plane's Integer columns (32-bit on PostgreSQL).
MAX_STORED_COUNT = 2**31 - 1
# LoRA adapter bounds (the backend checks the target modules against its backbone's text model).
MAX_ADAPTER_RANK = 64
MAX_ADAPTER_TARGETS = 16
ADAPTER_TARGET_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class TaskType(StrEnum):
    SFT = "sft"
    RL = "rl"
    EVAL = "eval"


_NUMBERS = (int, float, bool)


def _scalar_types(annotation: Any) -> tuple[set[type], bool]:
    """(the number / bool types a field or its items take, whether they are items of a list or
    tuple); `int | None`, `tuple[int, int]` and `list[float]` are looked through."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, UnionType):
        found = [_scalar_types(arg) for arg in args if arg is not type(None)]
        return set().union(*(types for types, _ in found)), any(items for _, items in found)
    if origin in (list, tuple):
        return {arg for arg in args if arg in _NUMBERS}, True
    return ({annotation} if annotation in _NUMBERS else set()), False


def _coerced(value: Any, types: set[type]) -> str | None:
    """Why `value` would only pass by coercion (a string for a number or bool, a bool for a
    number); None: it is what the field takes, or not a scalar at all (the field's own checks)."""
    if isinstance(value, str):
        wanted = "true or false" if types == {bool} else "a number"
        if value.strip().lower().lstrip("+-") in ("inf", "infinity", "nan"):
            wanted = "a finite number"
        return f"expected {wanted}, not the string {value!r} (write it without quotes)"
    if isinstance(value, bool) and bool not in types:
        return f"expected a number, not {value!r}"
    return None


class _Strict(BaseModel):
    # allow_inf_nan=False: `Infinity` / `NaN` (JSON, YAML's .inf, the strings) is refused in every
    # float field of a spec, naming it; a bound like `ge=0` alone lets +inf through.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_coerced_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        """Numbers and flags are taken as written (`state_dim: "4"` is refused, not read as 4):
        pydantic's lax mode would coerce them, and a quoted number is usually a mistake elsewhere."""
        if info.field_name is None:
            return value
        types, items = _scalar_types(cls.model_fields[info.field_name].annotation)
        if not types:
            return value
        values = value if items and isinstance(value, (list, tuple)) else [] if items else [value]
        for item in values:
            reason = _coerced(item, types)
            if reason is not None:
                raise ValueError(reason)
        return value


class ActionModuleSpec(_Strict):
    kind: str = "oft_mlp"  # a name in joynexus.models.action_modules registry
    size: str = "small"  # a size preset of that registry
    # A LeRobot policy directory on the server (what `SmolVLAPolicy.save_pretrained` writes, with its
    # processor pipelines) the tenant starts from: its expert is the tenant's version 0, its
    # processor's statistics the tenant's normalizer, its VLM must be the resident backbone's.
    checkpoint: str | None = None


class AdapterSpec(_Strict):
    """A tenant-private LoRA adapter on the shared backbone's text model, trained beside the action
    module (peft LoRA: W x + B A x * alpha / rank on each targeted Linear layer)."""

    kind: Literal["lora"] = "lora"
    rank: int = Field(default=8, ge=1, le=MAX_ADAPTER_RANK)
    alpha: float = Field(default=16.0, gt=0, le=4096)
    target_modules: list[str] = Field(default=["q_proj", "v_proj"], min_length=1, max_length=MAX_ADAPTER_TARGETS)
    dropout: float = 0.0

    @field_validator("target_modules")
    @classmethod
    def _target_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not ADAPTER_TARGET_PATTERN.match(name):
                raise ValueError(
                    f"target module {name!r} must be a layer name matching {ADAPTER_TARGET_PATTERN.pattern}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"target modules must be unique, got {names}")
        return names

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError(
                f"only 0.0 is supported, got {value}: the shared backbone runs in eval mode, and a tenant's "
                "grouped and per-tenant training steps must be equal"
            )
        return value


class ObservationSpec(_Strict):
    cameras: list[str]  # [] for a state-only tenant: the backbone sees the instruction only
    image_size: tuple[int, int] = (32, 32)  # (height, width) of the tenant's camera images
    state_dim: int = Field(default=0, ge=0)
    action_dim: int = Field(ge=1)
    action_chunk: int = Field(default=1, ge=1)
    instruction: str = Field(default="", max_length=512)

    @field_validator("cameras")
    @classmethod
    def _camera_names(cls, cameras: list[str]) -> list[str]:
        for name in cameras:
            if not CAMERA_NAME_PATTERN.match(name):
                raise ValueError(f"camera name {name!r} must match {CAMERA_NAME_PATTERN.pattern}")
        if len(set(cameras)) != len(cameras):
            raise ValueError(f"camera names must be unique, got {cameras}")
        return cameras

    @field_validator("image_size")
    @classmethod
    def _image_size(cls, size: tuple[int, int]) -> tuple[int, int]:
        if min(size) < 8 or max(size) > 1024:
            raise ValueError(f"image_size {list(size)} must have both sides in [8, 1024]")
        return size


class DatasetSpec(_Strict):
    """A LeRobot-format dataset (image mode): a server directory (`root`, under the operator's
    JOYNEXUS_DATASET_ROOTS when set), an S3 prefix (`uri`) the Master fetches into its
    content-addressed cache, or one the tenant uploaded (`id`, as POST /v1/datasets returned it),
    which the Master resolves to its stored copy (`joynexus.data.sources`). `sha256` pins (or, once
    resolved, records) the content: checkpoint manifests carry it as the data that trained them."""

    root: str | None = None
    uri: str | None = Field(default=None, pattern=r"^s3://[^/]+(/.*)?$")
    id: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    repo_id: str = Field(min_length=1)
    # The last N episodes are held out of training: the dataset-only tenant's promotion metric
    # (held-out loss, joynexus.services.producers.heldout) is measured on them. 0: none held out.
    validation_episodes: int = Field(default=0, ge=0, le=100_000)

    @field_validator("root")
    @classmethod
    def _root_is_a_path(cls, root: str | None) -> str | None:
        if root is not None and "\x00" in root:
            raise ValueError(f"{root!r} holds a NUL byte: a path cannot (give the dataset folder's path)")
        return root

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        # A root beside a uri or an id only once resolved: the Master records the local copy and the digest.
        references = [name for name in ("uri", "id") if getattr(self, name) is not None]
        resolved = self.root is not None and self.sha256 is not None and len(references) == 1
        if len(references) > 1 or (self.root is None) == (not references) and not resolved:
            raise ValueError(
                "give exactly one of dataset.root (a server path), dataset.uri (s3://...) and dataset.id "
                "(a dataset you uploaded: POST /v1/datasets)"
            )
        return self


class EnvironmentSpec(_Strict):
    """A simulator task the tenant's RL rollouts (and evaluations) run in."""

    simulator: str = Field(min_length=1)  # a name in joynexus.envs registry
    task: str = Field(min_length=1)  # the simulator's task id, e.g. PushCube-v1
    control_mode: str | None = None
    reward_mode: str | None = None
    max_episode_steps: int | None = Field(default=None, ge=1, le=100_000)
    num_envs: int = Field(default=2, ge=1, le=16)  # parallel sessions per rollout
    # Environments one Environment Service worker steps per call (a vectorized session, envs.vector).
    envs_per_worker: int = Field(default=1, ge=1, le=16)
    horizon: int = Field(default=32, ge=1, le=4096)  # policy steps per session per rollout
    seed: int = Field(default=0, ge=0, le=MAX_ENVIRONMENT_SEED)


class RLSpec(_Strict):
    advantage: Literal["gae", "grpo"] = "gae"
    gamma: float = Field(default=0.99, gt=0, le=1)
    gae_lambda: float = Field(default=0.95, ge=0, le=1)
    clip: float = Field(default=0.2, gt=0, le=1)
    ppo_epochs: int = Field(default=4, ge=1, le=64)
    value_coef: float = Field(default=0.5, ge=0)
    entropy_coef: float = Field(default=0.0, ge=0)
    # Standardize the policy's state input by running statistics of the rollouts' states (updated
    # after each PPO update, carried in every version): raw simulator states mix metres, radians
    # and velocities, and without it PushCube-v1 learned ~4x slower (docs/rl_tuning.md).
    normalize_state: bool = True
    # How PPO treats a rollout its tenant's policy moved on from (scheduling.max_in_flight_jobs > 1
    # trains each rollout after the previous one's update): "decoupled" clips each update around the
    # learner's policy at the job's start and weights samples by pi_learner / pi_behavior (capped;
    # Hilton et al. 2022, AReaL); "none": clipped around the behavior policy, as plain PPO.
    off_policy_correction: Literal["none", "decoupled"] = "none"
    # GRPO only: G, the attempts from one initial state that form a group (environment.num_envs =
    # groups x G). None: all of a rollout's environments form one group.
    group_size: int | None = Field(default=None, ge=2, le=16)


class PromotionMetric(StrEnum):
    SUCCESS_RATE = "success_rate"  # simulator success rate of an evaluation (higher is better)
    HELDOUT_LOSS = "heldout_loss"  # action error on dataset.validation_episodes (lower is better)


class PromotionSpec(_Strict):
    """When `champion` moves (joynexus.master.workloads.promotion); `candidate` always moves."""

    # None: success_rate for a tenant with an environment, else heldout_loss when the dataset holds
    # out validation episodes, else no metric (the champion follows every new version).
    metric: PromotionMetric | None = None
    min_improvement: float = Field(default=0.0, ge=0.0, le=1e6)
    eval_episodes: int = Field(default=4, ge=1, le=256)  # simulator episodes per evaluation


class SchedulingSpec(_Strict):
    priority: int = Field(default=0, ge=-100, le=100)
    max_in_flight_jobs: int = Field(default=2, ge=1, le=64)
    completion_target: int | None = Field(default=None, ge=1, le=MAX_STORED_COUNT)  # None: no bound
    max_policy_staleness: int | None = Field(default=None, ge=0, le=MAX_STORED_COUNT)  # RL only: Δmax of eq. 1


class TrainingSpec(_Strict):
    samples_per_job: int = Field(default=32, ge=1, le=65536)
    microbatch_size: int = Field(default=8, ge=1, le=4096)
    learning_rate: float = Field(default=1e-3, gt=0, le=1.0)
    seed: int = Field(default=0, ge=0, le=MAX_TRAINING_SEED)
    checkpoint_every_jobs: int = Field(default=1, ge=0)  # 0: only at the end of the workload
    # Linear learning-rate decay over the tenant's first `lr_decay_jobs` jobs (its policy versions)
    # to learning_rate x lr_final_fraction, constant after (CleanRL's anneal_lr, counted in jobs):
    # late PPO updates at the full rate can undo a learned policy. None: a constant learning rate.
    lr_decay_jobs: int | None = Field(default=None, ge=1, le=MAX_STORED_COUNT)
    lr_final_fraction: float = Field(default=0.1, ge=0.0, le=1.0)


class WorkloadSpec(_Strict):
    tenant: str = Field(pattern=TENANT_ID_PATTERN)
    base_model: str = Field(min_length=1)
    task: TaskType
    action_module: ActionModuleSpec = ActionModuleSpec()
    adapter: AdapterSpec | None = None  # a tenant-private LoRA adapter on the backbone; None: none
    observation: ObservationSpec
    dataset: DatasetSpec | None = Field(default=None, validate_default=True)
    environment: EnvironmentSpec | None = Field(default=None, validate_default=True)
    rl: RLSpec = RLSpec()
    scheduling: SchedulingSpec = SchedulingSpec()
    training: TrainingSpec = TrainingSpec()
    # LeRobot feature type (VISUAL / STATE / ACTION) -> NormalizationMode (MEAN_STD / MIN_MAX /
    # IDENTITY); types left out keep LeRobot's defaults (joynexus.data.normalization.DEFAULT_MODES).
    normalization: dict[str, str] = Field(default_factory=dict)

    @field_validator("normalization", mode="before")
    @classmethod
    def _normalization_modes(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value  # pydantic reports the type
        check_modes(value)  # raises naming the bad feature type or mode
        return {str(k).upper(): str(v).upper() for k, v in value.items()}

    promotion: PromotionSpec = PromotionSpec()

    @field_validator("promotion")
    @classmethod
    def _promotion_metric_is_measurable(cls, promotion: PromotionSpec, info: ValidationInfo) -> PromotionSpec:
        if promotion.metric is PromotionMetric.SUCCESS_RATE and info.data.get("environment") is None:
            raise ValueError("metric 'success_rate' needs an environment to evaluate in")
        if promotion.metric is PromotionMetric.HELDOUT_LOSS:
            dataset = info.data.get("dataset")
            if dataset is None or dataset.validation_episodes < 1:
                raise ValueError("metric 'heldout_loss' needs dataset.validation_episodes >= 1")
        return promotion

    def promotion_metric(self) -> PromotionMetric | None:
        """The declared promotion metric, or the default the tenant's inputs allow (see PromotionSpec)."""
        if self.promotion.metric is not None:
            return self.promotion.metric
        if self.environment is not None:
            return PromotionMetric.SUCCESS_RATE
        if self.dataset is not None and self.dataset.validation_episodes > 0:
            return PromotionMetric.HELDOUT_LOSS
        return None

    @field_validator("dataset")
    @classmethod
    def _sft_needs_a_dataset(cls, dataset: DatasetSpec | None, info: ValidationInfo) -> DatasetSpec | None:
        # A field validator (not a model validator) so the error is reported at `dataset`.
        if dataset is None and info.data.get("task") is TaskType.SFT:
            raise ValueError("dataset is required when task is 'sft'")
        return dataset

    @field_validator("environment")
    @classmethod
    def _rl_needs_an_environment(
        cls, environment: EnvironmentSpec | None, info: ValidationInfo
    ) -> EnvironmentSpec | None:
        if environment is None and info.data.get("task") is TaskType.RL:
            raise ValueError("environment is required when task is 'rl'")
        obs = info.data.get("observation")
        if environment is not None and obs is not None:
            # The simulator renders observation.image_size for every camera: refuse here what the
            # Environment Service (at its default limits) would refuse at every session open.
            problem = image_size_problem(obs.image_size, len(obs.cameras))
            if problem is not None:
                raise ValueError(f"observation.image_size {list(obs.image_size)} for the simulator: {problem}")
        return environment

    def vla_schema(self) -> VLASchema:
        obs = self.observation
        return VLASchema(
            base_model_id=self.base_model,
            cameras=tuple(obs.cameras),
            image_size=obs.image_size,
            state_dim=obs.state_dim,
            action_dim=obs.action_dim,
            action_chunk=obs.action_chunk,
        )


class SpecError(ValueError):
    """A workload spec was rejected; each problem names its field path and the reason."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = [f"{field}: {reason}" for field, reason in problems]
        super().__init__("invalid workload spec:\n  " + "\n  ".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process boundaries (Ray) with its problems
        return (type(self), (self.problems,))

    @property
    def fields(self) -> list[str]:
        return [field for field, _ in self.problems]


def parse_workload_spec(data: dict[str, Any] | str | Path) -> WorkloadSpec:
    """Parse a dict or a YAML/JSON file into a spec, turning pydantic errors into a SpecError."""
    if isinstance(data, (str, Path)):
        path = Path(data)
        if not path.is_file():
            raise SpecError([("spec", f"file {str(path)!r} does not exist")])
        data = load_spec_yaml(path.read_text())
        if not isinstance(data, dict):
            raise SpecError([("spec", f"file {str(path)!r} does not hold a mapping")])
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            field = ".".join(str(part) for part in item["loc"]) or "spec"
            value = item.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            problems.append((field, item["msg"] + shown))
        raise SpecError(problems) from None
