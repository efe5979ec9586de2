"""The second feature form of a resident backbone: the prefix's per-layer key/value cache.

Last-layer tokens (`BackboneFeatures`) serve heads that cross-attend to one sequence. An action
expert that attends to the prefix in EVERY layer (LeRobot's SmolVLA, pi0's Gemma expert) needs each
decoder layer's keys and values of the prefix instead, with the prefix's padding mask: a
`LayerPrefix`. It is computed once per observation batch, in one forward over every row of every
tenant in the batch, and reused by every Euler step of every tenant's expert over those rows.

The computation is LeRobot's own (`lerobot.policies.smolvla.smolvlm_with_expert`, the
``fill_kv_cache`` pass): RoPE with LeRobot's fixed wavelength, eager attention in float32 with a
block-causal mask (``make_att_2d_masks``), grouped KV heads; so a cache made here is the cache
LeRobot's policy makes from the same weights and embeddings. A tenant-private piece of the prefix
(SmolVLA's state token, made by the tenant's ``state_proj``) is one more row of embeddings: the
forward carries it, and with ``grad`` the graph runs from the cache back through the frozen layers
to it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LayerPrefix",
    "PrefixGeometry",
    "apply_rope",
    "block_causal_mask",
    "eager_attention",
    "layer_prefix_of",
    "prefix_weight_names",
    "prefix_weights_digest",
]

# LeRobot's `apply_rope` default: SmolVLA applies this wavelength whatever the VLM config's rope_theta.
ROPE_WAVELENGTH = 10_000.0


@dataclass(frozen=True)
class PrefixGeometry:
    """The attention shape of the prefix's decoder layers (what an expert over the cache needs)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class LayerPrefix:
    """Per-layer keys/values of a batch's prefix, with its padding mask.

    ``keys[l]`` / ``values[l]``: (B, L, kv_heads, head_dim) of decoder layer l, RoPE applied to the
    keys at each token's position (``cumsum(pad_mask) - 1``); ``pad_mask`` (B, L) True = real token.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    pad_mask: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values) or not self.keys:
            raise ValueError(f"LayerPrefix: {len(self.keys)} key layers and {len(self.values)} value layers")
        b, length = self.pad_mask.shape
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k.ndim != 4 or k.shape[:2] != (b, length) or v.shape != k.shape:
                raise ValueError(
                    f"LayerPrefix layer {i}: keys {tuple(k.shape)} / values {tuple(v.shape)} do not match "
                    f"pad_mask ({b}, {length})"
                )

    @property
    def batch_size(self) -> int:
        return self.pad_mask.shape[0]

    @property
    def length(self) -> int:
        return self.pad_mask.shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return self.batch_size

    @property
    def offsets(self) -> torch.Tensor:
        """(B, 1) real prefix tokens per row: where a suffix's positions start."""
        return self.pad_mask.sum(dim=-1, keepdim=True)

    def select(self, index: slice | Sequence[int] | torch.Tensor) -> LayerPrefix:
        """Rows of the batch (the length is kept)."""
        if isinstance(index, Sequence) and not isinstance(index, torch.Tensor):
            index = torch.as_tensor(list(index), dtype=torch.long, device=self.pad_mask.device)
        return LayerPrefix(
            keys=tuple(k[index] for k in self.keys),
            values=tuple(v[index] for v in self.values),
            pad_mask=self.pad_mask[index],
        )

    def trimmed(self) -> LayerPrefix:
        """Without the trailing positions that are padding in every row."""
        real = self.pad_mask.any(dim=0).nonzero()
        length = int(real.max()) + 1 if real.numel() else 0
        if length == self.length:
            return self
        return LayerPrefix(
            keys=tuple(k[:, :length] for k in self.keys),
            values=tuple(v[:, :length] for v in self.values),
            pad_mask=self.pad_mask[:, :length],
        )

    def detach(self) -> LayerPrefix:
        return LayerPrefix(tuple(k.detach() for k in self.keys), tuple(v.detach() for v in self.values), self.pad_mask)

    @staticmethod
    def concat(parts: Sequence[LayerPrefix]) -> LayerPrefix:
        """Join batches along B, right-padding L to the longest part (padding masked out)."""
        if not parts:
            raise ValueError("LayerPrefix.concat needs at least one part")
        if len(parts) == 1:
            return parts[0]
        if len({p.num_layers for p in parts}) != 1:
            raise ValueError(f"LayerPrefix.concat: parts have {sorted({p.num_layers for p in parts})} layers")
        longest = max(p.length for p in parts)

        def pad(t: torch.Tensor, length: int) -> torch.Tensor:
            return F.pad(t, (0, 0, 0, 0, 0, longest - length))

        layers = range(parts[0].num_layers)
        return LayerPrefix(
            keys=tuple(torch.cat([pad(p.keys[i], p.length) for p in parts]) for i in layers),
            values=tuple(torch.cat([pad(p.values[i], p.length) for p in parts]) for i in layers),
            pad_mask=torch.cat([F.pad(p.pad_mask, (0, longest - p.length), value=False) for p in parts]),
        )


def apply_rope(x: torch.Tensor, positions: torch.Tensor, max_wavelength: float = ROPE_WAVELENGTH) -> torch.Tensor:
    """RoPE of (B, L) positions on x (B, L, H, D), computed in float32 (LeRobot's `apply_rope`)."""
    d_half = x.shape[-1] // 2
    dtype = x.dtype
    x = x.to(torch.float32)
    freq_exponents = (2.0 / x.shape[-1]) * torch.arange(d_half, dtype=torch.float32, device=x.device)
    timescale = max_wavelength**freq_exponents
    radians = (positions[..., None].to(torch.float32) / timescale[None, None, :])[..., None, :]
    sin, cos = torch.sin(radians), torch.cos(radians)
    x1, x2 = x.split(d_half, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def block_causal_mask(pad_mask: torch.Tensor, att_mask: torch.Tensor) -> torch.Tensor:
    """(B, L, L) bool: token i sees real token j when j's block starts at or before i's
    (``att_mask`` 1 opens a block), big_vision's / LeRobot's ``make_att_2d_masks``."""
    cumsum = torch.cumsum(att_mask.to(torch.long), dim=1)
    allowed = cumsum[:, None, :] <= cumsum[:, :, None]
    return allowed & (pad_mask[:, None, :] & pad_mask[:, :, None])


def eager_attention(
    mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_heads: int
) -> torch.Tensor:
    """(B, Lq, H*D) attention of query (B, Lq, H, D) over key/value (B, Lk, Hkv, D) with a (B, Lq, Lk)
    bool mask: KV heads repeated for their query groups, scores in float32, masked entries at the
    float32 minimum (a row with no allowed key is uniform, never NaN), as LeRobot computes it."""
    b, lk, kv_heads, head_dim = key.shape
    groups = num_heads // kv_heads
    key = key[:, :, :, None, :].expand(b, lk, kv_heads, groups, head_dim).reshape(b, lk, num_heads, head_dim)
    value = value[:, :, :, None, :].expand(b, lk, kv_heads, groups, head_dim).reshape(b, lk, num_heads, head_dim)
    scores = torch.matmul(query.to(torch.float32).transpose(1, 2), key.to(torch.float32).permute(0, 2, 3, 1))
    scores = scores * head_dim**-0.5
    scores = torch.where(mask[:, None, :, :], scores, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
    return out.reshape(b, -1, num_heads * head_dim)


def layer_prefix_of(
    layers: Sequence[nn.Module],
    embeds: torch.Tensor,
    pad_mask: torch.Tensor,
    att_mask: torch.Tensor,
    geometry: PrefixGeometry,
) -> LayerPrefix:
    """Run prefix embeddings (B, L, D) through Llama-style decoder ``layers``, keeping each layer's
    keys (RoPE'd) and values. The last layer's attention output and MLP feed nothing an expert reads,
    so they are not computed."""
    mask = block_causal_mask(pad_mask, att_mask)
    positions = torch.cumsum(pad_mask.to(torch.long), dim=1) - 1
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    hidden = embeds
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        normed = layer.input_layernorm(hidden).to(dtype=attn.q_proj.weight.dtype)
        shape = (*normed.shape[:-1], -1, geometry.head_dim)
        key = apply_rope(attn.k_proj(normed).view(shape), positions)
        value = attn.v_proj(normed).view(shape)
        keys.append(key)
        values.append(value)
        if index == len(layers) - 1:
            break
        query = apply_rope(attn.q_proj(normed).view(shape), positions)
        out = attn.o_proj(eager_attention(mask, query, key, value, geometry.num_heads).to(attn.o_proj.weight.dtype))
        hidden = out + hidden
        hidden = layer.mlp(layer.post_attention_layernorm(hidden)) + hidden
    return LayerPrefix(keys=tuple(keys), values=tuple(values), pad_mask=pad_mask)


_LAYER = re.compile(r"^text_model\.layers\.(\d+)\.")
_PREFIX_PARTS = ("vision_model.", "connector.", "text_model.embed_tokens.")


def prefix_weight_names(names: Sequence[str], num_layers: int) -> list[str]:
    """The names (a VLM's own, e.g. ``text_model.layers.3.mlp.up_proj.weight``) of the weights a
    ``num_layers`` layer prefix reads, sorted: the vision tower, the connector, the token embeddings
    and the first layers (a truncated LeRobot VLM holds exactly these, plus the unused norm/head)."""
    kept = []
    for name in names:
        layer = _LAYER.match(name)
        if name.startswith(_PREFIX_PARTS) or (layer is not None and int(layer.group(1)) < num_layers):
            kept.append(name)
    return sorted(kept)


def prefix_weights_digest(state: Mapping[str, torch.Tensor], num_layers: int) -> str:
    """sha256 over the prefix's weights (`prefix_weight_names`), each as float32 bytes beside its
    name and shape: the same base in bfloat16 or float32 gives one digest."""
    digest = hashlib.sha256()
    names = prefix_weight_names(list(state), num_layers)
    if not any(_LAYER.match(n) for n in names):
        raise ValueError(f"prefix_weights_digest: no text_model.layers.* weights among {len(state)} tensors")
    for name in names:
        tensor = state[name].detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()
