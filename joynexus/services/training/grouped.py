"""Group-batched training (paper 5.2): one shared backbone forward over several tenants'
microbatches, then each tenant's own update on its own rows (`GroupTrainer.train_group`, and
`train_members` for callers that bring their own objective, e.g. an RL job's PPO step).

Three update paths follow the shared forward: tenants whose modules share an architecture and train
on the module's own loss compute their losses as ONE batched computation (`_batched_updates`), the
others update one at a time (`_module_updates`; a member with its own objective, such as PPO's
clipped surrogate, always does), and tenants with LoRA adapters or layer-wise experts take their
gradients from the one shared graph before any of them steps (`_gradients_then_steps`). Every path
ends in the serial path's own clip and AdamW step (`SlotTrainer`), so grouped results equal serial ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from joynexus.core.metering import split_group_seconds
from joynexus.models.action_modules import uses_layer_prefix
from joynexus.models.backbone import BackboneFeatures
from joynexus.models.module_batching import gather_inputs, group_by_architecture, group_loss, stack_parameters
from joynexus.services.training.slot_table import SlotTable
from joynexus.services.training.slots import (
    Microbatch,
    TenantSlot,
    TenantSlotError,
    adapter_keys,
    check_annotations,
    loss_generator,
)
from joynexus.services.training.trainer import SlotTrainer, clip_gradients

__all__ = ["GroupMember", "GroupTrainer"]

log = logging.getLogger(__name__)

# (loss, error, module seconds) of one tenant's update in a group; loss None when it failed.
_Outcome = tuple[float | None, str | None, float]


@dataclass
class GroupMember:
    """One tenant's part of a grouped step."""

    slot: TenantSlot
    batch: Microbatch
    # The tenant's own objective, built on its rows' features (BackboneFeatures, or a layer-wise
    # expert's prefix): `SlotTrainer.update`'s compute_loss. None: the module's own loss.
    objective: Callable[[Any], Callable[[], torch.Tensor]] | None = None
    # Its rows' features when the caller holds them already (a frozen backbone's features of an
    # earlier PPO epoch): the member joins no forward.
    features: BackboneFeatures | None = None

    def loss_fn(self, features: Any) -> Callable[[], torch.Tensor] | None:
        return None if self.objective is None else self.objective(features)


class GroupTrainer:
    """`train_group` over the table's slots, stepping through the trainer's update path."""

    def __init__(self, trainer: SlotTrainer, table: SlotTable, *, issue_versions: bool = True) -> None:
        self.trainer = trainer
        self.table = table
        # `train_group` numbers every step (each is a parameter change a caller may export); grouped
        # jobs (`job_groups`) number each job once, when it ends, as the serial `train_job` does.
        self.issue_versions = issue_versions

    def _issue_version(self, slot: TenantSlot) -> None:
        if self.issue_versions:
            self.table.issue_version(slot)

    def train_group(self, batches: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        """See `TrainingModelService.train_group`."""
        if not batches:
            return []
        seen: set[str] = set()
        slots: list[TenantSlot] = []
        for tenant_id, data in batches:
            if tenant_id in seen:
                raise ValueError(
                    f"tenant {tenant_id!r} appears more than once in one training group; "
                    "a group takes at most one microbatch (one optimizer step) per tenant"
                )
            seen.add(tenant_id)
            slot = self.table.slot(tenant_id)
            check_annotations(data, tenant_id, slot.config.schema_signature)
            slots.append(slot)
        prepared = [self.trainer.prepare(slot, data) for slot, (_, data) in zip(slots, batches, strict=True)]
        return self.train_members([GroupMember(slot, batch) for slot, batch in zip(slots, prepared, strict=True)])

    def train_members(self, members: list[GroupMember]) -> list[dict[str, Any]]:
        """One step of each member (distinct tenants, prepared microbatches) through one shared
        forward over the rows that need one; each member's result (`_group_result`) in order. An
        error raised here means no member stepped; a member's own failure is its result's `error`."""
        for member in members:
            if len(member.batch) == 0:
                raise TenantSlotError(f"tenant {member.slot.config.tenant_id!r}: empty microbatch in a training group")
        if any(uses_layer_prefix(member.slot.module) for member in members):
            return self._split_by_feature_form(members)
        return self._token_group(members)

    def _split_by_feature_form(self, members: list[GroupMember]) -> list[dict[str, Any]]:
        """A group with layer-wise experts: their rows share ONE prefix forward (with the graph back
        to each tenant's prefix token), each takes its gradients from it, then all step; the other
        tenants go through the token-feature group. Results in the order of `members`."""
        layered = [i for i, member in enumerate(members) if uses_layer_prefix(member.slot.module)]
        plain = [i for i in range(len(members)) if i not in layered]
        results: list[dict[str, Any] | None] = [None] * len(members)
        if plain:
            for i, out in zip(plain, self._token_group([members[i] for i in plain]), strict=True):
                results[i] = out
        started = time.perf_counter()
        try:
            prefixes = self.trainer.layer_prefixes([(members[i].slot, members[i].batch) for i in layered], grad=True)
        except Exception as exc:  # the shared prefix failed: each of its members fails, the others stand
            error = f"{type(exc).__name__}: {exc}"
            for i in layered:
                results[i] = _group_result(members[i].slot, None, time.perf_counter() - started, 0.0, error)
            return [r for r in results if r is not None]
        encode_seconds = time.perf_counter() - started
        self._gradients_then_steps(members, list(zip(layered, prefixes, strict=True)), encode_seconds, results)
        return [r for r in results if r is not None]

    def _token_group(self, members: list[GroupMember]) -> list[dict[str, Any]]:
        """One shared token-feature forward over the rows of every member that brings no features,
        then each member's update. With an adapter in the group the forward keeps its graph."""
        rows: list[slice | None] = [None] * len(members)  # each member's rows of the shared forward
        encoded, offset = [], 0
        for i, member in enumerate(members):
            if member.features is None:
                rows[i] = slice(offset, offset + len(member.batch))
                offset += len(member.batch)
                encoded.append(member)
        started = time.perf_counter()
        images = [cams for member in encoded for cams in member.batch.images]
        instructions = [text for member in encoded for text in member.batch.instructions]
        adapted = any(member.slot.adapter is not None for member in members)
        shared: BackboneFeatures | None = None
        if encoded and adapted:
            keys = [key for member in encoded for key in adapter_keys(member.slot, member.batch)]
            shared = self.trainer.encode(images, instructions, adapters=keys, grad=True)
        elif encoded:
            shared = self.trainer.encode(images, instructions)
        encode_seconds = time.perf_counter() - started
        if adapted:
            return self._adapter_group_updates(members, rows, shared, encode_seconds)
        return self._module_updates(members, rows, shared, encode_seconds)

    def _module_updates(
        self,
        members: list[GroupMember],
        rows: list[slice | None],
        shared: BackboneFeatures | None,
        encode_seconds: float,
    ) -> list[dict[str, Any]]:
        """`train_group`'s updates of tenants without an adapter, after the shared forward (on
        features without a graph). Tenants on their module's own loss whose modules share an
        architecture compute their losses as ONE batched computation (`models.module_batching`),
        then each takes its own clip and AdamW step; the others update one at a time. Results in
        the order of `members`."""
        results: list[dict[str, Any] | None] = [None] * len(members)
        batchable = [i for i, m in enumerate(members) if m.objective is None and rows[i] is not None]
        # Identical configs only (no padded dims, unlike inference): a padded group's gradients equal
        # the per-tenant ones only to float rounding, and AdamW's normalization amplifies rounding in
        # near-zero gradient entries (~1e-5 after a few steps); grouped training is held to serial
        # steps at 1e-5 (tests/services/test_group_training.py).
        groups = [
            [batchable[j] for j in g]
            for g in group_by_architecture([members[i].slot.module for i in batchable], pad_dims=False)
        ]
        groups += [[i] for i in range(len(members)) if i not in batchable]
        for indices in groups:
            outcomes = None
            if len(indices) >= 2 and shared is not None:
                outcomes = self._batched_updates(
                    [members[i].slot for i in indices],
                    [members[i].batch for i in indices],
                    [rows[i] for i in indices],  # batchable members have rows of the shared forward
                    shared,
                )
            if outcomes is None:  # a group of one, or a batched loss that raised: one tenant at a time
                outcomes = [
                    self._serial_update(members[i], _own_features(members[i], shared, rows[i])) for i in indices
                ]
            for i, (loss, error, seconds) in zip(indices, outcomes, strict=True):
                results[i] = _group_result(members[i].slot, loss, encode_seconds, seconds, error)
        return [r for r in results if r is not None]

    def _serial_update(self, member: GroupMember, features: BackboneFeatures) -> _Outcome:
        """One tenant's update on its own rows of the shared forward; its failure is its own."""
        started = time.perf_counter()
        try:
            loss = self.trainer.update(member.slot, features, member.batch, compute_loss=member.loss_fn(features))
            self._issue_version(member.slot)  # as train_batch: every parameter change is a new version
            return loss, None, time.perf_counter() - started
        except Exception as exc:  # one tenant's failure is its own; the group goes on
            return None, f"{type(exc).__name__}: {exc}", time.perf_counter() - started

    def _batched_updates(
        self, slots: list[TenantSlot], prepared: list[Microbatch], rows: list[slice], features: BackboneFeatures
    ) -> list[_Outcome] | None:
        """Same-architecture tenants' updates from one batched loss: (loss, error, module seconds)
        per tenant, or None when the batched computation raised (nothing changed, no gradient left;
        the caller then updates them one at a time, which names the failing tenant).

        The stacked parameters are `torch.stack`s of each tenant's own leaves and every op is
        independent along the tenant axis, so backward of the sum of the finite losses gives each
        tenant exactly its own loss's gradients. A tenant whose loss or gradient norm is not finite
        gets an error and keeps its slot (no gradient, no step) while the others step."""
        started = time.perf_counter()
        modules = [slot.module for slot in slots]
        for slot in slots:
            slot.module.train()
            slot.optimizer.zero_grad(set_to_none=True)
        try:
            inputs = gather_inputs(
                features, [range(r.start, r.stop) for r in rows], [batch.state for batch in prepared]
            )
            if not bool(inputs.mask.any(dim=-1).all()):
                raise ValueError("features.mask: every sample needs at least one real token")
            losses = group_loss(
                modules,
                stack_parameters(modules),
                inputs,
                [batch.action for batch in prepared],
                [batch.action_is_pad for batch in prepared],
                [loss_generator(slot) for slot in slots],
            )
            finite = torch.isfinite(losses.detach())
            if bool(finite.any()):
                losses[finite].sum().backward()
        except Exception as exc:
            log.debug("batched loss of %d tenants fell back to per-tenant updates: %s", len(slots), exc)
            for slot in slots:
                slot.optimizer.zero_grad(set_to_none=True)
            return None
        values = losses.detach().cpu().tolist()
        finite_flags = finite.cpu().tolist()
        # The group's module time, shared by rows.
        shares = split_group_seconds(time.perf_counter() - started, [len(batch) for batch in prepared])
        return [
            self._step_batched_member(slot, batch, value, ok, share)
            for slot, batch, value, ok, share in zip(slots, prepared, values, finite_flags, shares, strict=True)
        ]

    def _step_batched_member(
        self, slot: TenantSlot, batch: Microbatch, value: float, finite: bool, share: float
    ) -> _Outcome:
        """One tenant's clip and AdamW step after the batched backward (`share`: its part of it)."""
        step_started = time.perf_counter()
        try:
            if not finite:
                raise TenantSlotError(f"tenant {slot.config.tenant_id!r}: non-finite loss {value}")
            clip_gradients(slot)
        except Exception as exc:
            slot.optimizer.zero_grad(set_to_none=True)
            return None, f"{type(exc).__name__}: {exc}", share + time.perf_counter() - step_started
        try:
            self.trainer.apply_step(slot, batch, value)
            self._issue_version(slot)
            return value, None, share + time.perf_counter() - step_started
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}", share + time.perf_counter() - step_started

    def _adapter_group_updates(
        self,
        members: list[GroupMember],
        rows: list[slice | None],
        shared: BackboneFeatures | None,
        encode_seconds: float,
    ) -> list[dict[str, Any]]:
        """`train_group`'s updates after a shared forward that carries adapter gradients. Tenants
        without an adapter update on detached features (their module is not in the graph) through
        `_module_updates`, batched like any group; adapter tenants first all take their gradients,
        then all step."""
        results: list[dict[str, Any] | None] = [None] * len(members)
        plain = [i for i, member in enumerate(members) if member.slot.adapter is None]
        if plain:
            updated = self._module_updates(
                [members[i] for i in plain],
                [rows[i] for i in plain],
                None if shared is None else shared.detach(),
                encode_seconds,
            )
            for i, out in zip(plain, updated, strict=True):
                results[i] = out
        adapted = [
            (i, _own_features(member, shared, rows[i]))
            for i, member in enumerate(members)
            if member.slot.adapter is not None
        ]
        self._gradients_then_steps(members, adapted, encode_seconds, results)
        return [r for r in results if r is not None]

    def _gradients_then_steps(
        self,
        members: list[GroupMember],
        pairs: list[tuple[int, Any]],
        encode_seconds: float,
        results: list[dict[str, Any] | None],
    ) -> None:
        """Members (index, own rows of a graph they share) first all take their gradients from the
        shared graph (a failure fails that member only), then all step; fills `results`."""
        waiting: list[tuple[int, float, float]] = []  # (index, loss, module seconds so far)
        for index, features in pairs:
            member = members[index]
            started = time.perf_counter()
            try:
                loss = self.trainer.gradients(member.slot, features, member.batch, member.loss_fn(features))
                waiting.append((index, loss, time.perf_counter() - started))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                results[index] = _group_result(member.slot, None, encode_seconds, time.perf_counter() - started, error)
        for index, loss, seconds in waiting:
            member = members[index]
            started = time.perf_counter()
            self.trainer.apply_step(member.slot, member.batch, loss)
            self._issue_version(member.slot)
            results[index] = _group_result(
                member.slot, loss, encode_seconds, seconds + time.perf_counter() - started, None
            )


def _own_features(member: GroupMember, shared: BackboneFeatures | None, rows: slice | None) -> BackboneFeatures:
    """A member's features: those it brought, or its rows of the shared forward without the padding
    columns other tenants' longer prompts added (the shapes a forward of its own would give)."""
    if member.features is not None:
        return member.features
    if shared is None or rows is None:
        raise RuntimeError(f"tenant {member.slot.config.tenant_id!r}: no features for its rows")
    return shared.select(rows).trimmed()


def _group_result(
    slot: TenantSlot, loss: float | None, encode_seconds: float, module_seconds: float, error: str | None
) -> dict[str, Any]:
    """One tenant's entry in `train_group`'s results (an `error` only when its update failed)."""
    out = {
        "tenant_id": slot.config.tenant_id,
        "loss": loss,
        "optimizer_steps": slot.optimizer_steps,
        "version": slot.version,
        "encode_seconds": encode_seconds,
        "module_seconds": module_seconds,
    }
    if error is not None:
        out["error"] = error
    return out
