"""What the services see of a resident backbone, whatever its family: the `Backbone` protocol, the
features it returns (`BackboneFeatures`) and the registry of backbone families.

A family is one class (e.g. `backbone.idefics3.ResidentBackbone` for Idefics3 / SmolVLM) that
implements `Backbone`, registered with ``@register_backbone_family(name)`` and declaring the HF
``model_type`` values its checkpoints carry (`BackboneSource` picks the family of a checkpoint from
its ``config.json``) and the default LoRA targets of its text model. A second family is one new
file that does the same; a family that builds its own presets lists them in ``presets`` (name ->
its spec), and `family_for_preset` finds the family of a preset name.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import torch
import torch.nn.functional as F

from joynexus.extensions import Registry

if TYPE_CHECKING:
    from joynexus.models.adapters import BackboneAdapters
    from joynexus.models.backbone.tiny import TinyBackboneSpec
    from joynexus.models.placement import DevicePlacement

__all__ = [
    "BACKBONE_FAMILIES",
    "DEFAULT_FAMILY",
    "METADATA_FILE",
    "METADATA_FORMAT_VERSION",
    "Backbone",
    "BackboneFeatures",
    "available_backbone_families",
    "default_lora_targets",
    "family_for_model_type",
    "family_for_preset",
    "register_backbone_family",
]

# Our metadata beside a saved checkpoint (model id, canonical image size, camera slots, ...).
METADATA_FILE = "joynexus_backbone.json"
METADATA_FORMAT_VERSION = 1
# The family of the built-in presets and of a checkpoint directory without a config.json.
DEFAULT_FAMILY = "idefics3"


@dataclass(frozen=True)
class BackboneFeatures:
    """Backbone output for a batch: per-token states, their mask and a pooled summary."""

    tokens: torch.Tensor  # (B, L, D) float32, padded positions zeroed
    mask: torch.Tensor  # (B, L) bool, True = real token
    pooled: torch.Tensor  # (B, D) masked mean of tokens

    def __post_init__(self) -> None:
        # Cheap shape checks: features travel between processes/modules and a
        # transposed tensor would otherwise fail far from its cause.
        if self.tokens.ndim != 3:
            raise ValueError(f"BackboneFeatures.tokens must be (B, L, D), got shape {tuple(self.tokens.shape)}")
        b, length, d = self.tokens.shape
        if self.mask.shape != (b, length) or self.mask.dtype != torch.bool:
            raise ValueError(
                f"BackboneFeatures.mask must be bool ({b}, {length}), got {self.mask.dtype} {tuple(self.mask.shape)}"
            )
        if self.pooled.shape != (b, d):
            raise ValueError(f"BackboneFeatures.pooled must be ({b}, {d}), got {tuple(self.pooled.shape)}")

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.tokens.shape[-1]

    def __len__(self) -> int:
        return self.batch_size

    def select(self, index: slice | torch.Tensor | list[int]) -> BackboneFeatures:
        """Rows of the batch (sequence length is kept)."""
        if isinstance(index, int):
            index = [index]  # keep the batch dimension
        if isinstance(index, list):
            index = torch.as_tensor(index, dtype=torch.long, device=self.tokens.device)
        return BackboneFeatures(tokens=self.tokens[index], mask=self.mask[index], pooled=self.pooled[index])

    def trimmed(self) -> BackboneFeatures:
        """Drop trailing sequence positions that are padding in every row."""
        real_cols = self.mask.any(dim=0).nonzero()
        length = int(real_cols.max()) + 1 if real_cols.numel() else 0
        if length == self.tokens.shape[1]:
            return self
        return BackboneFeatures(self.tokens[:, :length], self.mask[:, :length], self.pooled)

    def to(self, device: torch.device | str) -> BackboneFeatures:
        return BackboneFeatures(self.tokens.to(device), self.mask.to(device), self.pooled.to(device))

    def detach(self) -> BackboneFeatures:
        """The same values without the autograd graph (features of an adapter-carrying forward)."""
        return BackboneFeatures(self.tokens.detach(), self.mask, self.pooled.detach())

    @staticmethod
    def concat(parts: Sequence[BackboneFeatures]) -> BackboneFeatures:
        """Join batches along B, right-padding L to the longest part (padding zeroed, masked out)."""
        if not parts:
            raise ValueError("BackboneFeatures.concat needs at least one part")
        dims = {p.hidden_size for p in parts}
        if len(dims) != 1:
            raise ValueError(f"BackboneFeatures.concat: parts have different hidden sizes {sorted(dims)}")
        if len(parts) == 1:
            return parts[0]
        max_len = max(p.tokens.shape[1] for p in parts)
        tokens = [F.pad(p.tokens, (0, 0, 0, max_len - p.tokens.shape[1])) for p in parts]
        masks = [F.pad(p.mask, (0, max_len - p.mask.shape[1]), value=False) for p in parts]
        return BackboneFeatures(
            tokens=torch.cat(tokens, dim=0),
            mask=torch.cat(masks, dim=0),
            pooled=torch.cat([p.pooled for p in parts], dim=0),
        )


class Backbone(Protocol):
    """A frozen, memory-resident VLM as the training and inference services use it."""

    family: ClassVar[str]  # its registered family name (set by @register_backbone_family)
    model_types: ClassVar[tuple[str, ...]]  # HF config.json model_type values of its checkpoints
    lora_targets: ClassVar[tuple[str, ...]]  # default LoRA target layers of its text model
    instances_created: ClassVar[int]  # backbones of this family built in this process (stats)

    model_id: str
    hidden_size: int  # feature dim D of `encode`
    image_size: int  # canonical square side camera images are resized to
    max_images: int  # camera slots per sample
    device: torch.device
    placement: DevicePlacement

    @classmethod
    def build_tiny(
        cls, spec: TinyBackboneSpec | None = None, seed: int = 0, placement: DevicePlacement | None = None
    ) -> Backbone:
        """A randomly initialized backbone of this family from a preset (no files, no network)."""
        ...

    @classmethod
    def from_pretrained(cls, path: str | Path, placement: DevicePlacement | None = None) -> Backbone:
        """Load a local checkpoint directory of this family (offline only)."""
        ...

    def save_pretrained(self, path: str | Path) -> None:
        """Write a checkpoint `from_pretrained` reads back (the base model only, no adapters)."""
        ...

    def encode(
        self,
        images: list[list[torch.Tensor]],
        instructions: list[str],
        adapters: Sequence[Hashable | None] | None = None,
        *,
        grad: bool = False,
    ) -> BackboneFeatures:
        """Features of a batch of (cameras, instruction) samples; ``adapters[b]``: sample b's LoRA key."""
        ...

    @property
    def prefix_key(self) -> tuple:
        """Two backbones with equal keys produce interchangeable features."""
        ...

    @property
    def adapters(self) -> BackboneAdapters:
        """The tenants' LoRA adapters on the text model."""
        ...

    def has_adapters(self) -> bool: ...

    def lora_target_modules(self) -> list[str]:
        """Names of the text model's Linear layers an adapter may target."""
        ...

    def parameter_count(self) -> int: ...

    def placement_info(self) -> dict[str, Any]: ...


_B = TypeVar("_B", bound=type)

# Filled by @register_backbone_family where each family is defined.
BACKBONE_FAMILIES: Registry[Any] = Registry(
    object, field="family", noun="backbone family", plural="families", name_attribute="family"
)


def register_backbone_family(name: str) -> Callable[[_B], _B]:
    """Class decorator: register a `Backbone` implementation as family ``name``."""
    register = BACKBONE_FAMILIES.register(name)

    def decorator(cls: _B) -> _B:
        for attribute in ("model_types", "lora_targets", "build_tiny", "from_pretrained"):
            if not hasattr(cls, attribute):
                raise TypeError(f"backbone family {name!r}: {cls.__qualname__} has no {attribute!r}")
        return register(cls)

    return decorator


def available_backbone_families() -> list[str]:
    """Registered family names, sorted."""
    return BACKBONE_FAMILIES.available()


def family_for_model_type(model_type: str) -> type[Backbone]:
    """The family whose checkpoints carry this HF ``model_type``."""
    for _, cls in BACKBONE_FAMILIES.items():
        if model_type in cls.model_types:
            return cls
    supported = sorted(t for _, cls in BACKBONE_FAMILIES.items() for t in cls.model_types)
    raise ValueError(f"model_type {model_type!r} belongs to no registered backbone family; supported: {supported}")


def default_lora_targets() -> tuple[str, ...]:
    """The default family's LoRA target layers, sorted: what a backend accepts when nobody asked
    its backbone (`core.tenants.BaseModelCapabilities`)."""
    return tuple(sorted(BACKBONE_FAMILIES.get(DEFAULT_FAMILY).lora_targets))


def family_for_preset(preset: str) -> str:
    """The family whose own ``presets`` (a class attribute: name -> spec) name this preset; the
    default family for any other name (its builder knows the built-in presets, and says which
    exist)."""
    for name, cls in BACKBONE_FAMILIES.items():
        if preset in vars(cls).get("presets", {}):
            return name
    return DEFAULT_FAMILY
