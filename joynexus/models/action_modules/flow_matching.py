"""The ``flow_matching`` action-module kind: a GR00T / pi0 style flow-matching action expert.

A small transformer over the noisy action-chunk tokens (+ a state token, + timestep conditioning)
cross-attends to the backbone tokens; trained with the rectified-flow velocity loss and sampled by
Euler integration from noise (`FlowMatchingConfig.num_inference_steps` steps). `FlowKernel` is the
same computation over stacked parameters, for grouped serving and training. A stochastic (RL) flow
head injects learned Gaussian noise in every Euler step (ReinFlow; `flow_rl`), so its denoising
chain has an exact log-probability for PPO / GRPO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pydantic
import torch
import torch.nn.functional as F
from torch import nn

from joynexus.models.action_modules.base import (
    ActionModule,
    ActionModuleConfig,
    register_action_module,
    standard_normal,
)
from joynexus.models.action_modules.flow_rl import (
    FlowNoiseNet,
    bounded_std,
    chain_entropy,
    gaussian_log_density,
    group_noise_std,
)
from joynexus.models.backbone import BackboneFeatures
from joynexus.models.grouped_kernels import (
    DERIVED,
    GroupDims,
    GroupInputs,
    Kernel,
    StackedParameters,
    attention,
    cross_key_values,
    fold_norm,
    head_mask,
    layer_norm,
    linear,
    masked_means,
    normalize,
    pad_rows,
    self_attention,
)

__all__ = ["FlowKernel", "FlowMatchingActionModule", "FlowMatchingConfig", "timestep_embedding"]


class FlowMatchingConfig(ActionModuleConfig):
    """The flow expert's config: the shared fields plus its Euler step count."""

    num_inference_steps: int = pydantic.Field(default=10, ge=1, description="flow_matching Euler steps")

    def architecture_fields(self) -> tuple[Any, ...]:
        # The grouped Euler loop runs one step count for the whole group.
        return (self.num_inference_steps,)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10_000.0) -> torch.Tensor:
    """Sinusoidal embedding of t in [0, 1] (scaled so the full range spans many periods)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * 1000.0).unsqueeze(-1) * freqs
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, dim % 2))


class FlowKernel(Kernel):
    """`FlowMatchingActionModule` over stacked parameters. What is fixed over the Euler loop is
    computed once: from the parameters alone (`derived`, cached with the inference stacks) each
    pre-norm LayerNorm's affine folded into the projection it feeds, `action_in` folded into the
    action/time MLP's first layer, and the time embedding's share of that layer for every Euler
    step; per group call, each block's cross-attention keys/values of the backbone tokens, the state
    token and the attention masks. Per step the loop runs only what depends on x_t."""

    def draw_loss_noise(
        self,
        modules: Sequence[ActionModule],
        actions: Sequence[torch.Tensor],
        action_is_pad: Sequence[torch.Tensor],
        generators: Sequence[torch.Generator | None],
        x: GroupInputs,
        dims: GroupDims,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each member's (x1, x0, t) through its module's `draw_loss_noise`, as its `loss` draws them."""
        drawn = [
            module.draw_loss_noise(act, pad, gen)  # type: ignore[attr-defined]
            for module, act, pad, gen in zip(modules, actions, action_is_pad, generators, strict=True)
        ]
        device = x.tokens.device
        chunk_shape = (dims.chunk, dims.action)
        return (
            pad_rows([d[0] for d in drawn], x.rows, chunk_shape).to(device),
            pad_rows([d[1] for d in drawn], x.rows, chunk_shape).to(device),
            pad_rows([d[2] for d in drawn], x.rows).to(device),
        )

    def derived(self, p: StackedParameters, cfg: FlowMatchingConfig) -> StackedParameters:
        w, e = cfg.preset.width, cfg.preset.width
        first = p["action_time_mlp.0.weight"]  # (G, 2w, w): rows [:w] see action_in's output, [w:] the time
        out: StackedParameters = {}
        for i in range(cfg.preset.depth):
            block = f"blocks.{i}."
            sa_w, sa_b = p[block + "self_attn.in_proj_weight"], p[block + "self_attn.in_proj_bias"]
            ca_w, ca_b = p[block + "multihead_attn.in_proj_weight"], p[block + "multihead_attn.in_proj_bias"]
            # Each pre-norm LayerNorm's affine folded into the projection it feeds (both are linear):
            # per step a block runs 3 plain normalizations instead of 3 normalize-scale-shifts.
            folds = {
                "qkv": fold_norm(p, block + "norm1.", sa_w, sa_b),
                "q": fold_norm(p, block + "norm2.", ca_w[:, :, :e], ca_b[:, :e]),
                "ff1": fold_norm(p, block + "norm3.", p[block + "linear1.weight"], p[block + "linear1.bias"]),
            }
            for name, (weight, bias) in folds.items():
                out[f"{DERIVED}{block}{name}.weight"], out[f"{DERIVED}{block}{name}.bias"] = weight, bias
        out[DERIVED + "out.weight"], out[DERIVED + "out.bias"] = fold_norm(
            p, "out_norm.", p["velocity_out.weight"], p["velocity_out.bias"]
        )
        # action_in folded into the first layer: (x W_in + b_in) W_a = x (W_in W_a) + b_in W_a.
        out[DERIVED + "action.weight"] = torch.bmm(p["action_in.weight"], first[:, :w])
        out[DERIVED + "action.bias"] = torch.bmm(p["action_in.bias"].unsqueeze(1), first[:, :w])  # (G, 1, w)
        # Every Euler step's time as the module makes it (torch.full(i * dt)), through the time
        # embedding's part of the first layer: (G, steps, w).
        steps = cfg.num_inference_steps
        times = torch.tensor([i / steps for i in range(steps)], device=first.device).expand(first.shape[0], -1)
        out[DERIVED + "step_bias"] = self._time_bias(p, out, times, w)
        return out

    def _constants(
        self, p: StackedParameters, cfg: FlowMatchingConfig, x: GroupInputs, dims: GroupDims
    ) -> dict[str, Any]:
        heads = cfg.preset.heads
        memory = linear(
            layer_norm(x.tokens, p["memory_norm.weight"], p["memory_norm.bias"]),
            p["memory_proj.weight"],
            p["memory_proj.bias"],
        )
        position = p["position"]  # (G, 1, n_tokens, w)
        state_token = None
        if cfg.state_dim > 0:
            state_token = linear(x.state, p["state_in.weight"], p["state_in.bias"]).unsqueeze(2) + position[:, :, :1]
            position = position[:, :, 1:]
        lead = 1 if cfg.state_dim > 0 else 0
        token_mask = None
        if len(set(dims.chunks)) > 1:  # a member's chunk tokens past its own chunk are hidden
            real = torch.arange(lead + dims.chunk, device=memory.device).view(1, -1) < (
                torch.tensor(dims.chunks, device=memory.device).view(-1, 1) + lead
            )
            token_mask = head_mask(real.unsqueeze(1).expand(-1, x.rows, -1), heads, memory.dtype)
        blocks = []
        for i in range(cfg.preset.depth):
            block = f"blocks.{i}."
            ca = block + "multihead_attn."
            blocks.append(
                {
                    "qkv": (p[f"{DERIVED}{block}qkv.weight"], p[f"{DERIVED}{block}qkv.bias"]),
                    "q": (p[f"{DERIVED}{block}q.weight"], p[f"{DERIVED}{block}q.bias"]),
                    "ff1": (p[f"{DERIVED}{block}ff1.weight"], p[f"{DERIVED}{block}ff1.bias"]),
                    "kv": cross_key_values(p, ca, memory, heads),
                    "sa_out": (p[block + "self_attn.out_proj.weight"], p[block + "self_attn.out_proj.bias"]),
                    "ca_out": (p[ca + "out_proj.weight"], p[ca + "out_proj.bias"]),
                    "ff2": (p[block + "linear2.weight"], p[block + "linear2.bias"]),
                }
            )
        return {
            "blocks": blocks,
            "out": (p[DERIVED + "out.weight"], p[DERIVED + "out.bias"]),
            # Backbone padding positions, per head row; None when the group has none (no add at all).
            "mask": None if bool(x.mask.all()) else head_mask(x.mask, heads, memory.dtype),
            "token_mask": token_mask,
            "action_w": p[DERIVED + "action.weight"],
            "state_token": state_token,
            "position": position,
            "lead": lead,
        }

    def _time_bias(self, p: StackedParameters, folded: StackedParameters, t: torch.Tensor, width: int) -> torch.Tensor:
        """The time embedding's contribution to the first MLP layer, + its bias and action_in's:
        t (G, N) -> (G, N, w)."""
        emb = timestep_embedding(t, width)
        bias = p["action_time_mlp.0.bias"].unsqueeze(1) + folded[DERIVED + "action.bias"]
        return torch.baddbmm(bias, emb, p["action_time_mlp.0.weight"][:, width:])

    def velocity(
        self,
        p: StackedParameters,
        cfg: FlowMatchingConfig,
        c: dict[str, Any],
        x_t: torch.Tensor,
        time_bias: torch.Tensor,
    ) -> torch.Tensor:
        """`FlowMatchingActionModule._velocity`: x_t (G, B, chunk, A); time_bias (G, B or 1, 1, w)."""
        heads = cfg.preset.heads
        g, b, chunk, a = x_t.shape
        pre = torch.bmm(x_t.reshape(g, b * chunk, a), c["action_w"]).view(g, b, chunk, -1) + time_bias
        tokens = linear(F.silu(pre), p["action_time_mlp.2.weight"], p["action_time_mlp.2.bias"]) + c["position"]
        if c["state_token"] is not None:
            tokens = torch.cat([c["state_token"], tokens], dim=2)
        hidden = tokens
        last = len(c["blocks"]) - 1
        for i, blk in enumerate(c["blocks"]):
            # nn.TransformerDecoderLayer, norm_first=True, dropout 0, gelu (norm affines folded).
            qkv = linear(normalize(hidden), *blk["qkv"])
            hidden = hidden + self_attention(qkv, c["token_mask"], *blk["sa_out"], heads)
            if i == last and c["lead"]:
                # Past the last self-attention the state token feeds nothing that is kept (every
                # later op is per token, and its output is dropped): compute only the chunk tokens.
                hidden = hidden[:, :, c["lead"] :]
            q = linear(normalize(hidden), *blk["q"])
            hidden = hidden + attention(q, *blk["kv"], c["mask"], *blk["ca_out"], heads)
            inner = F.gelu(linear(normalize(hidden), *blk["ff1"]))
            hidden = hidden + linear(inner, *blk["ff2"])
        hidden = hidden[:, :, -cfg.action_chunk :]  # drop the state token
        return linear(normalize(hidden), *c["out"])

    def predict(
        self,
        p: StackedParameters,
        cfg: FlowMatchingConfig,
        x: GroupInputs,
        noise: torch.Tensor | None,
        dims: GroupDims,
    ) -> torch.Tensor:
        if noise is None:
            raise ValueError("noise: the flow-matching expert integrates from given noise x0 (G, B, chunk, A)")
        c = self._constants(p, cfg, x, dims)
        steps = cfg.num_inference_steps
        dt = 1.0 / steps
        time_bias = p[DERIVED + "step_bias"]  # (G, steps, w)
        out_w, out_b = c["out"]
        c["out"] = (out_w * dt, out_b * dt)  # the Euler step's dt folded into the velocity head
        out = noise
        for i in range(steps):  # ONE Euler loop for the whole group
            out = out + self.velocity(p, cfg, c, out, time_bias[:, i].view(x.groups, 1, 1, -1))
        return out

    def sample_chain(
        self, p: StackedParameters, cfg: FlowMatchingConfig, x: GroupInputs, noise: torch.Tensor, dims: GroupDims
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`FlowMatchingActionModule.sample_chain` of every member: noise (G, B, K+1, chunk, A) ->
        the chains (G, B, K+1, chunk, A) and their log-densities over each member's own steps and
        dims (G, B)."""
        c = self._constants(p, cfg, x, dims)
        steps = cfg.num_inference_steps
        dt = 1.0 / steps
        time_bias = p[DERIVED + "step_bias"]
        out_w, out_b = c["out"]
        c["out"] = (out_w * dt, out_b * dt)
        own = dims.action_mask(noise.device)  # (G, 1, chunk, A)
        state = x.state if cfg.state_dim > 0 else None
        xk = noise[:, :, 0]
        chain, density = [xk], gaussian_log_density(xk, 0.0, 1.0)
        for i in range(steps):
            mean = xk + self.velocity(p, cfg, c, xk, time_bias[:, i].view(x.groups, 1, 1, -1))
            time_emb = timestep_embedding(torch.full((1,), i * dt, device=xk.device), cfg.preset.width)
            std = group_noise_std(p, x.pooled, state, time_emb.expand(x.groups, 1, -1))
            xk = mean + std * noise[:, :, i + 1]
            chain.append(xk)
            density = density + gaussian_log_density(xk, mean, std)
        zero = torch.zeros((), dtype=density.dtype, device=density.device)
        return torch.stack(chain, dim=2), torch.where(own, density, zero).sum(dim=(-1, -2))

    def loss(
        self,
        p: StackedParameters,
        cfg: FlowMatchingConfig,
        x: GroupInputs,
        actions: torch.Tensor,
        action_is_pad: torch.Tensor,
        noise: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        dims: GroupDims,
    ) -> torch.Tensor:
        if noise is None:
            raise ValueError("noise: the flow-matching loss needs (x1, x0, t) from draw_loss_noise")
        x1, x0, t = noise
        tb = t.view(*t.shape, 1, 1)
        x_t = (1.0 - tb) * x0 + tb * x1
        c = self._constants(p, cfg, x, dims)
        pred = self.velocity(p, cfg, c, x_t, self._time_bias(p, p, t, cfg.preset.width).unsqueeze(2))
        own = dims.action_mask(pred.device)
        return masked_means((pred - (x1 - x0)).pow(2), action_is_pad, x.valid, own)


@register_action_module("flow_matching")
class FlowMatchingActionModule(ActionModule):
    """Flow-matching action expert (rectified flow) cross-attending to backbone tokens.

    Convention: x0 ~ N(0, I) noise at t = 0, x1 = true actions at t = 1,
    x_t = (1 - t) x0 + t x1, target velocity v = x1 - x0; sampling integrates
    dx/dt = v(x_t, t) from t = 0 to 1 with Euler steps.
    """

    uses_noise = True
    supports_rl = True  # stochastic=True: the noise-injected chain of `flow_rl` (ReinFlow)
    rl_record_field = "chain"
    config_class = FlowMatchingConfig
    kernel = FlowKernel()
    config: FlowMatchingConfig

    def __init__(self, config: FlowMatchingConfig) -> None:
        super().__init__(config)
        p = config.preset
        w = p.width
        self.memory_norm = nn.LayerNorm(config.feature_dim)
        self.memory_proj = nn.Linear(config.feature_dim, w)
        self.action_in = nn.Linear(config.action_dim, w)
        # pi0-style action/time fusion: MLP over [action embedding, time embedding].
        self.action_time_mlp = nn.Sequential(nn.Linear(2 * w, w), nn.SiLU(), nn.Linear(w, w))
        self.state_in = nn.Linear(config.state_dim, w) if config.state_dim > 0 else None
        n_tokens = config.action_chunk + (1 if self.state_in is not None else 0)
        self.position = nn.Parameter(torch.randn(1, n_tokens, w) * 0.02)
        # Bidirectional self-attention over the chunk + cross-attention to the backbone.
        self.blocks = nn.ModuleList(
            nn.TransformerDecoderLayer(
                d_model=w,
                nhead=p.heads,
                dim_feedforward=4 * w,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(p.depth)
        )
        self.out_norm = nn.LayerNorm(w)
        self.velocity_out = nn.Linear(w, config.action_dim)
        # RL: the learned per-step noise (ReinFlow); log_std is its global part, starting mid-range.
        self.noise_net = (
            FlowNoiseNet(config.feature_dim, config.state_dim, config.action_dim, w) if config.stochastic else None
        )
        if self.log_std is not None:
            nn.init.zeros_(self.log_std)

    def _memory(self, features: BackboneFeatures) -> tuple[torch.Tensor, torch.Tensor]:
        return self.memory_proj(self.memory_norm(features.tokens)), ~features.mask

    def _velocity(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        memory: torch.Tensor,
        memory_pad: torch.Tensor,
        state: torch.Tensor,
    ) -> torch.Tensor:
        w = self.config.preset.width
        time_emb = timestep_embedding(t, w).unsqueeze(1).expand(-1, x_t.shape[1], -1)
        tokens = self.action_time_mlp(torch.cat([self.action_in(x_t), time_emb], dim=-1))
        if self.state_in is not None:
            tokens = torch.cat([self.state_in(self.normalized_state(state)).unsqueeze(1), tokens], dim=1)
        hidden = tokens + self.position
        for block in self.blocks:
            hidden = block(hidden, memory, memory_key_padding_mask=memory_pad)
        hidden = hidden[:, -self.config.action_chunk :]  # drop the state token
        return self.velocity_out(self.out_norm(hidden))

    def forward(
        self, x_t: torch.Tensor, t: torch.Tensor, features: BackboneFeatures, state: torch.Tensor
    ) -> torch.Tensor:
        """Predicted velocity (B, chunk, action_dim) at noisy actions ``x_t`` and times ``t`` (B,)."""
        memory, memory_pad = self._memory(features)
        return self._velocity(x_t, t, memory, memory_pad, state)

    def sample_time(self, batch: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
        """t in [0, 0.999]: 1 - Beta(1.5, 1), i.e. pi0's emphasis on the noisier end.

        Beta(a, 1) is U**(1/a), which lets a torch.Generator drive it (torch.distributions can't).
        """
        u = torch.rand(batch, generator=generator, device=device)
        return (1.0 - u.pow(1.0 / 1.5)) * 0.999

    def draw_loss_noise(
        self, actions: torch.Tensor, action_is_pad: torch.Tensor | None, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The randomness of one loss, apart from the computation: (x1, x0, t).

        x1 is ``actions`` with padded steps zeroed; x0 and then t are drawn from ``generator``
        in this order. The batched path (`FlowKernel.draw_loss_noise`) draws through this same
        method, so a tenant's loss is the same served alone or in a group.
        """
        x1 = actions
        if action_is_pad is not None:
            # Padded steps would otherwise leak into valid steps through self-attention
            # over the noisy chunk; zero them so their content cannot matter.
            x1 = torch.where(action_is_pad.unsqueeze(-1), torch.zeros((), dtype=x1.dtype, device=x1.device), x1)
        x0 = torch.randn(x1.shape, generator=generator, device=x1.device, dtype=x1.dtype)
        t = self.sample_time(x1.shape[0], generator, x1.device)
        return x1, x0, t

    def draw_noise(
        self,
        batch: int,
        generator: torch.Generator | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The starting noise x0 of ``predict`` for ``batch`` samples: (batch, chunk, action_dim).

        A generator on another device than ``device`` (a CPU generator for a CUDA module) draws on
        its own device and the draw is moved: the same seed gives the same actions on any device.
        """
        cfg = self.config
        shape = (batch, cfg.action_chunk, cfg.action_dim)
        device = torch.device(device) if device is not None else next(self.parameters()).device
        return standard_normal(shape, generator, device, dtype)

    def loss(
        self,
        features: BackboneFeatures,
        state: torch.Tensor,
        actions: torch.Tensor,
        action_is_pad: torch.Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        self._check_inputs(features, state, actions, action_is_pad)
        x1, x0, t = self.draw_loss_noise(actions, action_is_pad, generator)
        tb = t.view(-1, 1, 1)
        x_t = (1.0 - tb) * x0 + tb * x1
        pred = self(x_t, t, features, state)
        # MSE to the rectified-flow target velocity.
        return self._masked_mean((pred - (x1 - x0)).pow(2), action_is_pad)

    def predict(
        self,
        features: BackboneFeatures,
        state: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        num_steps: int | None = None,
    ) -> torch.Tensor:
        """Euler-integrate from Gaussian noise; same generator state -> same actions."""
        self._check_inputs(features, state)
        steps = num_steps if num_steps is not None else self.config.num_inference_steps
        if steps < 1:
            raise ValueError(f"num_steps: expected >= 1, got {steps}")
        b = features.batch_size
        with torch.no_grad():
            memory, memory_pad = self._memory(features)  # once, not per step
            x = self.draw_noise(b, generator, device=state.device, dtype=memory.dtype)
            dt = 1.0 / steps
            for i in range(steps):
                t = torch.full((b,), i * dt, device=x.device)
                x = x + dt * self._velocity(x, t, memory, memory_pad, state)
        return x

    # ------------------------------------------------------------------ RL (flow_rl)
    def action_distribution(self, features: BackboneFeatures, state: torch.Tensor) -> torch.distributions.Normal:
        raise RuntimeError(
            "flow_matching has no closed-form action density: its RL density is over the denoising chain "
            "(sample_policy / record_log_prob with the recorded 'chain')"
        )

    def sample_noise_shape(self) -> tuple[int, ...]:
        """x_0 and one draw per Euler step: (K+1, chunk, action_dim)."""
        cfg = self.config
        return (cfg.num_inference_steps + 1, cfg.action_chunk, cfg.action_dim)

    def noise_std(self, features: BackboneFeatures, state: torch.Tensor, t: float) -> torch.Tensor:
        """Step std sigma(obs, t) per row: (B, 1, action_dim); stochastic heads only."""
        if self.noise_net is None or self.log_std is None:
            raise RuntimeError("FlowMatchingActionModule was built with stochastic=False; it injects no noise")
        time_emb = timestep_embedding(torch.full((1,), t, device=state.device), self.config.preset.width)
        normalized = self.normalized_state(state)
        return bounded_std(self.noise_net(features.pooled, normalized, time_emb) + self.log_std).unsqueeze(1)

    def sample_policy(
        self, features: BackboneFeatures, state: torch.Tensor, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The noise-injected Euler chain from standard normals ``noise`` (B, K+1, chunk, A):
        (actions x_K, log p(chain) (B,), chain (B, K+1, chunk, A))."""
        self._check_inputs(features, state)
        steps = self.config.num_inference_steps
        if noise.shape != (features.batch_size, *self.sample_noise_shape()):
            raise _noise_shape_error(noise, (features.batch_size, *self.sample_noise_shape()))
        memory, memory_pad = self._memory(features)
        dt = 1.0 / steps
        x = noise[:, 0]
        chain, density = [x], gaussian_log_density(x, 0.0, 1.0).sum(dim=(-1, -2))
        for i in range(steps):
            t = torch.full((x.shape[0],), i * dt, device=x.device)
            mean = x + dt * self._velocity(x, t, memory, memory_pad, state)
            std = self.noise_std(features, state, i * dt)
            x = mean + std * noise[:, i + 1]
            chain.append(x)
            density = density + gaussian_log_density(x, mean, std).sum(dim=(-1, -2))
        return x, density, torch.stack(chain, dim=1)

    def record_log_prob(
        self, features: BackboneFeatures, state: torch.Tensor, record: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(chain) of recorded chains (B, K+1, chunk, A) under the current parameters, all K
        transitions in one batched velocity pass; the entropy is the transitions' (given x_0)."""
        self._check_inputs(features, state)
        b, steps = features.batch_size, self.config.num_inference_steps
        if record.shape != (b, *self.sample_noise_shape()):
            raise _noise_shape_error(record, (b, *self.sample_noise_shape()), name="chain")
        dt = 1.0 / steps
        memory, memory_pad = self._memory(features)
        x_k = record[:, :-1].reshape(b * steps, *record.shape[2:])  # rows: (sample, step)
        t = (torch.arange(steps, device=record.device, dtype=record.dtype) * dt).repeat(b)
        velocity = self._velocity(
            x_k, t, memory.repeat_interleave(steps, 0), memory_pad.repeat_interleave(steps, 0),
            state.repeat_interleave(steps, 0),
        ).view(b, steps, *record.shape[2:])  # fmt: skip
        mean = record[:, :-1] + dt * velocity
        std = torch.stack([self.noise_std(features, state, i * dt) for i in range(steps)], dim=1)  # (B, K, 1, A)
        density = gaussian_log_density(record[:, 1:], mean, std).sum(dim=(1, 2, 3))
        density = density + gaussian_log_density(record[:, 0], 0.0, 1.0).sum(dim=(-1, -2))
        entropy = chain_entropy(std).expand_as(mean).sum(dim=(1, 2, 3))
        return density, entropy


def _noise_shape_error(got: torch.Tensor, expected: tuple[int, ...], name: str = "noise") -> ValueError:
    return ValueError(f"{name}: expected shape {expected} [B, num_inference_steps + 1, chunk, action_dim], "
                      f"got {tuple(got.shape)}")  # fmt: skip
