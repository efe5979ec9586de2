"""Plain Hugging Face checkpoint directories as a resident backbone (``JOYNEXUS_BACKBONE_PATH``).

A directory exactly as transformers writes it (``save_pretrained`` of an Idefics3 / SmolVLM model and
of its processor): ``config.json``, ``model.safetensors`` (or sharded, with its index), the tokenizer
(``tokenizer.json`` / ``tokenizer_config.json``), ``preprocessor_config.json`` and a chat template,
with no JoyNexus metadata. Everything the hot path needs comes from those files:

* the canonical tile side from the image processor's ``max_image_size`` (what the HF processor
  squares an image to when it does not split it), its mean/std from ``image_mean`` / ``image_std``;
* ``do_image_splitting`` must be false: the backbone serves ONE tile per camera, so a checkpoint
  whose processor splits images would see other inputs here than it was trained on; it is refused;
* the instruction prompt from the chat template (`ChatTemplatePrompt`), rendered per request shape;
* the model id from ``JOYNEXUS_BACKBONE_ID``, else the config's ``_name_or_path``, else the path.

Every refusal names the file or field that is missing or unsupported. What every family reads the same
way (files present, config, image processor config, serving id, chat template) is `read_plain_directory`;
`qwen_vl_directory` reads Qwen3-VL directories with it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from transformers import AutoConfig, AutoModel, AutoTokenizer, PreTrainedTokenizerBase

from joynexus.models.backbone.tiny import IMAGE_TOKEN
from joynexus.models.placement import DevicePlacement

if TYPE_CHECKING:
    from joynexus.models.backbone.idefics3 import ResidentBackbone

__all__ = [
    "ChatTemplatePrompt",
    "HFDirectory",
    "PlainDirectory",
    "backbone_over",
    "load_hf_directory",
    "normalization",
    "read_chat_template",
    "read_plain_directory",
]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PREPROCESSOR_FILE = "preprocessor_config.json"
# Where transformers (by version) keeps a processor's or tokenizer's chat template, in lookup order.
CHAT_TEMPLATE_SOURCES = ("chat_template.jinja", "chat_template.json", "processor_config.json", "tokenizer_config.json")
DEFAULT_MAX_IMAGES = 3  # camera slots: an HF checkpoint does not say; the tiny preset's count
_SENTINEL = "\x00instruction\x00"  # stands for the instruction when the template is checked


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _longest_edge(pre: dict[str, Any], key: str, where: Path) -> int | None:
    value = pre.get(key)
    if value is None:
        return None
    edge = value.get("longest_edge") if isinstance(value, dict) else None
    if not isinstance(edge, int) or edge < 1:
        raise ValueError(f"{where}: field {key}: expected {{'longest_edge': <positive int>}}, got {value!r}")
    return edge


def normalization(pre: dict[str, Any], where: Path) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """The image processor's (mean, std); identity when it does not normalize."""
    if not pre.get("do_normalize", True):
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    return _triple(pre, "image_mean", where), _triple(pre, "image_std", where)


def _triple(pre: dict[str, Any], key: str, where: Path) -> tuple[float, float, float]:
    value = pre.get(key)
    if value is None:
        raise ValueError(f"{where}: field {key} missing (the normalization of camera images)")
    if isinstance(value, (int, float)):
        value = [value] * 3
    if not isinstance(value, list) or len(value) != 3 or not all(isinstance(v, (int, float)) for v in value):
        raise ValueError(f"{where}: field {key}: expected 3 numbers (one per RGB channel), got {value!r}")
    return float(value[0]), float(value[1]), float(value[2])


class ChatTemplatePrompt:
    """The instruction prompt of a checkpoint, rendered from its own chat template.

    One user turn holding the sample's images then its instruction, with the generation prompt
    (what the HF processor's ``apply_chat_template`` makes); each ``image_token`` of the rendered text
    (``<image>`` in Idefics3, ``<|image_pad|>`` in Qwen-VL) becomes the image block the family's
    processor expands it to (Idefics3 without image splitting; Qwen-VL at the fixed side)."""

    def __init__(self, template: str, source: str, image_token: str = IMAGE_TOKEN) -> None:
        self.template = template
        self.source = source  # where it was read: named in errors
        self.image_token = image_token

    @staticmethod
    def messages(num_images: int, instruction: str) -> list[dict[str, Any]]:
        content: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
        return [{"role": "user", "content": [*content, {"type": "text", "text": instruction}]}]

    def render(self, tokenizer: PreTrainedTokenizerBase, num_images: int, instruction: str) -> str:
        return tokenizer.apply_chat_template(
            self.messages(num_images, instruction),
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=True,
        )

    def check(self, tokenizer: PreTrainedTokenizerBase, max_images: int) -> None:
        """Refuse a template that does not place one image token per image and the instruction once."""
        for n in sorted({0, 1, max_images}):
            try:
                text = self.render(tokenizer, n, _SENTINEL)
            except Exception as error:  # a jinja error of the checkpoint's own template
                raise ValueError(f"chat template ({self.source}) does not render {n} image(s): {error}") from None
            images = text.count(self.image_token)
            if images != n or text.count(_SENTINEL) != 1:
                raise ValueError(
                    f"chat template ({self.source}) renders {images} {self.image_token!r} token(s) "
                    f"for {n} image(s) and the instruction {text.count(_SENTINEL)} time(s); expected {n} and 1"
                )

    def ids(
        self,
        tokenizer: PreTrainedTokenizerBase,
        num_images: int,
        instruction: str,
        image_block: Sequence[int],
        max_instruction_tokens: int,
    ) -> tuple[int, ...]:
        """Token ids of the prompt, the instruction cut to ``max_instruction_tokens`` tokens."""
        instruction_ids = tokenizer(instruction, add_special_tokens=False)["input_ids"]
        if len(instruction_ids) > max_instruction_tokens:
            instruction = tokenizer.decode(instruction_ids[:max_instruction_tokens])
        # The rendered text carries the template's own special tokens (e.g. <|im_start|>) literally.
        rendered = tokenizer(self.render(tokenizer, num_images, instruction), add_special_tokens=False)["input_ids"]
        image_id = tokenizer.convert_tokens_to_ids(self.image_token)
        out: list[int] = []
        for token in rendered:
            out.extend(image_block if token == image_id else (token,))
        return tuple(out)


def read_chat_template(root: Path, image_token: str = IMAGE_TOKEN) -> ChatTemplatePrompt:
    """The chat template a checkpoint directory holds, wherever transformers put it."""
    for name in CHAT_TEMPLATE_SOURCES:
        path = root / name
        if not path.is_file():
            continue
        if name.endswith(".jinja"):
            return ChatTemplatePrompt(path.read_text(), str(path), image_token)
        template = _read_json(path).get("chat_template")
        if isinstance(template, str) and template.strip():
            return ChatTemplatePrompt(template, str(path), image_token)
    raise FileNotFoundError(
        f"backbone checkpoint {root}: chat template missing (the instruction prompt comes from it); "
        f"looked in {list(CHAT_TEMPLATE_SOURCES)}"
    )


@dataclass(frozen=True)
class PlainDirectory:
    """What every family reads the same way from a plain HF checkpoint directory (no weights loaded):
    its config, image processor config, serving id and chat template."""

    root: Path
    config: dict[str, Any]
    model_type: str
    model_id: str
    preprocessor: dict[str, Any]
    preprocessor_path: Path
    prompt: ChatTemplatePrompt


def read_plain_directory(
    path: str | Path,
    *,
    model_types: Sequence[str],
    model_id: str | None = None,
    preprocessor_use: str,
    image_token: str = IMAGE_TOKEN,
) -> PlainDirectory:
    """Check the directory's files (config, weights and every shard, tokenizer, image processor config,
    chat template); refusals name what is missing. ``preprocessor_use`` says in an error what the
    family reads from the image processor config."""
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"backbone checkpoint directory {str(root)!r} does not exist")
    if not root.is_dir():
        raise ValueError(f"backbone checkpoint path {str(root)!r} is not a directory")
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"backbone checkpoint {root}: config.json missing (the model config)")
    config = _read_json(root / "config.json")
    model_type = config.get("model_type")
    if model_type not in model_types:
        raise ValueError(
            f"{root / 'config.json'}: model_type {model_type!r} is not supported by this backbone family; "
            f"supported: {list(model_types)}"
        )
    _check_weights(root)
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"backbone checkpoint {root}: tokenizer missing (expected {' or '.join(TOKENIZER_FILES)})"
        )
    pre_path = root / PREPROCESSOR_FILE
    if not pre_path.is_file():
        raise FileNotFoundError(f"backbone checkpoint {root}: {PREPROCESSOR_FILE} missing ({preprocessor_use})")
    name_or_path = config.get("_name_or_path")
    resolved_id = model_id or (name_or_path if isinstance(name_or_path, str) and name_or_path else None)
    return PlainDirectory(
        root=root,
        config=config,
        model_type=str(model_type),
        model_id=resolved_id or str(root.resolve()),
        preprocessor=_read_json(pre_path),
        preprocessor_path=pre_path,
        prompt=read_chat_template(root, image_token),
    )


@dataclass(frozen=True)
class HFDirectory:
    """What a plain Idefics3 / SmolVLM checkpoint directory says about serving it (read without
    loading weights)."""

    root: Path
    model_type: str
    model_id: str
    image_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    image_seq_len: int | None  # the processor's image tokens per tile, when it says
    prompt: ChatTemplatePrompt

    @classmethod
    def read(cls, path: str | Path, *, model_types: Sequence[str], model_id: str | None = None) -> HFDirectory:
        """Check the directory's files and read its serving settings; refusals name what is missing."""
        plain = read_plain_directory(
            path,
            model_types=model_types,
            model_id=model_id,
            preprocessor_use="the image size, mean/std and do_image_splitting come from it",
        )
        root, pre, pre_path = plain.root, plain.preprocessor, plain.preprocessor_path
        # Absent means the Idefics3 image processor's default, which is to split.
        if pre.get("do_image_splitting", True):
            state = "true" if "do_image_splitting" in pre else "absent (the image processor's default: true)"
            raise ValueError(
                f"{pre_path}: do_image_splitting is {state}; JoyNexus serves one tile per camera image, so a "
                "checkpoint must be served with do_image_splitting false (set it in the file to serve it so)"
            )
        # Without splitting, the HF image processor squares every image to max_image_size.
        image_size = _longest_edge(pre, "max_image_size", pre_path)
        if image_size is None:
            raise ValueError(f"{pre_path}: field max_image_size missing (the tile side images are resized to)")
        mean, std = normalization(pre, pre_path)
        image_seq_len = None
        if (root / "processor_config.json").is_file():
            image_seq_len = _read_json(root / "processor_config.json").get("image_seq_len")
        return cls(
            root=root,
            model_type=plain.model_type,
            model_id=plain.model_id,
            image_size=image_size,
            image_mean=mean,
            image_std=std,
            image_seq_len=int(image_seq_len) if isinstance(image_seq_len, int) else None,
            prompt=plain.prompt,
        )


def _check_weights(root: Path) -> None:
    """A single safetensors file, or an index whose every shard is there."""
    if (root / "model.safetensors").is_file():
        return
    index = root / "model.safetensors.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"backbone checkpoint {root}: weights missing (expected {' or '.join(WEIGHT_FILES)})")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: field weight_map missing or empty")
    for shard in sorted(set(weight_map.values())):
        if not (root / shard).is_file():
            raise FileNotFoundError(
                f"backbone checkpoint {root}: weight shard {shard} missing (listed in {index.name})"
            )


class CheckpointDirectory(Protocol):
    """What a backbone takes from a checkpoint directory (`HFDirectory`, the Qwen family's own)."""

    model_id: str
    image_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    prompt: ChatTemplatePrompt


def backbone_over(
    family: type[ResidentBackbone],
    model: Any,
    tokenizer: Any,
    directory: CheckpointDirectory,
    max_images: int,
    placement: DevicePlacement,
) -> ResidentBackbone:
    """A backbone of `family` over loaded weights, with the id, image geometry and chat prompt the
    checkpoint directory declares: one construction for every family's directory loader."""
    return family(
        model,
        tokenizer,
        model_id=directory.model_id,
        image_size=directory.image_size,
        max_images=max_images,
        image_mean=directory.image_mean,
        image_std=directory.image_std,
        chat_prompt=directory.prompt,
        placement=placement,
    )


def load_hf_directory(
    family: type[ResidentBackbone],
    path: str | Path,
    placement: DevicePlacement | None = None,
    *,
    model_id: str | None = None,
    max_images: int = DEFAULT_MAX_IMAGES,
) -> ResidentBackbone:
    """A backbone of ``family`` from a plain HF checkpoint directory, offline; weights are read in
    the placement's dtype."""
    directory = HFDirectory.read(path, model_types=family.model_types, model_id=model_id)
    root = directory.root
    placement = placement or DevicePlacement.from_env()
    config = AutoConfig.from_pretrained(root, local_files_only=True)
    # AutoModel maps idefics3 -> Idefics3Model, smolvlm -> SmolVLMModel and strips the "model." prefix
    # of *ForConditionalGeneration checkpoints.
    model = AutoModel.from_pretrained(root, config=config, local_files_only=True, dtype=placement.torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    tokenizer.padding_side = "right"
    directory.prompt.check(tokenizer, max_images)
    backbone = backbone_over(family, model, tokenizer, directory, max_images, placement)
    if directory.image_seq_len is not None and directory.image_seq_len != backbone.image_seq_len:
        raise ValueError(
            f"{root / 'processor_config.json'}: image_seq_len {directory.image_seq_len} != the "
            f"{backbone.image_seq_len} tokens a {directory.image_size}-pixel tile makes in this model "
            "(vision patch_size and scale_factor of config.json)"
        )
    return backbone
