"""What every flow-matching action expert over a shared prefix cache does the same way (LeRobot's
SmolVLA, OpenPI's π0 / π0.5): the flow-matching loss, Euler integration from t=1 to 0, the
Beta(1.5, 1) time draw and the flow-RL path (learned Gaussian noise in each Euler step, the density
over the recorded chain). A kind supplies ``velocity(prefix, x_t, time, state)`` (its expert over a
`LayerPrefix`), ``layer_prefixes`` (its grouped prefix forward) and its config; the rest is here.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from joynexus.models.action_modules.base import ActionModule, standard_normal
from joynexus.models.action_modules.flow_rl import bounded_std, chain_entropy, gaussian_log_density
from joynexus.models.backbone.layer_prefix import LayerPrefix

__all__ = [
    "PrefixFlowExpert",
    "check_padded_dims",
    "checkpoint_dim_problems",
    "sinusoidal_time_embedding",
    "standard_uniform",
]


def sinusoidal_time_embedding(time: torch.Tensor, dimension: int, min_period: float, max_period: float) -> torch.Tensor:
    """LeRobot's / openpi's `create_sinusoidal_pos_embedding` (float64 where the device has it)."""
    dtype = torch.float32 if time.device.type == "mps" else torch.float64
    fraction = torch.linspace(0.0, 1.0, dimension // 2, dtype=dtype, device=time.device)
    period = min_period * (max_period / min_period) ** fraction
    sin_input = (1.0 / period * 2 * math.pi)[None, :] * time[:, None]
    return torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=1)


def standard_uniform(batch: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """(batch,) U[0, 1) drawn on the generator's device and moved (as `standard_normal`)."""
    draw_device = generator.device if generator is not None else device
    return torch.rand(batch, generator=generator, device=draw_device).to(device)


def check_padded_dims(config: Any) -> None:
    """What every layer-wise expert's config holds (its validator calls this): state and action fit
    the padded dims, the heads group over the KV heads, and no critic (the prefix cache has none)."""
    if config.state_dim > config.max_state_dim:
        raise ValueError(f"state_dim={config.state_dim} exceeds max_state_dim={config.max_state_dim}")
    if config.action_dim > config.max_action_dim:
        raise ValueError(f"action_dim={config.action_dim} exceeds max_action_dim={config.max_action_dim}")
    if config.vlm_num_heads % config.vlm_num_kv_heads:
        raise ValueError(f"vlm_num_heads={config.vlm_num_heads} is not a multiple of vlm_num_kv_heads")
    if config.value_head:
        raise ValueError(
            f"kind={config.kind!r} has no critic over the prefix cache: an RL tenant takes rl.advantage: grpo"
        )


def checkpoint_dim_problems(spec: Any, checkpoint: Any, chunk: int) -> list[tuple[str, str]]:
    """(field, reason) for each of the spec's dims a LeRobot checkpoint does not have."""
    obs, where = spec.observation, spec.action_module.checkpoint
    problems = []
    for field, ours, theirs in (
        ("observation.state_dim", obs.state_dim, checkpoint.state_dim),
        ("observation.action_dim", obs.action_dim, checkpoint.action_dim),
        ("observation.action_chunk", obs.action_chunk, chunk),
        ("observation.cameras", len(obs.cameras), len(checkpoint.camera_keys)),
    ):
        if ours != theirs:
            problems.append((field, f"{ours}, but the LeRobot checkpoint {where!r} has {theirs}"))
    return problems


class PrefixFlowExpert(ActionModule):
    """A flow-matching expert whose features are a `LayerPrefix` (see the module docstring). The
    config has ``num_steps``, ``max_action_dim`` and ``action_chunk``; ``log_std`` exists when it is
    stochastic."""

    uses_noise: ClassVar[bool] = True
    supports_rl: ClassVar[bool] = True
    rl_record_field: ClassVar[str] = "chain"
    feature_form: ClassVar[str] = "layers"
    # LeRobot's SmolVLA averages the loss over the padded max_action_dim (it trains the padding toward
    # the noise too); π0 / π0.5 truncate to the real action dims first.
    loss_over_padded_dims: ClassVar[bool] = True
    # The prefix layers the expert reads (a config field of the kind's).
    prefix_layers_field: ClassVar[str] = "num_vlm_layers"

    def velocity(self, prefix: LayerPrefix, x_t: torch.Tensor, time: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """v(x_t, t): (B, chunk, max_action_dim) from the expert over the prefix cache."""
        raise NotImplementedError

    def draw_noise(
        self,
        batch: int,
        generator: torch.Generator | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """x at t=1 for ``batch`` samples: (batch, chunk, max_action_dim) (the same seed gives the same
        actions on any device)."""
        device = torch.device(device) if device is not None else self.action_out_proj.weight.device
        shape = (batch, self.config.action_chunk, self.config.max_action_dim)
        return standard_normal(shape, generator, device, dtype)

    def sample_time(self, batch: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
        """t ~ Beta(1.5, 1) * 0.999 + 0.001 (LeRobot's `sample_time`); Beta(a, 1) is U**(1/a), which a
        torch.Generator can drive (torch.distributions cannot)."""
        u = standard_uniform(batch, generator, device)
        return u.pow(1.0 / 1.5) * 0.999 + 0.001

    def _check_prefix(self, prefix: Any, state: torch.Tensor) -> None:
        if not isinstance(prefix, LayerPrefix):
            raise ValueError(
                f"kind={self.kind!r} reads the prefix's per-layer cache (LayerPrefix), got {type(prefix).__name__}"
            )
        layers = getattr(self.config, self.prefix_layers_field)
        if prefix.num_layers != layers:
            raise ValueError(f"prefix has {prefix.num_layers} layers, the expert needs {layers}")
        if state.ndim != 2 or state.shape != (prefix.batch_size, self.config.state_dim):
            raise ValueError(
                f"state: expected shape ({prefix.batch_size}, {self.config.state_dim}), got {tuple(state.shape)}"
            )

    def loss(
        self,
        features: Any,
        state: torch.Tensor,
        actions: torch.Tensor,
        action_is_pad: torch.Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        time: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The flow-matching loss of LeRobot's `forward`: x_t = t noise + (1 - t) actions, target
        noise - actions; padded chunk steps left out."""
        self._check_prefix(features, state)
        b, cfg = features.batch_size, self.config
        if actions.shape != (b, cfg.action_chunk, cfg.action_dim):
            raise ValueError(
                f"actions: expected ({b}, {cfg.action_chunk}, {cfg.action_dim}), got {tuple(actions.shape)}"
            )
        target_actions = F.pad(actions, (0, cfg.max_action_dim - cfg.action_dim))
        if noise is None:
            noise = self.draw_noise(b, generator, device=actions.device)
        if time is None:
            time = self.sample_time(b, generator, actions.device)
        t = time[:, None, None]
        x_t = t * noise + (1 - t) * target_actions
        losses = F.mse_loss(noise - target_actions, self.velocity(features, x_t, time, state), reduction="none")
        if not self.loss_over_padded_dims:
            losses = losses[:, :, : cfg.action_dim]
        return self._masked_mean(losses, action_is_pad)

    # -------------------------------------------------------------- RL (the flow-RL path)
    def sample_noise_shape(self) -> tuple[int, ...]:
        """x at t=1 and one draw per Euler step: (num_steps + 1, chunk, max_action_dim)."""
        return (self.config.num_steps + 1, self.config.action_chunk, self.config.max_action_dim)

    def _step_std(self) -> torch.Tensor:
        if self.log_std is None:
            raise RuntimeError(f"{type(self).__name__} was built with stochastic=False; it injects no noise")
        return bounded_std(self.log_std)

    def sample_policy(
        self, features: Any, state: torch.Tensor, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Euler steps (t from 1 to 0) with learned Gaussian noise injected in each (ReinFlow, as
        `flow_rl`): (actions (B, chunk, action_dim), log p(chain) (B,), chain (B, K+1, chunk, max_A))."""
        self._check_prefix(features, state)
        b, steps = features.batch_size, self.config.num_steps
        if noise.shape != (b, *self.sample_noise_shape()):
            raise ValueError(f"noise: expected {(b, *self.sample_noise_shape())}, got {tuple(noise.shape)}")
        dt, std = -1.0 / steps, self._step_std()
        x = noise[:, 0]
        chain, density = [x], gaussian_log_density(x, 0.0, 1.0).sum(dim=(-1, -2))
        for k in range(steps):
            time = torch.full((b,), 1.0 + k * dt, dtype=torch.float32, device=x.device)
            mean = x + dt * self.velocity(features, x, time, state)
            x = mean + std * noise[:, k + 1]
            chain.append(x)
            density = density + gaussian_log_density(x, mean, std).sum(dim=(-1, -2))
        return x[:, :, : self.config.action_dim], density, torch.stack(chain, dim=1)

    def record_log_prob(
        self, features: Any, state: torch.Tensor, record: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(chain) of recorded chains under the current parameters (differentiable through the
        expert, the step std and any tenant-made prefix token), and the transitions' entropy."""
        self._check_prefix(features, state)
        b, steps = features.batch_size, self.config.num_steps
        if record.shape != (b, *self.sample_noise_shape()):
            raise ValueError(f"chain: expected {(b, *self.sample_noise_shape())}, got {tuple(record.shape)}")
        dt, std = -1.0 / steps, self._step_std()
        density = gaussian_log_density(record[:, 0], 0.0, 1.0).sum(dim=(-1, -2))
        for k in range(steps):
            time = torch.full((b,), 1.0 + k * dt, dtype=torch.float32, device=record.device)
            mean = record[:, k] + dt * self.velocity(features, record[:, k], time, state)
            density = density + gaussian_log_density(record[:, k + 1], mean, std).sum(dim=(-1, -2))
        entropy = chain_entropy(std).sum() * steps * self.config.action_chunk
        return density, entropy.expand(b)

    @torch.no_grad()
    def predict(
        self,
        features: Any,
        state: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        noise: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, chunk, action_dim): Euler from noise at t=1 to t=0 in ``num_steps`` steps over the cache."""
        self._check_prefix(features, state)
        b = features.batch_size
        x_t = noise if noise is not None else self.draw_noise(b, generator, device=state.device)
        dt = -1.0 / self.config.num_steps
        for step in range(self.config.num_steps):
            time = torch.full((b,), 1.0 + step * dt, dtype=torch.float32, device=x_t.device)
            x_t = x_t + dt * self.velocity(features, x_t, time, state)
        return x_t[:, :, : self.config.action_dim]
