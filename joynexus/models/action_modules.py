"""Tenant-private action modules trained on top of the frozen resident backbone.

A LeRobot-style registry maps a config ``kind`` to a module class, so adding a new
head is one decorated class; nothing switches on kind names.

Kinds:

* ``oft_mlp`` -- OpenVLA-OFT style parallel decoding: pooled + attention-pooled
  backbone features and the projected robot state go through a residual MLP that
  emits the whole action chunk at once; L1 regression (the loss OFT uses).
* ``flow_matching`` -- GR00T / pi0 style flow-matching action expert: a small
  transformer over the noisy action-chunk tokens (+ a state token, + timestep
  conditioning) that cross-attends to the backbone tokens; trained with the
  rectified-flow velocity loss and sampled by Euler integration from noise.

Actions are expected already normalized by the data pipeline (roughly zero mean,
unit scale); the modules do not normalize.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import pydantic
import torch
import torch.nn.functional as F
from torch import nn

from joynexus.models.backbone import BackboneFeatures

__all__ = [
    "ACTION_MODULES",
    "SIZE_PRESETS",
    "ActionModule",
    "ActionModuleConfig",
    "FlowMatchingActionModule",
    "OFTMLPActionModule",
    "available_action_modules",
    "build_action_module",
    "register_action_module",
]


@dataclass(frozen=True)
class SizePreset:
    width: int  # hidden width of the head
    depth: int  # residual MLP blocks (oft_mlp) / transformer layers (flow_matching)
    heads: int  # attention heads (must divide width)


SIZE_PRESETS: dict[str, SizePreset] = {
    "tiny": SizePreset(width=64, depth=2, heads=4),
    "small": SizePreset(width=128, depth=3, heads=4),
    "base": SizePreset(width=256, depth=4, heads=8),
}

ACTION_MODULES: dict[str, type[ActionModule]] = {}

_M = TypeVar("_M", bound="type[ActionModule]")


def register_action_module(name: str) -> Callable[[_M], _M]:
    """Class decorator: make ``cls`` buildable from ``ActionModuleConfig(kind=name)``."""

    def decorator(cls: _M) -> _M:
        if not (isinstance(cls, type) and issubclass(cls, ActionModule)):
            raise TypeError(f"@register_action_module({name!r}) must decorate an ActionModule subclass, got {cls!r}")
        existing = ACTION_MODULES.get(name)
        # Re-registering the same class (module reload) is fine; two classes for one name is a bug.
        if existing is not None and (existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"action module kind {name!r} is already registered to {existing.__qualname__}")
        cls.kind = name
        ACTION_MODULES[name] = cls
        return cls

    return decorator


def available_action_modules() -> list[str]:
    """Registered kinds, sorted."""
    return sorted(ACTION_MODULES)


def _unknown_kind_error(kind: str) -> ValueError:
    return ValueError(f"kind={kind!r} is not a registered action module; allowed kinds: {available_action_modules()}")


class ActionModuleConfig(pydantic.BaseModel):
    """What a tenant picks for its head; frozen so it can key caches and be stored as-is."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    kind: str
    feature_dim: int = pydantic.Field(ge=1, description="backbone hidden size D")
    state_dim: int = pydantic.Field(ge=0, description="robot state size; 0 = no state input")
    action_dim: int = pydantic.Field(ge=1)
    action_chunk: int = pydantic.Field(ge=1, description="actions predicted per call")
    size: str = "small"
    value_head: bool = False
    # A learned, state-independent log-std turns the head into a Gaussian policy with a tractable
    # log-density, which PPO needs; only kinds with `supports_rl` accept it.
    stochastic: bool = False
    num_inference_steps: int = pydantic.Field(default=10, ge=1, description="flow_matching Euler steps")

    @pydantic.field_validator("kind")
    @classmethod
    def _kind_registered(cls, value: str) -> str:
        if value not in ACTION_MODULES:
            raise _unknown_kind_error(value)
        return value

    @pydantic.field_validator("size")
    @classmethod
    def _size_known(cls, value: str) -> str:
        if value not in SIZE_PRESETS:
            raise ValueError(f"size={value!r} is not a known preset; allowed sizes: {sorted(SIZE_PRESETS)}")
        return value

    @property
    def preset(self) -> SizePreset:
        return SIZE_PRESETS[self.size]


def build_action_module(config: ActionModuleConfig | Mapping[str, Any]) -> ActionModule:
    """Instantiate the registered class for ``config.kind``."""
    if not isinstance(config, ActionModuleConfig):
        config = ActionModuleConfig.model_validate(config)
    cls = ACTION_MODULES.get(config.kind)
    if cls is None:  # only reachable for configs built with model_construct()
        raise _unknown_kind_error(config.kind)
    return cls(config)


def _shape_error(name: str, expected: str, got: torch.Tensor) -> ValueError:
    return ValueError(f"{name}: expected shape {expected}, got {tuple(got.shape)}")


class _ResidualMLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ActionModule(nn.Module, abc.ABC):
    """Base class: input validation, padded-step masking and the optional value head."""

    kind: ClassVar[str] = ""
    supports_rl: ClassVar[bool] = False  # has a tractable action density (policy_mean + log_std)
    uses_noise: ClassVar[bool] = False  # predict draws noise (draw_noise): a batched decode must draw it per request
    config: ActionModuleConfig

    def __init__(self, config: ActionModuleConfig) -> None:
        super().__init__()
        if config.kind != type(self).kind:
            raise ValueError(f"kind={config.kind!r} does not match {type(self).__name__} (kind {type(self).kind!r})")
        if config.stochastic and not type(self).supports_rl:
            raise ValueError(
                f"stochastic=True: kind={config.kind!r} has no tractable action density; "
                f"kinds that support RL: {[k for k, c in ACTION_MODULES.items() if c.supports_rl]}"
            )
        self.config = config
        self.log_std: nn.Parameter | None = None
        if config.stochastic:
            self.log_std = nn.Parameter(torch.full((config.action_dim,), -0.5))
        width = config.preset.width
        # Value head for PPO: a separate MLP on (pooled features, state) so value
        # regression never pulls on the policy's own layers.
        self.value_net: nn.Module | None = None
        if config.value_head:
            self.value_net = nn.Sequential(
                nn.LayerNorm(config.feature_dim + config.state_dim),
                nn.Linear(config.feature_dim + config.state_dim, width),
                nn.GELU(),
                nn.Linear(width, width),
                nn.GELU(),
                nn.Linear(width, 1),
            )

    # -------------------------------------------------------------- API
    @abc.abstractmethod
    def loss(
        self,
        features: BackboneFeatures,
        state: torch.Tensor,
        actions: torch.Tensor,
        action_is_pad: torch.Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Scalar training loss; chunk steps with ``action_is_pad`` True are excluded."""

    @abc.abstractmethod
    def predict(
        self, features: BackboneFeatures, state: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """(B, action_chunk, action_dim) actions; no autograd graph is built."""

    def value(self, features: BackboneFeatures, state: torch.Tensor) -> torch.Tensor:
        """(B,) state-value estimate; only for configs with ``value_head=True``."""
        if self.value_net is None:
            raise RuntimeError(f"{type(self).__name__} was built with value_head=False; it has no value head")
        self._check_inputs(features, state)
        return self.value_net(torch.cat([features.pooled, state], dim=-1)).squeeze(-1)

    def policy_mean(self, features: BackboneFeatures, state: torch.Tensor) -> torch.Tensor:
        """Differentiable mean action chunk of the Gaussian policy (kinds with `supports_rl`)."""
        raise NotImplementedError(f"{type(self).__name__} has no tractable action density")

    def action_distribution(self, features: BackboneFeatures, state: torch.Tensor) -> torch.distributions.Normal:
        """The Gaussian policy over the (B, chunk, action_dim) action chunk; needs stochastic=True."""
        if self.log_std is None:
            raise RuntimeError(f"{type(self).__name__} was built with stochastic=False; it defines no policy density")
        self._check_inputs(features, state)
        mean = self.policy_mean(features, state)
        std = self.log_std.clamp(-5.0, 2.0).exp().expand_as(mean)
        return torch.distributions.Normal(mean, std)

    # -------------------------------------------------------------- helpers
    def _check_inputs(
        self,
        features: BackboneFeatures,
        state: torch.Tensor,
        actions: torch.Tensor | None = None,
        action_is_pad: torch.Tensor | None = None,
    ) -> None:
        cfg = self.config
        if not isinstance(features, BackboneFeatures):
            raise ValueError(f"features: expected BackboneFeatures, got {type(features).__name__}")
        b = features.batch_size
        if features.hidden_size != cfg.feature_dim:
            raise _shape_error("features.tokens", f"(B, L, {cfg.feature_dim}) [feature_dim]", features.tokens)
        if not bool(features.mask.any(dim=1).all()):
            # Cross-attention over a row with no real token would produce NaNs.
            raise ValueError("features.mask: every sample needs at least one real token")
        if state.ndim != 2 or state.shape != (b, cfg.state_dim):
            raise _shape_error("state", f"({b}, {cfg.state_dim}) [B, state_dim]", state)
        if actions is not None and actions.shape != (b, cfg.action_chunk, cfg.action_dim):
            raise _shape_error(
                "actions", f"({b}, {cfg.action_chunk}, {cfg.action_dim}) [B, chunk, action_dim]", actions
            )
        if action_is_pad is not None:
            if action_is_pad.shape != (b, cfg.action_chunk):
                raise _shape_error("action_is_pad", f"({b}, {cfg.action_chunk}) [B, chunk]", action_is_pad)
            if action_is_pad.dtype != torch.bool:
                raise ValueError(f"action_is_pad: expected dtype torch.bool, got {action_is_pad.dtype}")

    @staticmethod
    def _masked_mean(per_element: torch.Tensor, action_is_pad: torch.Tensor | None) -> torch.Tensor:
        """Mean over (B, chunk, action_dim) ignoring padded chunk steps."""
        if action_is_pad is None:
            return per_element.mean()
        valid = (~action_is_pad).unsqueeze(-1)
        # where(), not a multiply: NaN/inf in a padded step must not poison the mean.
        kept = torch.where(valid, per_element, torch.zeros((), dtype=per_element.dtype, device=per_element.device))
        denom = (valid.sum() * per_element.shape[-1]).clamp_min(1).to(per_element.dtype)
        return kept.sum() / denom


@register_action_module("oft_mlp")
class OFTMLPActionModule(ActionModule):
    """OpenVLA-OFT style head: one forward pass decodes the whole chunk in parallel."""

    supports_rl = True

    def __init__(self, config: ActionModuleConfig) -> None:
        super().__init__(config)
        p = config.preset
        self.feature_norm = nn.LayerNorm(config.feature_dim)
        self.pooled_proj = nn.Linear(config.feature_dim, p.width)
        # Attention pooling with a learned query: lets the head pick the relevant
        # tokens (e.g. one camera's patches) that a plain mean would wash out.
        self.token_proj = nn.Linear(config.feature_dim, p.width)
        self.pool_query = nn.Parameter(torch.randn(1, 1, p.width) * 0.02)
        self.attn_pool = nn.MultiheadAttention(p.width, p.heads, batch_first=True)
        self.state_proj = nn.Linear(config.state_dim, p.width) if config.state_dim > 0 else None
        n_inputs = 2 + (1 if self.state_proj is not None else 0)
        self.trunk = nn.Sequential(
            nn.Linear(n_inputs * p.width, p.width),
            *[_ResidualMLPBlock(p.width) for _ in range(p.depth)],
            nn.LayerNorm(p.width),
        )
        self.action_out = nn.Linear(p.width, config.action_chunk * config.action_dim)

    def forward(self, features: BackboneFeatures, state: torch.Tensor) -> torch.Tensor:
        """Differentiable chunk prediction (B, chunk, action_dim)."""
        cfg = self.config
        pooled = self.pooled_proj(self.feature_norm(features.pooled))
        tokens = self.token_proj(self.feature_norm(features.tokens))
        query = self.pool_query.expand(tokens.shape[0], -1, -1)
        attended, _ = self.attn_pool(query, tokens, tokens, key_padding_mask=~features.mask, need_weights=False)
        parts = [pooled, attended.squeeze(1)]
        if self.state_proj is not None:
            parts.append(self.state_proj(state))
        hidden = self.trunk(torch.cat(parts, dim=-1))
        return self.action_out(hidden).view(-1, cfg.action_chunk, cfg.action_dim)

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
        # L1 regression, as in OpenVLA-OFT: robust to outlier demos, sharper than MSE.
        return self._masked_mean((self(features, state) - actions).abs(), action_is_pad)

    def predict(
        self, features: BackboneFeatures, state: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        # Deterministic regression head (the policy mean): the generator is accepted for a uniform API.
        self._check_inputs(features, state)
        with torch.no_grad():
            return self(features, state)

    def policy_mean(self, features: BackboneFeatures, state: torch.Tensor) -> torch.Tensor:
        return self(features, state)


def _timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10_000.0) -> torch.Tensor:
    """Sinusoidal embedding of t in [0, 1] (scaled so the full range spans many periods)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * 1000.0).unsqueeze(-1) * freqs
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, dim % 2))


@register_action_module("flow_matching")
class FlowMatchingActionModule(ActionModule):
    """Flow-matching action expert (rectified flow) cross-attending to backbone tokens.

    Convention: x0 ~ N(0, I) noise at t = 0, x1 = true actions at t = 1,
    x_t = (1 - t) x0 + t x1, target velocity v = x1 - x0; sampling integrates
    dx/dt = v(x_t, t) from t = 0 to 1 with Euler steps.
    """

    uses_noise: ClassVar[bool] = True

    def __init__(self, config: ActionModuleConfig) -> None:
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
        time_emb = _timestep_embedding(t, w).unsqueeze(1).expand(-1, x_t.shape[1], -1)
        tokens = self.action_time_mlp(torch.cat([self.action_in(x_t), time_emb], dim=-1))
        if self.state_in is not None:
            tokens = torch.cat([self.state_in(state).unsqueeze(1), tokens], dim=1)
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
        in this order. The batched path (``models.module_batching``) draws through this same
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
        if generator is not None and generator.device != device:
            return torch.randn(shape, generator=generator, device=generator.device, dtype=dtype).to(device)
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

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
