"""The PaliGemma backbone family (``paligemma``): the prefix of OpenPI's π0 / π0.5 as a frozen,
memory-resident backbone.

It wraps a real transformers ``PaliGemmaForConditionalGeneration`` (a SigLIP vision tower, a linear
projector, a Gemma decoder), built the way LeRobot's ``PaliGemmaWithExpertModel`` builds it: Gemma
with the GeLU-tanh MLP and PaliGemma's 257,152-token vocabulary. The prefix follows π0, not HF's
PaliGemma forward: image tokens are the projector's outputs as they are (openpi's transformers patch
drops HF's division by sqrt(width)), language embeddings are scaled by sqrt(width) by the caller,
and the prefix attends bidirectionally over every real token (π0's prefix-LM mask, all in one
block). `layer_prefix` keeps every decoder layer's keys (RoPE'd) and values for the tenants' Gemma
action experts (`action_modules.pi0`); `encode` (the `Backbone` contract for token heads) runs the
same prefix of [cameras, instruction] to the final norm and mean-pools.

Cameras are resized on tensors to the square ``image_size`` the vision tower was built for (SigLIP's
position table is fixed), into [-1, 1] (SigLIP's mean = std = 0.5). Tenant LoRA adapters live on the
Gemma decoder (``language_model``), whose Linear layers carry Llama's names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
    PaliGemmaConfig,
    PaliGemmaForConditionalGeneration,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from joynexus.models.backbone.base import (
    METADATA_FILE,
    METADATA_FORMAT_VERSION,
    BackboneFeatures,
    register_backbone_family,
)
from joynexus.models.backbone.common import (
    LayerPrefixHost,
    TenantAdapterHost,
    canonical_pixels,
    validate_encode_inputs,
)
from joynexus.models.backbone.layer_prefix import (
    PrefixGeometry,
    PrefixWeightLayout,
    layer_prefix_of,
)
from joynexus.models.backbone.tiny import _TOKENIZER_CORPUS
from joynexus.models.placement import DevicePlacement

__all__ = [
    "PALIGEMMA_PREFIX_WEIGHTS",
    "PALIGEMMA_PRESETS",
    "PALIGEMMA_VOCAB_SIZE",
    "PaliGemmaBackbone",
    "PaliGemmaSpec",
    "paligemma_config",
]

SUPPORTED_MODEL_TYPES = ("paligemma",)
GEMMA_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# LeRobot's PaliGemmaWithExpertModel: vocabulary and image token index of every π0 / π0.5 checkpoint.
PALIGEMMA_VOCAB_SIZE = 257152
# `PaliGemmaForConditionalGeneration`'s own names of what a prefix reads.
PALIGEMMA_PREFIX_WEIGHTS = PrefixWeightLayout(
    layer_pattern=r"^model\.language_model\.layers\.(\d+)\.",
    parts=("model.vision_tower.", "model.multi_modal_projector.", "model.language_model.embed_tokens."),
)
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<bos>", "<eos>"


@dataclass(frozen=True)
class PaliGemmaSpec:
    """Size of a randomly initialized PaliGemma built in code (no hub). The Gemma part has π0's
    variant fields (width, depth, mlp_dim, heads, kv heads, head_dim)."""

    name: str = "paligemma-tiny"
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    patch_size: int = 14
    image_size: int = 28  # SigLIP's position table is built for this square side
    width: int = 64
    depth: int = 2
    mlp_dim: int = 128
    num_heads: int = 8  # LeRobot's joint attention reshapes to 8 heads: both published variants have 8
    num_kv_heads: int = 1
    head_dim: int = 8
    tokenizer_vocab_size: int = 320
    max_images: int = 3
    max_instruction_tokens: int = 48

    @property
    def image_seq_len(self) -> int:
        return (self.image_size // self.patch_size) ** 2


PALIGEMMA_PRESETS: dict[str, PaliGemmaSpec] = {
    "paligemma-tiny": PaliGemmaSpec(),
    # π0's published prefix: SigLIP So400m/14 at 224 px + Gemma 2B (LeRobot's `gemma_2b` variant).
    "paligemma-3b": PaliGemmaSpec(
        name="paligemma-3b",
        vision_hidden_size=1152,
        vision_intermediate_size=4304,
        vision_layers=27,
        vision_heads=16,
        patch_size=14,
        image_size=224,
        width=2048,
        depth=18,
        mlp_dim=16_384,
        num_heads=8,
        num_kv_heads=1,
        head_dim=256,
        tokenizer_vocab_size=1024,
    ),
}


def paligemma_config(spec: PaliGemmaSpec) -> PaliGemmaConfig:
    """The HF config LeRobot's `PaliGemmaWithExpertModel` sets up for a Gemma variant, at this spec's
    vision size (the projector maps the vision width to the Gemma width)."""
    config = PaliGemmaConfig(
        text_config={
            "model_type": "gemma",
            "hidden_size": spec.width,
            "intermediate_size": spec.mlp_dim,
            "num_attention_heads": spec.num_heads,
            "head_dim": spec.head_dim,
            "num_hidden_layers": spec.depth,
            "num_key_value_heads": spec.num_kv_heads,
            "hidden_activation": "gelu_pytorch_tanh",
            "vocab_size": PALIGEMMA_VOCAB_SIZE,
        },
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": spec.vision_hidden_size,
            "intermediate_size": spec.vision_intermediate_size,
            "num_hidden_layers": spec.vision_layers,
            "num_attention_heads": spec.vision_heads,
            "patch_size": spec.patch_size,
            "image_size": spec.image_size,
            "projection_dim": spec.width,
            "projector_hidden_act": "gelu_fast",
            "vision_use_head": False,
        },
        image_token_index=PALIGEMMA_VOCAB_SIZE,
        projection_dim=spec.width,
        vocab_size=PALIGEMMA_VOCAB_SIZE,
    )
    config.text_config._attn_implementation = "eager"
    return config


def train_gemma_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained in code on robot instructions with Gemma's special tokens; like
    PaliGemma's tokenizer, it starts every text with <bos>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, tok.token_to_id(BOS_TOKEN))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="right",
        model_max_length=4096,
    )


def _spec_model_id(spec: PaliGemmaSpec, seed: int) -> str:
    base = f"joynexus/{spec.name}"
    if seed == 0 and PALIGEMMA_PRESETS.get(spec.name) == spec:
        return base
    digest = hashlib.sha256(json.dumps([dataclasses.asdict(spec), seed], sort_keys=True).encode()).hexdigest()
    return f"{base}-{digest[:10]}"


@register_backbone_family("paligemma")
class PaliGemmaBackbone(LayerPrefixHost, TenantAdapterHost):
    """Frozen PaliGemma whose prefix π0 / π0.5 experts attend to (module docstring)."""

    family: ClassVar[str] = "paligemma"
    model_types: ClassVar[tuple[str, ...]] = SUPPORTED_MODEL_TYPES
    lora_targets: ClassVar[tuple[str, ...]] = GEMMA_DECODER_LINEARS
    presets: ClassVar[dict[str, PaliGemmaSpec]] = PALIGEMMA_PRESETS
    prefix_weights = PALIGEMMA_PREFIX_WEIGHTS
    instances_created: ClassVar[int] = 0
    _instances_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        model: PaliGemmaForConditionalGeneration,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_id: str,
        max_images: int = 3,
        max_instruction_tokens: int = 48,
        spec: PaliGemmaSpec | None = None,
        placement: DevicePlacement | None = None,
    ) -> None:
        config = model.config
        if tokenizer.pad_token_id is None:
            raise ValueError(f"tokenizer of backbone {model_id!r} has no pad token")
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = str(model_id)
        self.image_size = int(config.vision_config.image_size)
        self.max_images = int(max_images)
        self.hidden_size = int(config.text_config.hidden_size)
        self.max_instruction_tokens = int(max_instruction_tokens)
        self.spec = spec
        # SigLIP normalizes with mean = std = 0.5: pixels in [0, 1] go to [-1, 1].
        self._mean = torch.full((1, 3, 1, 1), 0.5)
        self._std = torch.full((1, 3, 1, 1), 0.5)
        self.model.requires_grad_(False)
        self.model.eval()
        self.placement = placement or DevicePlacement.from_env()
        self.device = self.placement.resolve()
        self.model.to(device=self.device, dtype=self.placement.torch_dtype)
        self.dtype = self.placement.torch_dtype
        self._mean, self._std = self._mean.to(self.device), self._std.to(self.device)
        self._placement_info = self.placement.describe(self.device)
        self._init_adapter_host()
        self._prefix_digests: dict[int, str] = {}
        with PaliGemmaBackbone._instances_lock:
            PaliGemmaBackbone.instances_created += 1

    # ------------------------------------------------------------------ construction
    @classmethod
    def build_tiny(
        cls, spec: PaliGemmaSpec | None = None, seed: int = 0, placement: DevicePlacement | None = None
    ) -> PaliGemmaBackbone:
        """Randomly initialized PaliGemma of a preset (no files, no network); drawn on the CPU in the
        placement's dtype, then placed (the same seed and dtype give the same backbone on every device)."""
        spec = spec or PALIGEMMA_PRESETS["paligemma-tiny"]
        if not isinstance(spec, PaliGemmaSpec):
            raise ValueError(
                f"backbone family 'paligemma' builds its own presets {sorted(PALIGEMMA_PRESETS)}, "
                f"not {type(spec).__name__} {getattr(spec, 'name', spec)!r}"
            )
        tokenizer = train_gemma_tokenizer(spec.tokenizer_vocab_size)
        placement = placement or DevicePlacement.from_env()
        previous = torch.get_default_dtype()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # Drawn in the placement's dtype: PaliGemma 3B in float32 first would hold 12 GB to keep 6.
            torch.set_default_dtype(placement.torch_dtype)
            try:
                model = PaliGemmaForConditionalGeneration(paligemma_config(spec))
            finally:
                torch.set_default_dtype(previous)
        return cls(
            model,
            tokenizer,
            model_id=_spec_model_id(spec, seed),
            max_images=spec.max_images,
            max_instruction_tokens=spec.max_instruction_tokens,
            spec=spec,
            placement=placement,
        )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, placement: DevicePlacement | None = None, *, model_id: str | None = None
    ) -> PaliGemmaBackbone:
        """Load a local PaliGemma directory (as transformers' ``save_pretrained`` writes it, with a
        tokenizer; our metadata optional). Offline only, in the placement's dtype."""
        root = Path(path).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"backbone checkpoint directory {str(root)!r} does not exist")
        for required, what in (("config.json", "the model config"), ("tokenizer_config.json", "the tokenizer")):
            if not (root / required).is_file():
                raise FileNotFoundError(f"backbone checkpoint {str(root)!r} has no {required} ({what})")
        config = PaliGemmaConfig.from_pretrained(root, local_files_only=True)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"backbone checkpoint {str(root)!r} has model_type {config.model_type!r}; "
                f"supported: {list(SUPPORTED_MODEL_TYPES)}"
            )
        config.text_config._attn_implementation = "eager"
        placement = placement or DevicePlacement.from_env()
        model = PaliGemmaForConditionalGeneration.from_pretrained(
            root, config=config, local_files_only=True, dtype=placement.torch_dtype
        )
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
        tokenizer.padding_side = "right"
        meta: dict[str, Any] = {}
        if (root / METADATA_FILE).is_file():
            meta = json.loads((root / METADATA_FILE).read_text())
            if meta.get("format_version") != METADATA_FORMAT_VERSION:
                raise ValueError(f"{root / METADATA_FILE}: unsupported format_version {meta.get('format_version')!r}")
        spec = PaliGemmaSpec(**meta["spec"]) if meta.get("spec") else None
        return cls(
            model,
            tokenizer,
            model_id=model_id or meta.get("model_id", str(root.resolve())),
            max_images=meta.get("max_images", 3),
            max_instruction_tokens=meta.get("max_instruction_tokens", 48),
            spec=spec,
            placement=placement,
        )

    def save_pretrained(self, path: str | Path) -> None:
        """Write config + safetensors weights + tokenizer + joynexus metadata (the base only)."""
        root = Path(path).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(root, state_dict=self.base_state_dict(), safe_serialization=True)
        self.tokenizer.save_pretrained(root)
        meta = {
            "format_version": METADATA_FORMAT_VERSION,
            "model_id": self.model_id,
            "max_images": self.max_images,
            "max_instruction_tokens": self.max_instruction_tokens,
            "spec": dataclasses.asdict(self.spec) if self.spec is not None else None,
        }
        (root / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    # ------------------------------------------------------------------ the layer-wise prefix
    @property
    def language_model(self) -> torch.nn.Module:
        return self.model.model.language_model

    @property
    def text_model(self) -> torch.nn.Module:
        """The decoder LoRA adapters are injected into."""
        return self.language_model

    @property
    def prefix_geometry(self) -> PrefixGeometry:
        text = self.model.config.text_config
        return PrefixGeometry(
            hidden_size=int(text.hidden_size),
            num_heads=int(text.num_attention_heads),
            num_kv_heads=int(text.num_key_value_heads),
            head_dim=int(text.head_dim),
        )

    @property
    def num_layers(self) -> int:
        return len(self.language_model.layers)

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) pixels in [-1, 1] -> (N, tokens, D) projector outputs (π0's image embedding:
        no 1/sqrt(D) scaling), frozen."""
        with torch.no_grad():
            states = self.model.model.vision_tower(pixel_values=pixels.to(self.device, self.dtype)).last_hidden_state
            return self.model.model.multi_modal_projector(states).float()

    def embed_text(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, T, D) Gemma input embeddings, unscaled (π0 scales them by sqrt(D))."""
        with torch.no_grad():
            return self.language_model.embed_tokens(token_ids.to(self.device)).float()


    # ------------------------------------------------------------------ encode (token features)
    def _encode_features(
        self,
        images: list[list[torch.Tensor]],
        instructions: list[str],
        adapters: Sequence[Hashable | None] | None = None,
        *,
        grad: bool = False,
    ) -> BackboneFeatures:
        """π0's prefix of [cameras, instruction] through every layer and the final norm: (B, L, D)
        float32 features, padding zeroed, mean-pooled over real tokens."""
        validate_encode_inputs(images, instructions, self.max_images)
        embeds, pad_mask = self.prefix_embeddings(images, instructions)
        context = torch.enable_grad() if grad else torch.inference_mode()
        with self._adapter_lock, self.adapter_routing(adapters, len(images)), context:
            hidden = layer_prefix_of(
                list(self.language_model.layers),
                embeds.to(self.dtype),
                pad_mask,
                torch.zeros_like(pad_mask),
                self.prefix_geometry,
                final_norm=self.language_model.norm,
            )
        tokens = hidden.float() * pad_mask.unsqueeze(-1)
        pooled = tokens.sum(dim=1) / pad_mask.sum(dim=1, keepdim=True)
        if not grad:
            tokens, pooled = tokens.clone(), pooled.clone()  # out of inference mode: heads may train on them
        return BackboneFeatures(tokens=tokens, mask=pad_mask.clone(), pooled=pooled)

    def prefix_embeddings(
        self, images: list[list[torch.Tensor]], instructions: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L, D) right-padded [image tokens of each camera, language * sqrt(D)] and its (B, L) mask."""
        pixels, slot_mask = canonical_pixels(
            images, size=self.image_size, mean=self._mean, std=self._std, max_images=self.max_images, device=self.device
        )
        image_tokens = self.embed_images(pixels[slot_mask]) if bool(slot_mask.any()) else None
        ids, mask = self.tokenize_prompts(instructions, self.max_instruction_tokens)
        language = self.embed_text(ids) * math.sqrt(self.hidden_size)
        rows, flat = [], 0
        for b, cams in enumerate(images):
            parts = [image_tokens[flat + c] for c in range(len(cams))] if image_tokens is not None else []
            flat += len(cams)
            rows.append(torch.cat([*parts, language[b, mask[b]]]))
        longest = max(r.shape[0] for r in rows)
        embeds = torch.stack([F.pad(r, (0, 0, 0, longest - r.shape[0])) for r in rows])
        lengths = torch.tensor([r.shape[0] for r in rows], device=self.device)
        return embeds, torch.arange(longest, device=self.device)[None, :] < lengths[:, None]
