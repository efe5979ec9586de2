"""The ``smolvla`` action-module kind: LeRobot's SmolVLA action expert over the shared, frozen prefix.

SmolVLA (Shukor et al. 2025, ``lerobot.policies.smolvla``) is a SmolVLM2 prefix truncated to
``num_vlm_layers`` decoder layers and a flow-matching action expert, a narrower copy of the same
decoder (``expert_width_multiplier``) that attends to the prefix in every layer: self-attention
over [prefix cache, actions] every ``self_attn_every_n_layers``-th layer, cross-attention through
its own key/value projections of the prefix's cache in the others. The prefix is [images, language,
state]: images and language are the frozen VLM's; the state token is made by the tenant's trainable
``state_proj``. SmolVLA's own default fine-tuning (``train_expert_only``, frozen VLM) is exactly the
JoyNexus split: the VLM is the resident backbone, shared by every tenant of the same base; this
module holds the tenant-private rest (expert, ``state_proj``, action and time projections) under
LeRobot's own parameter names, so a LeRobot checkpoint loads into it and back out unchanged
(`models.lerobot_smolvla`).

The computation follows LeRobot 0.4.4 line by line (masks, RoPE, positions, time embedding, the
Beta(1.5, 1) time draw, Euler from t=1 to 0); `tests/models/test_smolvla_parity.py` holds it equal
to ``SmolVLAPolicy``. The services call `layer_prefixes` once per batch for every SmolVLA row of
every tenant (one grouped prefix forward), then each tenant's ``predict`` / ``loss`` over its rows.
Where LeRobot and our module contract differ, LeRobot is followed: the loss averages over the padded
``max_action_dim`` (LeRobot trains the padding dims toward the noise too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import pydantic
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaModel

from joynexus.models.action_modules.base import ActionModuleConfig, PrefixRows, register_action_module
from joynexus.models.action_modules.prefix_flow import (
    PrefixFlowExpert,
    check_padded_dims,
    checkpoint_dim_problems,
    sinusoidal_time_embedding,
)
from joynexus.models.backbone.layer_prefix import LayerPrefix, PrefixGeometry, apply_rope, eager_attention

__all__ = [
    "SmolVLAActionModule",
    "SmolVLAConfig",
    "SmolVLARows",
    "expert_intermediate_size",
    "resize_with_pad",
]


class SmolVLAConfig(ActionModuleConfig):
    """SmolVLA's knobs under LeRobot's names (``action_chunk`` is its ``chunk_size``), plus the
    attention shape of the VLM whose prefix the expert reads (from the base, at tenant creation)."""

    max_state_dim: int = pydantic.Field(default=32, ge=1)
    max_action_dim: int = pydantic.Field(default=32, ge=1)
    num_steps: int = pydantic.Field(default=10, ge=1, description="Euler steps of the flow")
    num_vlm_layers: int = pydantic.Field(default=16, ge=1)
    num_expert_layers: int = -1
    self_attn_every_n_layers: int = 2
    expert_width_multiplier: float = pydantic.Field(default=0.75, gt=0, le=4)
    attention_mode: Literal["cross_attn"] = "cross_attn"
    min_period: float = pydantic.Field(default=4e-3, gt=0)
    max_period: float = pydantic.Field(default=4.0, gt=0)
    tokenizer_max_length: int = pydantic.Field(default=48, ge=1)
    resize_imgs_with_padding: tuple[int, int] | None = (512, 512)
    add_image_special_tokens: bool = False
    # The VLM text model's attention shape, which LeRobot's expert copies (filled from the base).
    vlm_num_heads: int = pydantic.Field(default=15, ge=1)
    vlm_num_kv_heads: int = pydantic.Field(default=5, ge=1)
    vlm_head_dim: int = pydantic.Field(default=64, ge=1)
    vlm_rms_norm_eps: float = 1e-5
    # sha256 of the base's prefix weights (`ResidentBackbone.prefix_digest`): a tenant made from a
    # LeRobot checkpoint only runs over the VLM it was trained with. "" = made for this backbone.
    base_digest: str = ""
    # A LeRobot SmolVLA policy directory whose expert the tenant starts from ("" = from its seed).
    lerobot_checkpoint: str = ""

    @pydantic.model_validator(mode="after")
    def _smolvla_shapes(self) -> SmolVLAConfig:
        check_padded_dims(self)
        if self.num_expert_layers > 0 and self.num_vlm_layers % self.num_expert_layers:
            raise ValueError(
                f"num_expert_layers={self.num_expert_layers} must divide num_vlm_layers={self.num_vlm_layers}"
            )
        return self

    @property
    def expert_hidden_size(self) -> int:
        return int(self.feature_dim * self.expert_width_multiplier)

    @property
    def expert_layers(self) -> int:
        return self.num_expert_layers if self.num_expert_layers > 0 else self.num_vlm_layers

    def architecture_fields(self) -> tuple[Any, ...]:
        return (self.num_steps, self.num_vlm_layers, self.expert_layers, self.expert_width_multiplier)

    @classmethod
    def backend_fields(cls, spec: Any, caps: Any, problems: list[tuple[str, str]]) -> dict[str, Any]:
        """The backbone's decoder shape and, with ``action_module.checkpoint``, the LeRobot policy's
        SmolVLA fields (read from its config.json; its weights are loaded and its VLM checked by the
        Training Model Service, `load_initial_state`). Dims that differ from the spec are refused."""
        module = spec.action_module
        if caps.prefix_geometry is None:
            problems.append(("action_module.kind", f"backbone {caps.model_id!r} offers no layer-wise prefix"))
            return {}
        heads, kv_heads, head_dim, layers = caps.prefix_geometry
        fields: dict[str, Any] = {"vlm_num_heads": heads, "vlm_num_kv_heads": kv_heads, "vlm_head_dim": head_dim}
        # From scratch: SmolVLA's 16 layers (or all there are), cameras at the backbone's canonical side.
        fields["num_vlm_layers"] = min(16, layers)
        fields["resize_imgs_with_padding"] = (caps.image_size, caps.image_size)
        if not module.checkpoint:
            return fields
        from joynexus.models.action_modules.smolvla_checkpoint import LeRobotCheckpointError, read_lerobot_smolvla

        try:
            checkpoint = read_lerobot_smolvla(module.checkpoint, weights=False)
        except LeRobotCheckpointError as error:
            problems.append(("action_module.checkpoint", str(error)))
            return fields
        problems.extend(checkpoint_dim_problems(spec, checkpoint, int(checkpoint.config.get("chunk_size", 0))))
        fields.update(checkpoint.module_config_fields())
        fields.pop("action_chunk", None)
        if fields["num_vlm_layers"] > layers:
            reason = f"num_vlm_layers={fields['num_vlm_layers']} > the backbone's {layers}"
            problems.append(("action_module.checkpoint", reason))
        fields["lerobot_checkpoint"] = str(Path(module.checkpoint).expanduser().resolve())
        return fields

    @classmethod
    def read_checkpoint(cls, path: str) -> Any:
        from joynexus.models.action_modules.smolvla_checkpoint import read_lerobot_smolvla

        return read_lerobot_smolvla(path, weights=False)

    def prefix_group_key(self) -> tuple[Any, ...]:
        """Tenants with equal keys share one prefix forward: the same prefix layout over the same layers."""
        return (
            self.num_vlm_layers,
            self.resize_imgs_with_padding,
            self.add_image_special_tokens,
            self.tokenizer_max_length,
            self.feature_dim,
        )


def expert_intermediate_size(hidden: int, ffn_dim_multiplier: int = 4, multiple_of: int = 256) -> int:
    """The expert's MLP width (LeRobot's `get_intermediate_size`)."""
    hidden = int(2 * hidden / 3)
    hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def resize_with_pad(img: torch.Tensor, width: int, height: int, pad_value: float = 0.0) -> torch.Tensor:
    """(B, 3, h, w) resized keeping the aspect ratio, padded on the left and top (LeRobot's)."""
    cur_height, cur_width = img.shape[2:]
    ratio = max(cur_width / width, cur_height / height)
    resized_height, resized_width = int(cur_height / ratio), int(cur_width / ratio)
    resized = F.interpolate(img, size=(resized_height, resized_width), mode="bilinear", align_corners=False)
    pad_height, pad_width = max(0, int(height - resized_height)), max(0, int(width - resized_width))
    return F.pad(resized, (pad_width, 0, pad_height, 0), value=pad_value)


SmolVLARows = PrefixRows  # a member of `SmolVLAActionModule.layer_prefixes`


@register_action_module("smolvla")
class SmolVLAActionModule(PrefixFlowExpert):
    """SmolVLA's tenant-private part: the action expert and its projections (module docstring). The
    flow-matching loss, Euler integration and flow-RL path are `PrefixFlowExpert`'s."""

    kind: ClassVar[str] = "smolvla"
    config_class: ClassVar[type[ActionModuleConfig]] = SmolVLAConfig
    config: SmolVLAConfig

    def __init__(self, config: SmolVLAConfig) -> None:
        super().__init__(config)
        cfg = config
        width = cfg.expert_hidden_size
        expert_config = LlamaConfig(
            vocab_size=1,
            hidden_size=width,
            intermediate_size=expert_intermediate_size(width),
            num_hidden_layers=cfg.expert_layers,
            num_attention_heads=cfg.vlm_num_heads,
            num_key_value_heads=cfg.vlm_num_kv_heads,
            head_dim=cfg.vlm_head_dim,
            rms_norm_eps=cfg.vlm_rms_norm_eps,
            attention_bias=False,
            tie_word_embeddings=False,
        )
        self.lm_expert = LlamaModel(expert_config)
        self.lm_expert.embed_tokens = None  # the expert reads embeddings, never tokens (as LeRobot)
        kv_width = cfg.vlm_num_kv_heads * cfg.vlm_head_dim
        for index, layer in enumerate(self.lm_expert.layers):
            if not self._self_attention_layer(index):  # cross-attention: k/v projections read the prefix cache
                layer.self_attn.k_proj = nn.Linear(kv_width, kv_width, bias=False)
                layer.self_attn.v_proj = nn.Linear(kv_width, kv_width, bias=False)
        self.state_proj = nn.Linear(cfg.max_state_dim, cfg.feature_dim)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, cfg.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * width, width)
        self.action_time_mlp_out = nn.Linear(width, width)
        self.geometry = PrefixGeometry(cfg.feature_dim, cfg.vlm_num_heads, cfg.vlm_num_kv_heads, cfg.vlm_head_dim)
        if cfg.stochastic:  # one raw step std per (padded) action dim, through flow_rl's bounds
            self.log_std = nn.Parameter(torch.zeros(cfg.max_action_dim))

    def _self_attention_layer(self, index: int) -> bool:
        every = self.config.self_attn_every_n_layers
        return every > 0 and index % every == 0

    def _expert_layer(self, vlm_layer: int) -> nn.Module | None:
        """The expert layer beside VLM layer i (LeRobot's `get_model_layers`: with fewer expert
        layers, only every (vlm / expert)-th VLM layer has one)."""
        multiple = self.config.num_vlm_layers // self.config.expert_layers
        if multiple > 0 and vlm_layer > 0 and vlm_layer % multiple != 0:
            return None
        return self.lm_expert.layers[vlm_layer // multiple if multiple > 0 else vlm_layer]

    def load_initial_state(self, backbone: Any) -> None:
        """Refuse a backbone whose decoder is not the one this expert was built against, and start
        from the LeRobot checkpoint's expert when the config names one: its VLM part must be this
        backbone's prefix (the digest of the weights the prefix reads), or it is refused naming
        ``action_module.checkpoint``."""
        from joynexus.models.action_modules.smolvla_checkpoint import load_expert_state

        cfg, geometry = self.config, backbone.prefix_geometry
        ours = (cfg.feature_dim, cfg.vlm_num_heads, cfg.vlm_num_kv_heads, cfg.vlm_head_dim)
        theirs = (geometry.hidden_size, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim)
        if ours != theirs:
            raise ValueError(
                f"action_module: the expert is built for a decoder of (hidden, heads, kv_heads, head_dim)={ours}, "
                f"backbone {backbone.model_id!r} has {theirs}"
            )
        if cfg.lerobot_checkpoint:
            state, digest = load_expert_state(cfg.lerobot_checkpoint, cfg.num_vlm_layers)
            resident = backbone.prefix_digest(cfg.num_vlm_layers)
            if digest != resident:
                raise ValueError(
                    f"action_module.checkpoint: the VLM of {cfg.lerobot_checkpoint!r} is not this deployment's "
                    f"backbone {backbone.model_id!r} (prefix weights digest {digest[:12]} vs {resident[:12]}); "
                    "create the tenant on the base it was trained on"
                )
            self.load_state_dict(state, strict=True)

    # -------------------------------------------------------------- the prefix
    def state_token(self, state: torch.Tensor) -> torch.Tensor:
        """(B, 1, D) the tenant-made prefix token of the (normalized) state, zero-padded to max_state_dim."""
        padded = F.pad(state, (0, self.config.max_state_dim - state.shape[-1]))
        return self.state_proj(padded)[:, None, :]

    @staticmethod
    def layer_prefixes(backbone: Any, members: Sequence[SmolVLARows], *, grad: bool = False) -> list[LayerPrefix]:
        """Every member's `LayerPrefix` from ONE prefix forward over all their rows (members share a
        `prefix_group_key`): cameras through the vision tower in one call, instructions in one
        tokenizer call, each member's state token by its own ``state_proj`` (with ``grad``, the graph
        reaches it), then one pass through the frozen layers. Each row's layout is LeRobot's
        [images, language, state] (right-padded to the longest row; padding is masked and skipped
        by the positions, so a row's cache does not depend on its batch mates)."""
        cfg = members[0].module.config
        if len({m.module.config.prefix_group_key() for m in members}) != 1:
            raise ValueError("layer_prefixes: members differ in their prefix layout (prefix_group_key)")
        device = backbone.device
        images = [cams for m in members for cams in m.images]
        texts = [text if text.endswith("\n") else f"{text}\n" for m in members for text in m.instructions]
        image_tokens = _embed_cameras(backbone, images, cfg)
        token_ids, token_mask = backbone.tokenize_prompts(texts, cfg.tokenizer_max_length)
        language = backbone.embed_text(token_ids) * math.sqrt(cfg.feature_dim)
        context = torch.enable_grad() if grad else torch.inference_mode()
        with context:
            states = torch.cat([m.module.state_token(m.state.to(device)) for m in members])
            rows = []
            for b in range(len(images)):
                parts = [*image_tokens[b], language[b, token_mask[b]], states[b]]
                rows.append((torch.cat(parts), sum(p.shape[0] for p in parts) - 1))
            longest = max(r[0].shape[0] for r in rows)
            embeds = torch.stack([F.pad(r[0], (0, 0, 0, longest - r[0].shape[0])) for r in rows])
            lengths = torch.tensor([r[1] + 1 for r in rows], device=device)
            pad_mask = torch.arange(longest, device=device)[None, :] < lengths[:, None]
            # The state token opens its own block: images and language never attend to it.
            att_mask = torch.zeros_like(pad_mask)
            att_mask[torch.arange(len(rows), device=device), lengths - 1] = True
            prefix = backbone.layer_prefix(embeds, pad_mask, att_mask, cfg.num_vlm_layers, grad=grad)
        out, start = [], 0
        for m in members:
            out.append(prefix.select(slice(start, start + len(m.instructions))).trimmed())
            start += len(m.instructions)
        return out

    # -------------------------------------------------------------- the expert
    def embed_suffix(self, noisy_actions: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """(B, chunk, width) action tokens fused with the time embedding (LeRobot's `embed_suffix`)."""
        action = self.action_in_proj(noisy_actions)
        emb = sinusoidal_time_embedding(time, action.shape[-1], self.config.min_period, self.config.max_period)
        emb = emb.to(action.dtype)[:, None, :].expand_as(action)
        fused = self.action_time_mlp_in(torch.cat([action, emb], dim=2))
        return self.action_time_mlp_out(F.silu(fused))

    def velocity(self, prefix: LayerPrefix, x_t: torch.Tensor, time: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """v(x_t, t) over the prefix cache: the expert's layers beside the VLM's (module docstring);
        the state is in the prefix already (its token)."""
        hidden = self.embed_suffix(x_t, time)
        b, s = hidden.shape[:2]
        lp = prefix.length
        causal = torch.ones(s, s, dtype=torch.bool, device=hidden.device).tril()
        mask = torch.cat([prefix.pad_mask[:, None, :].expand(b, s, lp), causal.expand(b, s, s)], dim=2)
        positions = prefix.offsets + torch.arange(s, device=hidden.device)[None, :]
        local = torch.arange(s, device=hidden.device)[None, :].expand(b, s)  # cross layers count from 0
        head_dim, heads = self.geometry.head_dim, self.geometry.num_heads
        for index in range(self.config.num_vlm_layers):
            layer = self._expert_layer(index)
            if layer is None:
                continue
            attn = layer.self_attn
            normed = layer.input_layernorm(hidden)
            query = attn.q_proj(normed).view(b, s, -1, head_dim)
            cached_k, cached_v = prefix.keys[index], prefix.values[index]
            if self._self_attention_layer(index):
                query = apply_rope(query, positions)
                key = apply_rope(attn.k_proj(normed).view(b, s, -1, head_dim), positions)
                value = attn.v_proj(normed).view(b, s, -1, head_dim)
                out = eager_attention(
                    mask, query, torch.cat([cached_k, key], dim=1), torch.cat([cached_v, value], dim=1), heads
                )
            else:
                key = attn.k_proj(cached_k.reshape(b, lp, -1).to(attn.k_proj.weight.dtype)).view(b, lp, -1, head_dim)
                value = attn.v_proj(cached_v.reshape(b, lp, -1).to(attn.v_proj.weight.dtype)).view(b, lp, -1, head_dim)
                out = eager_attention(mask[:, :, :lp], apply_rope(query, local), key, value, heads)
            hidden = attn.o_proj(out) + hidden
            hidden = layer.mlp(layer.post_attention_layernorm(hidden)) + hidden
        out = self.lm_expert.norm(hidden)[:, -self.config.action_chunk :]
        return self.action_out_proj(out.to(torch.float32))


def _embed_cameras(backbone: Any, images: list[list[torch.Tensor]], cfg: SmolVLAConfig) -> list[list[torch.Tensor]]:
    """Per row, per camera: (tokens, D) image embeddings scaled by sqrt(D) (LeRobot's
    `prepare_images` + `embed_image`), optionally between its image special tokens. Every camera of
    the batch goes through the vision tower in one call per input shape."""
    flat = [(b, img) for b, cams in enumerate(images) for img in cams]
    out: list[list[torch.Tensor]] = [[] for _ in images]
    if not flat:
        return out
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, (_, img) in enumerate(flat):
        by_shape.setdefault(tuple(img.shape), []).append(i)
    embedded: dict[int, torch.Tensor] = {}
    for idx in by_shape.values():
        pixels = torch.stack([flat[i][1] for i in idx]).to(backbone.device, torch.float32)
        if cfg.resize_imgs_with_padding is not None:
            pixels = resize_with_pad(pixels, *cfg.resize_imgs_with_padding, pad_value=0)
        tokens = backbone.embed_images(pixels * 2.0 - 1.0)
        tokens = tokens * torch.tensor(tokens.shape[-1] ** 0.5, dtype=tokens.dtype, device=tokens.device)
        for row, i in enumerate(idx):
            embedded[i] = tokens[row]
    if cfg.add_image_special_tokens:
        tok = backbone.tokenizer
        start = backbone.embed_text(torch.tensor([tok.fake_image_token_id, tok.global_image_token_id]))
        end = backbone.embed_text(torch.tensor([tok.fake_image_token_id]))
    for i, (b, _) in enumerate(flat):
        if cfg.add_image_special_tokens:
            out[b].extend([start, embedded[i], end])
        else:
            out[b].append(embedded[i])
    return out
