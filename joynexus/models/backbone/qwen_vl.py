"""The Qwen-VL backbone family (``qwen_vl``): Qwen3-VL, the paper's own family, as a frozen,
memory-resident backbone behind the same `Backbone` protocol as the Idefics3 / SmolVLM family.

It wraps a real transformers ``Qwen3VLModel`` (a ViT with 2-D rotary positions and a learned,
interpolated position table, a 2x2 patch merger, DeepStack mergers feeding early decoder layers,
and a Qwen3 decoder with interleaved multimodal RoPE), frozen and in eval mode.

Qwen's own image processor resizes every image to a *dynamic* resolution (a multiple of
patch x merge, bounded by a pixel budget), so the number of image tokens varies with the camera.
Here one canonical square side ``image_size`` is fixed per backbone instead (a multiple of
``patch_size * spatial_merge_size``): every camera is resized on tensors to it, so its patch grid
``image_grid_thw = (1, S/patch, S/patch)`` and its ``(S/patch/merge)^2`` image tokens are the same
for every request, and a request's features have a fixed shape whatever else shares its batch. The
patches are flattened exactly as ``Qwen2VLImageProcessorFast`` flattens them (a still image
repeated over ``temporal_patch_size`` frames, in merge-block order).

As in the Idefics3 family, the hot path builds ``input_ids`` by hand (image tokens expanded, an LRU
cache per instruction), right-pads them, and passes a prebuilt 4-D causal + padding mask. The
multimodal RoPE positions (3 x L: temporal, height, width) are computed per prompt from its fixed
layout and cached with it; they equal ``Qwen3VLModel.get_rope_index`` (the tests hold them equal).
The model's own forward is not used on the hot path: it keeps ``rope_deltas`` as model state
between calls (generation bookkeeping) and recomputes positions per sample in Python.

Features are the decoder's last hidden states (``hidden_size`` = the text model's), padding zeroed,
mean-pooled over real tokens: the same contract as the Idefics3 family. Tenant LoRA adapters live on
the decoder (``language_model``), whose Linear layers carry the same names as Llama's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2VLImageProcessor,
    Qwen3VLConfig,
    Qwen3VLModel,
)

from joynexus.models.backbone.base import (
    METADATA_FILE,
    METADATA_FORMAT_VERSION,
    BackboneFeatures,
    register_backbone_family,
)
from joynexus.models.backbone.common import (
    TenantAdapterHost,
    canonical_pixels,
    causal_padding_mask,
    validate_encode_inputs,
)
from joynexus.models.backbone.hf_directory import ChatTemplatePrompt, read_chat_template
from joynexus.models.backbone.qwen_vl_directory import load_qwen_vl_directory, load_qwen_weights
from joynexus.models.backbone.tiny import _TOKENIZER_CORPUS
from joynexus.models.placement import DevicePlacement

__all__ = ["QWEN3_DECODER_LINEARS", "QWEN_VL_PRESETS", "SUPPORTED_MODEL_TYPES", "QwenVLBackbone", "QwenVLSpec"]

SUPPORTED_MODEL_TYPES = ("qwen3_vl",)
# Linear layers of the Qwen3 decoder (q/k norms are RMSNorms, not Linear): the family's LoRA targets.
QWEN3_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Special tokens of the Qwen-VL prompt format (Qwen2-VL / Qwen2.5-VL / Qwen3-VL share them).
PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
SPECIAL_TOKENS = (
    PAD_TOKEN,
    IM_START_TOKEN,
    IM_END_TOKEN,
    VISION_START_TOKEN,
    VISION_END_TOKEN,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
)
# The prompt of ``QwenVLBackbone._prompt_ids`` as a chat template (images before the text).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for line in message['content'] %}{% if line['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif line['type'] == 'text' %}{{ line['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-VL's processor normalizes with mean = std = 0.5 (preprocessor_config.json of the release).
QWEN3_VL_IMAGE_MEAN = (0.5, 0.5, 0.5)
QWEN3_VL_IMAGE_STD = (0.5, 0.5, 0.5)
# The side a checkpoint without our metadata is served at when its processor's pixel range allows it
# (`qwen_vl_directory.fixed_image_side`): at patch 16, 14x14 patches and 49 image tokens per camera.
DEFAULT_IMAGE_SIZE = 224


@dataclass(frozen=True)
class QwenVLSpec:
    """Size of a randomly initialized Qwen3-VL backbone built in code (no hub)."""

    name: str = "qwen3-vl-tiny"
    # vision tower
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    patch_size: int = 8
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 16  # a square: the learned position grid is interpolated to each image's
    deepstack_visual_indexes: tuple[int, ...] = (0,)
    image_size: int = 32  # canonical square side: (32 / 8 / 2)^2 = 4 image tokens per camera
    # text decoder
    text_hidden_size: int = 64
    text_intermediate_size: int = 128
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    head_dim: int = 16
    mrope_section: tuple[int, int, int] = (4, 2, 2)  # (t, h, w) rotary pairs; sums to head_dim / 2
    rope_theta: float = 5_000_000.0
    max_position_embeddings: int = 4096
    # None: the offline tokenizer's size; a published size keeps its real embedding table.
    vocab_size: int | None = None
    # serving
    max_images: int = 3
    max_instruction_tokens: int = 64
    tokenizer_vocab_size: int = 512

    def __post_init__(self) -> None:
        step = self.patch_size * self.spatial_merge_size
        if self.image_size % step:
            raise ValueError(
                f"QwenVLSpec.image_size={self.image_size} must be a multiple of patch_size*spatial_merge_size={step}"
            )
        if self.vision_hidden_size % self.vision_heads or (self.vision_hidden_size // self.vision_heads) % 4:
            raise ValueError("QwenVLSpec.vision_hidden_size / vision_heads must be a multiple of 4 (2-D rotary)")
        if self.text_heads % self.text_kv_heads:
            raise ValueError(f"QwenVLSpec.text_heads={self.text_heads} must be a multiple of text_kv_heads")
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(
                f"QwenVLSpec.mrope_section={self.mrope_section} must sum to head_dim/2={self.head_dim // 2}"
            )
        if int(self.num_position_embeddings**0.5) ** 2 != self.num_position_embeddings:
            raise ValueError(f"QwenVLSpec.num_position_embeddings={self.num_position_embeddings} must be a square")
        if any(not 0 <= i < self.vision_layers for i in self.deepstack_visual_indexes):
            raise ValueError(f"QwenVLSpec.deepstack_visual_indexes must lie in 0..{self.vision_layers - 1}")
        if self.deepstack_visual_indexes and len(self.deepstack_visual_indexes) > self.text_layers:
            raise ValueError("QwenVLSpec: more DeepStack levels than decoder layers")
        if self.max_images < 1:
            raise ValueError(f"QwenVLSpec.max_images must be >= 1, got {self.max_images}")

    @property
    def image_seq_len(self) -> int:
        """Image tokens per camera after the 2x2 patch merger."""
        return (self.image_size // self.patch_size // self.spatial_merge_size) ** 2


# The family's presets (`BackboneSource(preset=...)` finds them through `base.family_for_preset`).
QWEN_VL_PRESETS: dict[str, QwenVLSpec] = {
    "qwen3-vl-tiny": QwenVLSpec(),
    # Published dimensions of Qwen/Qwen3-VL-2B-Instruct (its config.json on the Hugging Face hub:
    # text hidden 2048, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 6144, vocab
    # 151936, rope_theta 5e6, mrope_section [24, 20, 20] interleaved; vision depth 24, hidden 1024,
    # intermediate 4096, 16 heads, patch 16, temporal patch 2, merge 2, 2304 position embeddings,
    # DeepStack at vision layers 5/11/17), with random weights. The image side is ours: 224 pixels
    # (14x14 patches, 49 image tokens per camera).
    "qwen3-vl-2b": QwenVLSpec(
        name="qwen3-vl-2b",
        vision_hidden_size=1024,
        vision_intermediate_size=4096,
        vision_layers=24,
        vision_heads=16,
        patch_size=16,
        num_position_embeddings=2304,
        deepstack_visual_indexes=(5, 11, 17),
        image_size=224,
        text_hidden_size=2048,
        text_intermediate_size=6144,
        text_layers=28,
        text_heads=16,
        text_kv_heads=8,
        head_dim=128,
        mrope_section=(24, 20, 20),
        max_position_embeddings=262144,
        vocab_size=151936,
    ),
}


def train_qwen_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained in code on robot instructions, with the Qwen-VL special tokens (no BOS,
    like Qwen's own tokenizer)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, VISION_START_TOKEN, VISION_END_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN],
        padding_side="right",
        model_max_length=4096,
    )


def _spec_model_id(spec: QwenVLSpec, seed: int) -> str:
    """Readable id for presets at seed 0; otherwise suffixed with a digest of spec+seed."""
    base = f"joynexus/{spec.name}"
    if seed == 0 and QWEN_VL_PRESETS.get(spec.name) == spec:
        return base
    digest = hashlib.sha256(json.dumps([dataclasses.asdict(spec), seed], sort_keys=True).encode()).hexdigest()
    return f"{base}-{digest[:10]}"


def _config_of(spec: QwenVLSpec, tokenizer: PreTrainedTokenizerBase) -> Qwen3VLConfig:
    ids = {
        t: tokenizer.convert_tokens_to_ids(t) for t in (IMAGE_TOKEN, VIDEO_TOKEN, VISION_START_TOKEN, VISION_END_TOKEN)
    }
    text_config = {
        "vocab_size": spec.vocab_size or len(tokenizer),
        "hidden_size": spec.text_hidden_size,
        "intermediate_size": spec.text_intermediate_size,
        "num_hidden_layers": spec.text_layers,
        "num_attention_heads": spec.text_heads,
        "num_key_value_heads": spec.text_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rope_scaling": {"rope_type": "default", "mrope_section": list(spec.mrope_section), "mrope_interleaved": True},
        "rms_norm_eps": 1e-6,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
    }
    vision_config = {
        "depth": spec.vision_layers,
        "hidden_size": spec.vision_hidden_size,
        "intermediate_size": spec.vision_intermediate_size,
        "num_heads": spec.vision_heads,
        "patch_size": spec.patch_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "spatial_merge_size": spec.spatial_merge_size,
        "out_hidden_size": spec.text_hidden_size,
        "num_position_embeddings": spec.num_position_embeddings,
        "deepstack_visual_indexes": list(spec.deepstack_visual_indexes),
    }
    return Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids[IMAGE_TOKEN],
        video_token_id=ids[VIDEO_TOKEN],
        vision_start_token_id=ids[VISION_START_TOKEN],
        vision_end_token_id=ids[VISION_END_TOKEN],
        tie_word_embeddings=False,
    )


@register_backbone_family("qwen_vl")
class QwenVLBackbone(TenantAdapterHost):
    """Frozen, memory-resident Qwen3-VL that turns (camera images, instruction) into token features."""

    family: ClassVar[str] = "qwen_vl"
    model_types: ClassVar[tuple[str, ...]] = SUPPORTED_MODEL_TYPES
    lora_targets: ClassVar[tuple[str, ...]] = QWEN3_DECODER_LINEARS
    presets: ClassVar[dict[str, QwenVLSpec]] = QWEN_VL_PRESETS
    # What a plain HF checkpoint directory is read with (`qwen_vl_directory`).
    image_token: ClassVar[str] = IMAGE_TOKEN
    vision_start_token: ClassVar[str] = VISION_START_TOKEN
    vision_end_token: ClassVar[str] = VISION_END_TOKEN
    default_image_size: ClassVar[int] = DEFAULT_IMAGE_SIZE

    instances_created: ClassVar[int] = 0
    _instances_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        model: Qwen3VLModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_id: str,
        image_size: int,
        max_images: int,
        image_mean: Sequence[float] = QWEN3_VL_IMAGE_MEAN,
        image_std: Sequence[float] = QWEN3_VL_IMAGE_STD,
        max_instruction_tokens: int = 64,
        spec: QwenVLSpec | None = None,
        placement: DevicePlacement | None = None,
        chat_prompt: ChatTemplatePrompt | None = None,
    ) -> None:
        config = model.config
        vision = config.vision_config
        self.patch_size = int(vision.patch_size)
        self.temporal_patch_size = int(vision.temporal_patch_size)
        self.merge_size = int(vision.spatial_merge_size)
        step = self.patch_size * self.merge_size
        if image_size % step != 0:
            raise ValueError(f"image_size={image_size} must be a multiple of patch_size*spatial_merge_size={step}")
        if max_images < 1:
            raise ValueError(f"max_images must be >= 1, got {max_images}")
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = str(model_id)
        self.image_size = int(image_size)
        self.max_images = int(max_images)
        self.hidden_size = int(config.text_config.hidden_size)
        self.max_instruction_tokens = int(max_instruction_tokens)
        self.spec = spec
        self.image_mean = tuple(float(x) for x in image_mean)
        self.image_std = tuple(float(x) for x in image_std)
        # The fixed patch grid of every camera, and its token count after the merger.
        self.grid = self.image_size // self.patch_size
        self.image_seq_len = (self.grid // self.merge_size) ** 2
        self.image_token_id = int(config.image_token_id)
        # A plain HF checkpoint's prompt comes from its chat template (`qwen_vl_directory`); None: the
        # built-in Qwen-VL chat prompt of `_prompt_uncached`.
        self.chat_prompt = chat_prompt
        self._prepare_prompt_pieces(tokenizer, config)
        # Bounded LRU per instance (a decorated method would pin ``self`` in a global cache).
        self._prompt = functools.lru_cache(maxsize=4096)(self._prompt_uncached)

        self.model.requires_grad_(False)
        self.model.eval()
        self.placement = placement or DevicePlacement.from_env()
        self.device = self.placement.resolve()
        self.model.to(device=self.device, dtype=self.placement.torch_dtype)
        self.dtype = self.placement.torch_dtype
        self._mean = torch.tensor(self.image_mean, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        self._std = torch.tensor(self.image_std, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        self._placement_info = self.placement.describe(self.device)
        self._init_adapter_host()
        with QwenVLBackbone._instances_lock:
            QwenVLBackbone.instances_created += 1

    def _prepare_prompt_pieces(self, tokenizer: PreTrainedTokenizerBase, config: Qwen3VLConfig) -> None:
        """Check the tokenizer's special tokens against the model config; keep the prompt's fixed pieces as ids."""
        expected = {IMAGE_TOKEN: "image_token_id", VISION_START_TOKEN: "vision_start_token_id"}
        expected[VISION_END_TOKEN] = "vision_end_token_id"
        ids: dict[str, int] = {}
        for token in (*expected, IM_START_TOKEN, IM_END_TOKEN):
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == tokenizer.unk_token_id:
                raise ValueError(f"tokenizer of backbone {self.model_id!r} has no special token {token!r}")
            ids[token] = int(token_id)
        for token, field in expected.items():
            if ids[token] != getattr(config, field):
                raise ValueError(
                    f"tokenizer id {ids[token]} of {token!r} != the model config's {field} {getattr(config, field)}"
                )
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else ids[IM_END_TOKEN]
        # <|im_start|>user\n{<|vision_start|><|image_pad|>*n<|vision_end|> per camera}{instruction}<|im_end|>\n
        # <|im_start|>assistant\n
        self._prefix_ids = [ids[IM_START_TOKEN], *self._text_ids("user\n")]
        self._image_block_ids = (
            [ids[VISION_START_TOKEN]] + [ids[IMAGE_TOKEN]] * self.image_seq_len + [ids[VISION_END_TOKEN]]
        )
        self._suffix_ids = [
            ids[IM_END_TOKEN],
            *self._text_ids("\n"),
            ids[IM_START_TOKEN],
            *self._text_ids("assistant\n"),
        ]

    # ------------------------------------------------------------------ construction
    @classmethod
    def build_tiny(
        cls, spec: QwenVLSpec | None = None, seed: int = 0, placement: DevicePlacement | None = None
    ) -> QwenVLBackbone:
        """Randomly initialized backbone from a preset (no files, no network); the weights are drawn
        on the CPU, then placed: the same seed gives the same backbone on every device."""
        spec = spec or QWEN_VL_PRESETS["qwen3-vl-tiny"]
        if not isinstance(spec, QwenVLSpec):
            raise ValueError(
                f"backbone family 'qwen_vl' builds its own presets {sorted(QWEN_VL_PRESETS)}, "
                f"not {type(spec).__name__} {getattr(spec, 'name', spec)!r}"
            )
        tokenizer = train_qwen_tokenizer(spec.tokenizer_vocab_size)
        config = _config_of(spec, tokenizer)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3VLModel(config)
        return cls(
            model,
            tokenizer,
            model_id=_spec_model_id(spec, seed),
            image_size=spec.image_size,
            max_images=spec.max_images,
            max_instruction_tokens=spec.max_instruction_tokens,
            spec=spec,
            placement=placement,
        )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, placement: DevicePlacement | None = None, *, model_id: str | None = None
    ) -> QwenVLBackbone:
        """Load a local Qwen3-VL checkpoint directory: ours (with JoyNexus metadata), or a plain one as
        transformers writes it (`qwen_vl_directory`: every serving setting from its own files); a
        ``Qwen3VLForConditionalGeneration`` one's language-model head is dropped. Offline only, in
        the placement's dtype. ``model_id``: serve it under this id instead of the directory's own."""
        root = Path(path).expanduser()
        if not (root / METADATA_FILE).is_file():
            return load_qwen_vl_directory(cls, root, placement, model_id=model_id)
        for required, what in (("config.json", "the model config"), ("tokenizer_config.json", "the tokenizer")):
            if not (root / required).is_file():
                raise FileNotFoundError(f"backbone checkpoint {str(root)!r} has no {required} ({what})")
        config = Qwen3VLConfig.from_pretrained(root, local_files_only=True)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"backbone checkpoint {str(root)!r} has model_type {config.model_type!r}; "
                f"supported: {list(SUPPORTED_MODEL_TYPES)}"
            )
        placement = placement or DevicePlacement.from_env()
        model, tokenizer = load_qwen_weights(root, config, placement)
        meta: dict[str, Any] = json.loads((root / METADATA_FILE).read_text())
        if meta.get("format_version") != METADATA_FORMAT_VERSION:
            raise ValueError(
                f"{root / METADATA_FILE}: unsupported format_version {meta.get('format_version')!r} "
                f"(this code reads {METADATA_FORMAT_VERSION})"
            )
        image_mean, image_std = QWEN3_VL_IMAGE_MEAN, QWEN3_VL_IMAGE_STD
        if (root / "preprocessor_config.json").is_file():
            pre = json.loads((root / "preprocessor_config.json").read_text())
            image_mean = tuple(pre.get("image_mean", image_mean))
            image_std = tuple(pre.get("image_std", image_std))
        spec_fields = meta.get("spec")
        spec = QwenVLSpec(**{**spec_fields, **_tuple_fields(spec_fields)}) if spec_fields else None
        return cls(
            model,
            tokenizer,
            model_id=model_id or meta.get("model_id", str(root.resolve())),
            image_size=meta.get("image_size", DEFAULT_IMAGE_SIZE),
            max_images=meta.get("max_images", 3),
            image_mean=meta.get("image_mean", image_mean),
            image_std=meta.get("image_std", image_std),
            max_instruction_tokens=meta.get("max_instruction_tokens", 64),
            spec=spec,
            placement=placement,
            chat_prompt=read_chat_template(root, IMAGE_TOKEN) if meta.get("chat_template_prompt") else None,
        )

    def save_pretrained(self, path: str | Path) -> None:
        """Write config + safetensors weights + tokenizer + image processor + joynexus metadata."""
        root = Path(path).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(root, state_dict=self.base_state_dict(), safe_serialization=True)
        # A checkpoint's own prompt travels with it (read back by from_pretrained); the tokenizer is a copy.
        tokenizer = copy.copy(self.tokenizer)
        tokenizer.chat_template = self.chat_prompt.template if self.chat_prompt is not None else CHAT_TEMPLATE
        tokenizer.save_pretrained(root)
        # The stock image processor at this backbone's fixed side (min = max pixels: one resolution).
        pixels = self.image_size * self.image_size
        Qwen2VLImageProcessor(
            size={"shortest_edge": pixels, "longest_edge": pixels},
            patch_size=self.patch_size,
            temporal_patch_size=self.temporal_patch_size,
            merge_size=self.merge_size,
            image_mean=list(self.image_mean),
            image_std=list(self.image_std),
        ).save_pretrained(root)
        meta = {
            "format_version": METADATA_FORMAT_VERSION,
            "model_id": self.model_id,
            "image_size": self.image_size,
            "max_images": self.max_images,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "max_instruction_tokens": self.max_instruction_tokens,
            "spec": dataclasses.asdict(self.spec) if self.spec is not None else None,
            "chat_template_prompt": self.chat_prompt is not None,
        }
        (root / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    # ------------------------------------------------------------------ properties
    @property
    def text_model(self) -> torch.nn.Module:
        """The Qwen3 decoder LoRA adapters are injected into (``PeftModel.from_pretrained`` takes this)."""
        return self.model.language_model

    # ------------------------------------------------------------------ prompt
    def _prompt_uncached(self, num_images: int, instruction: str) -> tuple[tuple[int, ...], torch.Tensor]:
        """The prompt's ids and its (3, L) multimodal RoPE positions, as ``get_rope_index`` lays them
        out: text advances all three axes together; an image block holds (t, h, w) = start + (0, row,
        col) over its merged grid, and the text after it resumes at the block's largest position + 1."""
        if self.chat_prompt is not None:
            pads = [self.image_token_id] * self.image_seq_len
            ids = list(self.chat_prompt.ids(self.tokenizer, num_images, instruction, pads, self.max_instruction_tokens))
        else:
            text = self._text_ids(instruction)[: self.max_instruction_tokens]
            ids = self._prefix_ids + self._image_block_ids * num_images + text + self._suffix_ids
        side = self.grid // self.merge_size
        rows = torch.arange(side).repeat_interleave(side)
        cols = torch.arange(side).repeat(side)
        pieces: list[torch.Tensor] = []
        start, run = 0, 0  # next position; text tokens pending since the last image block
        for token in ids:
            if token != self.image_token_id:
                run += 1
                continue
            if run:  # the first image token of a block: flush the text before it
                pieces.append((torch.arange(run) + start).expand(3, -1))
                start, run = start + run, 0
                grid = torch.stack([torch.zeros_like(rows), rows, cols]) + start
                pieces.append(grid)
                start = int(grid.max()) + 1
        if run:
            pieces.append((torch.arange(run) + start).expand(3, -1))
        return tuple(ids), torch.cat(pieces, dim=1)

    def _inputs(
        self, images: list[list[torch.Tensor]], instructions: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded input_ids with expanded image tokens, the attention mask, and the (3, B, L) positions."""
        prompts = [self._prompt(len(cams), text) for cams, text in zip(images, instructions, strict=True)]
        length = max(len(ids) for ids, _ in prompts)
        input_ids = torch.full((len(prompts), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
        positions = torch.zeros((3, len(prompts), length), dtype=torch.long)
        for b, (ids, pos) in enumerate(prompts):
            input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[b, : len(ids)] = 1
            positions[:, b, : len(ids)] = pos
        return input_ids, attention_mask, positions

    def _patches(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) normalized images -> (N * grid^2, 3 * T * P * P) flattened patches, in the
        order and layout of ``Qwen2VLImageProcessorFast`` (a still image repeated over T frames)."""
        n, c = pixels.shape[:2]
        t, p, m, g = self.temporal_patch_size, self.patch_size, self.merge_size, self.grid
        frames = pixels.unsqueeze(1).expand(n, t, c, self.image_size, self.image_size)
        patches = frames.reshape(n, 1, t, c, g // m, m, p, g // m, m, p)
        # (n, grid_t, grid_h/m, grid_w/m, m, m, channel, t, p, p)
        patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
        return patches.reshape(n * g * g, c * t * p * p)

    # ------------------------------------------------------------------ encode
    def _encode_features(
        self,
        images: list[list[torch.Tensor]],
        instructions: list[str],
        adapters: Sequence[Hashable | None] | None = None,
        *,
        grad: bool = False,
    ) -> BackboneFeatures:
        """Encode a batch of (cameras, instruction) samples into frozen token features (the contract
        of `Backbone.encode`: 0..max_images float (3, h, w) cameras in [0, 1] per sample, ``adapters[b]``
        sample b's LoRA key or None, ``grad=True`` keeps the graph to the adapters' weights)."""
        validate_encode_inputs(images, instructions, self.max_images)
        input_ids, attention_mask, positions = (t.to(self.device) for t in self._inputs(images, instructions))
        pixels, slot_mask = canonical_pixels(
            images, size=self.image_size, mean=self._mean, std=self._std, max_images=self.max_images, device=self.device
        )
        with self._adapter_lock, self.placement.autocast_context(self.device):
            with self.adapter_routing(adapters, len(images)):
                if grad:
                    with torch.no_grad():
                        vision = self._image_states(pixels, slot_mask)
                    with torch.enable_grad():
                        return self._text_forward(input_ids, attention_mask, positions, vision)
                with torch.inference_mode():
                    features = self._text_forward(
                        input_ids, attention_mask, positions, self._image_states(pixels, slot_mask)
                    )
        # Tensors made under inference_mode can never be saved for backward; clones outside it can.
        return BackboneFeatures(
            tokens=features.tokens.clone(), mask=features.mask.clone(), pooled=features.pooled.clone()
        )

    def _image_states(
        self, pixels: torch.Tensor, slot_mask: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Merged image tokens of the real camera slots and their DeepStack features (one tensor per
        level), in (sample, camera) order; None when no sample has a camera."""
        if not bool(slot_mask.any()):
            return None
        real = pixels[slot_mask]
        grid_thw = torch.tensor([[1, self.grid, self.grid]] * real.shape[0], dtype=torch.long, device=self.device)
        embeds, deepstack = self.model.visual(self._patches(real).to(self.dtype), grid_thw=grid_thw)
        return embeds, deepstack

    def _text_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        vision: tuple[torch.Tensor, list[torch.Tensor]] | None,
    ) -> BackboneFeatures:
        """The decoder over the prompt with the image tokens merged in (and DeepStack features added
        to its first layers); float32 features, padding zeroed, mean-pooled over real tokens."""
        language = self.model.language_model
        embeds = language.embed_tokens(input_ids)
        visual_mask, deepstack = None, None
        if vision is not None:
            image_embeds, deepstack = vision
            visual_mask = input_ids == self.image_token_id
            embeds = embeds.masked_scatter(visual_mask.unsqueeze(-1), image_embeds.to(embeds.dtype))
        impl = getattr(language.config, "_attn_implementation", None)
        mask = causal_padding_mask(attention_mask, self.dtype) if impl in ("sdpa", "eager") else attention_mask
        out = language(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=positions,
            visual_pos_masks=visual_mask,
            deepstack_visual_embeds=deepstack,
            use_cache=False,
        )
        real = attention_mask.bool()
        tokens = out.last_hidden_state.float() * real.unsqueeze(-1)
        pooled = tokens.sum(dim=1) / real.sum(dim=1, keepdim=True)
        return BackboneFeatures(tokens=tokens, mask=real, pooled=pooled)


def _tuple_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """JSON lists back to the spec's tuple fields (a frozen dataclass compares tuples)."""
    return {k: tuple(v) for k, v in fields.items() if isinstance(v, list)}
