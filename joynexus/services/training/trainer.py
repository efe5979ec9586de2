"""The serial update path of the Training Model Service: one tenant's microbatch, its own backbone
forward, then that tenant's loss, backward, clip and AdamW step on its own slot (`SlotTrainer`).
`train_batch` is one such step from supplied samples; `train_job` consumes a leased job's Training
Queue partition (SFT: one step per microbatch; RL: PPO epochs over the rollout partition).

The update itself (`update`, and its two halves `gradients` / `apply_step` for a graph other
tenants share) and the checks it makes (`backward_loss`, `clip_gradients`) are shared with grouped
training (`grouped`) and the lower-layer primitives (`primitives`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from joynexus.core.service_metrics import service_metrics
from joynexus.models.action_modules import PrefixRows, by_prefix_layout, uses_layer_prefix
from joynexus.models.backbone import BackboneFeatures, ResidentBackbone
from joynexus.models.backbone.layer_prefix import LayerPrefix
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import TrainingJob
from joynexus.services.training.gradient_sync import reduce_gradients
from joynexus.services.training.ppo import FeatureRows, PpoRun, rl_fields, rl_record
from joynexus.services.training.slot_table import SlotTable
from joynexus.services.training.slots import (
    Microbatch,
    TenantSlot,
    TenantSlotError,
    adapter_keys,
    check_annotations,
    loss_generator,
    microbatch_to_tensors,
)

__all__ = [
    "MAX_GRAD_NORM",
    "FeatureRows",
    "RL_FIELDS",
    "SFT_FIELDS",
    "SlotTrainer",
    "backward_loss",
    "check_finite_loss",
    "clip_gradients",
    "module_loss",
]

# Fields an SFT partition carries per sample; tenant and schema annotations travel with each row.
SFT_FIELDS = ("images", "state", "action", "action_is_pad", "task", "tenant_id", "schema_signature")
# An RL partition adds what the rollout recorded and the advantage stage derived (a flow head's
# recorded chain too: `ppo.rl_fields`).
RL_FIELDS = (*SFT_FIELDS, "log_prob", "advantage", "return")

# The gradient-norm bound of every update (serial, grouped, optim_step).
MAX_GRAD_NORM = 1.0


def module_loss(
    slot: TenantSlot, features: BackboneFeatures, batch: Microbatch, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The tenant module's own loss on its microbatch, drawing from `generator` (default: the
    slot's next-step randomness, `loss_generator`)."""
    generator = loss_generator(slot) if generator is None else generator
    return slot.module.loss(features, batch.state, batch.action, batch.action_is_pad, generator=generator)


def check_finite_loss(slot: TenantSlot, loss: torch.Tensor) -> None:
    if not torch.isfinite(loss):
        raise TenantSlotError(f"tenant {slot.config.tenant_id!r}: non-finite loss {loss.item()}")


def backward_loss(slot: TenantSlot, compute_loss: Callable[[], torch.Tensor], *, accumulate: bool = False) -> float:
    """The module in training mode, its gradients zeroed (unless `accumulate`: summed into those it
    holds), the loss computed, refused if not finite (before any backward), backpropagated; its value."""
    slot.module.train()
    if not accumulate:
        slot.optimizer.zero_grad(set_to_none=True)
    loss = compute_loss()
    check_finite_loss(slot, loss)
    loss.backward()
    return float(loss.detach())


def clip_gradients(
    slot: TenantSlot, params: list[torch.nn.Parameter] | None = None, max_norm: float = MAX_GRAD_NORM
) -> torch.Tensor:
    """Clip the slot's gradients to norm `max_norm`; a non-finite norm raises (the caller drops them).
    On a rank of a data-parallel group they are first summed over the group (`data_parallel`)."""
    params = list(slot.parameters() if params is None else params)
    reduce_gradients(slot, params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if not torch.isfinite(grad_norm):
        raise TenantSlotError(f"tenant {slot.config.tenant_id!r}: non-finite gradient norm {grad_norm.item()}")
    return grad_norm


class SlotTrainer:
    """One tenant's updates on the shared frozen backbone (module docstring)."""

    def __init__(self, backbone: ResidentBackbone, table: SlotTable, queue: TrainingQueue | None) -> None:
        self.backbone = backbone
        self.device = backbone.device
        self.table = table
        self.queue = queue

    # -- forward ----------------------------------------------------------------------------
    def encode(
        self,
        images: list[list[torch.Tensor]],
        instructions: list[str],
        adapters: list[str | None] | None = None,
        grad: bool = False,
    ) -> BackboneFeatures:
        """The shared frozen forward; no graph is kept (only tenant modules learn) unless `grad`:
        then the graph reaches the LoRA adapters named per sample in `adapters` (tenant ids)."""
        if adapters is None and not grad:
            return self.backbone.encode(images, instructions)
        return self.backbone.encode(images, instructions, adapters, grad=grad)

    def layer_prefixes(self, members: list[tuple[TenantSlot, Microbatch]], *, grad: bool) -> list[LayerPrefix]:
        """Layer-wise experts' prefixes (`ActionModule.feature_form` "layers"): ONE prefix forward per
        prefix layout over every member's rows, each member's prefix token made by its own module
        (with `grad`, the graph reaches it). In the order of `members`."""
        out: list[LayerPrefix | None] = [None] * len(members)
        for (kind, _), indices in by_prefix_layout([slot.module for slot, _ in members]).items():
            rows = [
                PrefixRows(slot.module, batch.images, batch.instructions, batch.state)
                for slot, batch in (members[i] for i in indices)
            ]
            for i, prefix in zip(indices, kind.layer_prefixes(self.backbone, rows, grad=grad), strict=True):
                out[i] = prefix
        return [p for p in out if p is not None]

    def encode_slot(self, slot: TenantSlot, batch: Microbatch) -> BackboneFeatures | LayerPrefix:
        """One tenant's own forward: through its adapter with autograd if it has one; a layer-wise
        expert's prefix cache, with the graph back to its prefix token."""
        if uses_layer_prefix(slot.module):
            return self.layer_prefixes([(slot, batch)], grad=True)[0]
        if slot.adapter is None:
            return self.encode(batch.images, batch.instructions)
        return self.encode(batch.images, batch.instructions, adapters=adapter_keys(slot, batch), grad=True)

    def prepare(self, slot: TenantSlot, data: dict[str, Any]) -> Microbatch:
        images, instructions, state, action, pad = microbatch_to_tensors(data)
        if slot.config.instruction:
            instructions = [text or slot.config.instruction for text in instructions]
        # The module's tensors on the service's device; camera images stay on the host until the
        # backbone copies them over, one batch per image size.
        state, action, pad = state.to(self.device), action.to(self.device), pad.to(self.device)
        return Microbatch(images, instructions, state, action, pad)

    # -- the update -------------------------------------------------------------------------
    def step(self, slot: TenantSlot, data: dict[str, Any]) -> float:
        """Serial path: this microbatch's own backbone forward, then the tenant's update."""
        started = time.perf_counter()
        batch = self.prepare(slot, data)
        loss = self.update(slot, self.encode_slot(slot, batch), batch)
        service_metrics().training_step_seconds.labels("serial").observe(time.perf_counter() - started)
        return loss

    def update(
        self,
        slot: TenantSlot,
        features: BackboneFeatures,
        batch: Microbatch,
        compute_loss: Callable[[], torch.Tensor] | None = None,
    ) -> float:
        """The per-tenant update every path shares: loss, backward, clip, AdamW step, on this slot only.
        `compute_loss`: an algorithm's own objective (e.g. PPO); None: the module's own loss.

        Anything raised before the optimizer step leaves the slot's parameters, optimizer state and
        counters as they were (and drops the partial gradients).
        """
        try:
            value = backward_loss(slot, compute_loss or (lambda: module_loss(slot, features, batch)))
            clip_gradients(slot)
        except BaseException:
            slot.optimizer.zero_grad(set_to_none=True)
            raise
        self.apply_step(slot, batch, value)
        return value

    def gradients(
        self,
        slot: TenantSlot,
        features: BackboneFeatures,
        batch: Microbatch,
        compute_loss: Callable[[], torch.Tensor] | None = None,
    ) -> float:
        """The first half of `update` from a graph other tenants share: loss (`compute_loss`, as
        in `update`), then gradients of THIS slot's parameters only (autograd.grad, the graph
        kept), clipped. Raising leaves no gradient behind."""
        slot.module.train()
        slot.optimizer.zero_grad(set_to_none=True)
        # Trained ones only: an RL head's state statistics are parameters that no gradient moves.
        params = [param for param in slot.parameters() if param.requires_grad]
        try:
            loss = compute_loss() if compute_loss is not None else module_loss(slot, features, batch)
            check_finite_loss(slot, loss)
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
            clip_gradients(slot, params)
        except BaseException:
            slot.optimizer.zero_grad(set_to_none=True)
            raise
        return float(loss.detach())

    def apply_step(self, slot: TenantSlot, batch: Microbatch, loss: float) -> None:
        """The second half of `update`: the AdamW step on the gradients `gradients` left."""
        slot.optimizer.step()
        slot.optimizer_steps += 1
        slot.samples_trained += len(batch)
        slot.losses.append(loss)

    # -- serial training --------------------------------------------------------------------
    def train_batch(self, tenant_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        """One optimizer step on one tenant's slot from supplied samples (the lower-layer primitive)."""
        slot = self.table.slot(tenant_id)
        check_annotations(batch, tenant_id, slot.config.schema_signature)
        loss = self.step(slot, batch)
        self.table.issue_version(
            slot
        )  # every parameter change is a new version: exports and checkpoints stay unambiguous
        return {"tenant_id": tenant_id, "loss": loss, "optimizer_steps": slot.optimizer_steps, "version": slot.version}

    def train_job(self, job: TrainingJob | dict[str, Any]) -> dict[str, Any]:
        """Consume a leased job's partition in microbatches; one optimizer step per microbatch,
        then bump only this tenant's policy version and (per its config) checkpoint it."""
        if self.queue is None:
            raise TenantSlotError("this Training Model Service was started without a Training Queue")
        job = job if isinstance(job, TrainingJob) else TrainingJob(**job)
        slot = self.job_slot(job)
        started, start_version = time.perf_counter(), slot.version
        extra: dict[str, Any] = {"learning_rate": slot.schedule_learning_rate()}
        if job.task_type == "rl":
            losses, samples, rl_extra = self._train_rl_partition(self.queue, slot, job)
            extra.update(rl_extra)
        else:
            losses, samples = self._train_sft_partition(self.queue, slot, job)
        return self.finish_job(
            slot, job, losses, samples, start_version=start_version, seconds=time.perf_counter() - started, **extra
        )

    def job_slot(self, job: TrainingJob) -> TenantSlot:
        """The slot a leased job trains; refused when the job was made for another schema."""
        slot = self.table.slot(job.tenant_id)
        if job.schema_signature != slot.config.schema_signature:
            raise TenantSlotError(
                f"job {job.job_id} carries schema signature {job.schema_signature}, "
                f"tenant {job.tenant_id!r} has {slot.config.schema_signature}"
            )
        return slot

    def finish_job(
        self,
        slot: TenantSlot,
        job: TrainingJob,
        losses: list[float],
        samples: int,
        *,
        start_version: int,
        seconds: float,
        **extra: Any,
    ) -> dict[str, Any]:
        """The one wrap-up of a job that trained without error, serial (`train_job`) or grouped
        (`JobGroupTrainer.train_jobs`): ONE new version for the job's steps, the job counted, an SFT
        job's dataset noted, the periodic checkpoint, the job's metrics; its result. A job whose
        partition held no samples is refused (it stepped nothing)."""
        if samples == 0:
            raise TenantSlotError(f"job {job.job_id}: partition {job.partition_id} holds no samples")
        self.table.issue_version(slot)
        slot.jobs_completed += 1
        if job.task_type != "rl":
            slot.note_dataset(job.metadata)
        every = slot.config.checkpoint_every_jobs
        manifest = self.table.save(slot, include_optim=True) if every and slot.jobs_completed % every == 0 else None
        result = {
            "job_id": job.job_id,
            "tenant_id": job.tenant_id,
            "version": slot.version,
            "losses": losses,
            "samples": samples,
            "optimizer_steps": slot.optimizer_steps,
            "seconds": seconds,
            "checkpoint_version": manifest.policy_version if manifest else None,
            **extra,
        }
        service_metrics().observe_job(job, result, start_version)
        return result

    def _train_sft_partition(self, queue: TrainingQueue, slot: TenantSlot, job: TrainingJob) -> tuple[list[float], int]:
        """One optimizer step per microbatch of an SFT partition: (losses, samples)."""
        losses: list[float] = []
        samples = 0
        while True:
            meta = queue.get_meta(job.partition_id, SFT_FIELDS, slot.config.microbatch_size, job.read_task("train"))
            if meta is None:
                return losses, samples
            data = queue.get_data(meta)
            check_annotations(data, job.tenant_id, slot.config.schema_signature)
            losses.append(self.step(slot, data))
            samples += meta.size

    def _train_rl_partition(
        self, queue: TrainingQueue, slot: TenantSlot, job: TrainingJob
    ) -> tuple[list[float], int, dict[str, Any]]:
        """PPO over a rollout partition (paper A.6), one microbatch step after another (`PpoRun`)."""
        run = self.ppo_run(queue, slot, job)
        while (step := run.next_microbatch()) is not None:
            run.step_alone(step)
        return run.finish()

    def ppo_run(self, queue: TrainingQueue, slot: TenantSlot, job: TrainingJob) -> PpoRun:
        """An RL job's PPO update ready to step (serial here, or in a group): with the decoupled
        objective, the proximal log-probabilities are computed first (their forwards fill the
        run's feature cache)."""
        rl = slot.config.rl  # None: PpoRun refuses the job
        fields = rl_fields(SFT_FIELDS, slot.module)
        features_cache = FeatureRows()
        proximal = (
            self._proximal_log_probs(queue, slot, job, fields, features_cache)
            if rl is not None and rl.off_policy_correction == "decoupled"
            else None
        )
        return PpoRun(self, queue, slot, job, fields, features_cache, proximal)

    def _proximal_log_probs(
        self, queue: TrainingQueue, slot: TenantSlot, job: TrainingJob, fields: tuple[str, ...],
        features_cache: FeatureRows,
    ) -> torch.Tensor:  # fmt: skip
        """log pi(record | obs) of every sample under the slot's policy before this job's update
        (the decoupled objective's proximal policy), by sample index; fills `features_cache`."""
        module = slot.module
        out = torch.zeros(int(queue.describe(job.partition_id)["num_samples"]), device=self.device)
        while True:
            meta = queue.get_meta(job.partition_id, fields, slot.config.microbatch_size, job.read_task("ppo-proximal"))
            if meta is None:
                return out
            data = queue.get_data(meta)
            check_annotations(data, job.tenant_id, slot.config.schema_signature)
            batch = self.prepare(slot, data)
            with torch.no_grad():
                if slot.adapter is not None or uses_layer_prefix(module):
                    features = self.encode_slot(slot, batch)
                else:
                    features = features_cache.get(meta.indices, lambda b=batch: self.encode(b.images, b.instructions))
                record = rl_record(module, batch, data, self.device)
                log_prob, _ = module.record_log_prob(features, batch.state, record)
            out[list(meta.indices)] = log_prob.detach()
