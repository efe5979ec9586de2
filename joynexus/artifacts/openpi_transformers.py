"""openpi's ``transformers_replace`` on the transformers this stack runs (4.57), wherever JoyNexus runs
LeRobot's own π0 / π0.5 classes: writing a lab-style checkpoint (`lerobot_pi0`), the peer
benchmark's LeRobot policy servers, and the parity tests' oracle. JoyNexus's own π0 path never
needs it.

LeRobot 0.4.4's ``PI0Pytorch`` / ``PI05Pytorch`` need transformers patched by openpi
(``src/openpi/models_pytorch/transformers_replace``, written against transformers 4.53.2, which
LeRobot's old ``pi`` extra installed from a git branch): Gemma's RMSNorm takes an optional adaRMS
condition and returns ``(normed, gate)``, ``modeling_gemma._gated_residual`` exists, the decoder
layers and model pass ``adarms_cond`` on, ``GemmaModel`` does not scale its input embeddings,
attention over a past cache with ``use_cache=False`` concatenates instead of appending to it,
``PaliGemmaModel.get_image_features`` does not divide by sqrt(width), and
``transformers.models.siglip.check`` says the patch is in. That wheel cannot be installed beside
our transformers 4.57.6, so `openpi_transformers()` applies exactly those changes (read from
openpi's files, diffed against 4.53.2) to 4.57's classes for the duration of a ``with`` block and
restores them after; JoyNexus's own models are not called inside it.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.gemma import modeling_gemma as mg
from transformers.models.paligemma import modeling_paligemma as mp


def _norm_init(self: nn.Module, dim: int, eps: float = 1e-6, cond_dim: int | None = None) -> None:
    nn.Module.__init__(self)
    self.eps, self.dim, self.cond_dim = eps, dim, cond_dim
    if cond_dim is not None:
        self.dense = nn.Linear(cond_dim, dim * 3, bias=True)
        nn.init.zeros_(self.dense.weight)
    else:
        self.weight = nn.Parameter(torch.zeros(dim, dtype=torch.bfloat16))
        self.dense = None


def _norm_norm(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
    return x * torch.rsqrt(var + self.eps)


def _norm_forward(self: nn.Module, x: torch.Tensor, cond: torch.Tensor | None = None) -> Any:
    dtype = x.dtype
    normed = self._norm(x)
    if cond is None or self.dense is None:
        return (normed * (1.0 + self.weight.float())).to(dtype), None
    modulation = self.dense(cond)
    if len(x.shape) == 3:
        modulation = modulation.unsqueeze(1)
    scale, shift, gate = torch.chunk(modulation, 3, dim=-1)
    normed = normed * (1 + scale.to(torch.float32)) + shift.to(torch.float32)
    return normed.to(dtype), gate.to(dtype)


def _gated_residual(x: Any, y: Any, gate: Any) -> Any:
    if x is None and y is None:
        return None
    if x is None or y is None:
        return x if x is not None else y
    if gate is None:
        return x + y
    return x + y * gate


def _attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values: Any = None,
    cache_position: torch.Tensor | None = None,
    use_cache: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = mg.apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if past_key_values is not None:
        if use_cache:
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx, cache_kwargs)
        else:
            key_states = torch.cat([past_key_values[self.layer_idx][0], key_states], dim=2)
            value_states = torch.cat([past_key_values[self.layer_idx][1], value_states], dim=2)
    kwargs.pop("position_ids", None)
    attn_output, attn_weights = mg.eager_attention_forward(
        self, query_states, key_states, value_states, attention_mask, dropout=0.0, scaling=self.scaling
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def _cond_dim(config: Any) -> int | None:
    return getattr(config, "adarms_cond_dim", None) if getattr(config, "use_adarms", False) else None


def _layer_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: Any = None,
    use_cache: bool = False,
    cache_position: torch.Tensor | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    adarms_cond: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    residual = hidden_states
    hidden_states, gate = self.input_layernorm(hidden_states, adarms_cond)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        past_key_values=past_key_values,
        use_cache=use_cache,
        cache_position=cache_position,
        position_embeddings=position_embeddings,
    )
    hidden_states = _gated_residual(residual, hidden_states, gate)
    residual = hidden_states
    hidden_states, gate = self.post_attention_layernorm(hidden_states, adarms_cond)
    hidden_states = self.mlp(hidden_states)
    return _gated_residual(residual, hidden_states, gate)


def _model_forward(
    self: nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    cache_position: torch.Tensor | None = None,
    adarms_cond: torch.Tensor | None = None,
    **kwargs: Any,
) -> BaseModelOutputWithPast:
    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)
    if use_cache and past_key_values is None:
        past_key_values = mg.DynamicCache(config=self.config)
    if cache_position is None:
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(seen, seen + inputs_embeds.shape[1], device=inputs_embeds.device)
    if position_ids is None:
        position_ids = cache_position.unsqueeze(0)
    causal_mask = create_causal_mask(
        config=self.config,
        input_embeds=inputs_embeds,
        attention_mask=attention_mask,
        cache_position=cache_position,
        past_key_values=past_key_values,
        position_ids=position_ids,
    )
    hidden_states = inputs_embeds
    if len(self.layers) > 0 and self.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16:
        hidden_states = hidden_states.to(torch.bfloat16)
    position_embeddings = self.rotary_emb(hidden_states, position_ids)
    # openpi: no `hidden_states * sqrt(hidden_size)` here (the caller scales the language embeddings)
    for decoder_layer in self.layers[: self.config.num_hidden_layers]:
        hidden_states = decoder_layer(
            hidden_states,
            attention_mask=causal_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            cache_position=cache_position,
            position_embeddings=position_embeddings,
            adarms_cond=adarms_cond,
        )
    hidden_states, _ = self.norm(hidden_states, adarms_cond)
    return BaseModelOutputWithPast(
        last_hidden_state=hidden_states, past_key_values=past_key_values if use_cache else None
    )


def _get_image_features(self: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    image_outputs = self.vision_tower(pixel_values)
    return self.multi_modal_projector(image_outputs.last_hidden_state)


@contextlib.contextmanager
def openpi_transformers() -> Iterator[None]:
    """Within the block, transformers' Gemma / PaliGemma / SigLIP behave as openpi's patch makes them."""
    layer_init, model_init = mg.GemmaDecoderLayer.__init__, mg.GemmaModel.__init__
    pretrained_init = mg.GemmaPreTrainedModel._init_weights

    def patched_layer_init(self: nn.Module, config: Any, layer_idx: int) -> None:
        layer_init(self, config, layer_idx)
        cond_dim = _cond_dim(config)
        self.input_layernorm = mg.GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=cond_dim)
        self.post_attention_layernorm = mg.GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=cond_dim)

    def patched_model_init(self: nn.Module, config: Any) -> None:
        model_init(self, config)
        self.norm = mg.GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=_cond_dim(config))

    def patched_init_weights(self: nn.Module, module: nn.Module) -> None:
        if "RMSNorm" in module.__class__.__name__ and not hasattr(module, "weight"):
            return
        pretrained_init(self, module)

    saved = [
        (mg.GemmaRMSNorm, "__init__"),
        (mg.GemmaRMSNorm, "_norm"),
        (mg.GemmaRMSNorm, "forward"),
        (mg.GemmaAttention, "forward"),
        (mg.GemmaDecoderLayer, "__init__"),
        (mg.GemmaDecoderLayer, "forward"),
        (mg.GemmaModel, "__init__"),
        (mg.GemmaModel, "forward"),
        (mg.GemmaPreTrainedModel, "_init_weights"),
        (mp.PaliGemmaModel, "get_image_features"),
    ]
    originals = [(owner, name, owner.__dict__[name]) for owner, name in saved]
    check = types.ModuleType("transformers.models.siglip.check")
    check.check_whether_transformers_replace_is_installed_correctly = lambda: True
    previous_check = sys.modules.get(check.__name__)
    replacements = [
        _norm_init,
        _norm_norm,
        _norm_forward,
        _attention_forward,
        patched_layer_init,
        _layer_forward,
        patched_model_init,
        _model_forward,
        patched_init_weights,
        _get_image_features,
    ]
    try:
        for (owner, name), new in zip(saved, replacements, strict=True):
            setattr(owner, name, new)
        mg._gated_residual = _gated_residual
        sys.modules[check.__name__] = check
        import transformers.models.siglip as siglip

        siglip.check = check
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        if hasattr(mg, "_gated_residual"):
            del mg._gated_residual
        if previous_check is None:
            sys.modules.pop(check.__name__, None)
        import transformers.models.siglip as siglip

        if hasattr(siglip, "check"):
            del siglip.check
