"""RL estimators and objectives (paper A.5, A.6): PPO-style GAE, a GRPO-style group-relative
estimator, and the PPO clipped surrogate with a value loss. Pure functions over tensors / arrays,
so the advantage stage and the actor share them and tests pin their numbers down."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ADVANTAGE_ESTIMATORS = ("gae", "grpo")


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    dones: np.ndarray,
    last_values: np.ndarray,
    *,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation over (T, E) arrays (time, environment).

    `dones[t]` marks that the episode ended at step t (terminated: no bootstrap past it);
    `last_values` (E,) bootstraps the step after the horizon. Returns (advantages, returns)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    dones = np.asarray(dones, dtype=bool)
    horizon = rewards.shape[0]
    advantages = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[1:], dtype=np.float64)
    next_values = np.asarray(last_values, dtype=np.float64)
    for t in reversed(range(horizon)):
        alive = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_values * alive - values[t]
        running = delta + gamma * lam * alive * running
        advantages[t] = running
        next_values = values[t]
    returns = advantages + values
    return advantages.astype(np.float32), returns.astype(np.float32)


def discounted_returns(rewards: np.ndarray, dones: np.ndarray, *, gamma: float = 0.99) -> np.ndarray:
    """Reward-to-go per step over (T, E), restarting at episode ends; no value bootstrap."""
    rewards = np.asarray(rewards, dtype=np.float64)
    dones = np.asarray(dones, dtype=bool)
    out = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[1:], dtype=np.float64)
    for t in reversed(range(rewards.shape[0])):
        running = rewards[t] + gamma * running * (1.0 - dones[t])
        out[t] = running
    return out.astype(np.float32)


def grpo_advantages(
    rewards: np.ndarray, dones: np.ndarray, *, gamma: float = 0.99, eps: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    """Group-relative advantages: each step's reward-to-go, normalized against the group of all
    environments at the same time step (the group shares the policy and task), no critic needed.
    Returns (advantages, returns)."""
    returns = discounted_returns(rewards, dones, gamma=gamma)
    mean = returns.mean(axis=1, keepdims=True)
    std = returns.std(axis=1, keepdims=True)
    return ((returns - mean) / (std + eps)).astype(np.float32), returns


@dataclass(frozen=True)
class PPOLoss:
    total: torch.Tensor
    policy: torch.Tensor
    value: torch.Tensor
    entropy: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor


def ppo_loss(
    new_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    returns: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    clip: float = 0.2,
    value_coef: float = 0.5,
    entropy_coef: float = 0.0,
    normalize_advantages: bool = True,
) -> PPOLoss:
    """The PPO clipped surrogate (Schulman et al. 2017), plus a value loss when a critic exists."""
    adv = advantages
    if normalize_advantages and adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = torch.exp(new_log_prob - old_log_prob)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv)
    policy_loss = -surrogate.mean()
    value_loss = torch.zeros((), dtype=new_log_prob.dtype)
    if values is not None and returns is not None:
        value_loss = 0.5 * (values - returns).pow(2).mean()
    ent = entropy.mean() if entropy is not None else torch.zeros((), dtype=new_log_prob.dtype)
    total = policy_loss + value_coef * value_loss - entropy_coef * ent
    with torch.no_grad():
        clip_fraction = ((ratio - 1.0).abs() > clip).float().mean()
        approx_kl = ((ratio - 1.0) - (new_log_prob - old_log_prob)).mean()
    return PPOLoss(total, policy_loss, value_loss, ent, clip_fraction, approx_kl)
