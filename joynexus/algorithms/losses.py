"""The lower layer's extra objectives for `forward_backward` (beside a module's own loss): pure
functions of a tenant's action module, the backbone features of its microbatch and per-sample
advantages, so the Training Model Service only routes to them.

- "advantage_weighted": mean_i(advantages[i] * loss_i) over the module's per-sample losses
  (advantage-weighted regression; any module);
- "policy_gradient": -mean_i(advantages[i] * log pi(action_i | obs_i)) under the module's Gaussian
  policy, padded action steps left out (REINFORCE; stochastic modules, i.e. RL tenants);
- "importance_sampling", "ppo_clip": off-policy objectives over `sampling_logprobs`
  (`algorithms.policy_losses`; stochastic modules).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from joynexus.models.action_modules import ActionModule
from joynexus.models.backbone import BackboneFeatures

__all__ = [
    "FORWARD_BACKWARD_LOSSES",
    "STOCHASTIC_LOSSES",
    "advantage_weighted_loss",
    "check_loss_name",
    "check_objective",
    "per_sample_advantages",
    "policy_gradient_loss",
]

# "default" is the module's own loss (what train_batch optimizes); the others weigh by advantages.
FORWARD_BACKWARD_LOSSES = ("default", "advantage_weighted", "policy_gradient", "importance_sampling", "ppo_clip")
# The objectives that need the module's action density (a stochastic policy).
STOCHASTIC_LOSSES = ("policy_gradient", "importance_sampling", "ppo_clip")


def check_loss_name(loss: str) -> None:
    """Refuse an objective that is not one of `FORWARD_BACKWARD_LOSSES`."""
    if loss not in FORWARD_BACKWARD_LOSSES:
        raise ValueError(f"loss: {loss!r} is not one of {list(FORWARD_BACKWARD_LOSSES)}")


def check_objective(loss: str, module: ActionModule) -> None:
    """Refuse an objective `module` cannot compute (a policy gradient needs a stochastic policy)."""
    if loss in STOCHASTIC_LOSSES and getattr(module, "log_std", None) is None:
        raise ValueError(
            f"loss: {loss!r} needs a stochastic policy (an RL tenant's module); "
            "use 'advantage_weighted' for this module"
        )
    if loss == "policy_gradient" and type(module).rl_record_field != "action":
        raise ValueError(
            f"loss: 'policy_gradient' scores actions, but a {module.config.kind!r} head's density is over its "
            f"denoising {type(module).rl_record_field!r} (rescored by RL jobs); use 'advantage_weighted'"
        )


def per_sample_advantages(advantages: Any, samples: int, device: torch.device) -> torch.Tensor:
    """`advantages` as a float32 tensor on `device`, checked: `samples` finite values, one per sample."""
    weights = torch.as_tensor(np.asarray(advantages, dtype=np.float32), device=device)
    if weights.shape != (samples,) or not bool(torch.isfinite(weights).all()):
        raise ValueError(
            f"advantages: expected {samples} finite values (one per sample), got shape {tuple(weights.shape)}"
        )
    return weights


def advantage_weighted_loss(
    module: ActionModule,
    features: BackboneFeatures,
    state: torch.Tensor,
    action: torch.Tensor,
    action_is_pad: torch.Tensor,
    advantages: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """mean_i(advantages[i] * loss_i): the module's own loss of each sample alone (its features
    trimmed to its own tokens), weighted by that sample's advantage."""
    per_sample = torch.stack(
        [
            module.loss(
                features.select([i]).trimmed(),
                state[i : i + 1],
                action[i : i + 1],
                action_is_pad[i : i + 1],
                generator=generator,
            )
            for i in range(len(advantages))
        ]
    )
    return (advantages * per_sample).mean()


def policy_gradient_loss(
    module: ActionModule,
    features: BackboneFeatures,
    state: torch.Tensor,
    action: torch.Tensor,
    action_is_pad: torch.Tensor,
    advantages: torch.Tensor,
) -> torch.Tensor:
    """-mean_i(advantages[i] * log pi(action_i | obs_i)), the log-density summed over the sample's
    real (unpadded) action steps and dimensions."""
    log_prob = module.action_distribution(features, state).log_prob(action)
    valid = (~action_is_pad).unsqueeze(-1)
    per_sample = torch.where(valid, log_prob, torch.zeros_like(log_prob)).sum(dim=(-1, -2))
    return -(advantages * per_sample).mean()
