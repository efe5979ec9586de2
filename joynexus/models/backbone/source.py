"""Where the resident backbone comes from (`BackboneSource`), and which family builds it."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from joynexus.models.backbone.base import (
    BACKBONE_FAMILIES,
    DEFAULT_FAMILY,
    Backbone,
    family_for_model_type,
    family_for_preset,
)
from joynexus.models.backbone.tiny import TinyBackboneSpec
from joynexus.models.placement import DevicePlacement

__all__ = ["BackboneSource", "checkpoint_family"]


def checkpoint_family(path: str | Path) -> type[Backbone]:
    """The family of a checkpoint directory, from its ``config.json`` ``model_type``; a directory
    without a readable config.json goes to the default family, whose loader says what is missing."""
    config = Path(path).expanduser() / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return BACKBONE_FAMILIES.get(DEFAULT_FAMILY)
    if not isinstance(model_type, str):
        return BACKBONE_FAMILIES.get(DEFAULT_FAMILY)
    try:
        return family_for_model_type(model_type)
    except ValueError as error:
        raise ValueError(f"backbone checkpoint {str(path)!r} has {error}") from None


class BackboneSource(BaseModel):
    """Where the resident backbone comes from: a built-in random-weight preset, or a local directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: str | None = "tiny"
    path: str | None = None
    seed: int = 0
    # The family that builds a preset (a checkpoint's family comes from its config.json); None: the
    # family that owns the preset name (`family_for_preset`: e.g. "qwen3-vl-tiny" -> "qwen_vl").
    family: str | None = None

    def build(self, placement: DevicePlacement | None = None) -> Backbone:
        """The backbone, on the placement's device in its dtype (None: the environment's placement)."""
        if self.path is not None:
            return checkpoint_family(self.path).from_pretrained(self.path, placement=placement)
        if self.preset is None:
            raise ValueError("BackboneSource needs either `preset` or `path`")
        owner = family_for_preset(self.preset)
        name = self.family if self.family is not None else owner
        family = BACKBONE_FAMILIES.get(name)
        if owner != DEFAULT_FAMILY and not issubclass(family, BACKBONE_FAMILIES.get(owner)):
            raise ValueError(
                f"backbone preset {self.preset!r} belongs to family {owner!r}; family={name!r} can not build it"
            )
        presets = getattr(family, "presets", None)
        spec = presets[self.preset] if presets and self.preset in presets else TinyBackboneSpec.preset(self.preset)
        return family.build_tiny(spec, seed=self.seed, placement=placement)
