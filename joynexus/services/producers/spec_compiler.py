"""The spec compiler (paper 4.1.1): checks a workload spec against what the backend can do and
compiles the tenant's backend config. Every check that can fail runs here, including building the
tenant's module on torch's meta device the way the Training Model Service builds its slot, reading
its dataset (LeRobot, Great Expectations) and probing its simulator. It touches no state.

It runs where the model stack may be imported: a producer replica in a deployment (issue 40:
`ProducerService.compile_tenant`), the caller's process in one process. The tenant creator
(`master/tenant_creator.py`) writes what it compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from joynexus.core.tenants import BackendCapabilities, TenantBackendConfig, simulator_config
from joynexus.spec import SpecError, TaskType, WorkloadSpec

if TYPE_CHECKING:  # torch is imported only when a spec is compiled
    from joynexus.models.action_modules import ActionModuleConfig


class SpecCompiler:
    """Checks a spec against the backend's capabilities and compiles it; touches no state."""

    def __init__(
        self,
        capabilities: BackendCapabilities,
        *,
        validate_datasets: bool = True,
        environment_probe: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ):
        self.capabilities = capabilities
        self.validate_datasets = validate_datasets
        # Given a simulator config, returns its spec (cameras, image_size, state_dim, action_dim):
        # the Environment Service opens a session to answer. None: environments are not checked.
        self.environment_probe = environment_probe

    def compile(self, spec: WorkloadSpec) -> TenantBackendConfig:
        """Check the spec against the backend (raising SpecError naming every bad field) and compile it."""
        from joynexus.models.action_modules import ACTION_MODULES, ActionModuleConfig

        problems: list[tuple[str, str]] = []
        caps = self.capabilities.base_models.get(spec.base_model)
        if caps is None:
            known = sorted(self.capabilities.base_models)
            raise SpecError([("base_model", f"unknown base model {spec.base_model!r}; this backend serves {known}")])
        obs = spec.observation
        if len(obs.cameras) > caps.max_images:
            slots = f"{len(obs.cameras)} cameras, but {caps.model_id} has {caps.max_images} camera slots"
            problems.append(("observation.cameras", slots))
        for field, value, limit in (
            ("observation.state_dim", obs.state_dim, caps.max_state_dim),
            ("observation.action_dim", obs.action_dim, caps.max_action_dim),
            ("observation.action_chunk", obs.action_chunk, caps.max_action_chunk),
        ):
            if value > limit:
                problems.append((field, f"{value} exceeds this backend's limit of {limit}"))
        module_config = None
        kind_fields = _kind_backend_fields(spec, caps, problems)
        try:
            module_config = ActionModuleConfig(
                **kind_fields,
                kind=spec.action_module.kind,
                size=spec.action_module.size,
                feature_dim=caps.feature_dim,
                state_dim=obs.state_dim,
                action_dim=obs.action_dim,
                action_chunk=obs.action_chunk,
                # RL needs a policy density (PPO ratios) and, for GAE, a critic.
                stochastic=spec.task is TaskType.RL,
                value_head=spec.task is TaskType.RL and spec.rl.advantage == "gae",
                normalize_state=spec.task is TaskType.RL and spec.rl.normalize_state and obs.state_dim > 0,
            )
        except ValidationError as error:
            for item in error.errors():
                name = ".".join(str(part) for part in item["loc"]) or "kind"
                problems.append((f"action_module.{name}", item["msg"]))
        except ValueError as error:
            problems.append(("action_module", _first_line(error)))
        if module_config is not None and module_config.stochastic and not _supports_rl(module_config.kind):
            # The module would refuse stochastic=True only when the backend builds the slot.
            problems.append(
                (
                    "action_module.kind",
                    f"{module_config.kind!r} has no tractable action density, which RL (PPO ratios) needs; "
                    f"kinds that support RL: {sorted(k for k in ACTION_MODULES if _supports_rl(k))}",
                )
            )
        problems.extend(_rl_problems(spec))
        problems.extend(_adapter_problems(spec, caps))
        if spec.training.microbatch_size > spec.training.samples_per_job:
            problems.append(
                (
                    "training.microbatch_size",
                    f"{spec.training.microbatch_size} is larger than training.samples_per_job "
                    f"({spec.training.samples_per_job})",
                )
            )
        config = None
        if not problems:
            assert module_config is not None
            config = self._backend_config(spec, module_config)
            problems.extend(backend_build_problems(config))
        if spec.dataset is not None and not problems:
            problems.extend(self._dataset_problems(spec))
        probed: dict[str, Any] = {}  # the simulator's spec, when the Environment Service was asked
        if spec.environment is not None and not problems:
            problems.extend(self._environment_problems(spec, probed))
        normalization = None
        if not problems:
            normalization, trouble = self._normalization(spec, probed)
            problems.extend(trouble)
        if problems:
            raise SpecError(problems)
        assert config is not None
        return config.model_copy(update={"normalization": normalization})

    def _normalization(
        self, spec: WorkloadSpec, probed: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, list[tuple[str, str]]]:
        """The tenant's normalizer (joynexus.data.normalization): from its dataset's statistics
        (meta/stats.json, or computed and cached); for an RL tenant MIN_MAX over the simulator's
        action bounds when the Environment Service is asked (the rollout applies those)."""
        from joynexus.data.normalization import Normalizer, StatsError, dataset_normalizer

        obs = spec.observation
        if spec.action_module.checkpoint:  # a LeRobot policy's processor: its statistics are the tenant's
            return lerobot_checkpoint_normalization(spec)
        if spec.dataset is not None and spec.task is TaskType.SFT:
            try:
                normalizer = dataset_normalizer(spec.dataset.root, spec.normalization, obs.state_dim, obs.action_dim)
            except (StatsError, OSError) as error:
                return None, [("normalization", f"dataset statistics: {_first_line(error)}")]
            return normalizer.to_dict(), []
        if spec.task is TaskType.RL and "action_low" in probed and "action_high" in probed:
            return Normalizer.for_simulator(probed["action_low"], probed["action_high"]).to_dict(), []
        return None, []

    @staticmethod
    def _backend_config(spec: WorkloadSpec, module_config: ActionModuleConfig) -> TenantBackendConfig:
        obs = spec.observation
        schema = spec.vla_schema()
        return TenantBackendConfig(
            tenant_id=spec.tenant,
            task_type=spec.task.value,
            base_model_id=spec.base_model,
            schema_signature=schema.signature,
            cameras=tuple(obs.cameras),
            image_size=obs.image_size,
            state_dim=obs.state_dim,
            action_dim=obs.action_dim,
            action_chunk=obs.action_chunk,
            instruction=obs.instruction,
            action_module=module_config.model_dump(mode="json"),
            learning_rate=spec.training.learning_rate,
            microbatch_size=spec.training.microbatch_size,
            samples_per_job=spec.training.samples_per_job,
            checkpoint_every_jobs=spec.training.checkpoint_every_jobs,
            seed=spec.training.seed,
            lr_decay_jobs=spec.training.lr_decay_jobs,
            lr_final_fraction=spec.training.lr_final_fraction,
            environment=spec.environment,
            rl=spec.rl if spec.task is TaskType.RL else None,
            adapter=_adapter_config(spec),
        )

    def _environment_problems(self, spec: WorkloadSpec, probed: dict[str, Any] | None = None) -> list[tuple[str, str]]:
        """The tenant's observation interface must be what the simulator task produces."""
        from joynexus.envs import available_simulators

        env, obs = spec.environment, spec.observation
        assert env is not None
        if env.simulator not in available_simulators():
            return [("environment.simulator", f"unknown simulator {env.simulator!r}; known: {available_simulators()}")]
        if self.environment_probe is None:
            return []
        try:
            sim = self.environment_probe(simulator_config(spec))
        except Exception as error:  # the simulator refused the task (asset download, bad task id, ...)
            message = _first_line(error)
            if "config.image_size:" in message:  # the Environment Service's image limits
                return [("observation.image_size", message.split("config.image_size:", 1)[1].strip())]
            return [("environment.task", message)]
        if probed is not None:
            probed.update(sim)
        problems = []
        if tuple(sim["cameras"]) != tuple(obs.cameras):
            problems.append(("observation.cameras", f"{obs.cameras} but the simulator renders {list(sim['cameras'])}"))
        for field, ours, theirs in (
            ("observation.state_dim", obs.state_dim, sim["state_dim"]),
            ("observation.action_dim", obs.action_dim, sim["action_dim"]),
        ):
            if ours != theirs:
                problems.append((field, f"{ours} but {env.simulator}/{env.task} has {theirs}"))
        return problems

    def _dataset_problems(self, spec: WorkloadSpec) -> list[tuple[str, str]]:
        from joynexus.data.lerobot_dataset import inspect_dataset
        from joynexus.data.validation import DatasetExpectation, validate_dataset

        assert spec.dataset is not None
        if spec.dataset.root is None:  # MasterService.create_tenant fetches a dataset.uri first
            return [("dataset.uri", "not fetched: create the tenant through the Master Service")]
        root = Path(spec.dataset.root)
        if not root.is_dir():
            return [("dataset.root", f"directory {str(root)!r} does not exist")]
        try:
            inspect_dataset(root, spec.dataset.repo_id)
        except (FileNotFoundError, ValueError) as error:
            return [("dataset.root", _first_line(error))]
        if not self.validate_datasets:
            return []
        obs = spec.observation
        expectation = DatasetExpectation(
            cameras=tuple(obs.cameras),
            image_size=tuple(obs.image_size),
            state_dim=obs.state_dim,
            action_dim=obs.action_dim,
        )
        report = validate_dataset(root, spec.dataset.repo_id, expectation, raise_on_error=False)
        return [(failure.field, failure.reason) for failure in report.failures]


def _adapter_problems(spec: WorkloadSpec, caps: Any) -> list[tuple[str, str]]:
    """The LoRA adapter must target Linear layers the backbone's text model has, at a rank it allows."""
    adapter = spec.adapter
    if adapter is None:
        return []
    problems: list[tuple[str, str]] = []
    known = set(caps.lora_target_modules)
    unknown = [name for name in adapter.target_modules if name not in known]
    if unknown:
        problems.append(
            (
                "adapter.target_modules",
                f"{unknown} are not Linear layers of {caps.model_id}'s text model; choose from {sorted(known)}",
            )
        )
    limit = min(caps.max_lora_rank, caps.feature_dim)
    if adapter.rank > limit:
        problems.append(
            ("adapter.rank", f"{adapter.rank} exceeds this backend's limit of {limit} (1..{limit} for {caps.model_id})")
        )
    return problems


def _adapter_config(spec: WorkloadSpec) -> dict[str, Any] | None:
    """The spec's adapter as the backend's LoraAdapterConfig dict (None without an adapter)."""
    if spec.adapter is None:
        return None
    from joynexus.models.adapters import LoraAdapterConfig

    return LoraAdapterConfig.model_validate(spec.adapter.model_dump()).model_dump(mode="json")


def _rl_problems(spec: WorkloadSpec) -> list[tuple[str, str]]:
    """GRPO groups: num_envs = groups x group_size, at least two attempts per group."""
    if spec.task is not TaskType.RL or spec.environment is None:
        return []
    rl, num_envs = spec.rl, spec.environment.num_envs
    if rl.advantage != "grpo":
        if rl.group_size is not None:
            return [("rl.group_size", "only the 'grpo' estimator forms groups; leave it unset for 'gae'")]
        return []
    size = rl.group_size or num_envs
    if rl.group_size is None and num_envs < 2:
        return [("environment.num_envs", "GRPO compares attempts within a group: give at least 2 environments")]
    if num_envs % size:
        return [
            (
                "rl.group_size",
                f"{size} does not divide environment.num_envs ({num_envs}); num_envs must be groups x group_size",
            )
        ]
    return []


def _supports_rl(kind: str) -> bool:
    from joynexus.models.action_modules import ACTION_MODULES

    cls = ACTION_MODULES.get(kind)
    return cls is not None and cls.supports_rl


def _kind_backend_fields(spec: WorkloadSpec, caps: Any, problems: list[tuple[str, str]]) -> dict[str, Any]:
    """What the kind's config takes from the backend (`ActionModuleConfig.backend_fields`: e.g. a
    layer-wise expert's decoder shape and checkpoint fields); nothing for most kinds."""
    from joynexus.models.action_modules import ACTION_MODULES, ActionModuleConfig

    config_class = getattr(ACTION_MODULES.get(spec.action_module.kind, None), "config_class", ActionModuleConfig)
    return config_class.backend_fields(spec, caps, problems)


def lerobot_checkpoint_normalization(spec: WorkloadSpec) -> tuple[dict[str, Any] | None, list[tuple[str, str]]]:
    """A LeRobot checkpoint's processor statistics as the tenant's normalizer (read by the kind's
    config class, `read_checkpoint`)."""
    from joynexus.data.normalization import Normalizer, StatsError
    from joynexus.models.action_modules import ACTION_MODULES, ActionModuleConfig

    assert spec.action_module.checkpoint is not None
    config_class = getattr(ACTION_MODULES.get(spec.action_module.kind, None), "config_class", ActionModuleConfig)
    checkpoint = config_class.read_checkpoint(spec.action_module.checkpoint)
    if checkpoint is None:
        return None, []
    try:
        normalizer = Normalizer.from_lerobot_checkpoint(checkpoint)
    except StatsError as error:
        return None, [("action_module.checkpoint", f"processor statistics: {error}")]
    return (normalizer.to_dict() if normalizer is not None else None), []


def backend_build_problems(config: TenantBackendConfig) -> list[tuple[str, str]]:
    """Build the tenant's slot module (its value head included) the way the Training Model Service
    does, but on torch's meta device (no memory, no RNG draws), so a configuration the backend
    cannot build is refused as a spec problem instead of failing after the tenant is written."""
    import torch

    from joynexus.models.action_modules import ActionModuleConfig, build_action_module

    problems: list[tuple[str, str]] = []
    try:
        # TrainingModelService.add_tenant seeds torch with the tenant's seed before building.
        torch.Generator().manual_seed(config.seed)
    except (RuntimeError, ValueError, OverflowError) as error:
        problems.append(("training.seed", _first_line(error)))
    try:
        module_config = ActionModuleConfig.model_validate(config.action_module)
        with torch.device("meta"):
            module = build_action_module(module_config)
        if module_config.value_head and module.value_net is None:
            problems.append(("action_module", f"kind {module_config.kind!r} built no value head, which GAE needs"))
    except Exception as error:  # whatever the module raises is this spec's problem, not a server error
        problems.append(("action_module", _first_line(error)))
    if config.adapter is not None:
        from joynexus.models.adapters import LoraAdapterConfig

        try:
            LoraAdapterConfig.model_validate(config.adapter)
        except ValidationError as error:
            for item in error.errors():
                name = ".".join(str(part) for part in item["loc"])
                problems.append((f"adapter.{name}" if name else "adapter", item["msg"]))
    return problems


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
