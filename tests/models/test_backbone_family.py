"""The backbone-family seam: this file alone registers a second family (the tiny Idefics3 model
under another family name, with its own checkpoint model_type and LoRA targets), and
`BackboneSource` builds it by name, and picks it for a checkpoint whose config.json names its
model_type."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch

from joynexus.core.tenants import BaseModelCapabilities
from joynexus.models.backbone import (
    BackboneSource,
    ResidentBackbone,
    available_backbone_families,
    checkpoint_family,
    default_lora_targets,
    register_backbone_family,
)

FAMILY = "test_wrapped_idefics3"


@register_backbone_family(FAMILY)
class WrappedIdefics3(ResidentBackbone):
    """A real, working backbone of another family: the Idefics3 code path under its own name."""

    model_types: ClassVar[tuple[str, ...]] = ("test_wrapped_vlm",)
    lora_targets: ClassVar[tuple[str, ...]] = ("q_proj", "v_proj")


def test_a_registered_family_is_built_by_backbone_source():
    assert {"idefics3", FAMILY} <= set(available_backbone_families())
    wrapped = BackboneSource(preset="tiny", family=FAMILY).build()
    plain = BackboneSource(preset="tiny").build()
    assert type(wrapped) is WrappedIdefics3 and wrapped.family == FAMILY
    assert type(plain) is ResidentBackbone and plain.family == "idefics3"
    images, texts = [[torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0))]], ["pick up the cube"]
    torch.testing.assert_close(wrapped.encode(images, texts).tokens, plain.encode(images, texts).tokens)
    assert BaseModelCapabilities.of_backbone(wrapped).feature_dim == wrapped.hidden_size


def test_unknown_family_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"family='nope'.*allowed families.*idefics3"):
        BackboneSource(preset="tiny", family="nope").build()


def test_a_checkpoint_goes_to_the_family_of_its_model_type(tmp_path):
    for model_type, family in (("test_wrapped_vlm", WrappedIdefics3), ("idefics3", ResidentBackbone)):
        root = tmp_path / model_type
        root.mkdir()
        (root / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert checkpoint_family(root) is family
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    with pytest.raises(ValueError, match=r"qwen2_vl.*supported.*idefics3"):
        BackboneSource(path=str(tmp_path / "other")).build()
    # No config.json: the default family's loader says what is missing.
    with pytest.raises(FileNotFoundError, match="config.json"):
        BackboneSource(path=str(tmp_path)).build()


def test_the_default_lora_targets_come_from_the_default_family():
    assert default_lora_targets() == tuple(sorted(ResidentBackbone.lora_targets))
    caps = BaseModelCapabilities(model_id="m", feature_dim=8, max_images=1, image_size=32)
    assert caps.lora_target_modules == default_lora_targets()
