"""Foreign weights: tensors trained elsewhere installed into a tenant's slot as a NEW version.

`check_foreign_state` compares an uploaded state dict with the slot's own (the module's tensors and,
for an adapter tenant, its adapter's under ``adapter/``) and refuses, naming the tensor: a missing or
unexpected name, a shape that differs, a dtype that is not a float (floats are cast to the slot's
dtype, float32), NaN / Inf values. `install_foreign_state` loads the checked tensors, resets the
optimizer's moments (they belonged to the old weights), issues the next version (never a number
used before) and checkpoints it.
"""

from __future__ import annotations

import torch

from joynexus.artifacts import TenantManifest
from joynexus.models.adapters import split_tenant_state
from joynexus.services.training.slot_table import SlotTable
from joynexus.services.training.slots import TenantSlot

__all__ = ["ForeignWeightsError", "check_foreign_state", "install_foreign_state"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ForeignWeightsError(ValueError):
    """Uploaded weights that do not fit the tenant's slot; `field` names the tensor (or file)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason

    def __reduce__(self) -> tuple:  # crosses Ray intact
        return type(self), (self.field, self.reason)


def check_foreign_state(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The uploaded tensors, checked against the slot's and cast to its dtypes (CPU)."""
    missing = sorted(set(own) - set(state))
    if missing:
        raise ForeignWeightsError(
            f"weights.{missing[0]}", f"missing ({len(missing)} tensors of the tenant's module are)"
        )
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ForeignWeightsError(f"weights.{unexpected[0]}", "not a tensor of the tenant's module")
    checked: dict[str, torch.Tensor] = {}
    for name in sorted(own):
        value, expected = state[name], own[name]
        field = f"weights.{name}"
        if tuple(value.shape) != tuple(expected.shape):
            raise ForeignWeightsError(
                field, f"shape {tuple(value.shape)}, the tenant's module has {tuple(expected.shape)}"
            )
        if expected.is_floating_point():
            if value.dtype not in _FLOATS:
                raise ForeignWeightsError(field, f"dtype {value.dtype}, expected a float dtype ({expected.dtype})")
            if not bool(torch.isfinite(value).all()):
                raise ForeignWeightsError(field, "holds NaN or infinite values")
        elif value.dtype != expected.dtype:
            raise ForeignWeightsError(field, f"dtype {value.dtype}, the tenant's module has {expected.dtype}")
        checked[name] = value.detach().to(device="cpu", dtype=expected.dtype).contiguous()
    return checked


def install_foreign_state(table: SlotTable, slot: TenantSlot, state: dict[str, torch.Tensor]) -> TenantManifest:
    """Check, load, number and checkpoint; the slot is unchanged if a check fails."""
    checked = check_foreign_state(table.state_dict(slot), state)
    module_state, adapter_state = split_tenant_state(checked)
    slot.module.load_state_dict({k: v.to(table.device) for k, v in module_state.items()})
    if adapter_state:
        table.backbone.adapters.load_state_dict(slot.config.tenant_id, adapter_state)
    slot.optimizer.state.clear()  # AdamW moments of the old weights mean nothing for these
    table.pending_gradients.pop(slot.config.tenant_id, None)  # nor gradients taken on them
    table.issue_version(slot)
    # The provenance goes to MLflow (the Master tags the registered version): the checkpoint's
    # manifest stays what an export of this version says, byte for byte.
    return table.save(slot, include_optim=True)
