"""RL for the flow-matching expert: a denoising chain with learned noise injection, whose
log-probability is a sum of Gaussian log-densities.

A deterministic Euler integration (`FlowMatchingActionModule.predict`) has no action density, so
PPO/GRPO ratios cannot be formed. Following ReinFlow (Zhang et al. 2025, "ReinFlow: Fine-tuning
Flow Matching Policy with Online Reinforcement Learning", arXiv:2505.22094) -- the same idea RLinf-VLA
ships as "flow-noise" for pi0 (its "flow-SDE" variant turns the ODE into an SDE instead) -- every
Euler step of a stochastic (RL) flow head injects Gaussian noise with a learned, observation- and
time-dependent std:

    x_0 ~ N(0, I),   x_{k+1} = x_k + dt * v(x_k, t_k) + sigma_k * eps_k,   eps_k ~ N(0, I),
    sigma_k = sigma(obs, t_k) in [NOISE_STD_MIN, NOISE_STD_MAX],

so the chain (x_0, ..., x_K) is a Markov chain of Gaussians, x_K is the executed action chunk, and

    log p(chain) = log N(x_0; 0, I) + sum_k log N(x_{k+1}; x_k + dt * v(x_k, t_k), sigma_k^2).

The rollout records the chain (field "chain", (K+1, chunk, action_dim)) beside the action; the PPO
update recomputes this log-density under the current parameters (`FlowMatchingActionModule
.chain_log_prob`) -- the velocity field and the noise network both get gradients. Unlike ReinFlow,
sigma here sees the observation (pooled backbone features + state) and t_k, not x_k: the density
stays exact and the noise net stays a cheap MLP that runs once per step for the whole chunk.

`FlowNoiseNet` is the per-tenant noise network; the functions below are its bounded std and the
chain's Gaussian algebra, shared by the per-tenant module and the grouped kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from joynexus.models.grouped_kernels import StackedParameters, layer_norm, linear

__all__ = [
    "NOISE_STD_MAX",
    "NOISE_STD_MIN",
    "FlowNoiseNet",
    "bounded_std",
    "chain_entropy",
    "gaussian_log_density",
    "group_noise_std",
]

# Per-step std bounds of the injected noise, in the module's (normalized, [-1, 1]) action units. A
# floor keeps every transition a proper density (PPO ratios stay finite); a ceiling keeps K summed
# steps from drowning the flow's own prediction. With the initial raw value 0 a step's std is the
# geometric midpoint, ~0.077: ~0.24 over 10 steps, a moderate exploration scale.
NOISE_STD_MIN = 0.02
NOISE_STD_MAX = 0.3
_LOG_MIN, _LOG_MAX = math.log(NOISE_STD_MIN), math.log(NOISE_STD_MAX)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def bounded_std(raw: torch.Tensor) -> torch.Tensor:
    """A raw noise-net output mapped into [NOISE_STD_MIN, NOISE_STD_MAX], log-linearly by a sigmoid
    (smooth, never exactly at a bound, so its gradient never vanishes outright)."""
    return torch.exp(_LOG_MIN + (_LOG_MAX - _LOG_MIN) * torch.sigmoid(raw))


def gaussian_log_density(x: torch.Tensor, mean: torch.Tensor | float, std: torch.Tensor | float) -> torch.Tensor:
    """Elementwise log N(x; mean, std^2)."""
    std_t = torch.as_tensor(std, dtype=x.dtype, device=x.device)
    return -0.5 * ((x - mean) / std_t).pow(2) - torch.log(std_t) - _HALF_LOG_2PI


def chain_entropy(std: torch.Tensor) -> torch.Tensor:
    """Elementwise entropy of the Gaussian transitions with stds `std` (the chain's entropy given x_0)."""
    return 0.5 + _HALF_LOG_2PI + torch.log(std)


class FlowNoiseNet(nn.Module):
    """sigma(obs, t): a small MLP over the pooled backbone features, the state and the Euler step's
    time embedding, giving one raw log-std offset per action dim (shared over the chunk's steps).
    Its output layer starts at zero, so at first every step's std is the tenant's learned global
    `log_std` through `bounded_std`; the net then learns where to explore more or less."""

    def __init__(self, feature_dim: int, state_dim: int, action_dim: int, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(feature_dim)
        self.pooled = nn.Linear(feature_dim, width)
        self.state = nn.Linear(state_dim, width) if state_dim > 0 else None
        self.time = nn.Linear(width, width)
        self.out = nn.Linear(width, action_dim)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, pooled: torch.Tensor, state: torch.Tensor, time_emb: torch.Tensor) -> torch.Tensor:
        """Raw offsets (B, action_dim) from pooled (B, D), state (B, S) and time_emb (B or 1, width)."""
        hidden = self.pooled(self.norm(pooled)) + self.time(time_emb)
        if self.state is not None:
            hidden = hidden + self.state(state)
        return self.out(F.gelu(hidden))


def group_noise_std(
    p: StackedParameters, pooled: torch.Tensor, state: torch.Tensor | None, time_emb: torch.Tensor
) -> torch.Tensor:
    """`FlowNoiseNet` + `bounded_std` over stacked parameters: pooled (G, B, D), state (G, B, S) or
    None (no state input), time_emb (G, 1, width) -> each row's step std (G, B, 1, A). Padded state
    columns meet zero weight columns, padded action dims zero output rows (masked by the caller)."""
    hidden = linear(layer_norm(pooled, p["noise_net.norm.weight"], p["noise_net.norm.bias"]),
                    p["noise_net.pooled.weight"], p["noise_net.pooled.bias"])  # fmt: skip
    hidden = hidden + linear(time_emb, p["noise_net.time.weight"], p["noise_net.time.bias"])
    if state is not None:
        hidden = hidden + linear(state, p["noise_net.state.weight"], p["noise_net.state.bias"])
    raw = linear(F.gelu(hidden), p["noise_net.out.weight"], p["noise_net.out.bias"])
    raw = raw + p["log_std"].unsqueeze(1)  # (G, 1, A): the tenant's global part
    return bounded_std(raw).unsqueeze(2)
