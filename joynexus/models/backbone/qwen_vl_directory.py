"""Plain Hugging Face Qwen3-VL checkpoint directories (``JOYNEXUS_BACKBONE_PATH``) as a
`QwenVLBackbone`: a directory exactly as ``Qwen3VLForConditionalGeneration.save_pretrained`` and
``Qwen3VLProcessor.save_pretrained`` write it (``config.json``, ``model.safetensors`` or its shards,
the tokenizer, ``preprocessor_config.json``, the video processor config and the chat template), with
no JoyNexus metadata. Everything the hot path needs comes from those files:

* the image normalization from the image processor's ``image_mean`` / ``image_std``;
* the fixed camera side: Qwen's image processor is dynamic-resolution (``smart_resize``: each side a
  multiple of ``patch_size * merge_size``, the pixel count kept within ``size.shortest_edge`` ..
  ``size.longest_edge``, which ``min_pixels`` / ``max_pixels`` override when set). The backbone serves
  one square side S instead, chosen so that the stock processor would keep an S x S image as it is:
  a multiple of ``patch_size * merge_size`` with S^2 in that range; the family's default side when it
  fits, else the fitting side nearest to it. The processor's ``patch_size`` / ``merge_size`` /
  ``temporal_patch_size`` must equal the model config's vision config (the patches are flattened as
  the processor does);
* the instruction prompt from the chat template (`ChatTemplatePrompt`), each image as
  ``<|vision_start|><|image_pad|><|vision_end|>`` with the pad expanded to the image's tokens;
* the model id from ``JOYNEXUS_BACKBONE_ID``, else the config's ``_name_or_path``, else the path.

Every refusal names the file and field that is missing or unsupported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLModel

from joynexus.models.backbone.hf_directory import (
    DEFAULT_MAX_IMAGES,
    ChatTemplatePrompt,
    backbone_over,
    normalization,
    read_plain_directory,
)
from joynexus.models.placement import DevicePlacement

if TYPE_CHECKING:
    from joynexus.models.backbone.qwen_vl import QwenVLBackbone

__all__ = ["QwenVLDirectory", "fixed_image_side", "load_qwen_vl_directory"]

# What Qwen2VLImageProcessor(Fast) uses for a field its config leaves out.
PROCESSOR_DEFAULTS = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
# processor field -> the vision config field of config.json it must equal
VISION_FIELDS = {
    "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size",
    "merge_size": "spatial_merge_size",
}


def fixed_image_side(min_pixels: int, max_pixels: int, step: int, default: int) -> int | None:
    """The square side S the backbone serves: a multiple of ``step`` with ``min_pixels <= S^2 <=
    max_pixels`` (the stock processor keeps such an image as it is), ``default`` when it is one, else
    the one nearest to ``default``; None when no multiple of ``step`` fits."""
    low = -(-(math.isqrt(min_pixels - 1) + 1) // step) if min_pixels > 0 else 1  # ceil(sqrt(min) / step)
    high = math.isqrt(max_pixels) // step  # floor(sqrt(max) / step)
    if max(low, 1) > high:
        return None
    return min(max(round(default / step), low, 1), high) * step


def _positive_int(pre: dict[str, Any], key: str, where: Path, default: int | None = None) -> int | None:
    value = pre.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: field {key}: expected a positive int, got {value!r}")
    return value


def _pixel_range(pre: dict[str, Any], where: Path) -> tuple[int, int]:
    """The processor's (min, max) pixel count: ``size``, overridden by ``min_pixels`` / ``max_pixels``
    when set (what Qwen2VLImageProcessor does)."""
    size = pre.get("size")
    if size is not None and not isinstance(size, dict):
        raise ValueError(f"{where}: field size: expected {{'shortest_edge': <pixels>, 'longest_edge': <pixels>}}")
    size = size or {}
    low = _positive_int(pre, "min_pixels", where) or _positive_int(size, "shortest_edge", where)
    high = _positive_int(pre, "max_pixels", where) or _positive_int(size, "longest_edge", where)
    if low is None or high is None:
        raise ValueError(
            f"{where}: field size missing its shortest_edge / longest_edge (the processor's min / max pixels, "
            "which bound the camera side served)"
        )
    if low > high:
        raise ValueError(f"{where}: field size: shortest_edge {low} pixels > longest_edge {high} pixels")
    return low, high


@dataclass(frozen=True)
class QwenVLDirectory:
    """What a plain Qwen3-VL checkpoint directory says about serving it (read without loading weights)."""

    root: Path
    model_id: str
    image_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    prompt: ChatTemplatePrompt

    @classmethod
    def read(cls, path: str | Path, family: type[QwenVLBackbone], *, model_id: str | None = None) -> QwenVLDirectory:
        """Check the directory's files and read its serving settings; refusals name what is missing."""
        plain = read_plain_directory(
            path,
            model_types=family.model_types,
            model_id=model_id,
            preprocessor_use="the image normalization and the pixel range of the camera side come from it",
            image_token=family.image_token,
        )
        pre, where = plain.preprocessor, plain.preprocessor_path
        vision = plain.config.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError(f"{plain.root / 'config.json'}: field vision_config missing (the vision tower)")
        sizes: dict[str, int] = {}
        for key, vision_key in VISION_FIELDS.items():
            sizes[key] = _positive_int(pre, key, where, PROCESSOR_DEFAULTS[key])  # type: ignore[assignment]
            model_value = vision.get(vision_key)
            if model_value is not None and sizes[key] != model_value:
                state = "" if key in pre else f" (absent: the image processor's default {PROCESSOR_DEFAULTS[key]})"
                raise ValueError(
                    f"{where}: field {key} {sizes[key]}{state} != vision_config.{vision_key} {model_value} of "
                    f"{plain.root / 'config.json'}: the processor does not make the patches this model takes"
                )
        low, high = _pixel_range(pre, where)
        step = sizes["patch_size"] * sizes["merge_size"]
        side = fixed_image_side(low, high, step, family.default_image_size)
        if side is None:
            raise ValueError(
                f"{where}: field size allows {low}..{high} pixels per image, which no square side that is a "
                f"multiple of patch_size*merge_size={step} fits"
            )
        mean, std = normalization(pre, where)
        return cls(
            root=plain.root, model_id=plain.model_id, image_size=side, image_mean=mean, image_std=std,
            prompt=plain.prompt,
        )  # fmt: skip


def check_vision_blocks(prompt: ChatTemplatePrompt, tokenizer: Any, block: str, max_images: int) -> None:
    """Refuse a template whose images are not each ``<|vision_start|><|image_pad|><|vision_end|>``: the
    model finds an image's tokens (and their multimodal RoPE positions) after its vision start token."""
    prompt.check(tokenizer, max_images)
    for n in sorted({1, max_images}):
        text = prompt.render(tokenizer, n, "x")
        if text.count(block) != n:
            raise ValueError(
                f"chat template ({prompt.source}) renders {text.count(block)} {block!r} block(s) for {n} "
                f"image(s); expected {n} (Qwen-VL finds an image's tokens after its vision start token)"
            )


def load_qwen_weights(root: Path, config: Qwen3VLConfig, placement: DevicePlacement) -> tuple[Qwen3VLModel, Any]:
    """The model (a ``*ForConditionalGeneration`` checkpoint's LM head dropped) in the placement's
    dtype and the tokenizer (right padding), offline."""
    kwargs: dict[str, Any] = {"config": config, "local_files_only": True, "dtype": placement.torch_dtype}
    if "Qwen3VLForConditionalGeneration" in (config.architectures or []):
        model = Qwen3VLForConditionalGeneration.from_pretrained(root, **kwargs).model
    else:
        model = Qwen3VLModel.from_pretrained(root, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    tokenizer.padding_side = "right"
    return model, tokenizer


def load_qwen_vl_directory(
    family: type[QwenVLBackbone],
    path: str | Path,
    placement: DevicePlacement | None = None,
    *,
    model_id: str | None = None,
    max_images: int = DEFAULT_MAX_IMAGES,
) -> QwenVLBackbone:
    """A backbone of ``family`` from a plain Qwen3-VL checkpoint directory, offline; the weights are
    read in the placement's dtype (a ``*ForConditionalGeneration`` checkpoint's LM head is dropped)."""
    directory = QwenVLDirectory.read(path, family, model_id=model_id)
    root = directory.root
    placement = placement or DevicePlacement.from_env()
    model, tokenizer = load_qwen_weights(root, Qwen3VLConfig.from_pretrained(root, local_files_only=True), placement)
    block = family.vision_start_token + family.image_token + family.vision_end_token
    check_vision_blocks(directory.prompt, tokenizer, block, max_images)
    return backbone_over(family, model, tokenizer, directory, max_images, placement)
