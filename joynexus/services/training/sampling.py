"""Forward-only lower-layer calls of the Training Model Service on a tenant's training slot (the
current training parameters, not a served version): `sample` draws n action chunks per observation
with their log-probabilities, `compute_logprobs` scores given actions. Neither builds a graph,
touches the pending gradients of `forward_backward`, nor changes the version or any counter.

Which heads can do what (checked per head, the error names the head):

- a Gaussian policy head (`stochastic=True`, e.g. an RL tenant's `oft_mlp`): `sample` draws
  mean + temperature * std * noise and returns log pi_T(action | obs) under that tempered Gaussian
  (temperature 1: the policy's own density, what `compute_logprobs` returns), summed over the
  chunk's steps and action dimensions; `compute_logprobs` sums over the unpadded steps only;
- a flow-matching head: `sample` integrates from n noise draws (temperature 1 only); it has no
  tractable density, so its samples carry no log-probabilities and `compute_logprobs` is refused;
- a deterministic head (`oft_mlp` without `stochastic`): both are refused.

Randomness: one CPU generator seeded by the call's `seed` draws all noise in row order, so the same
seed, observations and parameters give the same samples on any device and whatever else runs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from joynexus.models.action_modules import ActionModule
from joynexus.models.backbone import BackboneFeatures
from joynexus.services.training.slot_table import SlotTable
from joynexus.services.training.slots import (
    Microbatch,
    TenantSlot,
    TenantSlotError,
    adapter_keys,
    check_annotations,
)
from joynexus.services.training.trainer import SlotTrainer

__all__ = ["MAX_SAMPLES_PER_OBSERVATION", "PolicySampler", "SamplingError"]

MAX_SAMPLES_PER_OBSERVATION = 64


class SamplingError(ValueError):
    """A sampling call this head or these arguments cannot serve; `field` names what to change."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def _head(module: ActionModule) -> str:
    cfg = module.config
    return f"{cfg.kind!r} (stochastic={cfg.stochastic})"


class PolicySampler:
    """`sample` / `compute_logprobs` over the table's slots (module docstring)."""

    def __init__(self, trainer: SlotTrainer, table: SlotTable) -> None:
        self.trainer = trainer
        self.table = table

    def sample(self, tenant_id: str, batch: dict[str, Any], n: int, temperature: float, seed: int) -> dict[str, Any]:
        """See `TrainingModelService.sample`."""
        if not 1 <= n <= MAX_SAMPLES_PER_OBSERVATION:
            raise SamplingError("n", f"must be in [1, {MAX_SAMPLES_PER_OBSERVATION}], got {n}")
        if not (np.isfinite(temperature) and 0.0 < temperature <= 10.0):
            raise SamplingError("temperature", f"must be in (0, 10], got {temperature}")
        slot = self.table.slot(tenant_id)
        module = slot.module
        density = module.log_std is not None
        if not density and not type(module).uses_noise:
            raise SamplingError(
                "sample",
                f"the tenant's head {_head(module)} is deterministic: it has no action distribution to sample; "
                "a Gaussian policy head (stochastic=True, an RL tenant) or a flow-matching head can sample",
            )
        if not density and temperature != 1.0:
            raise SamplingError("temperature", f"the head {_head(module)} samples at temperature 1.0 only")
        cfg = module.config
        count = len(batch.get("task", ()))
        no_actions = {  # observations only: the microbatch format's action columns, unused
            "action": np.zeros((count, cfg.action_chunk, cfg.action_dim), np.float32),
            "action_is_pad": np.zeros((count, cfg.action_chunk), bool),
        }
        started = time.perf_counter()
        features, prepared = self._forward(slot, {**batch, **no_actions})
        rows = torch.arange(len(prepared), device=features.tokens.device).repeat_interleave(n)
        features, state = features.select(rows), prepared.state[rows]
        generator = torch.Generator().manual_seed(int(seed) % 2**63)
        with torch.no_grad():
            if density:
                policy = module.action_distribution(features, state)
                std = policy.stddev * temperature
                noise = torch.randn((len(rows), cfg.action_chunk, cfg.action_dim), generator=generator)
                actions = policy.mean + std * noise.to(std.device)
                log_probs = torch.distributions.Normal(policy.mean, std).log_prob(actions).sum(dim=(-1, -2))
                log_probs_out = log_probs.view(len(prepared), n).cpu().numpy()
            else:
                actions = module.predict(features, state, generator=generator)
                log_probs_out = None
        return {
            "tenant_id": tenant_id,
            "actions": actions.view(len(prepared), n, cfg.action_chunk, cfg.action_dim).cpu().numpy(),
            "log_probs": log_probs_out,
            "version": slot.version,
            "seed": int(seed),
            "seconds": time.perf_counter() - started,
        }

    def compute_logprobs(self, tenant_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        """See `TrainingModelService.compute_logprobs`."""
        slot = self.table.slot(tenant_id)
        module = slot.module
        if module.log_std is None:
            raise SamplingError(
                "compute_logprobs",
                f"the tenant's head {_head(module)} defines no action density; log-probabilities need a "
                "Gaussian policy head (stochastic=True, an RL tenant)",
            )
        started = time.perf_counter()
        features, prepared = self._forward(slot, batch)
        with torch.no_grad():
            log_prob = module.action_distribution(features, prepared.state).log_prob(prepared.action)
            valid = (~prepared.action_is_pad).unsqueeze(-1)
            per_sample = torch.where(valid, log_prob, torch.zeros_like(log_prob)).sum(dim=(-1, -2))
        return {
            "tenant_id": tenant_id,
            "log_probs": per_sample.cpu().numpy(),
            "version": slot.version,
            "seconds": time.perf_counter() - started,
        }

    def _forward(self, slot: TenantSlot, batch: dict[str, Any]) -> tuple[BackboneFeatures, Microbatch]:
        """The annotations checked, the microbatch prepared and its features (through the tenant's
        adapter, if any), without a graph."""
        check_annotations(batch, slot.config.tenant_id, slot.config.schema_signature)
        prepared = self.trainer.prepare(slot, batch)
        if not len(prepared):
            raise TenantSlotError("microbatch holds no observations")
        adapters = adapter_keys(slot, prepared) if slot.adapter is not None else None
        with torch.no_grad():
            features = self.trainer.encode(prepared.images, prepared.instructions, adapters, grad=False)
        return features, prepared
