"""Training Model Service, the actor (paper sections 4.1.2, A.6).

Keeps ONE resident frozen backbone and a slot per tenant (action module, optimizer state, policy
version). `train_job` consumes a leased job's Training Queue partition in microbatches: it checks
that every sample carries the job's tenant and schema signature, runs the shared backbone forward
without gradients, then that tenant's loss, backward and optimizer step. `train_group` is the
group-batched form (paper 5.2): one shared backbone forward over several tenants' microbatches,
then each tenant's own update on its own rows. Nothing here is ever averaged or shared across
tenants. Deployed as a named Ray actor (`training_service_actor`).

A tenant may also own a LoRA adapter on the shared backbone (`TenantBackendConfig.adapter`): its
parameters join the tenant's AdamW, its forward runs with autograd through the backbone's text model
(the base weights stay frozen and shared), and the slot's state dict — the module's tensors plus the
adapter's under `adapter/` — is what is versioned, checkpointed, exported and loaded for serving.

Tenant density (issue 14.5): a slot is in one of three tiers, each bounded, least recently used first
out (vLLM's `max_loras` / `max_cpu_loras` and a disk tier behind them):

- active (at most `max_active_tenants`): module and AdamW are live objects, ready to step;
- packed resident (up to `max_resident_tenants` in all): the same numbers in a few flat tensors
  (`slot_packing`), materialized without a copy (views of those tensors) when the slot is used;
- paged out: the rest, one file each in a spill folder, paged back in exactly on next use
  (`tenant_residency`, `_SlotPager`).

A slot a call uses stays pinned until that call returns, so a step never runs on a slot that is being
packed or paged out; slots with a LoRA adapter or pending gradients are never packed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from joynexus.artifacts import (
    ACTION_MODULE_FILE,
    OPTIMIZER_TENSORS_FILE,
    VERSION_CREATED_AT_KEY,
    CheckpointError,
    CheckpointStore,
    TenantManifest,
    encode_tenant_payload,
)
from joynexus.artifacts.codec import _decode_optimizer_state, _encode_optimizer_state
from joynexus.core.metering import split_group_seconds
from joynexus.core.tenants import BaseModelCapabilities, TenantBackendConfig
from joynexus.models.action_modules import ActionModule, ActionModuleConfig, build_action_module
from joynexus.models.adapters import LoraAdapterConfig, join_tenant_state, split_tenant_state
from joynexus.models.backbone import BackboneFeatures, BackboneSource, ResidentBackbone
from joynexus.models.module_batching import gather_inputs, group_by_architecture, group_loss, stack_parameters
from joynexus.models.placement import DevicePlacement, cpu_copy
from joynexus.scheduling.training_queue import TrainingQueueClient
from joynexus.scheduling.training_scheduler import TrainingJob
from joynexus.services.residency import (
    DEFAULT_MAX_RESIDENT_TENANTS,
    ResidencyLimits,
    TenantResidency,
    UnknownEntry,
    pin_during_calls,
    rebuild_module,
    tensor_bytes,
)
from joynexus.services.training.packing import DEFAULT_MAX_ACTIVE_TENANTS, ActiveSlots, PackedTrainingState

TRAINING_SERVICE_ACTOR_NAME = "joynexus.training_service"

log = logging.getLogger(__name__)

# Fields an SFT partition carries per sample; tenant and schema annotations travel with each row.
SFT_FIELDS = ("images", "state", "action", "action_is_pad", "task", "tenant_id", "schema_signature")
# An RL partition adds what the rollout recorded and the advantage stage derived.
RL_FIELDS = (*SFT_FIELDS, "log_prob", "advantage", "return")


class TenantSlotError(RuntimeError):
    pass


class UnknownTenant(TenantSlotError, KeyError):
    def __init__(self, tenant_id: str):
        super().__init__(f"tenant {tenant_id!r} has no slot in this Training Model Service")


class TenantSlot:
    """One tenant's training state: its module and optimizer, counters, loss history, LoRA adapter.

    The module and optimizer are either live objects (active) or packed into flat tensors
    (`PackedTrainingState`); reading `module` or `optimizer` materializes a packed slot (views of
    its flat tensors, no copy) and reports it to `active_tier`, so callers never see the difference.
    A slot with a LoRA adapter is never packed (its adapter's parameters live on the backbone)."""

    __slots__ = (
        "_lock",
        "_module",
        "_optimizer",
        "_packed",
        "active_tier",
        "adapter",
        "adapter_parameters",
        "config",
        "issued_version",
        "jobs_completed",
        "losses",
        "optimizer_steps",
        "samples_trained",
        "version",
        "version_created_at",
    )

    def __init__(
        self,
        config: TenantBackendConfig,
        module: ActionModule | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        version: int = 0,
        issued_version: int = 0,
        optimizer_steps: int = 0,
        jobs_completed: int = 0,
        samples_trained: int = 0,
        losses: list[float] | None = None,
        adapter: LoraAdapterConfig | None = None,
        adapter_parameters: list[torch.nn.Parameter] | None = None,
        version_created_at: str | None = None,
        *,
        packed: PackedTrainingState | None = None,
        active_tier: ActiveSlots | None = None,
    ) -> None:
        """Either `module` and `optimizer` (active) or `packed`. `active_tier`: told when a packed
        slot is materialized (None: nobody tracks it)."""
        if (module is None or optimizer is None) == (packed is None):
            raise ValueError("TenantSlot: give either module and optimizer, or packed")
        if packed is not None and adapter is not None:
            raise ValueError("TenantSlot: a slot with a LoRA adapter is never packed")
        self.config = config
        self._module, self._optimizer, self._packed = module, optimizer, packed
        self._lock = threading.Lock()
        self.active_tier = active_tier
        self.version = version  # the version of the weights the slot holds now
        # Highest version number ever issued for this tenant (>= version; higher after a restore from
        # an older checkpoint): the next version is issued_version + 1, so no number is reused.
        self.issued_version = issued_version
        self.optimizer_steps = optimizer_steps
        self.jobs_completed = jobs_completed
        self.samples_trained = samples_trained
        self.losses = [] if losses is None else losses
        # The tenant's LoRA adapter on the shared backbone (its key there is the tenant id); None: none.
        self.adapter = adapter
        self.adapter_parameters = [] if adapter_parameters is None else adapter_parameters
        # When the weights of `version` were made (an export's created_at: exports of one version are
        # byte-identical); restored from the checkpoint with the version.
        self.version_created_at = datetime.now(UTC).isoformat() if version_created_at is None else version_created_at

    @property
    def module(self) -> ActionModule:
        module = self._module
        return module if module is not None else self._materialize()[0]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        optimizer = self._optimizer
        return optimizer if optimizer is not None else self._materialize()[1]

    @property
    def is_active(self) -> bool:
        """Module and optimizer are live objects (not only packed)."""
        return self._module is not None

    @property
    def packed_state(self) -> PackedTrainingState | None:
        """The flat tensors: the slot's numbers while packed; while active, the storage its tensors
        are views of (None before the slot was first packed)."""
        return self._packed

    def _materialize(self) -> tuple[ActionModule, torch.optim.Optimizer]:
        with self._lock:
            if self._module is None:
                assert self._packed is not None
                self._module, self._optimizer = self._packed.materialize()
            module, optimizer = self._module, self._optimizer
        if self.active_tier is not None:
            self.active_tier.activated(self.config.tenant_id)
        assert optimizer is not None
        return module, optimizer

    def pack(self) -> PackedTrainingState:
        """Drop the module and optimizer objects, keeping their numbers in flat tensors (no copy for
        tensors that are views of them already). Gradients are dropped: only for a slot at rest."""
        with self._lock:
            if self.adapter is not None:
                raise TenantSlotError(f"tenant {self.config.tenant_id!r}: a slot with a LoRA adapter is never packed")
            if self._module is not None:
                assert self._optimizer is not None
                self._packed = PackedTrainingState.pack(self._module, self._optimizer, self._packed)
                self._module = self._optimizer = None
            assert self._packed is not None
            return self._packed

    def zero_grad_if_active(self) -> None:
        """Free the gradients of a live optimizer (a packed slot holds none)."""
        with self._lock:
            if self._optimizer is not None:
                self._optimizer.zero_grad(set_to_none=True)

    def nbytes(self) -> int:
        """Bytes of tensors the slot holds: packed, its flat tensors; active, its parameters, buffers,
        gradients and optimizer state (views of the flat tensors counted once)."""
        with self._lock:
            module, optimizer, packed = self._module, self._optimizer, self._packed
        if module is None or optimizer is None:
            assert packed is not None
            return packed.nbytes
        params = [*module.parameters(), *self.adapter_parameters]
        moments = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        live = [*params, *module.buffers(), *(p.grad for p in params), *moments]
        return tensor_bytes(live) if packed is None else packed.bytes_with(live)

    def parameters(self) -> list[torch.nn.Parameter]:
        """Everything the tenant trains: its module's parameters, then its adapter's."""
        return [*self.module.parameters(), *self.adapter_parameters]


def microbatch_to_tensors(
    data: dict[str, Any],
) -> tuple[list[list[torch.Tensor]], list[str], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queue columns -> (per-sample camera lists, instructions, state, action, action_is_pad)."""
    images = torch.as_tensor(np.asarray(data["images"], dtype=np.float32))
    per_sample = [list(sample.unbind(0)) for sample in images]
    state = torch.as_tensor(np.asarray(data["state"], dtype=np.float32))
    action = torch.as_tensor(np.asarray(data["action"], dtype=np.float32))
    pad = torch.as_tensor(np.asarray(data["action_is_pad"], dtype=bool))
    return per_sample, [str(t) for t in data["task"]], state, action, pad


@dataclass
class _Microbatch:
    """One tenant's microbatch as tensors, blank instructions filled with the tenant's default."""

    images: list[list[torch.Tensor]]
    instructions: list[str]
    state: torch.Tensor
    action: torch.Tensor
    action_is_pad: torch.Tensor

    def __len__(self) -> int:
        return len(self.images)


class TrainingModelService:
    def __init__(
        self,
        backbone_source: BackboneSource | dict[str, Any],
        checkpoint_root: str | Path,
        queue: Any = None,
        num_threads: int | None = None,
        keep_last: int | None = None,  # checkpoint retention: last K + pinned versions; None keeps all
        placement: DevicePlacement | dict[str, Any] | str | None = None,
        max_resident_tenants: int = DEFAULT_MAX_RESIDENT_TENANTS,
        max_resident_tenant_bytes: int | None = None,
        spill_dir: str | Path | None = None,
        max_active_tenants: int = DEFAULT_MAX_ACTIVE_TENANTS,
    ):
        """`placement`: the device (and backbone dtype) of everything this service computes with:
        backbone, tenant modules, adapters, AdamW state, microbatches; None: what JOYNEXUS_DEVICE /
        JOYNEXUS_DTYPE say ("auto": a GPU this process sees, else the CPU). What leaves is CPU tensors.
        `max_resident_tenants` / `max_resident_tenant_bytes`: how many tenant slots (and bytes of
        their tensors) stay in memory; the least recently used beyond them are paged out to a folder
        under `spill_dir` (None: a temporary folder) and paged back in, exactly, on next use.
        `max_active_tenants`: how many resident slots keep their module and optimizer as live objects;
        the least recently used others are packed into flat tensors (materialized again on use)."""
        # The active tier's bound, checked first: a bad value fails before the backbone is built.
        self._active = ActiveSlots(max_active_tenants, "max_active_tenants")
        if num_threads:
            torch.set_num_threads(num_threads)
        source = (
            BackboneSource.model_validate(backbone_source) if isinstance(backbone_source, dict) else backbone_source
        )
        self.placement = DevicePlacement.of(placement)
        self.backbone = source.build(self.placement)
        self.device = self.backbone.device
        self.checkpoints = CheckpointStore(checkpoint_root, keep_last=keep_last)
        self.queue = TrainingQueueClient(queue) if queue is not None else None
        # Every registered tenant's slot, resident or paged out (a mapping of tenant ids; see _slot).
        self._slots: TenantResidency[str, TenantSlot] = TenantResidency(
            _SlotPager(self),
            ResidencyLimits(
                max_resident_tenants, max_resident_tenant_bytes, ("max_resident_tenants", "max_resident_tenant_bytes")
            ),
            spill_dir,
            name="training-slots",
        )
        # Which life of this role is answering: a Ray restart in place builds a new one (empty slots),
        # and the Master's Health Manager restores the tenants when it sees the change.
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.time()

    def heartbeat(self) -> dict[str, Any]:
        """Liveness answer (lock-free: it runs beside a training call, in the health group)."""
        return {
            "role": "training",
            "incarnation": self.incarnation,
            "started_at": self.started_at,
            "pid": os.getpid(),
            "tenants": sorted(list(self._slots)),
            **self.backbone.placement_info(),
        }

    # -- introspection ----------------------------------------------------------------------
    def backbone_info(self) -> dict[str, Any]:
        return {
            "model_id": self.backbone.model_id,
            "instances_created": ResidentBackbone.instances_created,
            "backbone_object_id": id(self.backbone),
            "parameter_count": self.backbone.parameter_count(),
            "prefix_key": list(self.backbone.prefix_key),
            "pid": os.getpid(),
            "tenants": sorted(self._slots),
            **self.backbone.placement_info(),
        }

    def capabilities(self) -> BaseModelCapabilities:
        return BaseModelCapabilities.of_backbone(self.backbone)

    def tenants(self) -> list[str]:
        return sorted(self._slots)

    def policy_version(self, tenant_id: str) -> int:
        return self._slot(tenant_id).version

    def tenant_status(self, tenant_id: str) -> dict[str, Any]:
        slot = self._slot(tenant_id)
        return {
            "tenant_id": tenant_id,
            "version": slot.version,
            "optimizer_steps": slot.optimizer_steps,
            "jobs_completed": slot.jobs_completed,
            "samples_trained": slot.samples_trained,
            "first_loss": slot.losses[0] if slot.losses else None,
            "last_loss": slot.losses[-1] if slot.losses else None,
        }

    def tenant_state(self, tenant_id: str) -> dict[str, Any]:
        """CPU copies of the slot's parameters and optimizer state (tests check isolation with these)."""
        slot = self._slot(tenant_id)
        state = {
            "version": slot.version,
            "module": cpu_copy(slot.module.state_dict()),
            "optimizer": cpu_copy(slot.optimizer.state_dict()),
        }
        if slot.adapter is not None:
            state["adapter"] = cpu_copy(self.backbone.adapters.state_dict(tenant_id))
        return state

    # -- slots ------------------------------------------------------------------------------
    def add_tenant(self, config: TenantBackendConfig | dict[str, Any], resume: bool = True) -> dict[str, Any]:
        """Create the tenant's slot; with `resume`, restore its last checkpoint if one exists."""
        config = TenantBackendConfig.model_validate(config) if isinstance(config, dict) else config
        if config.base_model_id != self.backbone.model_id:
            raise TenantSlotError(
                f"tenant {config.tenant_id!r} targets base model {config.base_model_id!r}, "
                f"this service holds {self.backbone.model_id!r}"
            )
        if config.tenant_id in self._slots:
            return {"tenant_id": config.tenant_id, "version": self._slot(config.tenant_id).version, "resumed": False}
        module_config = ActionModuleConfig.model_validate(config.action_module)
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            module = build_action_module(module_config)
        # Drawn on the CPU (the same initial weights on every device), trained in float32 on ours.
        module = module.to(self.device)
        if config.adapter is None:
            optimizer = torch.optim.AdamW(module.parameters(), lr=config.learning_rate)
            slot = TenantSlot(config=config, module=module, optimizer=optimizer, active_tier=self._active)
        else:
            adapter = LoraAdapterConfig.model_validate(config.adapter)
            # Initialized from the tenant's seed (peft: A Kaiming-uniform, B zero: a no-op at first).
            self.backbone.adapters.add(config.tenant_id, adapter, seed=config.seed, trainable=True)
            adapter_parameters = self.backbone.adapters.parameters(config.tenant_id)
            optimizer = torch.optim.AdamW([*module.parameters(), *adapter_parameters], lr=config.learning_rate)
            slot = TenantSlot(
                config=config,
                module=module,
                optimizer=optimizer,
                adapter=adapter,
                adapter_parameters=adapter_parameters,
            )
        resumed = False
        try:
            if resume and self.checkpoints.latest_version(config.tenant_id) is not None:
                self._restore(slot)
                resumed = True
        except BaseException:
            if slot.adapter is not None:  # no slot, so no adapter left on the shared backbone either
                self.backbone.adapters.remove(config.tenant_id)
            raise
        # Versions after the restored checkpoint may have been issued (exported, published) before a
        # crash with other weights: continue numbering after every version ever issued.
        slot.issued_version = max(slot.version, self.checkpoints.issued_version(config.tenant_id) or 0)
        self._slots.add(config.tenant_id, slot)  # resident; beyond the bound the least recently used slot pages out
        if slot.adapter is None:  # active until it falls beyond max_active_tenants (adapter slots stay so)
            self._active.activated(config.tenant_id)
        return {"tenant_id": config.tenant_id, "version": slot.version, "resumed": resumed}

    def _restore(self, slot: TenantSlot) -> None:
        tenant_id = slot.config.tenant_id
        manifest, module_state, optimizer_state = self.checkpoints.load_tenant(tenant_id, map_location=self.device)
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
        slot.version = manifest.policy_version
        created = manifest.extra.get(VERSION_CREATED_AT_KEY)
        slot.version_created_at = created if isinstance(created, str) else manifest.created_at
        slot.optimizer_steps = int(manifest.extra.get("optimizer_steps", 0))
        slot.jobs_completed = int(manifest.extra.get("jobs_completed", 0))
        slot.samples_trained = int(manifest.extra.get("samples_trained", 0))

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

    def remove_tenant(self, tenant_id: str) -> bool:
        """Drop the tenant's slot (module, adapter, optimizer, pending gradients) from memory, and its
        paged-out copy from the spill folder; its checkpoints stay (CheckpointStore.delete_tenant
        removes those). False if it had no slot."""
        self._pending_gradients().pop(tenant_id, None)
        if tenant_id not in self._slots:
            return False
        self._slots.remove(tenant_id)
        self._active.discard(tenant_id)
        # A resident adapter tenant's adapter is on the backbone (a paged-out one's left with its page-out).
        self.backbone.adapters.remove(tenant_id)
        return True

    def _issue_version(self, slot: TenantSlot) -> int:
        """Number a parameter change: the next never-issued version, made durable BEFORE the slot
        (and so any export, result or checkpoint) shows it; a crash after this only skips a number."""
        version = max(slot.version, slot.issued_version) + 1
        self.checkpoints.record_issued_version(slot.config.tenant_id, version)
        slot.issued_version = slot.version = version
        slot.version_created_at = datetime.now(UTC).isoformat()
        return version

    def _slot(self, tenant_id: str) -> TenantSlot:
        """The tenant's slot, paged in (exactly as it was paged out) if it was not resident, now the
        most recently used. It stays pinned in memory until the public call that asked for it returns
        (`pin_during_calls` below the class), so a step never runs on a slot that was paged out. A
        packed slot materializes when its module or optimizer is first read."""
        try:
            slot = self._slots.use(tenant_id)
        except UnknownEntry:
            raise UnknownTenant(tenant_id) from None
        self._active.touch(tenant_id)
        return slot

    def _pack_least_recent(self) -> None:
        """Pack the least recently used active slots beyond `max_active_tenants` that are free to go:
        not pinned (a call is using it), no pending gradients, no LoRA adapter. Runs when a slot's
        last pin goes (`_SlotPager.at_rest`), under the residency's lock, so no call can take one of
        these slots between the check and its packing."""
        over, candidates = self._active.excess()
        if over <= 0:  # the common case: every slot's release calls this
            return
        pending = self._pending_gradients()
        for tenant_id in candidates:
            if over <= 0:
                return
            slot = self._slots.peek(tenant_id)
            if slot is None or slot.adapter is not None or not slot.is_active:  # paged out, or never packable
                self._active.discard(tenant_id)
                over -= 1
                continue
            if tenant_id in pending or self._slots.pins(tenant_id) > 0:
                continue
            slot.pack()
            self._active.discard(tenant_id)
            over -= 1

    def residency_stats(self) -> dict[str, Any]:
        """Tenant slots in memory and paged out: counts, bytes, hits, page-ins and page-outs."""
        return self._slots.stats()

    # -- training ---------------------------------------------------------------------------
    def train_batch(self, tenant_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        """One optimizer step on one tenant's slot from supplied samples (the lower-layer primitive)."""
        slot = self._slot(tenant_id)
        _check_annotations(batch, tenant_id, slot.config.schema_signature)
        loss = self._step(slot, batch)
        self._issue_version(slot)  # every parameter change is a new version: exports and checkpoints stay unambiguous
        return {"tenant_id": tenant_id, "loss": loss, "optimizer_steps": slot.optimizer_steps, "version": slot.version}

    def train_job(self, job: TrainingJob | dict[str, Any]) -> dict[str, Any]:
        """Consume a leased job's partition in microbatches; one optimizer step per microbatch,
        then bump only this tenant's policy version and (per its config) checkpoint it."""
        if self.queue is None:
            raise TenantSlotError("this Training Model Service was started without a Training Queue")
        job = job if isinstance(job, TrainingJob) else TrainingJob(**job)
        slot = self._slot(job.tenant_id)
        if job.schema_signature != slot.config.schema_signature:
            raise TenantSlotError(
                f"job {job.job_id} carries schema signature {job.schema_signature}, "
                f"tenant {job.tenant_id!r} has {slot.config.schema_signature}"
            )
        started = time.perf_counter()
        losses: list[float] = []
        samples = 0
        extra: dict[str, Any] = {}
        if job.task_type == "rl":
            losses, samples, extra = self._train_rl_partition(slot, job)
        else:
            while True:
                meta = self.queue.get_meta(job.partition_id, SFT_FIELDS, slot.config.microbatch_size, "train")
                if meta is None:
                    break
                data = self.queue.get_data(meta)
                _check_annotations(data, job.tenant_id, slot.config.schema_signature)
                losses.append(self._step(slot, data))
                samples += meta.size
        if samples == 0:
            raise TenantSlotError(f"job {job.job_id}: partition {job.partition_id} holds no samples")
        self._issue_version(slot)
        slot.jobs_completed += 1
        every = slot.config.checkpoint_every_jobs
        manifest = self._save_slot(slot, include_optim=True) if every and slot.jobs_completed % every == 0 else None
        return {
            "job_id": job.job_id,
            "tenant_id": job.tenant_id,
            "version": slot.version,
            "losses": losses,
            "samples": samples,
            "optimizer_steps": slot.optimizer_steps,
            "seconds": time.perf_counter() - started,
            "checkpoint_version": manifest.policy_version if manifest else None,
            **extra,
        }

    def _train_rl_partition(self, slot: TenantSlot, job: TrainingJob) -> tuple[list[float], int, dict[str, Any]]:
        """PPO over a rollout partition (paper A.6): `ppo_epochs` passes of clipped-surrogate updates
        in microbatches, each pass reading the partition through its own Training Queue cursor.
        The backbone is frozen, so each sample's features are computed once and reused."""
        from joynexus.algorithms.rl import ppo_loss

        rl = slot.config.rl
        if rl is None:
            raise TenantSlotError(f"tenant {slot.config.tenant_id!r} is not an RL tenant; job {job.job_id} is 'rl'")
        losses: list[float] = []
        stats: dict[str, list[float]] = {"clip_fraction": [], "approx_kl": [], "value_loss": [], "entropy": []}
        features_cache: dict[tuple[int, ...], BackboneFeatures] = {}
        module = slot.module
        samples = 0
        for epoch in range(rl["ppo_epochs"]):
            while True:
                meta = self.queue.get_meta(
                    job.partition_id, RL_FIELDS, slot.config.microbatch_size, f"ppo-epoch-{epoch}"
                )
                if meta is None:
                    break
                data = self.queue.get_data(meta)
                _check_annotations(data, job.tenant_id, slot.config.schema_signature)
                batch = self._prepare(slot, data)
                if slot.adapter is not None:
                    # The features depend on the adapter, which every step changes: no reuse.
                    features = self._encode_slot(slot, batch)
                else:
                    if meta.indices not in features_cache:
                        features_cache[meta.indices] = self.encode(batch.images, batch.instructions)
                    features = features_cache[meta.indices]
                old_log_prob = torch.as_tensor(np.asarray(data["log_prob"], dtype=np.float32), device=self.device)
                advantages = torch.as_tensor(np.asarray(data["advantage"], dtype=np.float32), device=self.device)
                returns = torch.as_tensor(np.asarray(data["return"], dtype=np.float32), device=self.device)
                last: dict[str, Any] = {}

                def compute_loss(
                    features=features, batch=batch, old=old_log_prob, adv=advantages, ret=returns, last=last
                ) -> torch.Tensor:
                    dist = module.action_distribution(features, batch.state)
                    new_log_prob = dist.log_prob(batch.action).sum(dim=(-1, -2))
                    values = module.value(features, batch.state) if module.config.value_head else None
                    out = ppo_loss(
                        new_log_prob,
                        old,
                        adv,
                        values=values,
                        returns=ret if values is not None else None,
                        entropy=dist.entropy().sum(dim=(-1, -2)),
                        clip=rl["clip"],
                        value_coef=rl["value_coef"],
                        entropy_coef=rl["entropy_coef"],
                        # GRPO advantages are normalized within their groups already (0 outside them).
                        normalize_advantages=rl["advantage"] != "grpo",
                    )
                    last["out"] = out
                    return out.total

                losses.append(self._update(slot, features, batch, compute_loss=compute_loss))
                out = last["out"]
                stats["clip_fraction"].append(float(out.clip_fraction))
                stats["approx_kl"].append(float(out.approx_kl))
                if module.config.value_head:  # only what the algorithm computes: GRPO has no critic
                    stats["value_loss"].append(float(out.value.detach()))
                stats["entropy"].append(float(out.entropy.detach()))
                if epoch == 0:
                    samples += meta.size
        summary = {f"rl/{k}": float(np.mean(v)) for k, v in stats.items() if v}
        return losses, samples, {"rl_stats": summary}

    def train_group(self, batches: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        """Group-batched execution (paper 5.2): one optimizer step for each of several tenants from
        ONE shared backbone forward over all their microbatches (any mix of schemas).

        Each element is (tenant_id, microbatch in `train_batch`'s column format); results come back
        in the same order, like `train_batch`'s plus the shared forward's `encode_seconds` and the
        tenant's own `module_seconds`. Checked before any tenant steps, raising and changing
        nothing: unknown tenants, a tenant named twice (two optimizer steps would share one
        forward), every sample's tenant and schema annotations, empty microbatches. After the
        forward, each tenant's loss, backward, clip and AdamW step use only its own rows and its
        own slot; nothing is averaged across tenants. A tenant whose update raises (module error,
        non-finite loss or gradients) gets `error` in its result and keeps its slot unchanged,
        while the others still step.

        Tenants whose modules have identical configs compute their losses as ONE batched
        computation over their stacked parameters (`models.module_batching`, issue 14): the sum of
        their losses backpropagates into each tenant's own leaves exactly its own gradients, then
        each clips and steps its own AdamW; results equal per-tenant updates within float tolerance.

        Tenants with LoRA adapters share the forward too (a mixed-adapter batch with autograd on):
        each one's gradients are taken from the one graph for its own parameters only, and only
        when every tenant's are taken do their optimizers step (a step changes adapter weights the
        graph still needs).
        """
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
            slot = self._slot(tenant_id)
            _check_annotations(data, tenant_id, slot.config.schema_signature)
            slots.append(slot)
        prepared = [self._prepare(slot, data) for slot, (_, data) in zip(slots, batches, strict=True)]
        rows: list[slice] = []
        offset = 0
        for slot, batch in zip(slots, prepared, strict=True):
            if len(batch) == 0:
                raise TenantSlotError(f"tenant {slot.config.tenant_id!r}: empty microbatch in a training group")
            rows.append(slice(offset, offset + len(batch)))
            offset += len(batch)

        started = time.perf_counter()
        if any(slot.adapter is not None for slot in slots):
            features = self.encode(
                [cams for batch in prepared for cams in batch.images],
                [text for batch in prepared for text in batch.instructions],
                adapters=[
                    key for slot, batch in zip(slots, prepared, strict=True) for key in _adapter_keys(slot, batch)
                ],
                grad=True,
            )
            return self._adapter_group_updates(slots, prepared, rows, features, time.perf_counter() - started)
        features = self.encode(
            [cams for batch in prepared for cams in batch.images],
            [text for batch in prepared for text in batch.instructions],
        )
        encode_seconds = time.perf_counter() - started
        return self._module_updates(slots, prepared, rows, features, encode_seconds)

    def _module_updates(
        self,
        slots: list[TenantSlot],
        prepared: list[_Microbatch],
        rows: list[slice],
        features: BackboneFeatures,
        encode_seconds: float,
    ) -> list[dict[str, Any]]:
        """`train_group`'s updates of tenants without an adapter, after the shared forward (on
        features without a graph). Tenants whose modules share an architecture compute their losses
        as ONE batched computation (`models.module_batching`), then each takes its own clip and
        AdamW step; the others update one at a time. Results in the order of `slots`."""
        results: list[dict[str, Any] | None] = [None] * len(slots)
        # Identical configs only (no padded dims, unlike inference): a padded group's gradients equal
        # the per-tenant ones only to float rounding, and AdamW's normalization amplifies rounding in
        # near-zero gradient entries (~1e-5 after a few steps); grouped training is held to serial
        # steps at 1e-5 (tests/services/test_group_training.py).
        for members in group_by_architecture([slot.module for slot in slots], pad_dims=False):
            outcomes = None
            if len(members) >= 2:
                outcomes = self._batched_updates(
                    [slots[i] for i in members], [prepared[i] for i in members], [rows[i] for i in members], features
                )
            if outcomes is None:  # a group of one, or a batched loss that raised: one tenant at a time
                outcomes = []
                for i in members:
                    started = time.perf_counter()
                    try:
                        # trimmed(): drop the padding columns other tenants' longer prompts added, so
                        # the head sees exactly the shapes a forward of its own microbatch would give.
                        loss = self._update(slots[i], features.select(rows[i]).trimmed(), prepared[i])
                        self._issue_version(slots[i])  # as train_batch: every parameter change is a new version
                        outcomes.append((loss, None, time.perf_counter() - started))
                    except Exception as exc:  # one tenant's failure is its own; the group goes on
                        outcomes.append((None, f"{type(exc).__name__}: {exc}", time.perf_counter() - started))
            for i, (loss, error, seconds) in zip(members, outcomes, strict=True):
                results[i] = _group_result(slots[i], loss, encode_seconds, seconds, error)
        return [r for r in results if r is not None]

    def _batched_updates(
        self, slots: list[TenantSlot], prepared: list[_Microbatch], rows: list[slice], features: BackboneFeatures
    ) -> list[tuple[float | None, str | None, float]] | None:
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
                [_loss_generator(slot) for slot in slots],
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
        outcomes: list[tuple[float | None, str | None, float]] = []
        for slot, batch, value, ok, share in zip(slots, prepared, values, finite_flags, shares, strict=True):
            step_started = time.perf_counter()
            tenant = slot.config.tenant_id
            try:
                if not ok:
                    raise TenantSlotError(f"tenant {tenant!r}: non-finite loss {value}")
                grad_norm = torch.nn.utils.clip_grad_norm_(slot.parameters(), 1.0)
                if not torch.isfinite(grad_norm):
                    raise TenantSlotError(f"tenant {tenant!r}: non-finite gradient norm {grad_norm.item()}")
            except Exception as exc:
                slot.optimizer.zero_grad(set_to_none=True)
                outcomes.append((None, f"{type(exc).__name__}: {exc}", share + time.perf_counter() - step_started))
                continue
            try:
                self._apply_step(slot, batch, value)
                self._issue_version(slot)
                outcomes.append((value, None, share + time.perf_counter() - step_started))
            except Exception as exc:
                outcomes.append((None, f"{type(exc).__name__}: {exc}", share + time.perf_counter() - step_started))
        return outcomes

    def _adapter_group_updates(
        self,
        slots: list[TenantSlot],
        prepared: list[_Microbatch],
        rows: list[slice],
        features: BackboneFeatures,
        encode_seconds: float,
    ) -> list[dict[str, Any]]:
        """`train_group`'s updates after a shared forward that carries adapter gradients. Tenants
        without an adapter update on detached features (their module is not in the graph) through
        `_module_updates`, batched like any group; adapter tenants first all take their gradients,
        then all step."""
        results: list[dict[str, Any] | None] = [None] * len(slots)
        plain = [i for i, slot in enumerate(slots) if slot.adapter is None]
        if plain:
            updated = self._module_updates(
                [slots[i] for i in plain],
                [prepared[i] for i in plain],
                [rows[i] for i in plain],
                features.detach(),
                encode_seconds,
            )
            for i, out in zip(plain, updated, strict=True):
                results[i] = out
        waiting: list[tuple[int, float, float]] = []  # (index, loss, module seconds so far)
        for index, (slot, batch, own_rows) in enumerate(zip(slots, prepared, rows, strict=True)):
            if slot.adapter is None:
                continue
            started = time.perf_counter()
            try:
                own = features.select(own_rows).trimmed()
                waiting.append((index, self._gradients(slot, own, batch), time.perf_counter() - started))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                results[index] = _group_result(slot, None, encode_seconds, time.perf_counter() - started, error)
        for index, loss, seconds in waiting:
            slot = slots[index]
            started = time.perf_counter()
            self._apply_step(slot, prepared[index], loss)
            self._issue_version(slot)
            results[index] = _group_result(slot, loss, encode_seconds, seconds + time.perf_counter() - started, None)
        return [r for r in results if r is not None]

    def _gradients(self, slot: TenantSlot, features: BackboneFeatures, batch: _Microbatch) -> float:
        """The first half of `_update` from a graph other tenants share: loss, then gradients of
        THIS slot's parameters only (autograd.grad, the graph kept), clipped. Raising leaves no
        gradient behind."""
        slot.module.train()
        slot.optimizer.zero_grad(set_to_none=True)
        params = slot.parameters()
        try:
            loss = slot.module.loss(
                features, batch.state, batch.action, batch.action_is_pad, generator=_loss_generator(slot)
            )
            if not torch.isfinite(loss):
                raise TenantSlotError(f"tenant {slot.config.tenant_id!r}: non-finite loss {loss.item()}")
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            if not torch.isfinite(grad_norm):
                raise TenantSlotError(f"tenant {slot.config.tenant_id!r}: non-finite gradient norm {grad_norm.item()}")
        except BaseException:
            slot.optimizer.zero_grad(set_to_none=True)
            raise
        return float(loss.detach())

    def _apply_step(self, slot: TenantSlot, batch: _Microbatch, loss: float) -> None:
        """The second half of `_update`: the AdamW step on the gradients `_gradients` left."""
        slot.optimizer.step()
        slot.optimizer_steps += 1
        slot.samples_trained += len(batch)
        slot.losses.append(loss)

    def _encode_slot(self, slot: TenantSlot, batch: _Microbatch) -> BackboneFeatures:
        """One tenant's own forward: through its adapter with autograd if it has one."""
        if slot.adapter is None:
            return self.encode(batch.images, batch.instructions)
        return self.encode(batch.images, batch.instructions, adapters=_adapter_keys(slot, batch), grad=True)

    def _prepare(self, slot: TenantSlot, data: dict[str, Any]) -> _Microbatch:
        images, instructions, state, action, pad = microbatch_to_tensors(data)
        if slot.config.instruction:
            instructions = [text or slot.config.instruction for text in instructions]
        # The module's tensors on the service's device; camera images stay on the host until the
        # backbone copies them over, one batch per image size.
        state, action, pad = state.to(self.device), action.to(self.device), pad.to(self.device)
        return _Microbatch(images, instructions, state, action, pad)

    def _step(self, slot: TenantSlot, data: dict[str, Any]) -> float:
        """Serial path: this microbatch's own backbone forward, then the tenant's update."""
        batch = self._prepare(slot, data)
        return self._update(slot, self._encode_slot(slot, batch), batch)

    def _update(
        self,
        slot: TenantSlot,
        features: BackboneFeatures,
        batch: _Microbatch,
        compute_loss: Callable[[], torch.Tensor] | None = None,
    ) -> float:
        """The per-tenant update both paths share: loss, backward, clip, AdamW step, on this slot only.

        Anything raised before the optimizer step leaves the slot's parameters, optimizer state and
        counters as they were (and drops the partial gradients).
        """
        slot.module.train()
        slot.optimizer.zero_grad(set_to_none=True)
        try:
            if compute_loss is not None:  # an algorithm's own objective (e.g. PPO)
                loss = compute_loss()
            else:
                loss = slot.module.loss(
                    features, batch.state, batch.action, batch.action_is_pad, generator=_loss_generator(slot)
                )
            if not torch.isfinite(loss):
                raise TenantSlotError(f"tenant {slot.config.tenant_id!r}: non-finite loss {loss.item()}")
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(slot.parameters(), 1.0)
            if not torch.isfinite(grad_norm):
                raise TenantSlotError(f"tenant {slot.config.tenant_id!r}: non-finite gradient norm {grad_norm.item()}")
        except BaseException:
            slot.optimizer.zero_grad(set_to_none=True)
            raise
        value = float(loss.detach())
        self._apply_step(slot, batch, value)
        return value

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

    # -- export and checkpoints -------------------------------------------------------------
    def _manifest(self, slot: TenantSlot) -> TenantManifest:
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
            extra=self._extra(slot),
        )

    @staticmethod
    def _extra(slot: TenantSlot) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "optimizer_steps": slot.optimizer_steps,
            "jobs_completed": slot.jobs_completed,
            "samples_trained": slot.samples_trained,
            VERSION_CREATED_AT_KEY: slot.version_created_at,
        }
        if slot.adapter is not None:
            extra["adapter"] = slot.adapter.model_dump(mode="json")
        return extra

    def _state_dict(self, slot: TenantSlot) -> dict[str, torch.Tensor]:
        """What a version is: the module's tensors, plus the adapter's under `adapter/` if it has one;
        CPU copies whatever the service's device (exports and checkpoints are device-independent)."""
        module = {k: v.detach().cpu().contiguous() for k, v in slot.module.state_dict().items()}
        if slot.adapter is None:
            return module
        return join_tenant_state(module, cpu_copy(self.backbone.adapters.state_dict(slot.config.tenant_id)))

    def export_params(self, tenant_id: str) -> bytes:
        """The tenant's payload as safetensors bytes with its manifest: the action module's tensors
        and, for an adapter tenant, the adapter's (under `adapter/`); no backbone tensor. Exports of
        one version are byte-identical (the manifest's created_at is the version's)."""
        slot = self._slot(tenant_id)
        return encode_tenant_payload(self._state_dict(slot), self._manifest(slot))

    def save(self, tenant_ids: list[str] | None = None, include_optim: bool = True) -> list[dict[str, Any]]:
        ids = sorted(self._slots) if tenant_ids is None else tenant_ids
        manifests = []
        for tenant_id in ids:  # one tenant pinned at a time: its pin's release packs it again past the bound
            with self._slots.scope():
                manifests.append(_manifest_dict(self._save_slot(self._slot(tenant_id), include_optim)))
        return manifests

    def _save_slot(self, slot: TenantSlot, include_optim: bool) -> TenantManifest:
        """Checkpoints are immutable per version: saving an already-saved version returns its manifest."""
        cfg = slot.config
        if slot.version in self.checkpoints.versions(cfg.tenant_id):
            return self.checkpoints.load_tenant(cfg.tenant_id, slot.version)[0]
        return self.checkpoints.save_tenant(
            tenant_id=cfg.tenant_id,
            policy_version=slot.version,
            schema_signature=cfg.schema_signature,
            base_model_id=cfg.base_model_id,
            module_kind=slot.module.config.kind,
            module_config=slot.module.config.model_dump(mode="json"),
            module_state=self._state_dict(slot),
            optimizer_state=slot.optimizer.state_dict() if include_optim else None,
            extra=self._extra(slot),
        )

    # =======================================================================================
    # Lower-layer composition primitives: forward_backward + optim_step (used by joynexus/api).
    # Kept together at the end of the class. They reuse _prepare / encode / _check_annotations /
    # _loss_generator; forward_backward("default") followed by optim_step is exactly train_batch.
    # =======================================================================================
    FORWARD_BACKWARD_LOSSES = ("default", "advantage_weighted", "policy_gradient")

    def forward_backward(self, tenant_id: str, batch: dict[str, Any], loss: str = "default") -> dict[str, Any]:
        """Loss and gradients of one microbatch, summed into the tenant's pending gradients; no
        optimizer step, no version change (call `optim_step` to apply them).

        `loss`: "default" is the module's own loss (what train_batch optimizes);
        "advantage_weighted" is mean_i(advantages[i] * loss_i) over the module's per-sample losses
        (advantage-weighted regression, any module); "policy_gradient" is
        -mean_i(advantages[i] * log pi(action_i | obs_i)) under the tenant's Gaussian policy
        (REINFORCE; stochastic modules, i.e. RL tenants). Both take `batch["advantages"]` of shape
        (N,). Bad annotations, an unknown loss, bad advantages or a non-finite loss raise and leave
        the pending gradients as they were.
        """
        if loss not in self.FORWARD_BACKWARD_LOSSES:
            raise ValueError(f"loss: {loss!r} is not one of {list(self.FORWARD_BACKWARD_LOSSES)}")
        slot = self._slot(tenant_id)
        _check_annotations(batch, tenant_id, slot.config.schema_signature)
        pending = self._pending_gradients().get(tenant_id)
        if pending is not None and pending["optimizer_steps"] != slot.optimizer_steps:
            pending = None  # a train_batch / train_job step in between zeroed them: start afresh
        started = time.perf_counter()
        prepared = self._prepare(slot, batch)
        weights = None
        if loss == "policy_gradient" and getattr(slot.module, "log_std", None) is None:
            raise ValueError(
                "loss: 'policy_gradient' needs a stochastic policy (an RL tenant's module); "
                "use 'advantage_weighted' for this module"
            )
        if loss != "default":
            weights = torch.as_tensor(np.asarray(batch.get("advantages"), dtype=np.float32), device=self.device)
            if weights.shape != (len(prepared),) or not bool(torch.isfinite(weights).all()):
                raise ValueError(
                    f"advantages: expected {len(prepared)} finite values (one per sample), "
                    f"got shape {tuple(weights.shape)}"
                )
        features = self._encode_slot(slot, prepared)
        # The first microbatch draws exactly what train_batch would; later ones draw fresh values.
        generator = _loss_generator(slot)
        if pending is not None:
            generator.manual_seed((generator.initial_seed() + pending["microbatches"]) % 2**64)
        slot.module.train()
        if pending is None:
            slot.optimizer.zero_grad(set_to_none=True)
        if weights is None:
            value = slot.module.loss(
                features, prepared.state, prepared.action, prepared.action_is_pad, generator=generator
            )
        elif loss == "policy_gradient":
            log_prob = slot.module.action_distribution(features, prepared.state).log_prob(prepared.action)
            valid = (~prepared.action_is_pad).unsqueeze(-1)
            per_sample = torch.where(valid, log_prob, torch.zeros_like(log_prob)).sum(dim=(-1, -2))
            value = -(weights * per_sample).mean()
        else:
            per_sample = torch.stack(
                [
                    slot.module.loss(
                        features.select([i]).trimmed(),
                        prepared.state[i : i + 1],
                        prepared.action[i : i + 1],
                        prepared.action_is_pad[i : i + 1],
                        generator=generator,
                    )
                    for i in range(len(prepared))
                ]
            )
            value = (weights * per_sample).mean()
        if not torch.isfinite(value):
            raise TenantSlotError(f"tenant {tenant_id!r}: non-finite loss {value.item()}")
        value.backward()
        loss_value = float(value.detach())
        if pending is None:
            pending = {"optimizer_steps": slot.optimizer_steps, "microbatches": 0, "samples": 0, "losses": []}
            self._pending_gradients()[tenant_id] = pending
        pending["microbatches"] += 1
        pending["samples"] += len(prepared)
        pending["losses"].append(loss_value)
        return {
            "tenant_id": tenant_id,
            "loss": loss_value,
            "samples": len(prepared),
            "accumulated_microbatches": pending["microbatches"],
            "accumulated_samples": pending["samples"],
            "version": slot.version,
            "seconds": time.perf_counter() - started,
        }

    def optim_step(self, tenant_id: str) -> dict[str, Any]:
        """Apply the pending gradients of `forward_backward` calls: clip (norm 1.0, as train_batch),
        AdamW step, zero them, bump the tenant's version."""
        slot = self._slot(tenant_id)
        pending = self._pending_gradients().pop(tenant_id, None)
        if pending is None:
            raise TenantSlotError(f"tenant {tenant_id!r} has no pending gradients: call forward_backward first")
        if pending["optimizer_steps"] != slot.optimizer_steps:
            raise TenantSlotError(
                f"tenant {tenant_id!r}: the pending gradients were discarded by a train_batch / train_job step "
                "in between; call forward_backward again"
            )
        started = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(slot.parameters(), 1.0)
        if not torch.isfinite(grad_norm):
            slot.optimizer.zero_grad(set_to_none=True)
            raise TenantSlotError(f"tenant {tenant_id!r}: non-finite gradient norm {grad_norm.item()}")
        slot.optimizer.step()
        slot.optimizer.zero_grad(set_to_none=True)
        slot.optimizer_steps += 1
        slot.samples_trained += pending["samples"]
        mean_loss = sum(pending["losses"]) / len(pending["losses"])
        slot.losses.append(mean_loss)
        self._issue_version(slot)
        return {
            "tenant_id": tenant_id,
            "loss": mean_loss,
            "grad_norm": float(grad_norm),
            "microbatches": pending["microbatches"],
            "samples": pending["samples"],
            "optimizer_steps": slot.optimizer_steps,
            "version": slot.version,
            "seconds": time.perf_counter() - started,
        }

    def _pending_gradients(self) -> dict[str, dict[str, Any]]:
        """tenant -> what forward_backward has accumulated since the tenant's last optimizer step."""
        return self.__dict__.setdefault("_pending_grads", {})

    # =======================================================================================
    # End of the lower-layer composition primitives.
    # =======================================================================================


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


def _manifest_dict(manifest: TenantManifest) -> dict[str, Any]:
    import json

    return {**json.loads(manifest.to_json()), "digest": manifest.digest}


def _adapter_keys(slot: TenantSlot, batch: _Microbatch) -> list[str | None]:
    """Per-sample adapter keys of a tenant's rows in a shared forward (its id, or None)."""
    key = slot.config.tenant_id if slot.adapter is not None else None
    return [key] * len(batch)


def _loss_generator(slot: TenantSlot) -> torch.Generator:
    """The randomness of a tenant's next loss (flow-matching noise and times).

    A function of the tenant's seed and optimizer step only: serial and grouped training draw the
    same values, other tenants' work never shifts them, and a resumed slot continues the sequence.
    """
    seed = np.random.SeedSequence([slot.config.seed % 2**64, slot.optimizer_steps]).generate_state(1, np.uint64)[0]
    device = next(slot.module.parameters()).device
    return torch.Generator(device=device).manual_seed(int(seed))


def _check_annotations(data: dict[str, Any], tenant_id: str, signature: str) -> None:
    """Every sample must carry this tenant and schema: one tenant–schema group per optimizer microbatch."""
    for name, expected in (("tenant_id", tenant_id), ("schema_signature", signature)):
        values = data.get(name)
        if values is None:
            raise TenantSlotError(f"microbatch has no {name!r} annotation")
        bad = {str(v) for v in values if str(v) != expected}
        if bad:
            raise TenantSlotError(f"microbatch mixes {name} values {sorted(bad)} into {expected!r}'s update")


class _SlotPager:
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

    def __init__(self, service: TrainingModelService) -> None:
        self._service = service

    def nbytes(self, slot: TenantSlot) -> int:
        return slot.nbytes()

    def can_page_out(self, tenant_id: str, slot: TenantSlot) -> bool:
        # forward_backward's gradients wait in the parameters for optim_step: mid-step, so stay.
        return tenant_id not in self._service._pending_gradients()

    def at_rest(self, tenant_id: str, slot: TenantSlot) -> None:
        # A slot between calls holds no gradients (every step starts by zeroing them): 1/4 less memory.
        if tenant_id not in self._service._pending_gradients():
            slot.zero_grad_if_active()
        # A call released a slot: pack the active slots that are now beyond the bound.
        self._service._pack_least_recent()

    def spill(self, tenant_id: str, slot: TenantSlot) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if slot.adapter is None:
            tensors, packed_meta = slot.pack().to_tensors()
            tensors = {f"packed/{k}": v for k, v in tensors.items()}
            meta: dict[str, Any] = {"packed": packed_meta}
        else:
            tensors = {f"module/{k}": v for k, v in slot.module.state_dict().items()}
            optimizer_tensors, optimizer_doc = _encode_optimizer_state(slot.optimizer.state_dict())
            tensors.update({f"optimizer/{k}": v for k, v in optimizer_tensors.items()})
            adapter = self._service.backbone.adapters.state_dict(tenant_id)
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
        )
        return tensors, meta

    def evicted(self, tenant_id: str, slot: TenantSlot) -> None:
        self._service._active.discard(tenant_id)
        if slot.adapter is not None:
            self._service.backbone.adapters.remove(tenant_id)

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
        }
        if "packed" in meta:  # back as it left: packed (materialized on first use)
            packed = PackedTrainingState.from_tensors(parts["packed"], meta["packed"], self._service.device)
            return TenantSlot(config, packed=packed, active_tier=self._service._active, **counters)
        module_config = ActionModuleConfig.model_validate(config.action_module)
        module = rebuild_module(lambda: build_action_module(module_config), parts["module"], self._service.device)
        module.train(bool(meta["training"]))
        adapter, adapter_parameters = None, []
        if config.adapter is not None:
            adapter = LoraAdapterConfig.model_validate(config.adapter)
            adapters = self._service.backbone.adapters
            adapters.add(tenant_id, adapter, state=parts["adapter"], seed=config.seed, trainable=True)
            adapter_parameters = adapters.parameters(tenant_id)
        try:
            optimizer = torch.optim.AdamW([*module.parameters(), *adapter_parameters], lr=config.learning_rate)
            # CPU tensors: AdamW moves the moments onto their parameters' device and keeps its step
            # counts where they were written from (the CPU, unless fused or capturable).
            optimizer.load_state_dict(_decode_optimizer_state(meta["optimizer"], parts["optimizer"]))
        except BaseException:
            if adapter is not None:
                self._service.backbone.adapters.remove(tenant_id)
            raise
        return TenantSlot(config, module, optimizer, adapter=adapter, adapter_parameters=adapter_parameters, **counters)


# Every public call pins the slots it uses (through _slot) until it returns: a slot is never paged out
# in the middle of a step, even when one call (train_group) uses more tenants than the resident bound.
# Not `save`: it pins tenants one at a time, each in its own scope (each saved before the next is
# used); one scope for all of them would page every tenant in at once. Not `heartbeat`: it uses no
# slot and must never wait.
pin_during_calls(TrainingModelService, "_slots", exclude=("heartbeat", "save"))


def training_service_actor(
    backbone_source: BackboneSource,
    checkpoint_root: str | Path,
    queue: Any,
    *,
    num_threads: int = 1,
    num_cpus: float = 1,
    namespace: str | None = None,
    detached: bool = False,
    keep_last: int | None = None,
    placement: DevicePlacement | None = None,
    max_resident_tenants: int = DEFAULT_MAX_RESIDENT_TENANTS,
    spill_dir: str | None = None,
    max_active_tenants: int = DEFAULT_MAX_ACTIVE_TENANTS,
):  # type: ignore[no-untyped-def]
    """Get or create the named Training Model Service actor (Ray must be initialized). `placement`
    is resolved in the actor's process ("auto": a GPU if Ray gave the actor one, else the CPU).
    `max_resident_tenants`, `spill_dir`: the resident bound of tenant slots and where the rest page out;
    `max_active_tenants`: how many resident slots stay active (the others are packed)."""
    from joynexus.actors import named_actor

    return named_actor(
        TrainingModelService,
        TRAINING_SERVICE_ACTOR_NAME,
        backbone_source,
        str(checkpoint_root),
        queue,
        num_threads,
        namespace=namespace,
        detached=detached,
        num_cpus=num_cpus,
        keep_last=keep_last,
        placement=placement,
        max_resident_tenants=max_resident_tenants,
        spill_dir=spill_dir,
        max_active_tenants=max_active_tenants,
    )
