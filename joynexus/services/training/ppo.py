"""One RL job's PPO update (paper A.6) as a sequence of microbatch steps (`PpoRun`), so that the
serial path (`SlotTrainer.train_job`) and grouped training (`JobGroupTrainer.train_jobs`: several
tenants' jobs, one shared backbone forward per round) step the same microbatches in the same order
with the same objective.

A run holds what PPO keeps across its steps: the epoch and its shuffled read order, the frozen
backbone's features per sample (`FeatureRows`: each encoded once), the decoupled objective's
proximal log-probabilities, the losses and statistics. Where its rows' features come from (its own
forward, or its rows of a group's) is the caller's; the objective is the tenant's own
(`PpoObjective`: its clip, value head, entropy and advantage normalization).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from joynexus.algorithms.rl import PPOLoss, ppo_loss
from joynexus.core.service_metrics import service_metrics
from joynexus.models.action_modules import ActionModule, uses_layer_prefix
from joynexus.models.backbone import BackboneFeatures
from joynexus.scheduling.training_queue import BatchMeta, TrainingQueue
from joynexus.scheduling.training_scheduler import TrainingJob
from joynexus.services.training.slots import Microbatch, TenantSlot, TenantSlotError, check_annotations
from joynexus.spec import RLSpec

if TYPE_CHECKING:  # the trainer builds runs; its type only (the trainer imports this module)
    from joynexus.services.training.trainer import SlotTrainer

__all__ = ["FeatureRows", "PpoMicrobatch", "PpoObjective", "PpoRun", "rl_fields", "rl_record"]

# An RL partition's fields besides the SFT ones: what the rollout recorded and the advantage stage derived.
_RL_EXTRA = ("log_prob", "advantage", "return")


def rl_fields(sft_fields: tuple[str, ...], module: ActionModule) -> tuple[str, ...]:
    """The fields an RL job reads: a flow head's density is over its recorded denoising chain,
    which the partition then carries."""
    fields = (*sft_fields, *_RL_EXTRA)
    record = module.rl_record_field
    return fields if record in fields else (*fields, record)


def rl_record(module: ActionModule, batch: Microbatch, data: dict[str, Any], device: torch.device) -> torch.Tensor:
    """What the policy's density is over: the action chunk, or a flow head's recorded chain
    (`rl_record_field`)."""
    field = module.rl_record_field
    if field == "action":
        return batch.action
    return torch.as_tensor(np.asarray(data[field], np.float32), device=device)


class FeatureRows:
    """Backbone features kept per sample index for one PPO update: the backbone is frozen, so a
    sample's features never change between epochs; each is encoded once, and a shuffled minibatch is
    gathered from the rows (right-padded to its longest, as `BackboneFeatures.concat` does)."""

    def __init__(self) -> None:
        self._rows: dict[int, BackboneFeatures] = {}

    def cached(self, indices: Sequence[int]) -> BackboneFeatures | None:
        """The features of `indices` when every one is held, else None."""
        if any(i not in self._rows for i in indices):
            return None
        return BackboneFeatures.concat([self._rows[i] for i in indices])

    def remember(self, indices: Sequence[int], features: BackboneFeatures) -> None:
        """Keep each row of `features` (the rows of `indices`, in that order)."""
        for row, index in enumerate(indices):
            self._rows.setdefault(index, features.select([row]))

    def get(self, indices: Sequence[int], encode: Callable[[], BackboneFeatures]) -> BackboneFeatures:
        """The features of `indices`; `encode()` (the minibatch's own forward, in that order) runs
        when any of them is new."""
        held = self.cached(indices)
        if held is not None:
            return held
        features = encode()
        self.remember(indices, features)
        return features


class PpoObjective:
    """The clipped-surrogate loss of one RL microbatch (`algorithms.rl.ppo_loss`), as `update`'s
    `compute_loss`; keeps the last evaluation's parts (`last`) for the job's statistics."""

    def __init__(
        self,
        module: ActionModule,
        rl: RLSpec,
        features: Any,  # BackboneFeatures, or a layer-wise expert's LayerPrefix
        batch: Microbatch,
        data: dict[str, Any],
        device: torch.device,
        proximal_log_prob: torch.Tensor | None = None,
    ) -> None:
        self.module, self.rl, self.features, self.batch = module, rl, features, batch
        behavior = torch.as_tensor(np.asarray(data["log_prob"], dtype=np.float32), device=device)
        # Decoupled (`rl.off_policy_correction`): clipped around the proximal policy, weighted by
        # proximal / behavior; otherwise clipped around the behavior policy.
        self.old_log_prob = behavior if proximal_log_prob is None else proximal_log_prob
        self.behavior_log_prob = None if proximal_log_prob is None else behavior
        self.advantages = torch.as_tensor(np.asarray(data["advantage"], dtype=np.float32), device=device)
        self.returns = torch.as_tensor(np.asarray(data["return"], dtype=np.float32), device=device)
        self.record = rl_record(module, batch, data, device)
        self.last: PPOLoss | None = None

    def __call__(self) -> torch.Tensor:
        module, rl, features, batch = self.module, self.rl, self.features, self.batch
        new_log_prob, entropy = module.record_log_prob(features, batch.state, self.record)
        values = module.value(features, batch.state) if module.config.value_head else None
        self.last = ppo_loss(
            new_log_prob,
            self.old_log_prob,
            self.advantages,
            values=values,
            returns=self.returns if values is not None else None,
            entropy=entropy,
            clip=rl.clip,
            value_coef=rl.value_coef,
            entropy_coef=rl.entropy_coef,
            # GRPO advantages are normalized within their groups already (0 outside them).
            normalize_advantages=rl.advantage != "grpo",
            behavior_log_prob=self.behavior_log_prob,
        )
        return self.last.total


@dataclass
class PpoMicrobatch:
    """One step of a run: the rows read, as tensors, and (once features are known) its objective."""

    meta: BatchMeta
    data: dict[str, Any]
    batch: Microbatch
    epoch: int
    objective: PpoObjective | None = None


class PpoRun:
    """`ppo_epochs` passes of clipped-surrogate updates over one rollout partition, one microbatch
    at a time (`next_microbatch`, then `step_alone`, or a group's step then `record`); `finish`
    after the last. Each epoch reads the partition in a fresh order (PPO's minibatch shuffle) through
    its own Training Queue cursor, seeded by the tenant and the job (a re-run shuffles the same way)."""

    def __init__(
        self,
        trainer: SlotTrainer,
        queue: TrainingQueue,
        slot: TenantSlot,
        job: TrainingJob,
        fields: tuple[str, ...],
        features_cache: FeatureRows,
        proximal: torch.Tensor | None,
    ) -> None:
        if slot.config.rl is None:
            raise TenantSlotError(f"tenant {slot.config.tenant_id!r} is not an RL tenant; job {job.job_id} is 'rl'")
        self.trainer, self.queue, self.slot, self.job = trainer, queue, slot, job
        self.rl: RLSpec = slot.config.rl
        self.fields = fields
        self.features_cache = features_cache
        self.proximal = proximal
        # The features depend on the adapter (a layer-wise expert's prefix on its state token),
        # which every step changes: only a plain head reuses them.
        self.reuses_features = slot.adapter is None and not uses_layer_prefix(slot.module)
        self.sample_count = int(queue.describe(job.partition_id)["num_samples"])
        self._shuffle = np.random.default_rng([slot.config.seed % 2**32, zlib.crc32(job.job_id.encode())])
        self.epoch = 0
        self._order = self._shuffle.permutation(self.sample_count).tolist()
        self.losses: list[float] = []
        self.samples = 0  # distinct samples (the first epoch's)
        self.rows_stepped = 0  # rows over every epoch (a group's time is shared by these)
        self.stats: dict[str, list[float]] = {"clip_fraction": [], "approx_kl": [], "value_loss": [], "entropy": []}
        self._seen_states: list[torch.Tensor] = []

    def next_microbatch(self) -> PpoMicrobatch | None:
        """The next microbatch to step (checked, as tensors); None after the last epoch."""
        while self.epoch < self.rl.ppo_epochs:
            meta = self.queue.get_meta(
                self.job.partition_id,
                self.fields,
                self.slot.config.microbatch_size,
                self.job.read_task(f"ppo-epoch-{self.epoch}"),
                order=self._order,
            )
            if meta is None:
                self.epoch += 1
                if self.epoch < self.rl.ppo_epochs:
                    self._order = self._shuffle.permutation(self.sample_count).tolist()
                continue
            data = self.queue.get_data(meta)
            check_annotations(data, self.job.tenant_id, self.slot.config.schema_signature)
            return PpoMicrobatch(meta, data, self.trainer.prepare(self.slot, data), self.epoch)
        return None

    def cached_features(self, step: PpoMicrobatch) -> BackboneFeatures | None:
        """The step's features when every row was encoded before (no forward needed), else None."""
        return self.features_cache.cached(step.meta.indices) if self.reuses_features else None

    def objective(self, step: PpoMicrobatch, features: Any) -> PpoObjective:
        """The step's objective on its rows' `features` (kept for later epochs where reusable)."""
        if self.reuses_features:
            self.features_cache.remember(step.meta.indices, features)
        anchor = None if self.proximal is None else self.proximal[list(step.meta.indices)]
        step.objective = PpoObjective(
            self.slot.module, self.rl, features, step.batch, step.data, self.trainer.device, anchor
        )
        return step.objective

    def step_alone(self, step: PpoMicrobatch) -> float:
        """The step through the tenant's own forward (or its cached features) and `update`."""
        features = self.cached_features(step)
        if features is None:
            features = self.trainer.encode_slot(self.slot, step.batch)
        objective = self.objective(step, features)
        started = time.perf_counter()
        loss = self.trainer.update(self.slot, features, step.batch, compute_loss=objective)
        service_metrics().training_step_seconds.labels("serial").observe(time.perf_counter() - started)
        self.record(step, loss)
        return loss

    def record(self, step: PpoMicrobatch, loss: float) -> None:
        """Account a step that was applied (alone or in a group): its loss and PPO statistics."""
        out = step.objective.last if step.objective is not None else None
        if out is None:
            raise RuntimeError(f"job {self.job.job_id}: a PPO step was recorded before its objective ran")
        self.losses.append(loss)
        self.rows_stepped += step.meta.size
        self.stats["clip_fraction"].append(float(out.clip_fraction))
        self.stats["approx_kl"].append(float(out.approx_kl))
        if self.slot.module.config.value_head:  # only what the algorithm computes: GRPO has no critic
            self.stats["value_loss"].append(float(out.value.detach()))
        self.stats["entropy"].append(float(out.entropy.detach()))
        if step.epoch == 0:
            self.samples += step.meta.size
            self._seen_states.append(step.batch.state)

    def finish(self) -> tuple[list[float], int, dict[str, Any]]:
        """(losses, samples, {"rl_stats": means}) after the last step. The state statistics move
        after the update: its ratios were taken under the statistics the rollout's behavior version
        acted with (this version's), the next version acts with these."""
        if self._seen_states:
            self.slot.module.observe_states(torch.cat(self._seen_states))
        summary = {f"rl/{k}": float(np.mean(v)) for k, v in self.stats.items() if v}
        return self.losses, self.samples, {"rl_stats": summary}
