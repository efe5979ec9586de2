"""State control of a tenant's training slot (issue 28.3): `load_slot_state` rolls the slot back to
any kept (checkpointed) version — action module, LoRA adapter, AdamW state and counters — as
Tinker's `load_state` does.

All or nothing: the slot's current state is copied first and put back if the checkpoint cannot be
read or does not fit, so a failed rollback leaves the slot (and its pending gradients) as it was.
A successful one discards the pending gradients of `forward_backward` (they were computed on other
weights). Version numbers never go back: the slot holds the old version's weights under that
version's number, and its next step issues a number above every one issued (`SlotTable.issue_version`).

A checkpoint saved without optimizer state (`save(include_optim=False)`) restores the weights and
starts AdamW afresh (no moments, as before a first step); the answer says so (`optimizer_restored`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from joynexus.artifacts import OPTIMIZER_TENSORS_FILE
from joynexus.services.training.slot_table import SlotTable
from joynexus.services.training.slots import TenantSlot

__all__ = ["VersionNotKept", "load_slot_state"]

_COUNTERS = ("version", "version_created_at", "optimizer_steps", "jobs_completed", "samples_trained", "datasets")


class VersionNotKept(ValueError):
    """The version has no checkpoint (never saved, or pruned by retention)."""

    def __init__(self, tenant_id: str, version: int, kept: list[int]):
        self.tenant_id, self.version, self.kept = tenant_id, version, kept
        shown = kept if len(kept) <= 20 else [*kept[:10], "...", *kept[-10:]]
        super().__init__(f"version: tenant {tenant_id!r} has no checkpoint of version {version} (kept: {shown})")

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray with its fields
        return (type(self), (self.tenant_id, self.version, self.kept))


def _snapshot(table: SlotTable, slot: TenantSlot) -> dict[str, Any]:
    """Copies of everything a restore overwrites."""
    snapshot: dict[str, Any] = {
        "module": {k: v.detach().clone() for k, v in slot.module.state_dict().items()},
        "optimizer": copy.deepcopy(slot.optimizer.state_dict()),
        "counters": {name: getattr(slot, name) for name in _COUNTERS},
    }
    if slot.adapter is not None:
        adapter = table.backbone.adapters.state_dict(slot.config.tenant_id)
        snapshot["adapter"] = {k: v.detach().clone() for k, v in adapter.items()}
    return snapshot


def _put_back(table: SlotTable, slot: TenantSlot, snapshot: dict[str, Any]) -> None:
    with torch.no_grad():
        slot.module.load_state_dict(snapshot["module"])
    if "adapter" in snapshot:
        table.backbone.adapters.load_state_dict(slot.config.tenant_id, snapshot["adapter"])
    slot.optimizer.load_state_dict(snapshot["optimizer"])
    for name, value in snapshot["counters"].items():
        setattr(slot, name, value)


def load_slot_state(table: SlotTable, slot: TenantSlot, version: int) -> dict[str, Any]:
    """Roll `slot` back to its tenant's checkpoint `version` (module docstring); returns what was loaded."""
    tenant_id = slot.config.tenant_id
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version: {version!r} must be an int >= 0 (a kept checkpoint version)")
    kept = table.checkpoints.versions(tenant_id)
    if version not in kept:
        raise VersionNotKept(tenant_id, version, kept)
    previous_version = slot.version
    snapshot = _snapshot(table, slot)
    pending = table.pending_gradients.pop(tenant_id, None)
    try:
        manifest = table.restore(slot, version)
    except BaseException:
        _put_back(table, slot, snapshot)
        if pending is not None:
            table.pending_gradients[tenant_id] = pending
        raise
    slot.optimizer.zero_grad(set_to_none=True)  # the discarded pending gradients
    optimizer_restored = OPTIMIZER_TENSORS_FILE in manifest.files
    return {
        "tenant_id": tenant_id,
        "version": slot.version,
        "previous_version": previous_version,
        "optimizer_restored": optimizer_restored,
        "optimizer_steps": slot.optimizer_steps,
        "discarded_microbatches": 0 if pending is None else pending.microbatches,
    }
