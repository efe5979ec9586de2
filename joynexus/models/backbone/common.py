"""What every backbone family does the same way, whatever its architecture: the checks on an
``encode`` batch, camera images made canonical (resized, normalized, padded to the camera slots),
the causal + key-padding attention mask of a right-padded prompt, the hosting of tenants' LoRA
adapters on the family's text model (`TenantAdapterHost`), the features of image-free prompts
kept per instruction (`TenantAdapterHost.encode`), and the layer-wise prefix primitives of a family whose
experts read every decoder layer (`LayerPrefixHost`: SmolVLA's Idefics3, π0's PaliGemma)."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from joynexus.models.backbone.base import BackboneFeatures
from joynexus.models.backbone.layer_prefix import (
    IDEFICS3_PREFIX_WEIGHTS,
    LayerPrefix,
    PrefixWeightLayout,
    layer_prefix_of,
    prefix_weights_digest,
)

if TYPE_CHECKING:
    from joynexus.models.adapters import BackboneAdapters
    from joynexus.models.placement import DevicePlacement

__all__ = [
    "MAX_CACHED_INSTRUCTIONS",
    "LayerPrefixHost",
    "TenantAdapterHost",
    "canonical_pixels",
    "causal_padding_mask",
    "validate_encode_inputs",
]

# Instructions whose image-free features a backbone keeps (least recently used dropped first): one
# entry is (1, prompt tokens, hidden) float32, ~0.2 MiB for a 2k-wide model and a 25-token prompt.
MAX_CACHED_INSTRUCTIONS = 256


def validate_encode_inputs(images: list[list[torch.Tensor]], instructions: list[str], max_images: int) -> None:
    """An ``encode`` batch: as many instructions (str) as samples, 0..max_images float (3, h, w) cameras each."""
    if len(images) != len(instructions):
        raise ValueError(f"encode: got {len(images)} image lists but {len(instructions)} instructions")
    if not images:
        raise ValueError("encode: empty batch")
    for b, cams in enumerate(images):
        if not isinstance(instructions[b], str):
            raise ValueError(f"encode: instructions[{b}] must be str, got {type(instructions[b]).__name__}")
        if not 0 <= len(cams) <= max_images:
            raise ValueError(f"encode: sample {b} has {len(cams)} cameras; expected 0..{max_images} (max_images)")
        for c, img in enumerate(cams):
            if not isinstance(img, torch.Tensor) or img.ndim != 3 or img.shape[0] != 3:
                shape = tuple(img.shape) if isinstance(img, torch.Tensor) else type(img).__name__
                raise ValueError(f"encode: images[{b}][{c}] must be a (3, h, w) tensor, got {shape}")
            if not img.is_floating_point():
                raise ValueError(
                    f"encode: images[{b}][{c}] must be float in [0, 1], got dtype {img.dtype} "
                    "(convert uint8 with img.float() / 255)"
                )


def canonical_pixels(
    images: list[list[torch.Tensor]],
    *,
    size: int,
    mean: torch.Tensor,
    std: torch.Tensor,
    max_images: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, max_images, 3, S, S) float32 normalized pixels with zero padding slots, and the
    (B, max_images) slot mask; ``mean`` / ``std`` are (1, 3, 1, 1) on ``device``."""
    flat = [img for cams in images for img in cams]
    # On the backbone's device, in float32 (resizing and normalizing are cheap; the vision tower
    # takes the backbone's dtype).
    out = torch.empty(len(flat), 3, size, size, dtype=torch.float32, device=device)
    # Resize grouped by input shape: one interpolate call (and one host-to-device copy) per distinct (h, w).
    groups: dict[tuple[int, int], list[int]] = {}
    for i, img in enumerate(flat):
        groups.setdefault(tuple(img.shape[-2:]), []).append(i)
    for (h, w), idx in groups.items():
        batch = torch.stack([flat[i] for i in idx]).to(device=device, dtype=torch.float32)
        if (h, w) != (size, size):
            # antialias: cameras are usually larger than S; plain bilinear would alias.
            batch = F.interpolate(batch, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        out[idx] = batch
    if flat:
        out = (out - mean) / std
    counts = torch.tensor([len(cams) for cams in images], device=device)
    slot_mask = torch.arange(max_images, device=device).unsqueeze(0) < counts.unsqueeze(1)
    pixels = out.new_zeros(len(images), max_images, 3, size, size)
    pixels[slot_mask] = out  # row-major fill keeps (sample, camera) order
    return pixels, slot_mask


def causal_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Causal + key-padding mask of a right-padded (B, L) 0/1 mask, as a (B, 1, L, L) additive float mask.

    transformers 4.57 builds this mask with torch.vmap over mask functions, which costs ~5 ms per
    call on CPU (about 40% of a tiny batch-8 encode); a 4D mask is passed through untouched by its
    mask utilities and works for sdpa and eager.
    """
    length = attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)  # (B, Lq, Lk)
    # Right padding: every query row (even a padded one) sees key 0, so no row is all -inf.
    # In the backbone's dtype: sdpa wants a float mask of the query's dtype.
    additive = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
    additive.masked_fill_(~allowed, torch.finfo(dtype).min)
    return additive.unsqueeze(1)


class TenantAdapterHost:
    """Tenants' LoRA adapters on a family's text model, and what the services read of the frozen
    base: a family class sets ``model``, ``placement`` and ``_placement_info``, defines
    ``text_model`` and its forward ``_encode_features`` (the arguments of `encode`), and calls
    ``_init_adapter_host()`` in its constructor."""

    model: torch.nn.Module
    placement: DevicePlacement
    _placement_info: dict[str, Any]
    _adapter_lock: threading.RLock
    _adapters: BackboneAdapters | None

    def _init_adapter_host(self) -> None:
        # Made on first use; every encode holds this lock, so an adapter is never injected or
        # deleted while a forward runs.
        self._adapter_lock = threading.RLock()
        self._adapters = None
        # Features of image-free prompts by instruction (see `encode`), least recently used last out.
        self._instruction_features: OrderedDict[str, BackboneFeatures] = OrderedDict()
        self._instruction_features_lock = threading.Lock()

    def encode(
        self,
        images: list[list[torch.Tensor]],
        instructions: list[str],
        adapters: Sequence[Hashable | None] | None = None,
        *,
        grad: bool = False,
    ) -> BackboneFeatures:
        """`Backbone.encode`: the family's forward (`_encode_features`), except that a batch whose
        samples all have no camera, with no adapters, outside training's grad path (state-only
        tenants' rollouts and training batches, grouped or not) is answered from each
        instruction's features, computed once: they depend on the instruction alone, since the
        base model is frozen. Every state-only inference and training request ran the text model
        over the same constant prompt (~14% of the Master's CPU samples in a state-only PushCube
        benchmark). Rows are right-padded to the longest prompt, as the forward's are."""
        unique = list(dict.fromkeys(instructions))
        if grad or adapters is not None or any(images) or not 0 < len(unique) <= MAX_CACHED_INSTRUCTIONS:
            return self._encode_features(images, instructions, adapters, grad=grad)
        validate_encode_inputs(images, instructions, self.max_images)
        kept = BackboneFeatures.concat([self._instruction_features_of(text) for text in unique])
        row = {text: k for k, text in enumerate(unique)}
        return kept.select([row[text] for text in instructions])  # indexed: the caller's own copy

    def _instruction_features_of(self, instruction: str) -> BackboneFeatures:
        """One image-free sample's features of `instruction` (kept, least recently used dropped)."""
        with self._instruction_features_lock:
            found = self._instruction_features.get(instruction)
            if found is not None:
                self._instruction_features.move_to_end(instruction)
                return found
        found = self._encode_features([[]], [instruction])  # outside the lock: computed once or twice, same values
        with self._instruction_features_lock:
            self._instruction_features[instruction] = found
            while len(self._instruction_features) > MAX_CACHED_INSTRUCTIONS:
                self._instruction_features.popitem(last=False)
        return found

    @property
    def text_model(self) -> torch.nn.Module:
        """The decoder LoRA adapters are injected into (``PeftModel.from_pretrained`` takes this)."""
        raise NotImplementedError

    @property
    def adapters(self) -> BackboneAdapters:
        """The tenants' LoRA adapters on this backbone's text model (created on first use)."""
        with self._adapter_lock:
            if self._adapters is None:
                from joynexus.models.adapters import BackboneAdapters

                self._adapters = BackboneAdapters(self.text_model, self._adapter_lock)
            return self._adapters

    def has_adapters(self) -> bool:
        return self._adapters is not None and len(self._adapters) > 0

    def lora_target_modules(self) -> list[str]:
        """Names of the text model's Linear layers, i.e. what an adapter's ``target_modules`` may list."""
        from joynexus.models.adapters import linear_module_names

        return linear_module_names(self.text_model)

    def adapter_routing(
        self, adapters: Sequence[Hashable | None] | None, batch_size: int
    ) -> AbstractContextManager[None]:
        """The context one forward runs in: every forward is routed once any adapter exists
        (samples without one say so); without adapters, a key is an error. Call under the lock."""
        if adapters is not None and len(adapters) != batch_size:
            raise ValueError(f"encode: got {len(adapters)} adapter keys for {batch_size} samples")
        if self.has_adapters():
            return self.adapters.routing(list(adapters) if adapters is not None else [None] * batch_size)
        if adapters is not None and any(key is not None for key in adapters):
            unknown = sorted({repr(key) for key in adapters if key is not None})
            raise KeyError(f"encode: no LoRA adapter {', '.join(unknown)} on this backbone (it has none)")
        return contextlib.nullcontext()

    def base_state_dict(self) -> dict[str, torch.Tensor]:
        """The base model only, under its own names: tenant adapters (peft moves a wrapped layer's
        weight to `<layer>.base_layer.weight` and adds `lora_*` tensors) are never part of it."""
        return {
            name.replace(".base_layer.", "."): tensor
            for name, tensor in self.model.state_dict().items()
            if ".lora_" not in name
        }

    @property
    def prefix_key(self) -> tuple:
        """Two backbones with equal keys produce interchangeable features."""
        return (self.model_id, self.image_size, self.max_images)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model_id={self.model_id!r}, hidden_size={self.hidden_size}, "
            f"image_size={self.image_size}, max_images={self.max_images}, params={self.parameter_count():,}, "
            f"device={str(self.device)!r}, dtype={self.placement.dtype!r})"
        )

    def _text_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def parameter_count(self) -> int:
        """Parameters of the frozen base model (tenant adapters not counted)."""
        return sum(p.numel() for name, p in self.model.named_parameters() if ".lora_" not in name)

    def placement_info(self) -> dict[str, Any]:
        """Where this backbone computes (device, dtype, autocast, GPU name): for heartbeats and stats."""
        return dict(self._placement_info)


class LayerPrefixHost:
    """The prefix primitives a layer-wise expert needs, the same for every family that has them: the
    family's text model is ``text_model`` (its ``layers``), its tokenizer ``tokenizer``, the names of
    the weights a prefix reads ``prefix_weights``; `TenantAdapterHost` supplies the lock and routing."""

    prefix_weights: PrefixWeightLayout = IDEFICS3_PREFIX_WEIGHTS
    _prefix_digests: dict[int, str]

    def tokenize_prompts(self, texts: Sequence[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask) of texts, right-padded to the longest, truncated at ``max_length`` tokens, as
        LeRobot's tokenizer step calls this tokenizer (special tokens included)."""
        out = self.tokenizer(
            list(texts), max_length=max_length, truncation=True, padding="longest", padding_side="right",
            return_tensors="pt",
        )  # fmt: skip
        return out["input_ids"].to(self.device), out["attention_mask"].to(self.device).bool()

    def layer_prefix(
        self,
        embeds: torch.Tensor,
        pad_mask: torch.Tensor,
        att_mask: torch.Tensor,
        num_layers: int,
        *,
        grad: bool = False,
    ) -> LayerPrefix:
        """The per-layer key/value cache of a prefix of embeddings through the first ``num_layers``
        decoder layers (`layer_prefix.layer_prefix_of`); ``grad`` keeps the graph back to ``embeds``
        (a tenant-made prefix token) while every base weight stays frozen."""
        layers = self.text_model.layers
        if not 1 <= num_layers <= len(layers):
            raise ValueError(f"num_layers={num_layers}: backbone {self.model_id!r} has 1..{len(layers)} decoder layers")
        context = contextlib.nullcontext() if grad else torch.inference_mode()
        with self._adapter_lock, self.adapter_routing(None, embeds.shape[0]), context:
            return layer_prefix_of(
                list(layers[:num_layers]),
                embeds.to(self.device, self.dtype),
                pad_mask.to(self.device),
                att_mask.to(self.device),
                self.prefix_geometry,
            )

    def prefix_digest(self, num_layers: int) -> str:
        """sha256 of the weights a `num_layers` layer prefix reads (`prefix_weights`), as float32:
        equal for a LeRobot checkpoint's VLM part. The base is frozen: one digest per layer count."""
        key = int(num_layers)
        if key not in self._prefix_digests:
            self._prefix_digests[key] = prefix_weights_digest(self.base_state_dict(), key, self.prefix_weights)
        return self._prefix_digests[key]
