"""The Qwen3-VL backbone family (`qwen_vl`): built from its own presets, its hand-built inputs equal
what transformers' own processor and model compute (patches, multimodal RoPE positions, features),
a sample's features do not depend on its batch, LoRA tenants group on its decoder, it round-trips
through a checkpoint directory, refusals name the field, and a tenant trains and serves on it
through the services (SFT + predict). The LoRA / bfloat16 tests of test_lora_adapters.py and
test_placement.py also run on this family (their ``preset`` parameter)."""

from __future__ import annotations

import json
import resource
import time

import numpy as np
import pytest
import torch

from joynexus.core.tenants import BaseModelCapabilities
from joynexus.models.backbone import (
    BackboneSource,
    QwenVLBackbone,
    QwenVLSpec,
    ResidentBackbone,
    TinyBackboneSpec,
    checkpoint_family,
    family_for_preset,
)
from joynexus.models.backbone.common import canonical_pixels
from joynexus.models.backbone.qwen_vl import QWEN_VL_PRESETS

TEXTS = ["pick up the red cube", "push the green block to the left side of the table", "open the drawer"]


@pytest.fixture(scope="module")
def backbone() -> QwenVLBackbone:
    return BackboneSource(preset="qwen3-vl-tiny").build()


def _images(seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # Mixed camera counts and sizes (resized to the canonical side), and a state-only sample.
    return [[torch.rand(3, 48, 64, generator=g)], [torch.rand(3, 32, 32, generator=g)] * 2, []]


def test_the_preset_names_its_family_and_builds_a_qwen3_vl_model(backbone):
    assert family_for_preset("qwen3-vl-tiny") == family_for_preset("qwen3-vl-2b") == "qwen_vl"
    assert family_for_preset("tiny") == "idefics3"
    assert type(backbone) is QwenVLBackbone and backbone.family == "qwen_vl"
    assert backbone.model.config.model_type == "qwen3_vl"
    assert (backbone.model_id, backbone.hidden_size, backbone.image_size) == ("joynexus/qwen3-vl-tiny", 64, 32)
    assert backbone.image_seq_len == 4  # (32 / patch 8 / merge 2)^2 tokens per camera
    assert backbone.parameter_count() == sum(p.numel() for p in backbone.model.parameters())
    caps = BaseModelCapabilities.of_backbone(backbone)
    assert caps.feature_dim == 64 and caps.lora_target_modules == tuple(sorted(QwenVLBackbone.lora_targets))


def test_features_have_the_shared_contract_and_equal_transformers_own_forward(backbone):
    from transformers import Qwen2VLImageProcessorFast

    images = _images()
    features = backbone.encode(images, TEXTS)
    assert features.tokens.shape[0] == 3 and features.hidden_size == backbone.hidden_size
    assert features.tokens.dtype == torch.float32 and features.pooled.shape == (3, 64)
    counts = features.mask.sum(dim=1).tolist()
    # Every camera adds its image block (start, 4 image tokens, end) to the prompt.
    assert counts[1] - counts[2] == 2 * (backbone.image_seq_len + 2) + len(backbone._text_ids(TEXTS[1])) - len(
        backbone._text_ids(TEXTS[2])
    )
    assert not features.tokens[~features.mask].any()  # padding zeroed
    torch.testing.assert_close(features.pooled, features.tokens.sum(1) / features.mask.sum(1, keepdim=True))

    # The patches are the stock image processor's, at the fixed grid.
    pixels, slots = canonical_pixels(
        images, size=32, mean=backbone._mean, std=backbone._std, max_images=3, device=backbone.device
    )
    processor = Qwen2VLImageProcessorFast(
        patch_size=8, merge_size=2, do_resize=False, do_rescale=False, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    canonical = list(pixels[slots] * backbone._std + backbone._mean)  # resized to the side, in [0, 1]
    stock = processor(images=canonical, return_tensors="pt")
    assert stock["image_grid_thw"].tolist() == [[1, 4, 4]] * 3
    torch.testing.assert_close(backbone._patches(pixels[slots]), stock["pixel_values"], rtol=0, atol=1e-6)
    # The positions are get_rope_index's, and the features the model's own forward.
    input_ids, attention_mask, positions = backbone._inputs(images, TEXTS)
    rope, _ = backbone.model.get_rope_index(input_ids, stock["image_grid_thw"], None, attention_mask=attention_mask)
    real = attention_mask.bool()
    assert torch.equal(rope[:, real], positions[:, real])
    with torch.no_grad():
        reference = backbone.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pixel_values=stock["pixel_values"],
            image_grid_thw=stock["image_grid_thw"],
        ).last_hidden_state
    torch.testing.assert_close(features.tokens[real], reference[real], rtol=1e-5, atol=1e-5)


def test_a_samples_features_do_not_depend_on_its_batch(backbone):
    images = _images(1)
    batch = backbone.encode(images, TEXTS)
    for i in range(3):
        alone = backbone.encode(images[i : i + 1], TEXTS[i : i + 1])
        row = batch.select([i]).trimmed()
        assert torch.equal(row.mask, alone.mask)
        # sdpa over a longer padded key range rounds differently (~5e-7): equal to float rounding.
        torch.testing.assert_close(row.tokens, alone.tokens, rtol=1e-5, atol=1e-5)
    # A grouped forward of two tenants' requests equals their own forwards (what the services batch).
    grouped = backbone.encode(images + images[::-1], TEXTS + TEXTS[::-1])
    torch.testing.assert_close(grouped.select([0, 1, 2]).pooled, batch.pooled, rtol=1e-5, atol=1e-5)


def test_lora_tenants_group_on_the_decoder_and_train_only_their_adapter(backbone):
    images, keys = _images(2), ["a", None, "b"]
    backbone.adapters.add("a", {"rank": 4, "target_modules": ["q_proj", "v_proj"]}, seed=1, trainable=True)
    backbone.adapters.add("b", {"rank": 2, "target_modules": ["down_proj", "o_proj"]}, seed=2, trainable=True)
    try:
        g = torch.Generator().manual_seed(3)
        for key in ("a", "b"):
            state = backbone.adapters.state_dict(key)
            weights = {k: 0.2 * torch.randn(v.shape, generator=g) for k, v in state.items()}
            backbone.adapters.load_state_dict(key, weights)
        mixed = backbone.encode(images, TEXTS, keys)
        for i, key in enumerate(keys):
            alone = backbone.encode(images[i : i + 1], TEXTS[i : i + 1], [key])
            torch.testing.assert_close(mixed.select([i]).trimmed().tokens, alone.tokens, rtol=1e-5, atol=1e-5)
        traced = backbone.encode(images, TEXTS, keys, grad=True)
        own, other = backbone.adapters.parameters("a"), backbone.adapters.parameters("b")
        grads = torch.autograd.grad(traced.select([0]).pooled.square().sum(), own + other, allow_unused=True)
        assert all(g is not None and bool(g.abs().sum() > 0) for g in grads[: len(own)])
        assert all(g is None or not g.any() for g in grads[len(own) :])
        assert not any(p.requires_grad for n, p in backbone.model.named_parameters() if ".lora_" not in n)
    finally:
        backbone.adapters.remove("a")
        backbone.adapters.remove("b")


def test_a_checkpoint_directory_round_trips_and_names_its_family(backbone, tmp_path):
    backbone.save_pretrained(tmp_path / "qwen")
    config = json.loads((tmp_path / "qwen" / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl"
    assert checkpoint_family(tmp_path / "qwen") is QwenVLBackbone
    loaded = BackboneSource(preset=None, path=str(tmp_path / "qwen")).build()
    assert type(loaded) is QwenVLBackbone and loaded.prefix_key == backbone.prefix_key and loaded.spec == backbone.spec
    images = _images(3)
    assert torch.equal(loaded.encode(images, TEXTS).tokens, backbone.encode(images, TEXTS).tokens)


def test_refusals_name_the_field_and_what_is_allowed(backbone, tmp_path):
    with pytest.raises(ValueError, match="image_size=40 must be a multiple of patch_size\\*spatial_merge_size=16"):
        QwenVLSpec(image_size=40)
    with pytest.raises(ValueError, match="mrope_section=.*must sum to head_dim/2=8"):
        QwenVLSpec(mrope_section=(2, 2, 2))
    with pytest.raises(ValueError, match="text_heads=4 must be a multiple of text_kv_heads"):
        QwenVLSpec(text_kv_heads=3)
    with pytest.raises(ValueError, match="builds its own presets.*qwen3-vl-tiny"):
        QwenVLBackbone.build_tiny(TinyBackboneSpec())
    with pytest.raises(ValueError, match="preset 'qwen3-vl-tiny' belongs to family 'qwen_vl'; family='idefics3'"):
        BackboneSource(preset="qwen3-vl-tiny", family="idefics3").build()
    with pytest.raises(ValueError, match="sample 0 has 4 cameras; expected 0..3"):
        backbone.encode([[torch.rand(3, 32, 32)] * 4], ["x"])
    with pytest.raises(ValueError, match="must be float in"):
        backbone.encode([[torch.zeros(3, 32, 32, dtype=torch.uint8)]], ["x"])
    with pytest.raises(KeyError, match="no LoRA adapter 'nobody'"):
        backbone.encode([[]], ["x"], ["nobody"])
    with pytest.raises(ValueError, match="not Linear layers.*q_proj"):
        backbone.adapters.add("x", {"rank": 2, "target_modules": ["fc1"]})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    # Without JoyNexus metadata it is read as a plain HF directory (test_qwen_vl_directory.py): named what is missing.
    with pytest.raises(FileNotFoundError, match="weights missing"):
        BackboneSource(preset=None, path=str(tmp_path)).build()
    assert ResidentBackbone.lora_targets == QwenVLBackbone.lora_targets  # both decoders name them alike


def test_the_published_2b_preset_carries_qwen3_vl_2b_dimensions():
    spec = QWEN_VL_PRESETS["qwen3-vl-2b"]
    assert (spec.text_hidden_size, spec.text_layers, spec.text_heads, spec.text_kv_heads) == (2048, 28, 16, 8)
    assert (spec.text_intermediate_size, spec.vocab_size, spec.head_dim) == (6144, 151936, 128)
    assert (spec.vision_layers, spec.vision_hidden_size, spec.vision_intermediate_size) == (24, 1024, 4096)
    assert spec.deepstack_visual_indexes == (5, 11, 17) and spec.image_seq_len == 49


@pytest.mark.slow
def test_the_2b_preset_builds_at_its_published_size():
    from joynexus.models.placement import DevicePlacement

    # bfloat16: half the memory of float32 (about 4 GiB); the parameter count is the same. The weights
    # are drawn in float32 (the same backbone on every device), so the build peaks near 8.5 GiB.
    started = time.perf_counter()
    backbone = BackboneSource(preset="qwen3-vl-2b").build(DevicePlacement(device="cpu", dtype="bfloat16"))
    built_s = time.perf_counter() - started
    count = backbone.parameter_count()
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"qwen3-vl-2b parameters: {count:,}; build {built_s:.1f} s; peak RSS so far {peak_gib:.2f} GiB")
    # Qwen3VLModel without the language-model head (tied to the embeddings in the release): 406,957,056
    # vision + 1,720,574,976 decoder parameters.
    assert count == 2_127_532_032, count
    started = time.perf_counter()
    features = backbone.encode([[torch.rand(3, 240, 320)]], ["pick up the cube"])
    encode_s = time.perf_counter() - started
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    threads = torch.get_num_threads()
    print(
        f"qwen3-vl-2b encode (1 camera at 224 px, bfloat16, {threads} threads): {encode_s:.2f} s; "
        f"peak RSS {peak_gib:.2f} GiB"
    )
    assert features.hidden_size == 2048 and features.tokens.shape[1] == int(features.mask.sum())


# ------------------------------------------------------------------- through the services
def test_a_tenant_trains_and_serves_on_the_qwen_family_through_the_services(tmp_path):
    from joynexus.master.deployment import Deployment
    from joynexus.master.workloads.manager import WorkloadManager
    from joynexus.scheduling.inference_queue import Observation
    from joynexus.settings import Settings
    from tests.helpers import sft_spec, write_dataset_for

    spec = sft_spec("qwen-arm", tmp_path / "dataset", jobs=1, base_model="joynexus/qwen3-vl-tiny")
    spec["adapter"] = {"kind": "lora", "rank": 4, "target_modules": ["q_proj", "v_proj"]}
    write_dataset_for(spec, episodes=2, length=12)
    deployment = Deployment.in_process(
        Settings(data_dir=tmp_path / "data", torch_threads=1, backbone_preset="qwen3-vl-tiny")
    )
    manager = WorkloadManager(deployment).start()
    try:
        assert deployment.training_service.backbone_info()["model_id"] == "joynexus/qwen3-vl-tiny"
        deployment.creator.create(spec)
        workload = manager.submit("qwen-arm", jobs=1)
        (final,) = manager.wait_all([workload.workload_id], timeout_s=300)
        assert final.state == "completed" and final.version == 1, final
        rng = np.random.default_rng(0)
        obs = Observation(images=(rng.random((3, 32, 32), dtype=np.float32),), state=np.zeros(4, np.float32))
        served = deployment.inference_service.predict("qwen-arm", [obs], seeds=[0])
        assert served["policy_version"] == 1 and np.asarray(served["actions"]).shape == (1, 2, 3)
        assert np.isfinite(np.asarray(served["actions"])).all()
        # The export is the same directory as on the Idefics3 family: its adapter loads with stock peft
        # on the saved backbone's decoder (Qwen3VLModel.language_model).
        from peft import PeftModel
        from transformers import AutoModel

        from joynexus.artifacts.exports import export_directory, load_action_module

        export_directory(deployment.training_service.export_params("qwen-arm"), tmp_path / "export")
        assert load_action_module(tmp_path / "export") is not None
        deployment.training_service.backbone.save_pretrained(tmp_path / "backbone")
        base = AutoModel.from_pretrained(tmp_path / "backbone", local_files_only=True)
        PeftModel.from_pretrained(base.language_model, tmp_path / "export" / "adapter")
        assert any(".lora_A." in name for name, _ in base.language_model.named_parameters())
    finally:
        manager.stop()
        deployment.shutdown()
