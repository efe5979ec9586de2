"""The real-size presets (SmolVLM-256M / 500M at their published dimensions, random weights), the
image-size and feature-layers overrides, and their settings. Config-level in the default suite;
the slow test builds smolvlm-256m and counts its parameters."""

from __future__ import annotations

import pytest

from joynexus.models.backbone import BackboneSource, TinyBackboneSpec
from joynexus.settings import Settings

# Published dimensions (model cards of HuggingFaceTB/SmolVLM-256M-Instruct and -500M-Instruct, their
# SmolLM2-135M / -360M text models and google/siglip-base-patch16-512; see backbone/tiny.py).
PUBLISHED = {
    "smolvlm-256m": dict(text_hidden_size=576, text_layers=30, text_heads=9, text_kv_heads=3,
                         text_intermediate_size=1536),
    "smolvlm-500m": dict(text_hidden_size=960, text_layers=32, text_heads=15, text_kv_heads=5,
                         text_intermediate_size=2560),
}  # fmt: skip
SIGLIP_BASE_512 = dict(
    vision_hidden_size=768, vision_layers=12, vision_heads=12, vision_intermediate_size=3072, patch_size=16,
    image_size=512, scale_factor=4, vocab_size=49280,
)  # fmt: skip
# Idefics3Model (vision + connector + text model, no LM head), counted by hand from the architecture
# below; adding the untied LM head (vocab x hidden) gives the published 256M / 507M.
EXPECTED_PARAMETERS = {"smolvlm-256m": 228_099_648, "smolvlm-500m": 460_173_504}


def idefics3_parameters(spec: TinyBackboneSpec) -> int:
    """SigLIP vision tower + pixel-shuffle connector + Llama decoder, from the spec's dimensions."""
    h, i, p = spec.vision_hidden_size, spec.vision_intermediate_size or 4 * spec.vision_hidden_size, spec.patch_size
    layer = 2 * h + 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h)  # LN, q/k/v/o with bias, LN, MLP
    vision = (3 * p * p * h + h) + (spec.grid_image_size // p) ** 2 * h + spec.vision_layers * layer + 2 * h
    connector = h * spec.scale_factor**2 * spec.text_hidden_size  # no bias
    t, ti, head_dim = spec.text_hidden_size, spec.text_intermediate_size, spec.text_hidden_size // spec.text_heads
    text_layer = 2 * t * t + 2 * t * spec.kv_heads * head_dim + 3 * t * ti + 2 * t  # q,o + k,v + SwiGLU + 2 norms
    text = spec.vocab_size * t + spec.built_text_layers * text_layer + t
    return vision + connector + text


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_dimensions_match_the_published_ones(name: str) -> None:
    spec = TinyBackboneSpec.preset(name)
    for field, value in {**PUBLISHED[name], **SIGLIP_BASE_512}.items():
        assert getattr(spec, field) == value, field
    assert spec.image_seq_len == 64  # "64 visual tokens to encode image patches of size 512x512"
    assert idefics3_parameters(spec) == EXPECTED_PARAMETERS[name]
    assert (
        idefics3_parameters(spec) + spec.vocab_size * spec.text_hidden_size
        == {
            "smolvlm-256m": 256_484_928,
            "smolvlm-500m": 507_482_304,
        }[name]
    )


def test_image_size_override_keeps_the_published_grid() -> None:
    spec = TinyBackboneSpec.preset("smolvlm-256m").with_overrides(image_size=64)
    assert (spec.image_size, spec.grid_image_size, spec.image_seq_len) == (64, 512, 1)
    assert idefics3_parameters(spec) == EXPECTED_PARAMETERS["smolvlm-256m"]  # same weights, smaller images
    assert TinyBackboneSpec.preset("smolvlm-256m").with_overrides(image_size=128).image_seq_len == 4
    with pytest.raises(ValueError, match=r"image_size=96 .*patch_size\*scale_factor=64"):
        TinyBackboneSpec.preset("smolvlm-256m").with_overrides(image_size=96)


def test_feature_layers_override() -> None:
    spec = TinyBackboneSpec.preset("smolvlm-500m").with_overrides(feature_layers=16)
    assert (spec.text_layers, spec.built_text_layers) == (32, 16)
    assert idefics3_parameters(spec) < EXPECTED_PARAMETERS["smolvlm-500m"]
    with pytest.raises(ValueError, match=r"feature_layers=33 .*1\.\.text_layers=32"):
        TinyBackboneSpec.preset("smolvlm-500m").with_overrides(feature_layers=33)


def test_overrides_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from joynexus.services.configs import backbone_source

    monkeypatch.setenv("JOYNEXUS_BACKBONE_PRESET", "smolvlm-256m")
    monkeypatch.setenv("JOYNEXUS_BACKBONE_IMAGE_SIZE", "128")
    monkeypatch.setenv("JOYNEXUS_BACKBONE_FEATURE_LAYERS", "8")
    source = backbone_source(Settings())
    assert (source.image_size, source.feature_layers) == (128, 8)
    assert source.preset_spec().image_size == 128 and source.preset_spec().built_text_layers == 8
    monkeypatch.setenv("JOYNEXUS_BACKBONE_IMAGE_SIZE", "100")
    with pytest.raises(ValueError, match=r"JOYNEXUS_BACKBONE_IMAGE_SIZE.*smolvlm-256m.*multiple of"):
        backbone_source(Settings())
    monkeypatch.setenv("JOYNEXUS_BACKBONE_IMAGE_SIZE", "big")
    with pytest.raises(ValueError, match="JOYNEXUS_BACKBONE_IMAGE_SIZE: expected an integer"):
        Settings()
    with pytest.raises(ValueError, match="presets only"):
        BackboneSource(preset=None, path="/nowhere", image_size=64)


def test_tiny_with_overrides_builds_and_encodes() -> None:
    import torch

    backbone = BackboneSource(preset="tiny", image_size=48, feature_layers=1).build()
    assert backbone.image_size == 48 and len(backbone.model.text_model.layers) == 1
    assert backbone.model_id != BackboneSource(preset="tiny").build().model_id  # never shares a prefix key
    features = backbone.encode([[torch.rand(3, 64, 64)]], ["pick up the cube"])
    assert features.tokens.shape[-1] == 64 and torch.isfinite(features.tokens).all()


@pytest.mark.slow
def test_smolvlm_256m_builds_with_the_published_parameter_count() -> None:
    import torch

    backbone = BackboneSource(preset="smolvlm-256m", image_size=64).build()
    assert backbone.parameter_count() == EXPECTED_PARAMETERS["smolvlm-256m"]
    assert backbone.hidden_size == 576 and len(backbone.model.text_model.layers) == 30
    features = backbone.encode([[torch.rand(3, 64, 64), torch.rand(3, 48, 64)]], ["pick up the cube"])
    assert torch.isfinite(features.tokens).all()
