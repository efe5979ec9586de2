"""RL estimators and objectives (paper A.5, A.6): PPO-style GAE (time-limit truncation bootstrapped,
not treated as termination), GRPO's group-relative estimator over groups of attempts from one
initial state, and the PPO clipped surrogate with a value loss. Pure functions over tensors / arrays,
so the advantage stage and the actor share them and tests pin their numbers down. The estimators
need only numpy: the Master's advantage stage imports this module without torch (the PPO loss
imports it when it runs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
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
    truncated: np.ndarray | None = None,
    truncation_values: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation over (T, E) arrays (time, environment).

    `dones[t]` marks that the episode ended at step t (the env was reset after it): nothing is
    carried across it. `truncated[t]` (a subset of `dones`) marks the ends that were a time limit,
    not a termination: the episode did not really end there, so its last step bootstraps from
    `truncation_values[t]`, V of the observation it was cut at. A terminated step bootstraps
    nothing. `last_values` (E,) bootstraps the step after the horizon (the rollout's own cut).
    Returns (advantages, returns)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    dones = np.asarray(dones, dtype=bool)
    cut = np.zeros_like(dones) if truncated is None else np.asarray(truncated, dtype=bool) & dones
    cut_values = np.zeros_like(rewards) if truncation_values is None else np.asarray(truncation_values, np.float64)
    horizon = rewards.shape[0]
    advantages = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[1:], dtype=np.float64)
    next_values = np.asarray(last_values, dtype=np.float64)
    for t in reversed(range(horizon)):
        alive = 1.0 - dones[t]
        # After a cut the next state's value is V(s_cut); after a termination it is 0.
        bootstrap = np.where(dones[t], np.where(cut[t], cut_values[t], 0.0), next_values)
        delta = rewards[t] + gamma * bootstrap - values[t]
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


def attempt_returns(rewards: np.ndarray, dones: np.ndarray, *, gamma: float = 0.99) -> np.ndarray:
    """Per step, the discounted return of the attempt (episode segment) it belongs to, counted from
    the attempt's first step: an attempt runs from a reset (or the rollout's start) to its episode's
    end or the rollout's horizon. Over (T, E)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    dones = np.asarray(dones, dtype=bool)
    out = np.zeros_like(rewards)
    horizon = rewards.shape[0]
    for env in range(rewards.shape[1]):
        start = 0
        for t in range(horizon):
            if dones[t, env] or t == horizon - 1:
                segment = rewards[start : t + 1, env]
                out[start : t + 1, env] = float(np.sum(segment * gamma ** np.arange(len(segment))))
                start = t + 1
    return out.astype(np.float32)


def grpo_advantages(
    rewards: np.ndarray,
    dones: np.ndarray,
    groups: np.ndarray | None = None,
    *,
    gamma: float = 0.99,
    eps: float = 1e-6,
) -> tuple[np.ndarray, np.ndarray]:
    """Group-relative advantages (GRPO, Shao et al. 2024, outcome form) over (T, E) arrays.

    A group is G attempts from the SAME initial state (the producer resets a group's environments
    with one seed); `groups[t, e]` is the group id of step t of env e, -1 for steps outside every
    group (e.g. an env's later attempts, which had less of the horizon left and are not comparable).
    Each attempt's return R (`attempt_returns`) is its outcome; every step of an attempt gets
    (R - mean_group(R)) / (std_group(R) + eps), statistics over the group's attempts (not steps).
    A group whose returns are all equal carries no signal: 0. Steps outside groups: 0. No critic.
    `groups=None`: each env's first attempt, all in one group. Returns (advantages, returns)."""
    returns = attempt_returns(rewards, dones, gamma=gamma)
    dones = np.asarray(dones, dtype=bool)
    horizon, num_envs = returns.shape
    if groups is None:
        ended = np.cumsum(dones, axis=0) - dones  # episode ends before step t
        groups = np.where(ended == 0, 0, -1)
    groups = np.asarray(groups, dtype=np.int64).reshape(horizon, num_envs)
    # An attempt starts at t = 0 or after a done; its group is the group id of its first step.
    starts = np.zeros_like(dones)
    starts[0] = True
    starts[1:] = dones[:-1]
    attempt_id = np.cumsum(starts.T.reshape(-1)).reshape(num_envs, horizon).T - 1  # unique per (env, attempt)
    advantages = np.zeros_like(returns)
    for group in np.unique(groups[groups >= 0]):
        rows = groups == group
        members = dict(zip(attempt_id[rows].tolist(), returns[rows].tolist(), strict=True))
        outcomes = np.asarray(list(members.values()), dtype=np.float64)
        spread = outcomes.std()
        if len(outcomes) < 2 or spread <= 1e-12 * max(1.0, float(np.abs(outcomes).max())):
            continue  # all equal (or a lone attempt): no relative signal
        mean = outcomes.mean()
        for attempt, value in members.items():
            advantages[rows & (attempt_id == attempt)] = (value - mean) / (spread + eps)
    return advantages.astype(np.float32), returns


@dataclass(frozen=True)
class PPOLoss:
    total: torch.Tensor
    policy: torch.Tensor
    value: torch.Tensor
    entropy: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor


# The decoupled objective's cap on pi_proximal / pi_behavior: a sample the learner now finds far
# likelier than its (stale) behavior policy did cannot dominate the update (AReaL caps it likewise).
DEFAULT_BEHAVIOR_WEIGHT_CAP = 5.0


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
    behavior_log_prob: torch.Tensor | None = None,
    behavior_weight_cap: float = DEFAULT_BEHAVIOR_WEIGHT_CAP,
) -> PPOLoss:
    """The PPO clipped surrogate (Schulman et al. 2017), plus a value loss when a critic exists.

    With `behavior_log_prob` it is the decoupled objective (Hilton et al. 2022, "Batch
    size-invariance for policy optimization"; AReaL, Fu et al. 2025, for asynchronous RL):
    `old_log_prob` is then the proximal policy's (the learner's before this update), the ratio is
    clipped around it, and each sample is weighted by pi_proximal / pi_behavior (capped at
    `behavior_weight_cap`) for having been collected by an older version. On-policy data
    (proximal == behavior) gives the plain objective."""
    import torch

    adv = advantages
    if normalize_advantages and adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = torch.exp(new_log_prob - old_log_prob)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv)
    if behavior_log_prob is not None:
        weight = torch.exp(old_log_prob - behavior_log_prob).clamp(max=behavior_weight_cap).detach()
        surrogate = weight * surrogate
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
