"""A plain Hugging Face checkpoint directory (`JOYNEXUS_BACKBONE_PATH`), exactly as transformers
writes it, loads as the resident backbone: image size, mean/std and the prompt come from its own
processor files, its id from its config (or `JOYNEXUS_BACKBONE_ID`); what is missing is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from joynexus.models.backbone import METADATA_FILE, BackboneSource, ResidentBackbone
from tests.hf_checkpoint import CHAT_TEMPLATE, HF_MODEL_ID, IMAGE_MEAN, IMAGE_STD, write_plain_hf_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_plain_hf_checkpoint(tmp_path_factory.mktemp("hf") / "smolvlm-tiny")


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> ResidentBackbone:
    return BackboneSource(preset=None, path=str(checkpoint)).build()


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "copy"))


def test_the_directory_is_plain_transformers_output(checkpoint: Path) -> None:
    names = {p.name for p in checkpoint.iterdir()}
    assert METADATA_FILE not in names
    assert {"config.json", "model.safetensors.index.json", "preprocessor_config.json", "tokenizer.json"} <= names
    assert len([n for n in names if n.startswith("model-") and n.endswith(".safetensors")]) > 1  # sharded


def test_it_loads_with_the_settings_of_its_own_files(checkpoint: Path, loaded: ResidentBackbone) -> None:
    from transformers import Idefics3ForConditionalGeneration

    assert loaded.model_id == HF_MODEL_ID  # config.json's _name_or_path
    assert loaded.image_size == 32 and loaded.image_seq_len == 4
    assert loaded.image_mean == pytest.approx(IMAGE_MEAN) and loaded.image_std == pytest.approx(IMAGE_STD)
    assert loaded.chat_prompt is not None and loaded.chat_prompt.template == CHAT_TEMPLATE
    # Every weight of the (sharded) checkpoint arrived: the same as transformers' own load.
    reference = Idefics3ForConditionalGeneration.from_pretrained(checkpoint, local_files_only=True).model.state_dict()
    state = loaded.model.state_dict()
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in reference)


def test_the_prompt_is_what_the_stock_processor_makes_from_the_chat_template(
    checkpoint: Path, loaded: ResidentBackbone
) -> None:
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint, local_files_only=True)
    instruction = "pick up the red cube and place it in the bowl"
    for cameras in (0, 1, 2):
        content = [{"type": "image"}] * cameras + [{"type": "text", "text": instruction}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        assert text.endswith("Robot:")
        images = [[Image.new("RGB", (32, 32), (10, 200, 30))] * cameras] if cameras else None
        expected = processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
        assert list(loaded._prompt_ids(cameras, instruction)) == expected


def test_it_encodes_and_trains_adapters_like_any_backbone(loaded: ResidentBackbone) -> None:
    images = [[torch.rand(3, 48, 40), torch.rand(3, 32, 32)], []]
    features = loaded.encode(images, ["push the block to the left", "open the drawer"])
    assert features.tokens.shape[0] == 2 and features.hidden_size == 64
    assert torch.isfinite(features.tokens).all()
    assert "q_proj" in " ".join(loaded.lora_target_modules())


def test_saved_again_with_joynexus_metadata_it_keeps_its_prompt(loaded: ResidentBackbone, tmp_path: Path) -> None:
    loaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / METADATA_FILE).is_file()
    again = ResidentBackbone.from_pretrained(tmp_path / "again")
    assert again.prefix_key == loaded.prefix_key and again.image_mean == loaded.image_mean
    assert again._prompt_ids(2, "open the drawer") == loaded._prompt_ids(2, "open the drawer")
    images, instructions = [[torch.rand(3, 32, 32)]], ["push the block to the left"]
    torch.testing.assert_close(
        again.encode(images, instructions).tokens, loaded.encode(images, instructions).tokens, atol=0, rtol=0
    )


def test_the_model_id_can_be_given(checkpoint: Path, monkeypatch) -> None:
    from joynexus.services.configs import backbone_source
    from joynexus.settings import Settings

    monkeypatch.setenv("JOYNEXUS_BACKBONE_PATH", str(checkpoint))
    monkeypatch.setenv("JOYNEXUS_BACKBONE_ID", "acme/vla-base")
    source = backbone_source(Settings())
    assert source == BackboneSource(preset=None, path=str(checkpoint), model_id="acme/vla-base")
    backbone = source.build()
    assert backbone.model_id == "acme/vla-base" and backbone.prefix_key[0] == "acme/vla-base"


def test_an_unsharded_directory_without_a_name_is_served_under_its_path(tmp_path: Path) -> None:
    root = write_plain_hf_checkpoint(tmp_path / "single", max_shard_size=None, name_or_path=None)
    assert "_name_or_path" not in json.loads((root / "config.json").read_text())
    assert (root / "model.safetensors").is_file()
    assert ResidentBackbone.from_pretrained(root).model_id == str(root.resolve())


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _pop_json(path: Path, key: str) -> None:
    data = json.loads(path.read_text())
    del data[key]
    path.write_text(json.dumps(data))


def _drop_chat_templates(root: Path) -> None:
    for name in ("chat_template.jinja", "chat_template.json"):
        (root / name).unlink(missing_ok=True)
    for name in ("processor_config.json", "tokenizer_config.json"):
        data = json.loads((root / name).read_text())
        data.pop("chat_template", None)
        (root / name).write_text(json.dumps(data))


REFUSALS = {
    "config.json": (lambda root: (root / "config.json").unlink(), FileNotFoundError, r"config\.json missing"),
    "model_type": (
        lambda root: _edit_json(root / "config.json", model_type="llava"),
        ValueError,
        r"model_type 'llava'.*supported: .*'idefics3'",
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
    "preprocessor": (
        lambda root: (root / "preprocessor_config.json").unlink(),
        FileNotFoundError,
        r"preprocessor_config\.json missing",
    ),
    "splitting": (
        lambda root: _edit_json(root / "preprocessor_config.json", do_image_splitting=True),
        ValueError,
        "do_image_splitting is true",
    ),
    "splitting_default": (
        lambda root: _pop_json(root / "preprocessor_config.json", "do_image_splitting"),
        ValueError,
        r"do_image_splitting is absent \(the image processor's default: true\)",
    ),
    "tile_side": (
        lambda root: _pop_json(root / "preprocessor_config.json", "max_image_size"),
        ValueError,
        "field max_image_size missing",
    ),
    "mean": (
        lambda root: _edit_json(root / "preprocessor_config.json", image_mean=[0.5, 0.5]),
        ValueError,
        r"field image_mean: expected 3 numbers",
    ),
    "chat_template": (_drop_chat_templates, FileNotFoundError, "chat template missing"),
    "image_seq_len": (
        lambda root: _edit_json(root / "processor_config.json", image_seq_len=64),
        ValueError,
        "image_seq_len 64 != the 4 tokens",
    ),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_a_refusal_names_what_is_missing_or_unsupported(what: str, checkpoint: Path, tmp_path: Path) -> None:
    break_it, error, message = REFUSALS[what]
    root = _copy(checkpoint, tmp_path)
    break_it(root)
    with pytest.raises(error, match=message) as raised:
        BackboneSource(preset=None, path=str(root)).build()
    assert str(root) in str(raised.value) or what in (
        "model_type",
        "mean",
        "splitting",
        "splitting_default",
        "tile_side",
        "image_seq_len",
    )
