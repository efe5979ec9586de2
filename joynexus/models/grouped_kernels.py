"""What a kind's grouped kernel is written with (issue 14; S-LoRA / Punica for action modules).

A kind's kernel (`Kernel` subclass, set as its module class's ``kernel``) is its module's forward
and loss over parameters stacked along a leading tenant axis G (`models.module_batching` stacks
them, caches them and calls the kernel). Here: the kernel base class, the group's inputs
(`GroupInputs`, `GroupDims`) and the batched primitives kernels are made of (`linear` = ``baddbmm``
over weights stored transposed, `layer_norm` = LayerNorm then a per-tenant affine, attention over
G*B rows). Nothing here knows a kind.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from joynexus.models.action_modules.base import ActionModule, ActionModuleConfig

__all__ = [
    "DERIVED",
    "GroupDims",
    "GroupInputs",
    "Kernel",
    "StackedParameters",
    "attend",
    "attend_mask",
    "attention",
    "cross_key_values",
    "fold_norm",
    "head_mask",
    "key_values",
    "layer_norm",
    "linear",
    "masked_means",
    "merge_heads",
    "normalize",
    "pad_rows",
    "pad_to",
    "run_sequential",
    "self_attention",
    "split_heads",
]

StackedParameters = dict[str, torch.Tensor]

# Prefix of the tensors a kernel derives from the stacked parameters alone (`Kernel.derived`:
# folded affines, per-step constants). No parameter name has it; cached with the inference stacks.
DERIVED = "~derived."


@dataclass(frozen=True)
class GroupInputs:
    """A group's rows, padded to (G, B, ...): B = the largest member's row count."""

    tokens: torch.Tensor  # (G, B, L, D)
    mask: torch.Tensor  # (G, B, L) bool, True = real token
    pooled: torch.Tensor  # (G, B, D)
    state: torch.Tensor  # (G, B, S)
    valid: torch.Tensor  # (G, B) bool, False = a padding row (a copy of the member's first row)
    counts: tuple[int, ...]  # real rows per member

    @property
    def groups(self) -> int:
        return self.tokens.shape[0]

    @property
    def rows(self) -> int:
        return self.tokens.shape[1]

    def unpad(self, values: torch.Tensor) -> list[torch.Tensor]:
        """(G, B, ...) -> each member's (count, ...) real rows."""
        return [values[g, :n] for g, n in enumerate(self.counts)]


@dataclass(frozen=True)
class GroupDims:
    """The group's padded dims and each member's own."""

    state: int
    action: int
    chunk: int
    actions: tuple[int, ...]
    chunks: tuple[int, ...]

    @staticmethod
    def of(modules: Sequence[ActionModule]) -> GroupDims:
        cfgs = [m.config for m in modules]
        actions = tuple(c.action_dim for c in cfgs)
        chunks = tuple(c.action_chunk for c in cfgs)
        return GroupDims(max(c.state_dim for c in cfgs), max(actions), max(chunks), actions, chunks)

    @property
    def ragged(self) -> bool:
        return len(set(self.actions)) > 1 or len(set(self.chunks)) > 1

    def action_mask(self, device: torch.device) -> torch.Tensor:
        """(G, 1, chunk, action) True where a member has that chunk step and action dim."""
        steps = torch.arange(self.chunk, device=device)
        dims = torch.arange(self.action, device=device)
        chunks = torch.tensor(self.chunks, device=device)
        actions = torch.tensor(self.actions, device=device)
        own_steps = steps.view(1, -1) < chunks.view(-1, 1)
        own_dims = dims.view(1, -1) < actions.view(-1, 1)
        return (own_steps.unsqueeze(-1) & own_dims.unsqueeze(1)).unsqueeze(1)


def pad_to(tensor: torch.Tensor, shape: tuple[int, ...], value: float | bool = 0) -> torch.Tensor:
    """Pad at the end of every dim up to `shape`."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    pad: list[int] = []
    for size, target in zip(reversed(tensor.shape), reversed(shape), strict=True):
        pad += [0, target - size]
    return F.pad(tensor, pad, value=value)


def pad_rows(
    parts: Sequence[torch.Tensor], width: int, shape: tuple[int, ...] | None = None, value: float | bool = 0
) -> torch.Tensor:
    """Per-member (n_g, ...) tensors -> (G, width, *shape): rows padded by repeating the first row
    (a real row, so no all-masked attention row), trailing dims padded at the end with `value`
    (default: each part's own trailing shape, which must then agree)."""
    out = []
    for p in parts:
        if p.shape[0] != width:
            p = torch.cat([p, p[:1].expand(width - p.shape[0], *p.shape[1:])])
        out.append(p if shape is None else pad_to(p, (width, *shape), value))
    return torch.stack(out)


# ------------------------------------------------------------------------------ primitives
def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """nn.Linear per tenant: x (G, ..., in), weight_t (G, in, out) (stored transposed), bias (G, out)."""
    g = x.shape[0]
    flat = x.reshape(g, -1, x.shape[-1])
    out = torch.baddbmm(bias.unsqueeze(1), flat, weight_t)
    return out.view(*x.shape[:-1], weight_t.shape[-1])


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """nn.LayerNorm (default eps) per tenant over the last dim: weight/bias (G, dim)."""
    shape = (weight.shape[0],) + (1,) * (x.ndim - 2) + (weight.shape[-1],)
    return torch.addcmul(bias.view(shape), F.layer_norm(x, x.shape[-1:], eps=eps), weight.view(shape))


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(G, B, L, E) -> (G*B, H, L, E/H)."""
    g, b, length, e = x.shape
    return x.reshape(g * b, length, heads, e // heads).transpose(1, 2)


def merge_heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """(G*B, H, L, hd) -> (G, B, L, H*hd)."""
    gb, h, length, hd = x.shape
    return x.transpose(1, 2).reshape(g, gb // g, length, h * hd)


def key_values(p: StackedParameters, prefix: str, memory: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """nn.MultiheadAttention's key/value projections of `memory` (G, B, L, E), split into heads."""
    e = memory.shape[-1]
    w, b = p[prefix + "in_proj_weight"], p[prefix + "in_proj_bias"]
    kv = linear(memory, w[:, :, e:], b[:, e:])
    k, v = kv.split(e, dim=-1)
    return split_heads(k, heads), split_heads(v, heads)


def cross_key_values(
    p: StackedParameters, prefix: str, memory: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`key_values` prepared for `attention`'s cross-attention, once per group: keys transposed
    and pre-scaled by 1/sqrt(head dim), (G*B, H, hd, L); values (G*B, H, L, hd); contiguous."""
    keys, values = key_values(p, prefix, memory, heads)
    return (keys * keys.shape[-1] ** -0.5).transpose(-1, -2).contiguous(), values.contiguous()


def attend(
    p: StackedParameters,
    prefix: str,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attend_mask: torch.Tensor | None,
    heads: int,
) -> torch.Tensor:
    """nn.MultiheadAttention (batch_first, need_weights=False) from its projected keys/values:
    query (G, B, Lq, E) -> (G, B, Lq, E); attend_mask (G*B, 1, 1, Lk), additive."""
    g, e = query.shape[0], query.shape[-1]
    w, b = p[prefix + "in_proj_weight"], p[prefix + "in_proj_bias"]
    q = split_heads(linear(query, w[:, :, :e], b[:, :e]), heads)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend_mask)
    return linear(merge_heads(out, g), p[prefix + "out_proj.weight"], p[prefix + "out_proj.bias"])


def normalize(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm without its affine (folded into the next projection by `fold_norm`)."""
    return F.layer_norm(x, x.shape[-1:], eps=eps)


def fold_norm(
    p: StackedParameters, norm: str, weight_t: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(LN(x) * gamma + beta) @ W + b = LN(x) @ (gamma * W) + (beta @ W + b), per tenant."""
    gamma, beta = p[norm + "weight"], p[norm + "bias"]
    folded_bias = torch.baddbmm(bias.unsqueeze(1), beta.unsqueeze(1), weight_t).squeeze(1)
    return gamma.unsqueeze(-1) * weight_t, folded_bias


def self_attention(
    qkv: torch.Tensor, attend_mask: torch.Tensor | None, out_w: torch.Tensor, out_b: torch.Tensor, heads: int
) -> torch.Tensor:
    """nn.MultiheadAttention's self-attention from its packed projection `qkv` (G, B, L, 3E):
    matmul -> (+ mask) -> softmax -> matmul over (G*B*H) small matrices, measured faster than
    CPU SDPA at these sizes (a few tokens per row); `attend_mask` from `head_mask`."""
    g, b, length, three_e = qkv.shape
    e = three_e // 3
    hd = e // heads
    # (G, B, L, 3, H, hd) -> three (G*B*H, L, hd) views/copies.
    parts = qkv.view(g * b, length, 3, heads, hd).permute(2, 0, 3, 1, 4).reshape(3, g * b * heads, length, hd)
    q, k, v = parts[0] * hd**-0.5, parts[1], parts[2]
    if attend_mask is None:
        scores = torch.bmm(q, k.transpose(1, 2))
    else:
        scores = torch.baddbmm(attend_mask, q, k.transpose(1, 2))
    out = torch.bmm(scores.softmax(dim=-1), v).view(g * b, heads, length, hd)
    return linear(merge_heads(out, g), out_w, out_b)


def attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attend_mask: torch.Tensor | None,
    out_w: torch.Tensor,
    out_b: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """nn.MultiheadAttention's cross-attention from projected queries `q` (G, B, L, E) and
    `cross_key_values`' prepared keys (transposed, pre-scaled) and values: matmul -> (+ mask) ->
    softmax -> matmul, measured faster than CPU SDPA at these sizes (a few queries, tens of keys,
    G*B*H small matrices); `attend_mask` from `head_mask` (None: no padded key)."""
    g = q.shape[0]
    gb, h, hd, length = keys.shape
    q3 = split_heads(q, heads).reshape(gb * h, -1, hd)
    k3 = keys.view(gb * h, hd, length)
    scores = torch.bmm(q3, k3) if attend_mask is None else torch.baddbmm(attend_mask, q3, k3)
    out = torch.bmm(scores.softmax(dim=-1), values.view(gb * h, length, hd)).view(gb, h, -1, hd)
    return linear(merge_heads(out, g), out_w, out_b)


def head_mask(mask: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(G, B, L) real-token mask -> an additive (G*B*H, 1, L) mask (0 / -inf), one row per
    attention head: what `baddbmm` adds to the scores in the same op."""
    g, b, length = mask.shape
    additive = torch.zeros((g * b, 1, 1, length), dtype=dtype, device=mask.device)
    additive.masked_fill_(~mask.reshape(g * b, 1, 1, length), float("-inf"))
    return additive.expand(-1, heads, -1, -1).reshape(g * b * heads, 1, length)


def attend_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(G, B, L) real-token mask -> SDPA's additive (G*B, 1, 1, L) mask (0 / -inf), made once per
    group: a boolean mask is converted on every attention call."""
    g, b, length = mask.shape
    additive = torch.zeros((g * b, 1, 1, length), dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask.reshape(g * b, 1, 1, length), float("-inf"))


def masked_means(
    per_element: torch.Tensor, action_is_pad: torch.Tensor, valid: torch.Tensor, own: torch.Tensor
) -> torch.Tensor:
    """`ActionModule._masked_mean` per member: (G, B, chunk, A) -> (G,), over real rows' unpadded
    steps of the member's own action dims (`own`: (G, 1, chunk, A)); where(), so a non-finite
    padded value cannot poison a mean."""
    keep = (~action_is_pad & valid.unsqueeze(-1)).unsqueeze(-1) & own
    kept = torch.where(keep, per_element, torch.zeros((), dtype=per_element.dtype, device=per_element.device))
    return kept.sum(dim=(1, 2, 3)) / keep.sum(dim=(1, 2, 3)).clamp_min(1).to(per_element.dtype)


def run_sequential(layers: nn.Sequential, prefix: str, p: StackedParameters, x: torch.Tensor) -> torch.Tensor:
    """``layers`` (Linear / LayerNorm / GELU / SiLU / ReLU, default arguments) over stacked
    parameters, the parameters found under ``prefix`` + each layer's own name in ``layers``: the
    module's structure is read, not mirrored by hand."""
    for name, layer in layers.named_children():
        key = f"{prefix}{name}."
        if isinstance(layer, nn.Linear):
            x = linear(x, p[key + "weight"], p[key + "bias"])
        elif isinstance(layer, nn.LayerNorm):
            x = layer_norm(x, p[key + "weight"], p[key + "bias"], eps=layer.eps)
        elif isinstance(layer, nn.GELU | nn.SiLU | nn.ReLU):
            x = layer(x)
        else:
            raise TypeError(f"run_sequential: no stacked form of {type(layer).__name__} ({prefix}{name})")
    return x


# ------------------------------------------------------------------------------ the kernel base
class Kernel(abc.ABC):
    """One kind's forward over stacked parameters; mirrors the module class exactly. A kind
    sets an instance as its module class's ``kernel``; `models.module_batching` finds it there."""

    @abc.abstractmethod
    def predict(
        self,
        p: StackedParameters,
        cfg: ActionModuleConfig,
        x: GroupInputs,
        noise: torch.Tensor | None,
        dims: GroupDims,
    ) -> torch.Tensor:
        """(G, B, chunk, A) actions, padded dims (`noise`: the x0 each member's `draw_noise` drew,
        same shape, for kinds whose module `uses_noise`)."""

    @abc.abstractmethod
    def loss(
        self,
        p: StackedParameters,
        cfg: ActionModuleConfig,
        x: GroupInputs,
        actions: torch.Tensor,
        action_is_pad: torch.Tensor,
        noise: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        dims: GroupDims,
    ) -> torch.Tensor:
        """(G,) per-member training losses (`cfg` carries the group's padded dims; `noise`: what
        `draw_loss_noise` returned)."""

    def draw_loss_noise(
        self,
        modules: Sequence[ActionModule],
        actions: Sequence[torch.Tensor],
        action_is_pad: Sequence[torch.Tensor],
        generators: Sequence[torch.Generator | None],
        x: GroupInputs,
        dims: GroupDims,
    ) -> Any:
        """The randomness of each member's loss, drawn per member from its own generator in the
        order its module's `loss` draws it, padded to the group (None: the loss is deterministic)."""
        return None

    def policy_mean(self, p: StackedParameters, cfg: ActionModuleConfig, x: GroupInputs) -> torch.Tensor:
        raise NotImplementedError(f"kind {cfg.kind!r} has no tractable action density")

    def derived(self, p: StackedParameters, cfg: ActionModuleConfig) -> StackedParameters:
        """Tensors computed from the parameters alone, keyed under `DERIVED` (none by default)."""
        return {}
