"""Every tenant slot of the Training Model Service and its life: `SlotTable` adds a slot (restoring
its last checkpoint), hands it out (paged in, pinned by the calling scope), numbers its versions,
saves and exports it, packs what falls beyond the active bound, and removes it.

The slots are held in three tiers (the service's docstring): active, packed resident, paged out.
`TenantResidency` keeps the resident / paged-out split (with `SlotPager`), `ActiveSlots` the
active / packed one; this table ties the two together.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from joynexus.artifacts import (
    ACTION_MODULE_FILE,
    DATASET_SHA256_KEY,
    OBSERVATION_KEY,
    OPTIMIZER_TENSORS_FILE,
    VERSION_CREATED_AT_KEY,
    CheckpointError,
    CheckpointStore,
    TenantManifest,
    encode_tenant_payload,
)
from joynexus.core.tenants import TenantBackendConfig
from joynexus.models.action_modules import ActionModuleConfig, build_action_module
from joynexus.models.adapters import LoraAdapterConfig, join_tenant_state, split_tenant_state
from joynexus.models.backbone import ResidentBackbone
from joynexus.models.placement import cpu_copy
from joynexus.services.residency import ResidencyLimits, TenantResidency, UnknownEntry, decode_paged
from joynexus.services.training.packing import ActiveSlots
from joynexus.services.training.pager import SlotPager
from joynexus.services.training.slots import PendingGradients, TenantSlot, TenantSlotError, UnknownTenant

__all__ = ["SlotTable", "manifest_dict"]


class SlotTable:
    """Every registered tenant's slot, resident or paged out, and what happens to it between steps."""

    def __init__(
        self,
        backbone: ResidentBackbone,
        checkpoints: CheckpointStore,
        active: ActiveSlots,
        limits: ResidencyLimits,
        spill_dir: str | Path | None = None,
    ) -> None:
        self.backbone = backbone
        self.device = backbone.device
        self.checkpoints = checkpoints
        self.active = active
        # tenant -> what forward_backward has accumulated since the tenant's last optimizer step.
        self.pending_gradients: dict[str, PendingGradients] = {}
        pager = self.pager = SlotPager(backbone, self.device, active, self.pending_gradients, self.pack_least_recent)
        # A mapping of every registered tenant id to its slot (see `slot`).
        self.residency: TenantResidency[str, TenantSlot] = TenantResidency(
            pager, limits, spill_dir, name="training-slots"
        )

    def __contains__(self, tenant_id: object) -> bool:
        return tenant_id in self.residency

    def tenant_ids(self) -> list[str]:
        return sorted(self.residency)

    def slot(self, tenant_id: str) -> TenantSlot:
        """The tenant's slot, paged in (exactly as it was paged out) if it was not resident, now the
        most recently used. It stays pinned in memory until the service call that asked for it
        returns (the service's methods pin, `pins_during_call`), so a step never runs on a slot that
        was paged out. A packed slot materializes when its module or optimizer is first read."""
        try:
            slot = self.residency.use(tenant_id)
        except UnknownEntry:
            raise UnknownTenant(tenant_id) from None
        self.active.touch(tenant_id)
        return slot

    # -- lifecycle --------------------------------------------------------------------------
    def add(self, config: TenantBackendConfig, resume: bool = True) -> dict[str, Any]:
        """Create the tenant's slot; with `resume`, restore its last checkpoint if one exists."""
        if config.base_model_id != self.backbone.model_id:
            raise TenantSlotError(
                f"tenant {config.tenant_id!r} targets base model {config.base_model_id!r}, "
                f"this service holds {self.backbone.model_id!r}"
            )
        if config.tenant_id in self.residency:
            return {"tenant_id": config.tenant_id, "version": self.slot(config.tenant_id).version, "resumed": False}
        slot = self._new_slot(config)
        resumed = False
        try:
            if resume and self.checkpoints.latest_version(config.tenant_id) is not None:
                self.restore(slot)
                resumed = True
        except BaseException:
            if slot.adapter is not None:  # no slot, so no adapter left on the shared backbone either
                self.backbone.adapters.remove(config.tenant_id)
            raise
        # Versions after the restored checkpoint may have been issued (exported, published) before a
        # crash with other weights: continue numbering after every version ever issued.
        slot.issued_version = max(slot.version, self.checkpoints.issued_version(config.tenant_id) or 0)
        self.residency.add(config.tenant_id, slot)  # resident; beyond the bound the least recent pages out
        if slot.adapter is None:  # active until it falls beyond max_active_tenants (adapter slots stay so)
            self.active.activated(config.tenant_id)
        return {"tenant_id": config.tenant_id, "version": slot.version, "resumed": resumed}

    def _new_slot(self, config: TenantBackendConfig) -> TenantSlot:
        """A fresh slot from the tenant's seed: its module, its adapter on the backbone (if any), AdamW."""
        module_config = ActionModuleConfig.model_validate(config.action_module)
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            module = build_action_module(module_config)
        # What the kind needs of this backbone, and the weights it starts from (a LeRobot checkpoint's).
        module.load_initial_state(self.backbone)
        # Drawn on the CPU (the same initial weights on every device), trained in float32 on ours.
        module = module.to(self.device)
        if config.adapter is None:
            optimizer = torch.optim.AdamW(module.parameters(), lr=config.learning_rate)
            return TenantSlot(config=config, module=module, optimizer=optimizer, active_tier=self.active)
        adapter = LoraAdapterConfig.model_validate(config.adapter)
        # Initialized from the tenant's seed (peft: A Kaiming-uniform, B zero: a no-op at first).
        self.backbone.adapters.add(config.tenant_id, adapter, seed=config.seed, trainable=True)
        adapter_parameters = self.backbone.adapters.parameters(config.tenant_id)
        optimizer = torch.optim.AdamW([*module.parameters(), *adapter_parameters], lr=config.learning_rate)
        return TenantSlot(
            config=config, module=module, optimizer=optimizer, adapter=adapter, adapter_parameters=adapter_parameters
        )

    def restore(self, slot: TenantSlot, version: int | None = None) -> TenantManifest:
        """The tenant's checkpoint `version` (None: its latest) into `slot` (module, adapter, optimizer,
        counters), or refuse it. A checkpoint saved without optimizer state leaves AdamW with no
        state (fresh moments, as before a first step); the learning rate is always the tenant's."""
        tenant_id = slot.config.tenant_id
        manifest, module_state, optimizer_state = self.checkpoints.load_tenant(
            tenant_id, version, map_location=self.device
        )
        if manifest.schema_signature != slot.config.schema_signature:
            raise TenantSlotError(
                f"checkpoint of tenant {tenant_id!r} v{manifest.policy_version} has schema signature "
                f"{manifest.schema_signature}, the tenant's spec has {slot.config.schema_signature}"
            )
        where = f"checkpoint of tenant {tenant_id!r} v{manifest.policy_version}"
        module_state, adapter_state = split_tenant_state(module_state)
        try:
            slot.module.load_state_dict(module_state)
        except (RuntimeError, ValueError, KeyError) as exc:  # verified bytes, but not this module's tensors
            raise CheckpointError(
                f"{where}: file {ACTION_MODULE_FILE} does not fit the tenant's module: {exc}"
            ) from exc
        self._restore_adapter(slot, manifest, adapter_state, where)
        if optimizer_state is not None:
            try:
                slot.optimizer.load_state_dict(optimizer_state)
            except (RuntimeError, ValueError, KeyError) as exc:
                raise CheckpointError(
                    f"{where}: file {OPTIMIZER_TENSORS_FILE} does not fit the tenant's optimizer: {exc}"
                ) from exc
        else:
            slot.optimizer.state.clear()
        slot.version = manifest.policy_version
        # The tenant's own (scheduled) rate, not the one saved: a fork's checkpoint carries its source's.
        slot.schedule_learning_rate()
        created = manifest.extra.get(VERSION_CREATED_AT_KEY)
        slot.version_created_at = created if isinstance(created, str) else manifest.created_at
        slot.optimizer_steps = int(manifest.extra.get("optimizer_steps", 0))
        slot.jobs_completed = int(manifest.extra.get("jobs_completed", 0))
        slot.samples_trained = int(manifest.extra.get("samples_trained", 0))
        recorded = manifest.extra.get("datasets", [])
        slot.datasets = tuple(d for d in recorded if isinstance(d, str)) if isinstance(recorded, list) else ()
        return manifest

    def _restore_adapter(
        self, slot: TenantSlot, manifest: TenantManifest, adapter_state: dict[str, torch.Tensor], where: str
    ) -> None:
        """The checkpoint's adapter tensors into the slot's adapter (strict), or refuse the checkpoint."""
        if slot.adapter is None:
            if adapter_state:
                raise CheckpointError(
                    f"{where}: file {ACTION_MODULE_FILE} holds LoRA adapter tensors, but the tenant has no adapter"
                )
            return
        if not adapter_state:
            raise CheckpointError(f"{where}: file {ACTION_MODULE_FILE} holds no LoRA adapter tensors")
        recorded = manifest.extra.get("adapter")
        if recorded is not None and recorded != slot.adapter.model_dump(mode="json"):
            raise CheckpointError(
                f"{where}: adapter {recorded} differs from the tenant's {slot.adapter.model_dump(mode='json')}"
            )
        try:
            self.backbone.adapters.load_state_dict(slot.config.tenant_id, adapter_state)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"{where}: file {ACTION_MODULE_FILE} does not fit the tenant's adapter: {exc}"
            ) from exc

    def remove(self, tenant_id: str) -> bool:
        """Drop the tenant's slot (module, adapter, optimizer, pending gradients) from memory, and its
        paged-out copy from the spill folder; its checkpoints stay (CheckpointStore.delete_tenant
        removes those). False if it had no slot."""
        self.pending_gradients.pop(tenant_id, None)
        if tenant_id not in self.residency:
            return False
        self.residency.remove(tenant_id)
        self.active.discard(tenant_id)
        # A resident adapter tenant's adapter is on the backbone (a paged-out one's left with its page-out).
        self.backbone.adapters.remove(tenant_id)
        return True

    def detach(self, tenant_id: str) -> bytes:
        """Take the tenant's slot out in the paging format (`TenantResidency.detach`): every number
        of it, optimizer state, counters and loss history included, to `attach` on another shard.
        Refused while it holds pending gradients (a `forward_backward` chain waits for its step)."""
        if tenant_id not in self.residency:
            raise UnknownTenant(tenant_id)
        if tenant_id in self.pending_gradients:
            raise TenantSlotError(f"tenant {tenant_id!r} has pending gradients: step or discard them before moving it")
        data = self.residency.detach(tenant_id)
        self.active.discard(tenant_id)
        return data

    def attach(self, data: bytes) -> dict[str, Any]:
        """A slot another service `detach`-ed, resident here exactly as it left (packed slots come
        back packed and materialize on first use). Refused if the tenant already has a slot here or
        targets another base model."""
        tensors, meta = decode_paged(data)
        config = TenantBackendConfig.model_validate(meta["config"])
        if config.base_model_id != self.backbone.model_id:
            raise TenantSlotError(
                f"tenant {config.tenant_id!r} targets base model {config.base_model_id!r}, "
                f"this service holds {self.backbone.model_id!r}"
            )
        if config.tenant_id in self.residency:
            raise TenantSlotError(f"tenant {config.tenant_id!r} already has a slot here")
        slot = self.pager.restore(config.tenant_id, tensors, meta)
        self.residency.add(config.tenant_id, slot)
        if slot.is_active:
            self.active.activated(config.tenant_id)
        return {"tenant_id": config.tenant_id, "version": slot.version, "issued_version": slot.issued_version}

    def issue_version(self, slot: TenantSlot) -> int:
        """Number a parameter change: the next never-issued version, made durable BEFORE the slot
        (and so any export, result or checkpoint) shows it; a crash after this only skips a number."""
        version = max(slot.version, slot.issued_version) + 1
        self.checkpoints.record_issued_version(slot.config.tenant_id, version)
        slot.issued_version = slot.version = version
        slot.version_created_at = datetime.now(UTC).isoformat()
        return version

    def pack_least_recent(self) -> None:
        """Pack the least recently used active slots beyond `max_active_tenants` that are free to go:
        not pinned (a call is using it), no pending gradients, no LoRA adapter. Runs when a slot's
        last pin goes (`SlotPager.at_rest`), under the residency's lock, so no call can take one of
        these slots between the check and its packing."""
        over, candidates = self.active.excess()
        if over <= 0:  # the common case: every slot's release calls this
            return
        pending = self.pending_gradients
        for tenant_id in candidates:
            if over <= 0:
                return
            slot = self.residency.peek(tenant_id)
            if slot is None or slot.adapter is not None or not slot.is_active:  # paged out, or never packable
                self.active.discard(tenant_id)
                over -= 1
                continue
            if tenant_id in pending or self.residency.pins(tenant_id) > 0:
                continue
            slot.pack()
            self.active.discard(tenant_id)
            over -= 1

    # -- export and checkpoints -------------------------------------------------------------
    def manifest(self, slot: TenantSlot) -> TenantManifest:
        """The export manifest of the slot's version: a function of the version alone (its
        creation time, not the export's), so exports of one version are byte-identical and equal
        `artifacts.export_manifest` of that version's checkpoint manifest."""
        cfg = slot.config
        return TenantManifest(
            created_at=slot.version_created_at,
            tenant_id=cfg.tenant_id,
            policy_version=slot.version,
            schema_signature=cfg.schema_signature,
            base_model_id=cfg.base_model_id,
            module_kind=slot.module.config.kind,
            module_config=slot.module.config.model_dump(mode="json"),
            files={},
            extra=_extra(slot),
        )

    def state_dict(self, slot: TenantSlot) -> dict[str, torch.Tensor]:
        """What a version is: the module's tensors, plus the adapter's under `adapter/` if it has one;
        CPU copies whatever the service's device (exports and checkpoints are device-independent)."""
        module = {k: v.detach().cpu().contiguous() for k, v in slot.module.state_dict().items()}
        if slot.adapter is None:
            return module
        return join_tenant_state(module, cpu_copy(self.backbone.adapters.state_dict(slot.config.tenant_id)))

    def export(self, slot: TenantSlot) -> bytes:
        """The slot's payload as safetensors bytes with its manifest (see the service's `export_params`)."""
        return encode_tenant_payload(self.state_dict(slot), self.manifest(slot))

    def save(self, slot: TenantSlot, include_optim: bool) -> TenantManifest:
        """Checkpoints are immutable per version: saving an already-saved version returns its manifest."""
        cfg = slot.config
        if not self.checkpoints.writes:  # a data-parallel rank > 0: rank 0 writes this version
            return self.manifest(slot)
        if slot.version in self.checkpoints.versions(cfg.tenant_id):
            return self.checkpoints.load_tenant(cfg.tenant_id, slot.version)[0]
        return self.checkpoints.save_tenant(
            tenant_id=cfg.tenant_id,
            policy_version=slot.version,
            schema_signature=cfg.schema_signature,
            base_model_id=cfg.base_model_id,
            module_kind=slot.module.config.kind,
            module_config=slot.module.config.model_dump(mode="json"),
            module_state=self.state_dict(slot),
            optimizer_state=slot.optimizer.state_dict() if include_optim else None,
            extra=_extra(slot),
        )


def manifest_dict(manifest: TenantManifest) -> dict[str, Any]:
    """A checkpoint manifest as the service returns it: its JSON fields and its digest."""
    return {**json.loads(manifest.to_json()), "digest": manifest.digest}


def _extra(slot: TenantSlot) -> dict[str, Any]:
    """The slot's counters (and adapter config) a manifest records beside its tensors."""
    extra: dict[str, Any] = {
        "optimizer_steps": slot.optimizer_steps,
        "jobs_completed": slot.jobs_completed,
        "samples_trained": slot.samples_trained,
        VERSION_CREATED_AT_KEY: slot.version_created_at,
        # The cameras and their (height, width) as the tenant trains on them: an export declares
        # these, not the backbone's tile side (LeRobot resized frames to what it declared).
        OBSERVATION_KEY: {"cameras": list(slot.config.cameras), "image_size": list(slot.config.image_size)},
    }
    if slot.adapter is not None:
        extra["adapter"] = slot.adapter.model_dump(mode="json")
    if slot.config.normalization is not None:  # the statistics travel with every version
        extra["normalization"] = slot.config.normalization
    if slot.datasets:  # the data that trained it: every dataset's digest, and the latest one's
        extra["datasets"], extra[DATASET_SHA256_KEY] = list(slot.datasets), slot.datasets[-1]
    return extra
