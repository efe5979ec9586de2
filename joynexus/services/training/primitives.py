"""The lower layer's composition primitives of the Training Model Service (used by joynexus/api):
`forward_backward` sums one microbatch's gradients into the tenant's pending gradients, `optim_step`
applies them. `forward_backward(loss="default")` followed by `optim_step` is exactly `train_batch`:
the same forward, loss randomness, backward, clip and AdamW step (`trainer`). The other objectives
are algorithm code (`algorithms.losses`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from joynexus.algorithms.adamw_step import check_adamw_step, overridden_groups
from joynexus.algorithms.losses import (
    advantage_weighted_loss,
    check_loss_name,
    check_objective,
    per_sample_advantages,
    policy_gradient_loss,
)
from joynexus.algorithms.policy_losses import (
    OFF_POLICY_LOSSES,
    check_loss_config,
    importance_sampling_loss,
    per_sample_logprobs,
    ppo_clip_loss,
)
from joynexus.models.backbone import BackboneFeatures
from joynexus.services.training.slot_table import SlotTable
from joynexus.services.training.slots import (
    Microbatch,
    PendingGradients,
    TenantSlot,
    TenantSlotError,
    check_annotations,
    loss_generator,
)
from joynexus.services.training.trainer import MAX_GRAD_NORM, SlotTrainer, backward_loss, clip_gradients, module_loss

__all__ = ["LowerLayerPrimitives"]


class LowerLayerPrimitives:
    """`forward_backward` / `optim_step` over the table's slots; the pending gradients are the
    table's (`SlotTable.pending_gradients`: a slot holding them is never packed or paged out)."""

    def __init__(self, trainer: SlotTrainer, table: SlotTable) -> None:
        self.trainer = trainer
        self.table = table
        self.pending = table.pending_gradients

    def forward_backward(
        self, tenant_id: str, batch: dict[str, Any], loss: str = "default", loss_config: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """See `TrainingModelService.forward_backward`."""
        check_loss_name(loss)
        loss_params = check_loss_config(loss, loss_config)
        slot = self.table.slot(tenant_id)
        check_annotations(batch, tenant_id, slot.config.schema_signature)
        pending = self.pending.get(tenant_id)
        if pending is not None and pending.optimizer_steps != slot.optimizer_steps:
            pending = None  # a train_batch / train_job step in between zeroed them: start afresh
        started = time.perf_counter()
        prepared = self.trainer.prepare(slot, batch)
        check_objective(loss, slot.module)
        weights = None  # the module's own loss; the other objectives weigh each sample by its advantage
        if loss != "default":
            weights = per_sample_advantages(batch.get("advantages"), len(prepared), self.trainer.device)
        if loss in OFF_POLICY_LOSSES:  # ... and by its importance ratio against the sampling policy
            loss_params["sampling_logprobs"] = per_sample_logprobs(
                batch.get("sampling_logprobs"), len(prepared), self.trainer.device
            )
        features = self.trainer.encode_slot(slot, prepared)
        # The first microbatch draws exactly what train_batch would; later ones draw fresh values.
        generator = loss_generator(slot)
        if pending is not None:
            generator.manual_seed((generator.initial_seed() + pending.microbatches) % 2**64)
        loss_value = backward_loss(
            slot,
            lambda: _objective(loss, slot, features, prepared, weights, generator, loss_params),
            accumulate=pending is not None,
        )
        if pending is None:
            pending = self.pending[tenant_id] = PendingGradients(optimizer_steps=slot.optimizer_steps)
        pending.microbatches += 1
        pending.samples += len(prepared)
        pending.losses.append(loss_value)
        return {
            "tenant_id": tenant_id,
            "loss": loss_value,
            "samples": len(prepared),
            "accumulated_microbatches": pending.microbatches,
            "accumulated_samples": pending.samples,
            "version": slot.version,
            "seconds": time.perf_counter() - started,
        }

    def optim_step(self, tenant_id: str, adamw: dict[str, Any] | None = None) -> dict[str, Any]:
        """See `TrainingModelService.optim_step`."""
        hyper = check_adamw_step(adamw)  # before anything changes: a bad value keeps the pending gradients
        slot = self.table.slot(tenant_id)
        pending = self.pending.pop(tenant_id, None)
        if pending is None:
            raise TenantSlotError(f"tenant {tenant_id!r} has no pending gradients: call forward_backward first")
        if pending.optimizer_steps != slot.optimizer_steps:
            raise TenantSlotError(
                f"tenant {tenant_id!r}: the pending gradients were discarded by a train_batch / train_job step "
                "in between; call forward_backward again"
            )
        started = time.perf_counter()
        grad_clip = hyper.get("grad_clip", MAX_GRAD_NORM)
        try:
            grad_norm = clip_gradients(slot, max_norm=grad_clip)
        except TenantSlotError:
            slot.optimizer.zero_grad(set_to_none=True)
            raise
        with overridden_groups(slot.optimizer, hyper) as used:
            slot.optimizer.step()
        slot.optimizer.zero_grad(set_to_none=True)
        slot.optimizer_steps += 1
        slot.samples_trained += pending.samples
        mean_loss = sum(pending.losses) / len(pending.losses)
        slot.losses.append(mean_loss)
        self.table.issue_version(slot)
        return {
            "tenant_id": tenant_id,
            "loss": mean_loss,
            "grad_norm": float(grad_norm),
            "microbatches": pending.microbatches,
            "samples": pending.samples,
            "optimizer_steps": slot.optimizer_steps,
            "version": slot.version,
            "seconds": time.perf_counter() - started,
            **used,
            "grad_clip": grad_clip,
        }


def _objective(
    loss: str,
    slot: TenantSlot,
    features: BackboneFeatures,
    batch: Microbatch,
    weights: torch.Tensor | None,
    generator: torch.Generator,
    params: dict[str, Any],
) -> torch.Tensor:
    """The loss `forward_backward` backpropagates: the module's own, or an `algorithms` objective."""
    if weights is None:
        return module_loss(slot, features, batch, generator)
    if loss == "importance_sampling":
        return importance_sampling_loss(
            slot.module, features, batch.state, batch.action, batch.action_is_pad, weights, **params
        )
    if loss == "ppo_clip":
        return ppo_clip_loss(slot.module, features, batch.state, batch.action, batch.action_is_pad, weights, **params)
    if loss == "policy_gradient":
        return policy_gradient_loss(slot.module, features, batch.state, batch.action, batch.action_is_pad, weights)
    return advantage_weighted_loss(
        slot.module, features, batch.state, batch.action, batch.action_is_pad, weights, generator
    )
