"""How a training slot leaves memory and comes back bit-exact: `SlotPager`, the `TenantResidency`
pager of the Training Model Service's slots (`slot_table.SlotTable` owns the residency)."""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

import torch

from joynexus.artifacts.codec import decode_optimizer_state, encode_optimizer_state
from joynexus.core.tenants import TenantBackendConfig
from joynexus.models.action_modules import ActionModuleConfig, build_action_module
from joynexus.models.adapters import LoraAdapterConfig
from joynexus.models.backbone import ResidentBackbone
from joynexus.services.residency import rebuild_module
from joynexus.services.training.packing import ActiveSlots, PackedTrainingState
from joynexus.services.training.slots import TenantSlot

__all__ = ["SlotPager"]


class SlotPager:
    """How a tenant slot leaves memory and comes back bit-exact (`TenantResidency`'s pager).

    A slot without an adapter is packed first (free when it is packed already) and its flat tensors
    are written as they are (`PackedTrainingState.to_tensors`); it comes back packed, and
    materializes on first use. A LoRA adapter slot writes its module's tensors, the AdamW state (in
    the checkpoint codec's pickle-free form) and its adapter's tensors; its adapter leaves the
    shared backbone (every routed forward and every adapter add/remove costs more with each adapter
    on it) and is re-injected with its tensors on page-in, the optimizer rebuilt over the new
    parameters in the same order, so its state maps back one to one. Both forms keep the counters
    and the loss history."""

    immutable = False  # a slot changes with every step: each page-out writes it again

    def __init__(
        self,
        backbone: ResidentBackbone,
        device: torch.device,
        active: ActiveSlots,
        pending_gradients: Container[str],
        released: Callable[[], None],
    ) -> None:
        """`pending_gradients`: the tenants whose slots hold gradients waiting for `optim_step`;
        `released`: called when a slot's last pin goes (the owner packs what is beyond its bound)."""
        self._backbone = backbone
        self._device = device
        self._active = active
        self._pending_gradients = pending_gradients
        self._released = released

    def nbytes(self, slot: TenantSlot) -> int:
        return slot.nbytes()

    def can_page_out(self, tenant_id: str, slot: TenantSlot) -> bool:
        # forward_backward's gradients wait in the parameters for optim_step: mid-step, so stay.
        return tenant_id not in self._pending_gradients

    def at_rest(self, tenant_id: str, slot: TenantSlot) -> None:
        # A slot between calls holds no gradients (every step starts by zeroing them): 1/4 less memory.
        if tenant_id not in self._pending_gradients:
            slot.zero_grad_if_active()
        # A call released a slot: pack the active slots that are now beyond the bound.
        self._released()

    def spill(self, tenant_id: str, slot: TenantSlot) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if slot.adapter is None:
            tensors, packed_meta = slot.pack().to_tensors()
            tensors = {f"packed/{k}": v for k, v in tensors.items()}
            meta: dict[str, Any] = {"packed": packed_meta}
        else:
            tensors = {f"module/{k}": v for k, v in slot.module.state_dict().items()}
            optimizer_tensors, optimizer_doc = encode_optimizer_state(slot.optimizer.state_dict())
            tensors.update({f"optimizer/{k}": v for k, v in optimizer_tensors.items()})
            adapter = self._backbone.adapters.state_dict(tenant_id)
            tensors.update({f"adapter/{k}": v for k, v in adapter.items()})
            meta = {"optimizer": optimizer_doc, "training": slot.module.training}
        tensors["losses"] = torch.tensor(slot.losses, dtype=torch.float64)  # python floats, exactly
        meta.update(
            config=slot.config.model_dump(mode="json"),
            version=slot.version,
            issued_version=slot.issued_version,
            optimizer_steps=slot.optimizer_steps,
            jobs_completed=slot.jobs_completed,
            samples_trained=slot.samples_trained,
            version_created_at=slot.version_created_at,
            datasets=list(slot.datasets),
        )
        return tensors, meta

    def evicted(self, tenant_id: str, slot: TenantSlot) -> None:
        self._active.discard(tenant_id)
        if slot.adapter is not None:
            self._backbone.adapters.remove(tenant_id)

    def restore(self, tenant_id: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> TenantSlot:
        parts: dict[str, dict[str, torch.Tensor]] = {"module": {}, "optimizer": {}, "adapter": {}, "packed": {}}
        for name, tensor in tensors.items():
            part, _, key = name.partition("/")
            if key:
                parts[part][key] = tensor
        config = TenantBackendConfig.model_validate(meta["config"])
        counters = {
            "version": int(meta["version"]),
            "issued_version": int(meta["issued_version"]),
            "optimizer_steps": int(meta["optimizer_steps"]),
            "jobs_completed": int(meta["jobs_completed"]),
            "samples_trained": int(meta["samples_trained"]),
            "losses": tensors["losses"].tolist(),
            "version_created_at": str(meta["version_created_at"]),
            "datasets": tuple(meta.get("datasets", ())),
        }
        if "packed" in meta:  # back as it left: packed (materialized on first use)
            packed = PackedTrainingState.from_tensors(parts["packed"], meta["packed"], self._device)
            return TenantSlot(config, packed=packed, active_tier=self._active, **counters)
        return self._restore_active(tenant_id, config, parts, meta, counters)

    def _restore_active(
        self,
        tenant_id: str,
        config: TenantBackendConfig,
        parts: dict[str, dict[str, torch.Tensor]],
        meta: dict[str, Any],
        counters: dict[str, Any],
    ) -> TenantSlot:
        """A slot that left active (a LoRA adapter slot): module, adapter back on the backbone, AdamW."""
        module_config = ActionModuleConfig.model_validate(config.action_module)
        module = rebuild_module(lambda: build_action_module(module_config), parts["module"], self._device)
        module.train(bool(meta["training"]))
        adapter, adapter_parameters = None, []
        if config.adapter is not None:
            adapter = LoraAdapterConfig.model_validate(config.adapter)
            adapters = self._backbone.adapters
            adapters.add(tenant_id, adapter, state=parts["adapter"], seed=config.seed, trainable=True)
            adapter_parameters = adapters.parameters(tenant_id)
        try:
            optimizer = torch.optim.AdamW([*module.parameters(), *adapter_parameters], lr=config.learning_rate)
            # CPU tensors: AdamW moves the moments onto their parameters' device and keeps its step
            # counts where they were written from (the CPU, unless fused or capturable).
            optimizer.load_state_dict(decode_optimizer_state(meta["optimizer"], parts["optimizer"]))
        except BaseException:
            if adapter is not None:
                self._backbone.adapters.remove(tenant_id)
            raise
        return TenantSlot(config, module, optimizer, adapter=adapter, adapter_parameters=adapter_parameters, **counters)
