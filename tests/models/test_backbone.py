"""Tests for the resident frozen backbone (tiny random-weight Idefics3/SmolVLM)."""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported anywhere below
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json
import socket
from pathlib import Path

import pytest
import torch

from joynexus.models.backbone import METADATA_FILE, BackboneFeatures, ResidentBackbone, TinyBackboneSpec


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny workloads: with 2 OpenMP threads on a 2-core box shared with other jobs,
    spin-waiting threads made these tests ~10x slower; one thread is fast and stable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a connection (e.g. to a model hub) fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="module")
def backbone() -> ResidentBackbone:
    return ResidentBackbone.build_tiny()


def _img(h: int, w: int, seed: int) -> torch.Tensor:
    return torch.rand(3, h, w, generator=torch.Generator().manual_seed(seed))


def _mixed_batch() -> tuple[list[list[torch.Tensor]], list[str]]:
    """1, 2 and 3 cameras; canonical and non-canonical sizes; different instruction lengths."""
    images = [
        [_img(48, 64, 1)],
        [_img(32, 32, 2), _img(100, 80, 3)],
        [_img(32, 32, 4), _img(17, 23, 5), _img(64, 64, 6)],
    ]
    instructions = [
        "pick up the red cube",
        "push the green block to the left side of the table, then open the drawer",
        "",
    ]
    return images, instructions


def test_build_tiny_is_frozen(backbone: ResidentBackbone) -> None:
    assert backbone.parameter_count() > 0
    assert not any(p.requires_grad for p in backbone.model.parameters())
    assert not backbone.model.training
    feats = backbone.encode([[_img(32, 32, 0)]], ["open the drawer"])
    for t in (feats.tokens, feats.pooled):
        assert not t.requires_grad and t.grad_fn is None
        # Usable as a (constant) input to a trainable head: not an inference tensor.
        assert not t.is_inference()


def test_encode_shapes_and_mask(backbone: ResidentBackbone) -> None:
    images, instructions = _mixed_batch()
    feats = backbone.encode(images, instructions)
    lengths = [len(backbone._prompt_ids(len(c), t)) for c, t in zip(images, instructions, strict=True)]
    b, length, d = feats.tokens.shape
    assert (b, length, d) == (3, max(lengths), backbone.hidden_size)
    assert feats.tokens.dtype == torch.float32
    assert feats.mask.dtype == torch.bool and feats.mask.shape == (3, length)
    assert feats.mask.sum(dim=1).tolist() == lengths
    # Right padding: real tokens are a prefix; padded positions are zeroed.
    for row, n in zip(feats.mask, lengths, strict=True):
        assert row[:n].all() and not row[n:].any()
    assert torch.all(feats.tokens[~feats.mask] == 0)
    assert torch.isfinite(feats.tokens).all()
    expected_pooled = feats.tokens.sum(1) / feats.mask.sum(1, keepdim=True)
    torch.testing.assert_close(feats.pooled, expected_pooled)
    # Each camera adds image_seq_len image tokens + 3 markers.
    spec = TinyBackboneSpec.preset("tiny")
    assert backbone.image_seq_len == spec.image_seq_len == 4
    one = len(backbone._prompt_ids(1, "x"))
    assert len(backbone._prompt_ids(3, "x")) - one == 2 * (spec.image_seq_len + 3)


def test_sample_alone_equals_sample_in_mixed_batch(backbone: ResidentBackbone) -> None:
    images, instructions = _mixed_batch()
    batch = backbone.encode(images, instructions)
    for i in range(len(images)):
        alone = backbone.encode([images[i]], [instructions[i]])
        n = int(alone.mask.sum())
        assert int(batch.mask[i].sum()) == n
        torch.testing.assert_close(batch.tokens[i, :n], alone.tokens[0, :n], atol=1e-4, rtol=0)
        torch.testing.assert_close(batch.pooled[i], alone.pooled[0], atol=1e-4, rtol=0)


def test_fast_path_matches_hf_pixel_path(backbone: ResidentBackbone) -> None:
    """Our slot-mask fast path == Idefics3Model(pixel_values=...) on zero-padded slots.

    Equality shows that in transformers 4.57 the model drops all-zero padding slots
    and keeps a black real image (black normalizes to -1, not 0).
    """
    images, instructions = _mixed_batch()
    images[0] = [torch.zeros(3, 32, 32)]  # black real camera
    feats = backbone.encode(images, instructions)
    input_ids, attention_mask = backbone._input_ids(images, instructions)
    pixels, slot_mask = backbone._canonicalize(images)
    assert slot_mask.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert torch.all(pixels[~slot_mask] == 0)
    with torch.inference_mode():
        ref = backbone.model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixels)
    ref_tokens = ref.last_hidden_state * attention_mask.unsqueeze(-1)
    torch.testing.assert_close(feats.tokens, ref_tokens, atol=1e-5, rtol=0)


def test_black_and_grey_images_are_not_dropped(backbone: ResidentBackbone) -> None:
    instr = ["pick up the cube"] * 3
    black = torch.zeros(3, 32, 32)
    white = torch.ones(3, 32, 32)
    grey = torch.full((3, 32, 32), 0.5)  # normalizes to exactly 0: HF's padding test would drop it
    feats = backbone.encode([[black], [white], [grey]], instr)
    n = len(backbone._prompt_ids(1, instr[0]))
    assert feats.mask.sum(1).tolist() == [n, n, n]
    image_pos = backbone._input_ids([[black]], instr[:1])[0][0] == backbone.model.config.image_token_id
    assert int(image_pos.sum()) == backbone.image_seq_len
    # The image content reaches the image-token features: all three differ.
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert (feats.tokens[i, image_pos] - feats.tokens[j, image_pos]).abs().max() > 1e-3


def test_camera_count_changes_features(backbone: ResidentBackbone) -> None:
    a = backbone.encode([[_img(32, 32, 1)]], ["go"])
    b = backbone.encode([[_img(32, 32, 1), _img(32, 32, 2)]], ["go"])
    assert int(b.mask.sum()) - int(a.mask.sum()) == backbone.image_seq_len + 3


def test_encode_input_validation(backbone: ResidentBackbone) -> None:
    good = _img(32, 32, 0)
    assert backbone.encode([[]], ["x"]).batch_size == 1  # no camera: the instruction alone (state-only)
    with pytest.raises(ValueError, match="max_images"):
        backbone.encode([[good] * 4], ["x"])
    with pytest.raises(ValueError, match="float"):
        backbone.encode([[(good * 255).to(torch.uint8)]], ["x"])
    with pytest.raises(ValueError, match=r"\(3, h, w\)"):
        backbone.encode([[torch.rand(32, 32, 3)]], ["x"])
    with pytest.raises(ValueError, match="instructions"):
        backbone.encode([[good], [good]], ["x"])
    with pytest.raises(ValueError, match="empty"):
        backbone.encode([], [])


def test_long_instruction_is_truncated(backbone: ResidentBackbone) -> None:
    long = " ".join(["pick up the red cube"] * 100)
    feats = backbone.encode([[_img(32, 32, 0)]], [long])
    assert int(feats.mask.sum()) == len(backbone._prompt_ids(1, "")) + backbone.max_instruction_tokens


def test_features_select_and_concat(backbone: ResidentBackbone) -> None:
    images, instructions = _mixed_batch()
    feats = backbone.encode(images, instructions)
    for index in ([2, 0], slice(1, 3), torch.tensor([1])):
        sel = feats.select(index)
        torch.testing.assert_close(sel.tokens, feats.tokens[index])
        assert sel.mask.shape == sel.tokens.shape[:2]
    joined = BackboneFeatures.concat([feats.select([0]), feats.select([1, 2])])
    assert torch.equal(joined.tokens, feats.tokens) and torch.equal(joined.mask, feats.mask)
    # Separately encoded parts of different lengths: L is padded to the max.
    parts = [backbone.encode([images[i]], [instructions[i]]) for i in range(3)]
    joined = BackboneFeatures.concat(parts)
    assert joined.tokens.shape == feats.tokens.shape
    assert torch.equal(joined.mask, feats.mask)
    torch.testing.assert_close(joined.tokens, feats.tokens, atol=1e-4, rtol=0)
    torch.testing.assert_close(joined.pooled, feats.pooled, atol=1e-4, rtol=0)
    short = feats.select([0]).trimmed()
    assert short.tokens.shape[1] == int(feats.mask[0].sum())
    with pytest.raises(ValueError):
        BackboneFeatures.concat([])
    with pytest.raises(ValueError, match="mask"):
        BackboneFeatures(feats.tokens, feats.mask.float(), feats.pooled)


def test_save_then_load_gives_identical_encodings(backbone: ResidentBackbone, tmp_path: Path) -> None:
    images, instructions = _mixed_batch()
    backbone.save_pretrained(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())
    assert meta["max_images"] == backbone.max_images and meta["image_size"] == backbone.image_size
    loaded = ResidentBackbone.from_pretrained(tmp_path / "ckpt")
    assert loaded.prefix_key == backbone.prefix_key
    assert loaded.hidden_size == backbone.hidden_size
    assert not any(p.requires_grad for p in loaded.model.parameters())
    a = backbone.encode(images, instructions)
    b = loaded.encode(images, instructions)
    assert torch.equal(a.mask, b.mask)
    torch.testing.assert_close(a.tokens, b.tokens, atol=0, rtol=0)


def test_prompt_matches_stock_hf_processor(backbone: ResidentBackbone, tmp_path: Path) -> None:
    """The hand-built ids equal what the saved Idefics3Processor produces (offline)."""
    from PIL import Image
    from transformers import AutoProcessor

    backbone.save_pretrained(tmp_path)
    processor = AutoProcessor.from_pretrained(tmp_path, local_files_only=True)
    pil = Image.new("RGB", (32, 32), (10, 200, 30))
    instruction = "push the green block to the left"
    text = "User:<image><image>" + instruction + "<end_of_utterance>\nAssistant:"
    enc = processor(text=[text], images=[[pil, pil]], return_tensors="pt")
    assert enc["input_ids"][0].tolist() == list(backbone._prompt_ids(2, instruction))


def test_from_pretrained_errors(tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        ResidentBackbone.from_pretrained(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty.*config\.json"):
        ResidentBackbone.from_pretrained(empty)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        ResidentBackbone.from_pretrained(a_file)


def test_instances_created_counts_each_build(tmp_path: Path) -> None:
    before = ResidentBackbone.instances_created
    bb = ResidentBackbone.build_tiny()
    assert ResidentBackbone.instances_created == before + 1
    bb.encode([[_img(32, 32, 0)]], ["x"])  # encoding does not create instances
    assert ResidentBackbone.instances_created == before + 1
    bb.save_pretrained(tmp_path)
    ResidentBackbone.from_pretrained(tmp_path)
    assert ResidentBackbone.instances_created == before + 2


def test_build_is_deterministic_and_seed_changes_id(backbone: ResidentBackbone) -> None:
    images, instructions = _mixed_batch()
    again = ResidentBackbone.build_tiny(seed=0)
    assert again.model_id == backbone.model_id == "joynexus/tiny-smolvlm"
    assert again.tokenizer.get_vocab() == backbone.tokenizer.get_vocab()
    torch.testing.assert_close(
        again.encode(images, instructions).tokens, backbone.encode(images, instructions).tokens, atol=0, rtol=0
    )
    other = ResidentBackbone.build_tiny(seed=1)
    assert other.prefix_key != backbone.prefix_key


def test_spec_presets() -> None:
    tiny = TinyBackboneSpec.preset("tiny")
    small = TinyBackboneSpec.preset("small")
    assert tiny == TinyBackboneSpec()
    assert small.image_size == 64 and small.text_hidden_size > tiny.text_hidden_size
    with pytest.raises(ValueError, match=r"bogus.*small.*tiny"):
        TinyBackboneSpec.preset("bogus")
    with pytest.raises(ValueError, match="image_size"):
        TinyBackboneSpec(image_size=40)
