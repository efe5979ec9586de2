"""``JoyNexusConfig``: the LeRobot config of a JoyNexus export (``config.json`` of the export root).

The tenant's own action-module config stays in ``action_module/config.json`` (JoyNexus's export
format); this config says how LeRobot's observation dict maps onto it (camera keys in backbone
slot order, the state key, the default instruction) and where the export keeps its backbone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lerobot.configs.policies import PreTrainedConfig
from lerobot.configs.types import FeatureType, NormalizationMode
from lerobot.optim.optimizers import AdamWConfig

__all__ = ["JoyNexusConfig"]


@PreTrainedConfig.register_subclass("joynexus")
@dataclass
class JoyNexusConfig(PreTrainedConfig):
    # Actions per backbone call (the module's action_chunk) and how many of them select_action plays.
    chunk_size: int = 1
    n_action_steps: int = 1
    # JoyNexus modules take the dataset's units (a normalized tenant's export carries its stats in
    # the processors): LeRobot's normalizer steps are identity unless stats are given.
    normalization_mapping: dict[str, NormalizationMode] = field(
        default_factory=lambda: {
            "VISUAL": NormalizationMode.IDENTITY,
            "STATE": NormalizationMode.IDENTITY,
            "ACTION": NormalizationMode.IDENTITY,
        }
    )
    # Observation keys, cameras in the backbone's slot order (images CHW float in [0, 1]).
    camera_keys: list[str] = field(default_factory=list)
    state_key: str = "observation.state"
    # The instruction when the batch carries no "task" (LeRobot's env path adds one per env).
    default_task: str = ""
    # Seed of the flow-matching noise per observation (None: the global RNG): with a seed, actions
    # equal JoyNexus predict with `seeds=[noise_seed] * N`.
    noise_seed: int | None = None
    # Folders of the export, relative to the export root (absolute paths are taken as they are).
    action_module_dir: str = "action_module"
    backbone_dir: str = "backbone"
    adapter_dir: str | None = None  # a LoRA tenant's PEFT adapter for the backbone's text model
    # Provenance (informational): which tenant version this is and which base model it was trained on.
    tenant_id: str = ""
    policy_version: int = 0
    base_model_id: str = ""
    optimizer_lr: float = 1e-4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size: expected >= 1, got {self.chunk_size}")
        if not 1 <= self.n_action_steps <= self.chunk_size:
            raise ValueError(f"n_action_steps: expected 1..chunk_size ({self.chunk_size}), got {self.n_action_steps}")

    def validate_features(self) -> None:
        visual = [k for k, f in (self.input_features or {}).items() if f.type is FeatureType.VISUAL]
        missing = [k for k in self.camera_keys if k not in visual]
        if missing:
            raise ValueError(f"camera_keys: {missing} are not VISUAL input features; the features have {visual}")

    @property
    def observation_delta_indices(self) -> None:
        return None

    @property
    def action_delta_indices(self) -> list[int]:
        return list(range(self.chunk_size))

    @property
    def reward_delta_indices(self) -> None:
        return None

    def get_optimizer_preset(self) -> AdamWConfig:
        return AdamWConfig(lr=self.optimizer_lr)

    def get_scheduler_preset(self) -> None:
        return None
