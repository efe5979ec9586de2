"""The Idefics3 / SmolVLM backbone family: the resident, frozen vision-language backbone.

One ``ResidentBackbone`` (the ``idefics3`` family of `backbone.base`) lives in a service
process. It wraps a real transformers
Idefics3 model (the architecture of SmolVLM-256M/500M: SigLIP-style vision encoder,
pixel-shuffle connector, Llama decoder), frozen and in eval mode. Tenants never
train it; they train small action modules on the features it returns.

Hot path (``encode``) deliberately bypasses the HF image processor and processor:

* images are resized on tensors to one canonical square ``image_size`` (one vision
  tile per camera, no image splitting) and normalized with the checkpoint's mean/std;
* camera slots are padded to ``max_images`` with an explicit slot mask; only real
  slots go through the vision encoder. Idefics3 itself detects padding images by
  "every normalized pixel == 0", which also drops a *real* uniform mid-grey image
  (0.5 normalizes to exactly 0) -- the explicit mask has no such ambiguity;
* ``input_ids`` are built by hand with the image tokens already expanded, from an
  LRU cache of tokenized instructions;
* text is right-padded: the Llama decoder is causal and derives position ids from
  the sequence index, so right padding leaves every real token bit-for-bit
  independent of the other samples in the batch (left padding would shift RoPE
  positions).

Tenant-private LoRA adapters (``joynexus.models.adapters``) live on the text model of
this one backbone: ``encode(..., adapters=[key or None per sample])`` runs a batch
that mixes tenants' adapters (and samples without one) in ONE forward, and
``grad=True`` keeps the autograd graph from the features to the adapters' weights
for training (the vision tower and every base weight stay frozen). With no adapter
on the backbone, ``encode`` is exactly what it was before adapters existed.

Placement (``joynexus.models.placement``): the backbone lives on its placement's device in its
dtype (float32 or bfloat16, optionally under autocast); camera images are copied there once per
image size, and ``encode`` returns float32 features on that device whatever the dtype.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import threading
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoTokenizer,
    Idefics3Config,
    Idefics3ImageProcessor,
    Idefics3Model,
    Idefics3Processor,
    PreTrainedTokenizerBase,
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
    causal_padding_mask,
    validate_encode_inputs,
)
from joynexus.models.backbone.hf_directory import ChatTemplatePrompt, load_hf_directory, read_chat_template
from joynexus.models.backbone.layer_prefix import (
    PrefixGeometry,
)
from joynexus.models.backbone.tiny import (
    CHAT_TEMPLATE,
    END_OF_UTTERANCE_TOKEN,
    FAKE_IMAGE_TOKEN,
    GLOBAL_IMAGE_TOKEN,
    IMAGE_TOKEN,
    TinyBackboneSpec,
    spec_model_id,
    train_tokenizer,
)
from joynexus.models.placement import DevicePlacement

__all__ = ["LLAMA_DECODER_LINEARS", "SUPPORTED_MODEL_TYPES", "ResidentBackbone"]

SUPPORTED_MODEL_TYPES = ("idefics3", "smolvlm")
# Linear layers of the Llama decoder that Idefics3 / SmolVLM use as their text model: the family's
# default LoRA targets (`BaseModelCapabilities` offers them when no backbone was asked).
LLAMA_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@register_backbone_family("idefics3")
class ResidentBackbone(LayerPrefixHost, TenantAdapterHost):
    """Frozen, memory-resident VLM that turns (camera images, instruction) into token features."""

    family: ClassVar[str] = "idefics3"
    model_types: ClassVar[tuple[str, ...]] = SUPPORTED_MODEL_TYPES
    lora_targets: ClassVar[tuple[str, ...]] = LLAMA_DECODER_LINEARS

    instances_created: ClassVar[int] = 0
    _instances_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        model: Idefics3Model,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_id: str,
        image_size: int,
        max_images: int,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
        max_instruction_tokens: int = 64,
        spec: TinyBackboneSpec | None = None,
        placement: DevicePlacement | None = None,
        chat_prompt: ChatTemplatePrompt | None = None,
    ) -> None:
        config = model.config
        vision = config.vision_config
        if image_size % (vision.patch_size * config.scale_factor) != 0:
            raise ValueError(
                f"image_size={image_size} must be a multiple of patch_size*scale_factor="
                f"{vision.patch_size * config.scale_factor}"
            )
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
        # A plain HF checkpoint's prompt comes from its chat template (`hf_directory`); None: the
        # built-in SmolVLM prompt below.
        self.chat_prompt = chat_prompt
        self.image_mean = tuple(float(x) for x in image_mean)
        self.image_std = tuple(float(x) for x in image_std)
        self._mean = torch.tensor(self.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
        self._std = torch.tensor(self.image_std, dtype=torch.float32).view(1, 3, 1, 1)
        # Tokens per camera after pixel shuffle; SigLIP position ids are defined on
        # the config's image grid, so the canonical side decides the count.
        self.image_seq_len = (self.image_size // vision.patch_size) ** 2 // config.scale_factor**2

        self._prepare_prompt_pieces(tokenizer, config.image_token_id)
        # Bounded LRU per instance (a decorated method would pin ``self`` in a global cache).
        self._prompt_ids = functools.lru_cache(maxsize=4096)(self._prompt_ids_uncached)

        # Frozen: no gradients, eval mode (no dropout), and encode runs in inference_mode.
        self.model.requires_grad_(False)
        self.model.eval()
        # On the placement's device in its dtype (weights cast once, here; features stay float32).
        self.placement = placement or DevicePlacement.from_env()
        self.device = self.placement.resolve()
        self.model.to(device=self.device, dtype=self.placement.torch_dtype)
        self.dtype = self.placement.torch_dtype
        self._mean, self._std = self._mean.to(self.device), self._std.to(self.device)
        self._placement_info = self.placement.describe(self.device)  # fixed for life: heartbeats just copy it
        if self.dtype != torch.float32:
            self._cast_patch_inputs()
        self._init_adapter_host()
        self._prefix_digests: dict[int, str] = {}  # the base is frozen: a digest per layer count holds for life
        with ResidentBackbone._instances_lock:
            ResidentBackbone.instances_created += 1

    def _prepare_prompt_pieces(self, tokenizer: PreTrainedTokenizerBase, image_token_id: int) -> None:
        """Check the tokenizer's special tokens against the model config; keep the prompt's fixed
        pieces as ids."""
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (IMAGE_TOKEN, FAKE_IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN)}
        for token, token_id in ids.items():
            if token_id is None or token_id == tokenizer.unk_token_id:
                raise ValueError(f"tokenizer of backbone {self.model_id!r} has no special token {token!r}")
        if ids[IMAGE_TOKEN] != image_token_id:
            raise ValueError(
                f"tokenizer image token id {ids[IMAGE_TOKEN]} != model config image_token_id {image_token_id}"
            )
        if tokenizer.pad_token_id is None:
            raise ValueError(f"tokenizer of backbone {self.model_id!r} has no pad token")
        self.pad_token_id = int(tokenizer.pad_token_id)
        eou = tokenizer.convert_tokens_to_ids(END_OF_UTTERANCE_TOKEN)
        bos = tokenizer.bos_token_id
        # Prompt pieces as ids, computed once: <bos>User:{images}{instruction}<eou>\nAssistant:
        self._prefix_ids = ([bos] if bos is not None else []) + self._text_ids("User:")
        self._image_block_ids = (
            [ids[FAKE_IMAGE_TOKEN], ids[GLOBAL_IMAGE_TOKEN]]
            + [ids[IMAGE_TOKEN]] * self.image_seq_len
            + [ids[FAKE_IMAGE_TOKEN]]
        )
        self._suffix_ids = ([eou] if eou is not None else []) + self._text_ids("\nAssistant:")

    def _cast_patch_inputs(self) -> None:
        """Pixels reach a reduced-precision vision tower in float32, cast to its dtype only at the
        patch convolution. Idefics3's vision embeddings compute the patch position ids from
        fractional coordinates in the *pixels'* dtype: in bfloat16 they round onto the bucket
        boundaries and shift positions (measured on the tiny backbone: 18% relative error of the
        vision features vs float32, 0.5% with this cast)."""
        embeddings = getattr(getattr(self.model, "vision_model", None), "embeddings", None)
        patch = getattr(embeddings, "patch_embedding", None)
        if patch is None:
            return
        dtype = self.dtype

        def cast_input(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (args[0].to(dtype), *args[1:])

        patch.register_forward_pre_hook(cast_input)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build_tiny(
        cls, spec: TinyBackboneSpec | None = None, seed: int = 0, placement: DevicePlacement | None = None
    ) -> ResidentBackbone:
        """Randomly initialized backbone from a small config (no files, no network). The weights are
        drawn on the CPU, then placed: the same seed gives the same backbone on every device."""
        spec = spec or TinyBackboneSpec.preset("tiny")
        tokenizer = train_tokenizer(spec.tokenizer_vocab_size)
        pad_id = tokenizer.pad_token_id
        text_config = {
            "model_type": "llama",
            "vocab_size": spec.vocab_size or len(tokenizer),
            "hidden_size": spec.text_hidden_size,
            "intermediate_size": spec.text_intermediate_size or 4 * spec.text_hidden_size,
            "num_hidden_layers": spec.built_text_layers,  # feature_layers: the later ones are never built
            "num_attention_heads": spec.text_heads,
            "num_key_value_heads": spec.kv_heads,
            "max_position_embeddings": spec.max_position_embeddings,
            "rope_theta": spec.rope_theta,
            "rms_norm_eps": 1e-5,
            "pad_token_id": pad_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "tie_word_embeddings": False,
        }
        vision_config = {
            "hidden_size": spec.vision_hidden_size,
            "intermediate_size": spec.vision_intermediate_size or 4 * spec.vision_hidden_size,
            "num_hidden_layers": spec.vision_layers,
            "num_attention_heads": spec.vision_heads,
            "patch_size": spec.patch_size,
            "image_size": spec.grid_image_size,
        }
        config = Idefics3Config(
            vision_config=vision_config,
            text_config=text_config,
            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
            scale_factor=spec.scale_factor,
            pad_token_id=pad_id,
            use_cache=False,
            tie_word_embeddings=False,
        )
        # Seed a private RNG stream so building does not disturb the caller's global RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Idefics3Model(config)
        return cls(
            model,
            tokenizer,
            model_id=spec_model_id(spec, seed),
            image_size=spec.image_size,
            max_images=spec.max_images,
            max_instruction_tokens=spec.max_instruction_tokens,
            spec=spec,
            placement=placement,
        )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, placement: DevicePlacement | None = None, *, model_id: str | None = None
    ) -> ResidentBackbone:
        """Load a local checkpoint directory (ours, or a plain Idefics3/SmolVLM one). Offline only.
        The weights are read in the placement's dtype (a bfloat16 placement never holds a float32 copy).
        ``model_id``: serve it under this id instead of the directory's own."""
        root = Path(path).expanduser()
        if not (root / METADATA_FILE).is_file():
            # Exactly as transformers wrote it: every serving setting from its own files.
            return load_hf_directory(cls, root, placement, model_id=model_id)
        if not root.exists():
            raise FileNotFoundError(f"backbone checkpoint directory {str(root)!r} does not exist")
        if not root.is_dir():
            raise ValueError(f"backbone checkpoint path {str(root)!r} is not a directory")
        if not (root / "config.json").is_file():
            raise FileNotFoundError(f"backbone checkpoint {str(root)!r} has no config.json (the model config)")
        weight_files = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
        if not any((root / name).is_file() for name in weight_files):
            raise FileNotFoundError(
                f"backbone checkpoint {str(root)!r} has no weights (expected one of {list(weight_files)})"
            )
        if not any((root / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise FileNotFoundError(
                f"backbone checkpoint {str(root)!r} has no tokenizer (tokenizer.json / tokenizer_config.json)"
            )
        config = AutoConfig.from_pretrained(root, local_files_only=True)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"backbone checkpoint {str(root)!r} has model_type {config.model_type!r}; "
                f"supported: {list(SUPPORTED_MODEL_TYPES)}"
            )
        # AutoModel maps idefics3 -> Idefics3Model, smolvlm -> SmolVLMModel and strips the
        # "model." prefix of *ForConditionalGeneration checkpoints.
        placement = placement or DevicePlacement.from_env()
        model = AutoModel.from_pretrained(root, config=config, local_files_only=True, dtype=placement.torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
        tokenizer.padding_side = "right"

        meta: dict = {}
        if (root / METADATA_FILE).is_file():
            meta = json.loads((root / METADATA_FILE).read_text())
            if meta.get("format_version") != METADATA_FORMAT_VERSION:
                raise ValueError(
                    f"{root / METADATA_FILE}: unsupported format_version {meta.get('format_version')!r} "
                    f"(this code reads {METADATA_FORMAT_VERSION})"
                )
        image_mean, image_std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
        if (root / "preprocessor_config.json").is_file():
            pre = json.loads((root / "preprocessor_config.json").read_text())
            image_mean = tuple(pre.get("image_mean", image_mean))
            image_std = tuple(pre.get("image_std", image_std))
        spec = TinyBackboneSpec(**meta["spec"]) if meta.get("spec") else None
        return cls(
            model,
            tokenizer,
            model_id=model_id or meta.get("model_id", str(root.resolve())),
            image_size=meta.get("image_size", config.vision_config.image_size),
            max_images=meta.get("max_images", 3),
            image_mean=meta.get("image_mean", image_mean),
            image_std=meta.get("image_std", image_std),
            max_instruction_tokens=meta.get("max_instruction_tokens", 64),
            spec=spec,
            placement=placement,
            chat_prompt=read_chat_template(root) if meta.get("chat_template_prompt") else None,
        )

    # ------------------------------------------------------------------ the layer-wise prefix
    @property
    def prefix_geometry(self) -> PrefixGeometry:
        """The decoder's attention shape: what an expert over `layer_prefix` builds against."""
        text = self.model.config.text_config
        heads = int(text.num_attention_heads)
        return PrefixGeometry(
            hidden_size=int(text.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        )

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) pixels in the vision tower's input range -> (N, tokens, D) connector outputs
        (vision tower + pixel-shuffle connector, no grad: both are frozen)."""
        with torch.no_grad():  # not inference_mode: a training prefix joins these to a graph
            states = self.model.vision_model(pixel_values=pixels.to(self.device, self.dtype)).last_hidden_state
            return self.model.connector(states).float()

    def embed_text(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, D) input embeddings of the text model (frozen, no grad)."""
        with torch.no_grad():
            return self.model.text_model.get_input_embeddings()(token_ids.to(self.device)).float()


    def save_pretrained(self, path: str | Path) -> None:
        """Write config + safetensors weights + tokenizer + HF processor + joynexus metadata. The
        weights are written in the dtype this backbone holds (a bfloat16 placement writes bfloat16)."""
        root = Path(path).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        # The base model only, under its own names: tenant adapters (peft moves a wrapped layer's
        # weight to `<layer>.base_layer.weight` and adds `lora_*` tensors) are never part of it.
        base_state = {
            name.replace(".base_layer.", "."): tensor
            for name, tensor in self.model.state_dict().items()
            if ".lora_" not in name
        }
        self.model.save_pretrained(root, state_dict=base_state, safe_serialization=True)
        self.tokenizer.save_pretrained(root)
        if self.model.config.model_type == "idefics3":
            # A stock HF processor too, so the directory also works with AutoProcessor
            # (e.g. for tools outside this service). One tile per image, like encode.
            image_processor = Idefics3ImageProcessor(
                do_image_splitting=False,
                size={"longest_edge": self.image_size},
                max_image_size={"longest_edge": self.image_size},
                image_mean=list(self.image_mean),
                image_std=list(self.image_std),
            )
            Idefics3Processor(
                image_processor=image_processor,
                # A copy: the processor's __init__ calls add_special_tokens on it.
                tokenizer=copy.deepcopy(self.tokenizer),
                image_seq_len=self.image_seq_len,
                # A checkpoint's own prompt travels with it (read back below).
                chat_template=self.chat_prompt.template if self.chat_prompt is not None else CHAT_TEMPLATE,
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
        """The decoder LoRA adapters are injected into (``PeftModel.from_pretrained`` takes this)."""
        return self.model.text_model

    # ------------------------------------------------------------------ prompt
    def _prompt_ids_uncached(self, num_images: int, instruction: str) -> tuple[int, ...]:
        # Same token sequence as Idefics3Processor on
        # "<|im_start|>User:" + "<image>" * n + instruction + "<end_of_utterance>\nAssistant:"
        # without image splitting; special tokens delimit BPE segments, so pieces
        # tokenized separately equal the whole string tokenized at once.
        if self.chat_prompt is not None:
            return self.chat_prompt.ids(
                self.tokenizer, num_images, instruction, self._image_block_ids, self.max_instruction_tokens
            )
        text = self._text_ids(instruction)[: self.max_instruction_tokens]
        return tuple(self._prefix_ids + self._image_block_ids * num_images + text + self._suffix_ids)

    # ------------------------------------------------------------------ encode
    def _validate(self, images: list[list[torch.Tensor]], instructions: list[str]) -> None:
        validate_encode_inputs(images, instructions, self.max_images)

    def _canonicalize(self, images: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, max_images, 3, S, S) normalized pixels with zero padding slots, and the (B, max_images) slot mask."""
        return canonical_pixels(  # float32 always: see _cast_patch_inputs
            images, size=self.image_size, mean=self._mean, std=self._std, max_images=self.max_images, device=self.device
        )

    def _input_ids(
        self, images: list[list[torch.Tensor]], instructions: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded input_ids with expanded image tokens, and the attention mask."""
        rows = [self._prompt_ids(len(cams), text) for cams, text in zip(images, instructions, strict=True)]
        length = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[b, : len(row)] = 1
        return input_ids, attention_mask

    def _text_attention_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """Causal + key-padding mask, prebuilt as 4D additive floats (`common.causal_padding_mask`)."""
        impl = getattr(self.model.config.text_config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            return attention_mask  # let transformers build what other kernels expect
        return causal_padding_mask(attention_mask, self.dtype)

    def _encode_features(
        self,
        images: list[list[torch.Tensor]],
        instructions: list[str],
        adapters: Sequence[Hashable | None] | None = None,
        *,
        grad: bool = False,
    ) -> BackboneFeatures:
        """Encode a batch of (cameras, instruction) samples into frozen token features.

        ``images[b]`` holds 0..max_images float (3, h, w) tensors in [0, 1] of any size; a sample
        with none (a state-only tenant) is encoded from its instruction text alone, and may share a
        forward with samples that have cameras (its prompt simply holds no image tokens).
        Instructions longer than ``max_instruction_tokens`` tokens are truncated.
        ``adapters[b]``: the key of the LoRA adapter (see ``adapters``) sample b runs with, None for
        the base model; one forward serves any mix. ``grad=True`` keeps the graph from the features
        to the adapters' weights (training); otherwise everything runs in inference mode.
        """
        self._validate(images, instructions)
        if adapters is not None and len(adapters) != len(images):
            raise ValueError(f"encode: got {len(adapters)} adapter keys for {len(images)} samples")
        input_ids, attention_mask = self._input_ids(images, instructions)
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        pixels, slot_mask = self._canonicalize(images)  # made on the device
        with self._adapter_lock, self.placement.autocast_context(self.device):
            if self.has_adapters():
                # Every forward is routed once any adapter exists: samples without one say so.
                routing = self.adapters.routing(list(adapters) if adapters is not None else [None] * len(images))
            elif adapters is not None and any(key is not None for key in adapters):
                unknown = sorted({repr(key) for key in adapters if key is not None})
                raise KeyError(f"encode: no LoRA adapter {', '.join(unknown)} on this backbone (it has none)")
            else:
                routing = contextlib.nullcontext()
            with routing:
                if grad:
                    return self._encode_with_grad(input_ids, attention_mask, pixels, slot_mask)
                return self._encode_inference(input_ids, attention_mask, pixels, slot_mask)

    def _image_states(self, pixels: torch.Tensor, slot_mask: torch.Tensor) -> torch.Tensor | None:
        """Connector outputs of the real camera slots; None when no sample has a camera (text only)."""
        if not bool(slot_mask.any()):
            return None
        vision = self.model.vision_model(pixel_values=pixels[slot_mask]).last_hidden_state
        return self.model.connector(vision)

    def _encode_with_grad(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixels: torch.Tensor, slot_mask: torch.Tensor
    ) -> BackboneFeatures:
        """The same computation as ``_encode_inference`` with autograd on for the text model (where
        the adapters are); the vision tower and connector, which no adapter touches, run without."""
        with torch.no_grad():
            image_states = self._image_states(pixels, slot_mask)
        with torch.enable_grad():
            return self._text_forward(input_ids, attention_mask, image_states)

    def _text_forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_states: torch.Tensor | None
    ) -> BackboneFeatures:
        """The text model over the prompt with the image states merged in; float32 features,
        padding zeroed, mean-pooled over real tokens (both encode paths)."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=self._text_attention_mask(attention_mask),
            image_hidden_states=image_states,
            use_cache=False,
            return_dict=True,
        )
        mask = attention_mask.bool()
        tokens = out.last_hidden_state.float() * mask.unsqueeze(-1)
        pooled = tokens.sum(dim=1) / mask.sum(dim=1, keepdim=True)
        return BackboneFeatures(tokens=tokens, mask=mask, pooled=pooled)

    def _encode_inference(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixels: torch.Tensor, slot_mask: torch.Tensor
    ) -> BackboneFeatures:
        with torch.inference_mode():
            # Only real camera slots reach the vision tower (selected by the slot mask,
            # not by pixel values); the flattened order matches the order of the image
            # tokens, which is what Idefics3's inputs_merger expects.
            image_states = self._image_states(pixels, slot_mask)
            features = self._text_forward(input_ids, attention_mask, image_states)
        # Tensors made under inference_mode can never be saved for backward, so a
        # tenant's head would fail on `Linear(features.tokens)`. Cloning outside the
        # context turns them into ordinary (still grad-free) tensors.
        return BackboneFeatures(
            tokens=features.tokens.clone(), mask=features.mask.clone(), pooled=features.pooled.clone()
        )
