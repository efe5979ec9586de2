"""The ``pi0`` action-module kind: OpenPI's π0 action expert (LeRobot's ``lerobot.policies.pi0``)
over the shared, frozen PaliGemma prefix.

π0 is a PaliGemma prefix [images, language] and a Gemma action expert of the
``action_expert_variant`` shape that runs beside the prefix's decoder, layer for layer, attending
in every layer to [the prefix's keys/values, its own]. The suffix is [state token, chunk of
action-time tokens]: the state opens a block the prefix never sees, the actions a second block
that sees the state and each other. With LeRobot's ``train_expert_only`` (frozen PaliGemma) the
prefix depends on the observation alone, so every tenant of the same base shares it: the resident
backbone computes it once per batch (`layer_prefixes`, one forward over every row of every π0 /
π0.5 tenant) and each tenant's expert reads its rows. The tenant module holds the rest under
LeRobot's names (``gemma_expert.model.layers.*``, ``state_proj``, ``action_in_proj``,
``action_out_proj``, ``action_time_mlp_in/out``).

The computation follows LeRobot 0.4.4 (`PI0Pytorch`): images resized with centred padding to the
square ``image_resolution`` then mapped to [-1, 1], language embeddings scaled by sqrt(width),
positions ``cumsum(pad) - 1``, RoPE (theta 10,000), eager float32 attention, the sinusoidal time
embedding, Euler from t=1 to 0, the Beta(1.5, 1) time draw; the loss is over the real action dims.
`tests/models/test_pi0_parity.py` holds it equal to LeRobot's classes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pydantic
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GemmaConfig, GemmaModel

from joynexus.models.action_modules.base import ActionModuleConfig, PrefixRows, register_action_module
from joynexus.models.action_modules.prefix_flow import (
    PrefixFlowExpert,
    check_padded_dims,
    checkpoint_dim_problems,
    sinusoidal_time_embedding,
)
from joynexus.models.backbone.layer_prefix import (
    LayerPrefix,
    PrefixGeometry,
    apply_rope,
    block_causal_mask,
    eager_attention,
)

__all__ = ["GEMMA_VARIANTS", "PI0ActionModule", "PI0Config", "resize_with_centred_pad"]

# LeRobot's `get_gemma_config` variants: (width, depth, mlp_dim, heads, kv_heads, head_dim).
GEMMA_VARIANTS: dict[str, tuple[int, int, int, int, int, int]] = {
    "gemma_300m": (1024, 18, 4096, 8, 1, 256),
    "gemma_2b": (2048, 18, 16_384, 8, 1, 256),
}


class PI0Config(ActionModuleConfig):
    """π0's knobs under LeRobot's names (``action_chunk`` is its ``chunk_size``, ``num_steps`` its
    ``num_inference_steps``), and the PaliGemma decoder's shape the expert copies (from the base)."""

    max_state_dim: int = pydantic.Field(default=32, ge=1)
    max_action_dim: int = pydantic.Field(default=32, ge=1)
    num_steps: int = pydantic.Field(default=10, ge=1, description="Euler steps of the flow")
    # The expert's width and MLP (LeRobot's `gemma_300m`: 1024 / 4096); depth, heads and head_dim
    # are the VLM's, as LeRobot's joint attention needs.
    expert_width: int = pydantic.Field(default=1024, ge=1)
    expert_mlp_dim: int = pydantic.Field(default=4096, ge=1)
    min_period: float = pydantic.Field(default=4e-3, gt=0)
    max_period: float = pydantic.Field(default=4.0, gt=0)
    tokenizer_max_length: int = pydantic.Field(default=48, ge=1)
    image_resolution: int = pydantic.Field(default=224, ge=1)
    vlm_depth: int = pydantic.Field(default=18, ge=1)
    vlm_num_heads: int = pydantic.Field(default=8, ge=1)
    vlm_num_kv_heads: int = pydantic.Field(default=1, ge=1)
    vlm_head_dim: int = pydantic.Field(default=256, ge=1)
    # sha256 of the base's prefix weights: a tenant made from a LeRobot checkpoint only runs over the
    # PaliGemma it was trained with. "" = made for this backbone.
    base_digest: str = ""
    # A LeRobot π0 / π0.5 policy directory whose expert the tenant starts from ("" = from its seed).
    lerobot_checkpoint: str = ""

    @pydantic.model_validator(mode="after")
    def _pi0_shapes(self) -> PI0Config:
        check_padded_dims(self)
        return self

    def architecture_fields(self) -> tuple[Any, ...]:
        return (self.num_steps, self.vlm_depth, self.expert_width, self.expert_mlp_dim)

    @classmethod
    def backend_fields(cls, spec: Any, caps: Any, problems: list[tuple[str, str]]) -> dict[str, Any]:
        """The PaliGemma decoder's shape and camera side from the base and, with
        ``action_module.checkpoint``, the LeRobot policy's fields (its config.json and the expert's
        shapes; its weights are loaded and its PaliGemma checked by the Training Model Service,
        `load_initial_state`). A checkpoint of the other family, or dims that differ from the spec,
        are refused naming the field."""
        module = spec.action_module
        if caps.prefix_geometry is None:
            problems.append(("action_module.kind", f"backbone {caps.model_id!r} offers no layer-wise prefix"))
            return {}
        heads, kv_heads, head_dim, layers = caps.prefix_geometry
        fields: dict[str, Any] = {
            "vlm_num_heads": heads,
            "vlm_num_kv_heads": kv_heads,
            "vlm_head_dim": head_dim,
            "vlm_depth": layers,
            "image_resolution": caps.image_size,
        }
        if not module.checkpoint:
            return fields
        from joynexus.models.action_modules.pi0_checkpoint import read_lerobot_pi0
        from joynexus.models.action_modules.smolvla_checkpoint import LeRobotCheckpointError

        try:
            checkpoint = read_lerobot_pi0(module.checkpoint, weights=False)
            fields.update(checkpoint.module_config_fields())
        except LeRobotCheckpointError as error:
            problems.append(("action_module.checkpoint", str(error)))
            return fields
        if checkpoint.kind != module.kind:
            problems.append(
                ("action_module.kind", f"{module.kind!r}, but the checkpoint is a LeRobot {checkpoint.kind!r}")
            )
        problems.extend(checkpoint_dim_problems(spec, checkpoint, fields["action_chunk"]))
        if fields["image_resolution"] != caps.image_size:
            reason = (
                f"image_resolution={fields['image_resolution']}, the backbone's vision tower takes {caps.image_size}"
            )
            problems.append(("action_module.checkpoint", reason))
        fields.pop("action_chunk")
        fields["lerobot_checkpoint"] = str(Path(module.checkpoint).expanduser().resolve())
        return fields

    @classmethod
    def read_checkpoint(cls, path: str) -> Any:
        from joynexus.models.action_modules.pi0_checkpoint import read_lerobot_pi0

        return read_lerobot_pi0(path, weights=False)

    def prefix_group_key(self) -> tuple[Any, ...]:
        """π0 and π0.5 tenants with equal keys share one prefix forward (their prompts differ per row,
        the computation does not)."""
        return ("paligemma", self.vlm_depth, self.image_resolution, self.tokenizer_max_length, self.feature_dim)


def resize_with_centred_pad(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(N, 3, h, w) float images resized keeping the aspect ratio, clamped to [-1, 1] and padded
    around the centre with -1 (openpi's / LeRobot's `resize_with_pad_torch`, channels first)."""
    cur_height, cur_width = images.shape[-2:]
    ratio = max(cur_width / width, cur_height / height)
    resized_height, resized_width = int(cur_height / ratio), int(cur_width / ratio)
    resized = F.interpolate(images, size=(resized_height, resized_width), mode="bilinear", align_corners=False)
    resized = resized.clamp(-1.0, 1.0)
    pad_h0, rem_h = divmod(height - resized_height, 2)
    pad_w0, rem_w = divmod(width - resized_width, 2)
    return F.pad(resized, (pad_w0, pad_w0 + rem_w, pad_h0, pad_h0 + rem_h), value=-1.0)


class AdaptiveRMSNorm(nn.Module):
    """openpi's adaRMS norm (π0.5's expert): RMS-normalize, then scale, shift and a residual gate
    from a dense layer of the condition (zero-initialized weights, as openpi)."""

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, dim * 3, bias=True)
        nn.init.zeros_(self.dense.weight)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
        normed = x * torch.rsqrt(var + self.eps)
        modulation = self.dense(cond)
        if x.ndim == 3:
            modulation = modulation.unsqueeze(1)
        scale, shift, gate = torch.chunk(modulation, 3, dim=-1)
        normed = normed * (1 + scale.to(torch.float32)) + shift.to(torch.float32)
        return normed.to(x.dtype), gate.to(x.dtype)


def _norm(module: nn.Module, x: torch.Tensor, cond: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A norm of the expert with its residual gate (None: plain residual)."""
    if isinstance(module, AdaptiveRMSNorm):
        return module(x, cond)
    return module(x), None


def _gated(residual: torch.Tensor, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return residual + out if gate is None else residual + out * gate


PI0Rows = PrefixRows  # a member of `PI0ActionModule.layer_prefixes`


@register_action_module("pi0")
class PI0ActionModule(PrefixFlowExpert):
    """π0's tenant-private part: the Gemma action expert and its projections (module docstring)."""

    kind: ClassVar[str] = "pi0"
    config_class: ClassVar[type[ActionModuleConfig]] = PI0Config
    loss_over_padded_dims: ClassVar[bool] = False
    prefix_layers_field: ClassVar[str] = "vlm_depth"
    # π0.5 conditions the expert's norms on the time (adaRMS) instead of a state token.
    adaptive_norms: ClassVar[bool] = False
    config: PI0Config

    def __init__(self, config: PI0Config) -> None:
        super().__init__(config)
        cfg = config
        width = cfg.expert_width
        expert_config = GemmaConfig(
            vocab_size=1,
            hidden_size=width,
            intermediate_size=cfg.expert_mlp_dim,
            num_hidden_layers=cfg.vlm_depth,
            num_attention_heads=cfg.vlm_num_heads,
            num_key_value_heads=cfg.vlm_num_kv_heads,
            head_dim=cfg.vlm_head_dim,
            hidden_activation="gelu_pytorch_tanh",
        )
        self.gemma_expert = nn.Module()
        self.gemma_expert.model = GemmaModel(expert_config)
        self.gemma_expert.model.embed_tokens = None  # the expert reads embeddings, never tokens (as LeRobot)
        if self.adaptive_norms:
            eps = expert_config.rms_norm_eps
            for layer in self.gemma_expert.model.layers:
                layer.input_layernorm = AdaptiveRMSNorm(width, width, eps)
                layer.post_attention_layernorm = AdaptiveRMSNorm(width, width, eps)
            self.gemma_expert.model.norm = AdaptiveRMSNorm(width, width, eps)
        self._build_projections(cfg, width)
        self.geometry = PrefixGeometry(cfg.feature_dim, cfg.vlm_num_heads, cfg.vlm_num_kv_heads, cfg.vlm_head_dim)
        if cfg.stochastic:  # one raw step std per (padded) action dim, through flow_rl's bounds
            self.log_std = nn.Parameter(torch.zeros(cfg.max_action_dim))

    def _build_projections(self, cfg: PI0Config, width: int) -> None:
        self.state_proj = nn.Linear(cfg.max_state_dim, width)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, cfg.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * width, width)
        self.action_time_mlp_out = nn.Linear(width, width)

    def load_initial_state(self, backbone: Any) -> None:
        """Refuse a backbone whose decoder is not the one this expert was built against."""
        cfg, geometry = self.config, backbone.prefix_geometry
        ours = (cfg.feature_dim, cfg.vlm_num_heads, cfg.vlm_num_kv_heads, cfg.vlm_head_dim, cfg.vlm_depth)
        theirs = (geometry.hidden_size, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim)
        theirs = (*theirs, int(getattr(backbone, "num_layers", cfg.vlm_depth)))
        if ours != theirs:
            raise ValueError(
                f"action_module: the expert is built for a decoder of (hidden, heads, kv_heads, head_dim, depth)="
                f"{ours}, backbone {backbone.model_id!r} has {theirs}"
            )
        if cfg.lerobot_checkpoint:
            from joynexus.models.action_modules.pi0_checkpoint import read_lerobot_pi0

            checkpoint = read_lerobot_pi0(cfg.lerobot_checkpoint)
            digest, resident = checkpoint.vlm_digest(cfg.vlm_depth), backbone.prefix_digest(cfg.vlm_depth)
            if digest != resident:
                raise ValueError(
                    f"action_module.checkpoint: the PaliGemma of {cfg.lerobot_checkpoint!r} is not this deployment's "
                    f"backbone {backbone.model_id!r} (prefix weights digest {digest[:12]} vs {resident[:12]}); "
                    "create the tenant on the base it was trained on"
                )
            state = dict(self.state_dict())  # log_std (an RL tenant's) is ours, the rest LeRobot's
            state.update(checkpoint.module_state)
            self.load_state_dict(state, strict=True)

    # -------------------------------------------------------------- the prefix
    def prompts(self, instructions: Sequence[str], state: torch.Tensor) -> list[str]:
        """The language of each row's prefix: the task and a newline (LeRobot's π0 processor)."""
        return [text if text.endswith("\n") else f"{text}\n" for text in instructions]

    @staticmethod
    def layer_prefixes(backbone: Any, members: Sequence[PI0Rows], *, grad: bool = False) -> list[LayerPrefix]:
        """Every member's `LayerPrefix` from ONE prefix forward over all their rows (π0 and π0.5
        members of one `prefix_group_key`): cameras through SigLIP in one call per input shape,
        every row's prompt (its kind's `prompts`) in one tokenizer call, then one pass through the
        frozen Gemma. A row is [images, language], right-padded; the prefix attends bidirectionally
        (one block). Nothing in it is tenant-trained, so ``grad`` changes nothing but the context."""
        cfg = members[0].module.config
        if len({m.module.config.prefix_group_key() for m in members}) != 1:
            raise ValueError("layer_prefixes: members differ in their prefix layout (prefix_group_key)")
        device = backbone.device
        images = [cams for m in members for cams in m.images]
        texts = [text for m in members for text in m.module.prompts(m.instructions, m.state)]
        image_tokens = _embed_cameras(backbone, images, cfg.image_resolution)
        token_ids, token_mask = backbone.tokenize_prompts(texts, cfg.tokenizer_max_length)
        language = backbone.embed_text(token_ids) * math.sqrt(cfg.feature_dim)
        rows = [torch.cat([*image_tokens[b], language[b, token_mask[b]]]) for b in range(len(images))]
        longest = max(r.shape[0] for r in rows)
        embeds = torch.stack([F.pad(r, (0, 0, 0, longest - r.shape[0])) for r in rows])
        lengths = torch.tensor([r.shape[0] for r in rows], device=device)
        pad_mask = torch.arange(longest, device=device)[None, :] < lengths[:, None]
        prefix = backbone.layer_prefix(embeds, pad_mask, torch.zeros_like(pad_mask), cfg.vlm_depth, grad=grad)
        out, start = [], 0
        for m in members:
            out.append(prefix.select(slice(start, start + len(m.instructions))).trimmed())
            start += len(m.instructions)
        return out

    # -------------------------------------------------------------- the expert
    def embed_suffix(
        self, x_t: torch.Tensor, time: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(tokens (B, S, width), block starts (B, S), norm condition): π0's [state token, action-time
        tokens] (LeRobot's `embed_suffix`)."""
        padded_state = F.pad(state, (0, self.config.max_state_dim - state.shape[-1])).to(torch.float32)
        state_token = self.state_proj(padded_state)[:, None, :]
        action = self.action_in_proj(x_t)
        emb = sinusoidal_time_embedding(time, action.shape[-1], self.config.min_period, self.config.max_period)
        emb = emb.to(time.dtype)[:, None, :].expand_as(action)
        fused = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([action, emb], dim=2))))
        tokens = torch.cat([state_token, fused], dim=1)
        starts = torch.zeros(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        starts[:, :2] = True  # the state, then the actions, each its own block
        return tokens, starts, None

    def velocity(self, prefix: LayerPrefix, x_t: torch.Tensor, time: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """v(x_t, t): the expert's layers beside the prefix's, each attending to [that layer's
        prefix keys/values, the suffix's own] (LeRobot's `denoise_step`)."""
        hidden, starts, cond = self.embed_suffix(x_t, time, state)
        model = self.gemma_expert.model
        # The expert may run in bfloat16 while the projections stay float32 (LeRobot's split).
        dtype = model.layers[0].self_attn.q_proj.weight.dtype
        hidden, cond = hidden.to(dtype), (cond.to(dtype) if cond is not None else None)
        b, s = hidden.shape[:2]
        lp = prefix.length
        suffix_mask = block_causal_mask(torch.ones_like(starts), starts)
        mask = torch.cat([prefix.pad_mask[:, None, :].expand(b, s, lp), suffix_mask], dim=2)
        positions = prefix.offsets + torch.arange(s, device=hidden.device)[None, :]
        head_dim, heads = self.geometry.head_dim, self.geometry.num_heads
        for index, layer in enumerate(model.layers):
            attn = layer.self_attn
            normed, gate = _norm(layer.input_layernorm, hidden, cond)
            query = apply_rope(attn.q_proj(normed).view(b, s, -1, head_dim), positions)
            key = apply_rope(attn.k_proj(normed).view(b, s, -1, head_dim), positions)
            value = attn.v_proj(normed).view(b, s, -1, head_dim)
            keys = torch.cat([prefix.keys[index].to(dtype), key], dim=1)
            values = torch.cat([prefix.values[index].to(dtype), value], dim=1)
            hidden = _gated(hidden, attn.o_proj(eager_attention(mask, query, keys, values, heads)), gate)
            normed, gate = _norm(layer.post_attention_layernorm, hidden, cond)
            hidden = _gated(hidden, layer.mlp(normed), gate)
        out, _ = _norm(model.norm, hidden, cond)
        return self.action_out_proj(out[:, -self.config.action_chunk :].to(torch.float32))


def _embed_cameras(backbone: Any, images: list[list[torch.Tensor]], resolution: int) -> list[list[torch.Tensor]]:
    """Per row, per camera: (tokens, D) SigLIP + projector embeddings of LeRobot's preprocessing
    (resize with centred padding to the square resolution when the size differs, then [0, 1] ->
    [-1, 1]; the padding is resized's -1, then mapped as LeRobot maps it). One vision call per shape."""
    flat = [(b, img) for b, cams in enumerate(images) for img in cams]
    out: list[list[torch.Tensor]] = [[] for _ in images]
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, (_, img) in enumerate(flat):
        by_shape.setdefault(tuple(img.shape), []).append(i)
    embedded: dict[int, torch.Tensor] = {}
    for idx in by_shape.values():
        pixels = torch.stack([flat[i][1] for i in idx]).to(backbone.device, torch.float32)
        if tuple(pixels.shape[-2:]) != (resolution, resolution):
            pixels = resize_with_centred_pad(pixels, resolution, resolution)
        tokens = backbone.embed_images(pixels * 2.0 - 1.0)
        for row, i in enumerate(idx):
            embedded[i] = tokens[row]
    for i, (b, _) in enumerate(flat):  # each row's cameras in their own order
        out[b].append(embedded[i])
    return out
