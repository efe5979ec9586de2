"""Where the resident backbone comes from (`BackboneSource`), and which family builds it."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    # The id a checkpoint directory is served under (JOYNEXUS_BACKBONE_ID); None: the directory's own
    # (its JoyNexus metadata, else config.json's `_name_or_path`, else its path).
    model_id: str | None = None

    # Preset overrides (JOYNEXUS_BACKBONE_IMAGE_SIZE / JOYNEXUS_BACKBONE_FEATURE_LAYERS): the canonical
    # image side (e.g. a real-size preset at 64 or 128 px on a CPU) and SmolVLA's first-K-text-layers.
    image_size: int | None = Field(default=None, ge=1)
    feature_layers: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _overrides_fit(self) -> BackboneSource:
        """Refuse an override the preset cannot take here, in the process that reads the settings,
        rather than inside a service's actor."""
        overrides = {k: v for k, v in (("image_size", self.image_size), ("feature_layers", self.feature_layers)) if v}
        if not overrides:
            return self
        if self.path is not None:
            raise ValueError(
                f"backbone {', '.join(overrides)} override applies to presets only, not to the checkpoint "
                f"directory {self.path!r}"
            )
        if self.preset is not None and (self.family or family_for_preset(self.preset)) == DEFAULT_FAMILY:
            self.preset_spec()  # raises with the field and the allowed values
        return self

    def preset_spec(self) -> TinyBackboneSpec:
        """The default family's preset size with this source's overrides applied."""
        if self.preset is None:
            raise ValueError("BackboneSource has no preset")
        try:
            return TinyBackboneSpec.preset(self.preset).with_overrides(self.image_size, self.feature_layers)
        except ValueError as error:
            raise ValueError(
                f"backbone override (image_size={self.image_size} from JOYNEXUS_BACKBONE_IMAGE_SIZE, "
                f"feature_layers={self.feature_layers} from JOYNEXUS_BACKBONE_FEATURE_LAYERS) does not fit "
                f"preset {self.preset!r}: {error}"
            ) from None

    def build(self, placement: DevicePlacement | None = None) -> Backbone:
        """The backbone, on the placement's device in its dtype (None: the environment's placement)."""
        if self.path is not None:
            family = checkpoint_family(self.path)
            if self.model_id is None:
                return family.from_pretrained(self.path, placement=placement)
            if "model_id" not in inspect.signature(family.from_pretrained).parameters:
                raise ValueError(
                    f"backbone family {family.family!r} cannot serve a checkpoint under another model id "
                    f"(model_id={self.model_id!r}, JOYNEXUS_BACKBONE_ID); unset it"
                )
            return family.from_pretrained(self.path, placement=placement, model_id=self.model_id)
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
        if presets and self.preset in presets:
            if self.image_size or self.feature_layers:
                raise ValueError(f"backbone family {name!r} takes no image_size / feature_layers override")
            return family.build_tiny(presets[self.preset], seed=self.seed, placement=placement)
        return family.build_tiny(self.preset_spec(), seed=self.seed, placement=placement)
