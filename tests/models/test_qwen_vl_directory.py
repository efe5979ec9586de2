"""A plain Hugging Face Qwen3-VL checkpoint directory (`JOYNEXUS_BACKBONE_PATH`), exactly as
transformers writes it (no JoyNexus file), loads as the resident `qwen_vl` backbone: its mean/std,
fixed camera side (inside the processor's pixel range) and prompt (its chat template) come from its
own files, its id from its config (or `JOYNEXUS_BACKBONE_ID`); its prompt ids, patches and features
equal the stock processor's and transformers' own forward; a tenant trains and serves on it through
the services; what is missing or unsupported is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from joynexus.models.backbone import METADATA_FILE, BackboneSource, QwenVLBackbone, checkpoint_family
from joynexus.models.backbone.qwen_vl_directory import fixed_image_side
from tests.qwen_hf_checkpoint import (
    CHAT_TEMPLATE,
    HF_MODEL_ID,
    IMAGE_MEAN,
    IMAGE_STD,
    SERVED_SIDE,
    SYSTEM_PROMPT,
    write_qwen_hf_checkpoint,
)

INSTRUCTION = "pick up the red cube and place it in the bowl"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_qwen_hf_checkpoint(tmp_path_factory.mktemp("qwen-hf") / "qwen3-vl-tiny")


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> QwenVLBackbone:
    return BackboneSource(preset=None, path=str(checkpoint)).build()


def test_the_directory_is_plain_transformers_output(checkpoint: Path) -> None:
    names = {p.name for p in checkpoint.iterdir()}
    assert METADATA_FILE not in names
    assert {
        "config.json",
        "model.safetensors.index.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    } <= names
    assert len([n for n in names if n.startswith("model-") and n.endswith(".safetensors")]) > 1  # sharded
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert checkpoint_family(checkpoint) is QwenVLBackbone


def test_it_loads_with_the_settings_of_its_own_files(checkpoint: Path, loaded: QwenVLBackbone) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    assert type(loaded) is QwenVLBackbone and loaded.model_id == HF_MODEL_ID  # config.json's _name_or_path
    # The processor keeps 16^2..48^2 pixels: the family's 224 does not fit, the nearest side that does is 48.
    assert loaded.image_size == SERVED_SIDE and loaded.image_seq_len == (SERVED_SIDE // 8 // 2) ** 2
    assert loaded.image_mean == pytest.approx(IMAGE_MEAN) and loaded.image_std == pytest.approx(IMAGE_STD)
    assert loaded.chat_prompt is not None and loaded.chat_prompt.template == CHAT_TEMPLATE
    assert loaded.spec is None and loaded.hidden_size == 64
    # Every weight of the (sharded) checkpoint arrived, the language-model head left out.
    reference = Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, local_files_only=True).model.state_dict()
    state = loaded.model.state_dict()
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in reference)


def test_prompt_patches_and_features_equal_the_stock_processor_and_transformers_forward(
    checkpoint: Path, loaded: QwenVLBackbone
) -> None:
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint, local_files_only=True)
    rng = np.random.default_rng(0)
    for cameras in (0, 1, 2):
        # Cameras at the served side: the stock processor keeps them as they are (its smart_resize).
        arrays = [rng.integers(0, 256, (SERVED_SIDE, SERVED_SIDE, 3), dtype=np.uint8) for _ in range(cameras)]
        content = [{"type": "image"}] * cameras + [{"type": "text", "text": INSTRUCTION}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}")  # the directory's own template
        stock = processor(text=[text], images=[Image.fromarray(a) for a in arrays] or None, return_tensors="pt")
        ids, positions = loaded._prompt(cameras, INSTRUCTION)
        assert list(ids) == stock["input_ids"][0].tolist()
        images = [[torch.from_numpy(a).permute(2, 0, 1).float() / 255 for a in arrays]]
        if cameras:
            assert stock["image_grid_thw"].tolist() == [[1, SERVED_SIDE // 8, SERVED_SIDE // 8]] * cameras
            pixels = (torch.stack(images[0]) - loaded._mean) / loaded._std
            torch.testing.assert_close(loaded._patches(pixels), stock["pixel_values"], rtol=0, atol=1e-5)
        # The multimodal RoPE positions are get_rope_index's; the features transformers' own forward.
        rope, _ = loaded.model.get_rope_index(stock["input_ids"], stock.get("image_grid_thw"), None)
        assert torch.equal(rope[:, 0], positions)
        with torch.no_grad():
            reference = loaded.model(
                input_ids=stock["input_ids"],
                attention_mask=stock["attention_mask"],
                pixel_values=stock.get("pixel_values"),
                image_grid_thw=stock.get("image_grid_thw"),
            ).last_hidden_state
        features = loaded.encode(images, [INSTRUCTION])
        torch.testing.assert_close(features.tokens, reference, rtol=1e-4, atol=1e-4)


def test_saved_again_with_joynexus_metadata_it_keeps_its_prompt(loaded: QwenVLBackbone, tmp_path: Path) -> None:
    loaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / METADATA_FILE).is_file()
    again = QwenVLBackbone.from_pretrained(tmp_path / "again")
    assert again.prefix_key == loaded.prefix_key and again.image_mean == loaded.image_mean
    assert again.chat_prompt is not None and again.chat_prompt.template == CHAT_TEMPLATE
    assert again._prompt(2, "open the drawer")[0] == loaded._prompt(2, "open the drawer")[0]
    images, instructions = [[torch.rand(3, 40, 56)]], ["push the block to the left"]
    torch.testing.assert_close(
        again.encode(images, instructions).tokens, loaded.encode(images, instructions).tokens, atol=0, rtol=0
    )


def test_the_model_id_can_be_given(checkpoint: Path, monkeypatch) -> None:
    from joynexus.services.configs import backbone_source
    from joynexus.settings import Settings

    monkeypatch.setenv("JOYNEXUS_BACKBONE_PATH", str(checkpoint))
    monkeypatch.setenv("JOYNEXUS_BACKBONE_ID", "acme/qwen-vla-base")
    source = backbone_source(Settings())
    assert source == BackboneSource(preset=None, path=str(checkpoint), model_id="acme/qwen-vla-base")
    backbone = source.build()
    assert backbone.model_id == "acme/qwen-vla-base" and backbone.prefix_key[0] == "acme/qwen-vla-base"


def test_an_unsharded_directory_without_a_name_is_served_under_its_path(tmp_path: Path) -> None:
    root = write_qwen_hf_checkpoint(tmp_path / "single", max_shard_size=None, name_or_path=None)
    assert "_name_or_path" not in json.loads((root / "config.json").read_text())
    assert (root / "model.safetensors").is_file()
    assert QwenVLBackbone.from_pretrained(root).model_id == str(root.resolve())


def test_the_served_side_is_inside_the_processors_pixel_range() -> None:
    # The family default when it fits (Qwen2-VL's own range, patch 14 x merge 2).
    assert fixed_image_side(56 * 56, 28 * 28 * 1280, 28, 224) == 224
    # Qwen3-VL's released range (256^2 .. 4096^2 pixels, patch 16 x merge 2): 224 is too small.
    assert fixed_image_side(65536, 16777216, 32, 224) == 256
    assert fixed_image_side(16 * 16, 48 * 48, 16, 224) == 48 and fixed_image_side(1024, 1024, 16, 224) == 32
    assert fixed_image_side(1025, 1100, 16, 224) is None  # no multiple of 16 squared lies in 1025..1100
    for low, high, step in ((100, 5000, 16), (3136, 50000, 28), (4096, 4096, 32)):
        side = fixed_image_side(low, high, step, 224)
        assert side is not None and side % step == 0 and low <= side * side <= high


# ------------------------------------------------------------------- through the services
def test_a_tenant_trains_and_serves_on_it_through_the_services(checkpoint: Path, tmp_path: Path) -> None:
    from joynexus.master.deployment import Deployment
    from joynexus.master.workloads.manager import WorkloadManager
    from joynexus.scheduling.inference_queue import Observation
    from joynexus.settings import Settings
    from tests.helpers import sft_spec, write_dataset_for

    spec = sft_spec("qwen-hf-arm", tmp_path / "dataset", jobs=1, base_model=HF_MODEL_ID, image_size=(48, 64))
    spec["adapter"] = {"kind": "lora", "rank": 4, "target_modules": ["q_proj", "v_proj"]}
    write_dataset_for(spec, episodes=2, length=12)
    deployment = Deployment.in_process(
        Settings(data_dir=tmp_path / "data", torch_threads=1, backbone_path=str(checkpoint))
    )
    manager = WorkloadManager(deployment).start()
    try:
        info = deployment.training_service.backbone_info()
        assert info["model_id"] == HF_MODEL_ID  # the checkpoint's own id: the tenant names it as base_model
        deployment.creator.create(spec)
        workload = manager.submit("qwen-hf-arm", jobs=1)
        (final,) = manager.wait_all([workload.workload_id], timeout_s=300)
        assert final.state == "completed" and final.version == 1, final
        rng = np.random.default_rng(0)
        obs = Observation(images=(rng.random((3, 48, 64), dtype=np.float32),), state=np.zeros(4, np.float32))
        served = deployment.inference_service.predict("qwen-hf-arm", [obs], seeds=[0])
        assert served["policy_version"] == 1 and np.asarray(served["actions"]).shape == (1, 2, 3)
        assert np.isfinite(np.asarray(served["actions"])).all()
    finally:
        manager.stop()
        deployment.shutdown()


# ------------------------------------------------------------------- refusals
def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _pop_json(path: Path, *keys: str) -> None:
    data = json.loads(path.read_text())
    for key in keys:
        data.pop(key, None)
    path.write_text(json.dumps(data))


def _drop_chat_templates(root: Path) -> None:
    for name in ("chat_template.jinja", "chat_template.json"):
        (root / name).unlink(missing_ok=True)
    for name in ("processor_config.json", "tokenizer_config.json"):
        if (root / name).is_file():
            _pop_json(root / name, "chat_template")


def _bare_image_pads(root: Path) -> None:
    path = root / "chat_template.jinja"
    path.write_text(path.read_text().replace("<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>"))


PRE = "preprocessor_config.json"
REFUSALS = {
    "config.json": (lambda root: (root / "config.json").unlink(), FileNotFoundError, r"config\.json missing"),
    "model_type": (
        lambda root: _edit_json(root / "config.json", model_type="qwen2_5_vl"),
        ValueError,
        r"model_type 'qwen2_5_vl' belongs to no registered backbone family; supported: .*'qwen3_vl'",
    ),
    "shard": (
        lambda root: next(root.glob("model-00002-*.safetensors")).unlink(),
        FileNotFoundError,
        r"weight shard model-00002-of-\d+\.safetensors missing",
    ),
    "tokenizer": (
        lambda root: [(root / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
        FileNotFoundError,
        "tokenizer missing",
    ),
    "preprocessor": (lambda root: (root / PRE).unlink(), FileNotFoundError, r"preprocessor_config\.json missing"),
    "patch_size": (
        lambda root: _edit_json(root / PRE, patch_size=16),
        ValueError,
        r"field patch_size 16 != vision_config\.patch_size 8",
    ),
    "patch_size_default": (
        lambda root: _pop_json(root / PRE, "patch_size"),
        ValueError,
        r"field patch_size 14 \(absent: the image processor's default 14\) != vision_config\.patch_size 8",
    ),
    "merge_size": (
        lambda root: _edit_json(root / PRE, merge_size=1),
        ValueError,
        r"field merge_size 1 != vision_config\.spatial_merge_size 2",
    ),
    "size": (lambda root: _pop_json(root / PRE, "size", "min_pixels", "max_pixels"), ValueError, "field size missing"),
    "no_side": (
        lambda root: _edit_json(root / PRE, size={"shortest_edge": 1025, "longest_edge": 1100}),
        ValueError,
        r"field size allows 1025\.\.1100 pixels per image, which no square side .* patch_size\*merge_size=16 fits",
    ),
    "max_pixels": (
        lambda root: _edit_json(root / PRE, max_pixels=-1),
        ValueError,
        r"field max_pixels: expected a positive int, got -1",
    ),
    "mean": (
        lambda root: _edit_json(root / PRE, image_mean=[0.5, 0.5]),
        ValueError,
        r"field image_mean: expected 3 numbers",
    ),
    "chat_template": (_drop_chat_templates, FileNotFoundError, "chat template missing"),
    "vision_block": (
        _bare_image_pads,
        ValueError,
        r"renders 0 '<\|vision_start\|><\|image_pad\|><\|vision_end\|>' block\(s\) for 1 image",
    ),
    "image_token_id": (
        lambda root: _edit_json(root / "config.json", image_token_id=3),
        ValueError,
        r"tokenizer id \d+ of '<\|image_pad\|>' != the model config's image_token_id 3",
    ),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_a_refusal_names_what_is_missing_or_unsupported(what: str, checkpoint: Path, tmp_path: Path) -> None:
    break_it, error, message = REFUSALS[what]
    root = Path(shutil.copytree(checkpoint, tmp_path / "copy"))
    break_it(root)
    with pytest.raises(error, match=message) as raised:
        BackboneSource(preset=None, path=str(root)).build()
    assert str(root) in str(raised.value) or what == "image_token_id"  # the directory (or its file) is named
