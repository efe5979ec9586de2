"""Off-policy policy-gradient objectives of `forward_backward` (issue 28.4), Tinker's two
built-in RL losses: pure functions of a tenant's stochastic action module, the backbone features of
its microbatch, per-sample advantages and the log-probabilities the samples were drawn with.

A sample's log-probability is the Gaussian policy's log-density of its whole action chunk: summed
over the real (unpadded) action steps and every action dimension (`chunk_log_prob`), the same
quantity `policy_gradient` weighs.

- "importance_sampling": -mean_i(ratio_i * advantages[i]), ratio_i = exp(log pi(a_i|o_i) -
  sampling_logprobs[i]) (the importance-weighted REINFORCE estimator for samples drawn by an
  older policy);
- "ppo_clip": -mean_i(min(ratio_i * A_i, clip(ratio_i, 1 - clip_eps, 1 + clip_eps) * A_i)) (the PPO
  clipped surrogate, Schulman et al. 2017; advantages used as given, not normalized).

Their parameters (`loss_config`) are checked by `check_loss_config`: the error names the field.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from joynexus.algorithms.loss_names import OFF_POLICY_LOSSES
from joynexus.models.action_modules import ActionModule
from joynexus.models.backbone import BackboneFeatures

__all__ = [
    "DEFAULT_CLIP_EPS",
    "LOSS_CONFIG_FIELDS",
    "OFF_POLICY_LOSSES",
    "check_loss_config",
    "chunk_log_prob",
    "importance_sampling_loss",
    "per_sample_logprobs",
    "ppo_clip_loss",
]

DEFAULT_CLIP_EPS = 0.2
# loss -> the `loss_config` fields it reads (anything else is refused by name).
LOSS_CONFIG_FIELDS: dict[str, tuple[str, ...]] = {"importance_sampling": (), "ppo_clip": ("clip_eps",)}


def check_loss_config(loss: str, config: dict[str, Any] | None) -> dict[str, float]:
    """`config` for `loss`, checked and completed with defaults: a field the loss does not read, or a
    value out of its range, raises ValueError naming `loss_config.<field>`."""
    config = dict(config or {})
    allowed = LOSS_CONFIG_FIELDS.get(loss, ())
    for name in config:
        if name not in allowed:
            raise ValueError(
                f"loss_config.{name}: not a parameter of loss {loss!r} (it takes {list(allowed) or 'none'})"
            )
    checked: dict[str, float] = {}
    if loss == "ppo_clip":
        eps = config.get("clip_eps", DEFAULT_CLIP_EPS)
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0.0 < float(eps) < 1.0:
            raise ValueError(f"loss_config.clip_eps: {eps!r} must be a number in (0, 1), e.g. {DEFAULT_CLIP_EPS}")
        checked["clip_eps"] = float(eps)
    return checked


def per_sample_logprobs(values: Any, samples: int, device: torch.device) -> torch.Tensor:
    """`sampling_logprobs` as float32 on `device`, checked: `samples` finite values, one per sample."""
    try:
        array = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError):
        array = None
    if array is None or array.shape != (samples,) or not np.isfinite(array).all():
        shape = None if array is None else tuple(array.shape)
        raise ValueError(
            f"sampling_logprobs: expected {samples} finite log-probabilities (one per sample), got shape {shape}"
        )
    return torch.as_tensor(array, device=device)


def chunk_log_prob(
    module: ActionModule,
    features: BackboneFeatures,
    state: torch.Tensor,
    action: torch.Tensor,
    action_is_pad: torch.Tensor,
) -> torch.Tensor:
    """(N,) log pi(action_i | obs_i): the Gaussian log-density over sample i's real action steps and
    every action dimension (padded steps left out)."""
    log_prob = module.action_distribution(features, state).log_prob(action)
    valid = (~action_is_pad).unsqueeze(-1)
    return torch.where(valid, log_prob, torch.zeros_like(log_prob)).sum(dim=(-1, -2))


def _ratio(log_prob: torch.Tensor, sampling_logprobs: torch.Tensor) -> torch.Tensor:
    # exp of a log-ratio over ~80 overflows float32: such a sample would make the loss infinite
    # (refused as non-finite); the clamp keeps the loss finite and the sample's weight enormous.
    return torch.exp(torch.clamp(log_prob - sampling_logprobs, max=math.log(torch.finfo(torch.float32).max) - 1))


def importance_sampling_loss(
    module: ActionModule,
    features: BackboneFeatures,
    state: torch.Tensor,
    action: torch.Tensor,
    action_is_pad: torch.Tensor,
    advantages: torch.Tensor,
    sampling_logprobs: torch.Tensor,
) -> torch.Tensor:
    """-mean_i(exp(log pi(a_i|o_i) - sampling_logprobs[i]) * advantages[i])."""
    ratio = _ratio(chunk_log_prob(module, features, state, action, action_is_pad), sampling_logprobs)
    return -(ratio * advantages).mean()


def ppo_clip_loss(
    module: ActionModule,
    features: BackboneFeatures,
    state: torch.Tensor,
    action: torch.Tensor,
    action_is_pad: torch.Tensor,
    advantages: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    clip_eps: float = DEFAULT_CLIP_EPS,
) -> torch.Tensor:
    """-mean_i(min(r_i * A_i, clip(r_i, 1 - clip_eps, 1 + clip_eps) * A_i)), r_i the importance ratio."""
    ratio = _ratio(chunk_log_prob(module, features, state, action, action_is_pad), sampling_logprobs)
    surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages)
    return -surrogate.mean()
