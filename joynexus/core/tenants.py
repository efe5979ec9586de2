"""The compiled tenant: what the backend can do, the backend config a spec compiles to, and the
tenant as the control plane stores it. Every layer uses these; only the Master creates tenants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from joynexus.core.store import TenantRecord
from joynexus.spec import EnvironmentSpec, RLSpec, WorkloadSpec


def _default_lora_targets() -> tuple[str, ...]:
    # Imported here, not at module level: the control plane and the API load transformers only when
    # a capability record is made without asking a backbone (the default family's names).
    from joynexus.models.backbone import default_lora_targets

    return default_lora_targets()


@dataclass(frozen=True)
class BaseModelCapabilities:
    """What one resident backbone accepts at its frozen-prefix boundary."""

    model_id: str
    feature_dim: int
    max_images: int
    image_size: int  # canonical square side the backbone resizes camera images to
    max_state_dim: int = 128
    max_action_dim: int = 64
    max_action_chunk: int = 128
    # Linear layers of the text model a LoRA adapter may target: by default the default backbone
    # family's (Idefics3 / SmolVLM: a Llama decoder); `of_backbone` asks the backbone itself.
    lora_target_modules: tuple[str, ...] = field(default_factory=_default_lora_targets)
    max_lora_rank: int = 64
    # The decoder's attention shape (num_heads, num_kv_heads, head_dim, num_layers) that a layer-wise
    # expert (kinds smolvla, pi0, pi05) is built against; None: the backbone offers no layer-wise prefix.
    prefix_geometry: tuple[int, int, int, int] | None = None

    @classmethod
    def of_backbone(cls, backbone: Any, **limits: Any) -> BaseModelCapabilities:
        targets = getattr(backbone, "lora_target_modules", None)
        if targets is not None and "lora_target_modules" not in limits:
            limits["lora_target_modules"] = tuple(targets())
        geometry = getattr(backbone, "prefix_geometry", None)
        if geometry is not None and "prefix_geometry" not in limits:
            layers = getattr(backbone, "num_layers", None) or len(backbone.model.text_model.layers)
            limits["prefix_geometry"] = (geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, layers)
        return cls(
            model_id=backbone.model_id,
            feature_dim=backbone.hidden_size,
            max_images=backbone.max_images,
            image_size=backbone.image_size,
            **limits,
        )


@dataclass(frozen=True)
class BackendCapabilities:
    base_models: dict[str, BaseModelCapabilities]

    @classmethod
    def single(cls, base_model: BaseModelCapabilities) -> BackendCapabilities:
        return cls(base_models={base_model.model_id: base_model})


class TenantBackendConfig(BaseModel):
    """The compiled spec: everything a model service needs to build and train a tenant slot."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant_id: str
    task_type: str
    base_model_id: str
    schema_signature: str
    cameras: tuple[str, ...]
    image_size: tuple[int, int]
    state_dim: int
    action_dim: int
    action_chunk: int
    instruction: str
    action_module: dict[str, Any]  # an ActionModuleConfig as a dict
    learning_rate: float
    microbatch_size: int
    samples_per_job: int
    checkpoint_every_jobs: int
    seed: int
    environment: EnvironmentSpec | None = None  # RL tenants (and evaluations) run here
    rl: RLSpec | None = None  # RL tenants
    # A LoraAdapterConfig as a dict (joynexus.models.adapters): the tenant's LoRA adapter on the
    # shared backbone, trained, versioned and exported with its action module; None: no adapter.
    adapter: dict[str, Any] | None = None
    # A joynexus.data.normalization.Normalizer as a dict (modes + statistics): how the tenant's state
    # and actions are normalized for its module; versioned with every checkpoint. None: raw units.
    normalization: dict[str, Any] | None = None
    # The learning-rate schedule (joynexus.spec.TrainingSpec): None = constant learning_rate.
    lr_decay_jobs: int | None = None
    lr_final_fraction: float = 0.1


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    spec: WorkloadSpec
    schema_signature: str
    backend_config: TenantBackendConfig
    status: str = "active"  # "active" | "unhealthy" (see TenantCreator.mark_unhealthy)
    status_reason: str | None = None


def simulator_config(spec: WorkloadSpec | TenantBackendConfig, seed_offset: int = 0) -> dict[str, Any]:
    """The Environment Service session config of a tenant's environment (a SimulatorConfig dict)."""
    if isinstance(spec, WorkloadSpec):
        env, cameras, image_size = spec.environment, spec.observation.cameras, spec.observation.image_size
    else:
        env, cameras, image_size = spec.environment, spec.cameras, spec.image_size
    if env is None:
        raise ValueError("environment: this tenant declares no simulator environment")
    return {
        "simulator": env.simulator,
        "task": env.task,
        "seed": env.seed + seed_offset,
        "image_size": list(image_size),
        "cameras": list(cameras),
        "max_episode_steps": env.max_episode_steps,
        "reward_mode": env.reward_mode,
        "control_mode": env.control_mode,
    }


def tenant_of(record: TenantRecord) -> Tenant:
    return Tenant(
        tenant_id=record.tenant_id,
        spec=WorkloadSpec.model_validate(record.spec),
        schema_signature=record.schema_signature,
        backend_config=TenantBackendConfig.model_validate(record.backend_config),
        status=record.status or "active",
        status_reason=record.status_reason,
    )
