"""Training Model Service, the actor (paper sections 4.1.2, A.6).

Keeps ONE resident frozen backbone and a slot per tenant (action module, optimizer state, policy
version). `train_job` consumes a leased job's Training Queue partition in microbatches: it checks
that every sample carries the job's tenant and schema signature, runs the shared backbone forward
without gradients, then that tenant's loss, backward and optimizer step. `train_group` is the
group-batched form (paper 5.2): one shared backbone forward over several tenants' microbatches,
then each tenant's own update on its own rows. Nothing here is ever averaged or shared across
tenants. Deployed as a named Ray actor (`services.configs.TrainingServiceConfig.actor`).

A tenant may also own a LoRA adapter on the shared backbone (`TenantBackendConfig.adapter`): its
parameters join the tenant's AdamW, its forward runs with autograd through the backbone's text model
(the base weights stay frozen and shared), and the slot's state dict — the module's tensors plus the
adapter's under `adapter/` — is what is versioned, checkpointed, exported and loaded for serving.

Tenant density (issue 14.5): a slot is in one of three tiers, each bounded, least recently used first
out (vLLM's `max_loras` / `max_cpu_loras` and a disk tier behind them):

- active (at most `max_active_tenants`): module and AdamW are live objects, ready to step;
- packed resident (up to `max_resident_tenants` in all): the same numbers in a few flat tensors
  (`packing`), materialized without a copy (views of those tensors) when the slot is used;
- paged out: the rest, one file each in a spill folder, paged back in exactly on next use
  (`services.residency`, `pager`).

A slot a call uses stays pinned until that call returns (`pins_during_call` on each method), so a
step never runs on a slot that is being packed or paged out; slots with a LoRA adapter or pending
gradients are never packed.

This class is the actor: it validates arguments and delegates. Its collaborators, one module each:
`slots` (the slot model), `slot_table` (slot lifecycle, versions, checkpoints, residency and the
active tier), `pager` (page-out and page-in), `trainer` (the serial update path, `train_batch`,
`train_job`), `grouped` (`train_group`), `job_groups` (`train_jobs`), `primitives`
(`forward_backward` / `optim_step`), `packing`
(packed slots).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from joynexus.actors import service_handle
from joynexus.algorithms.losses import FORWARD_BACKWARD_LOSSES
from joynexus.artifacts import CheckpointStore
from joynexus.core.service_metrics import service_metrics
from joynexus.core.tenants import BaseModelCapabilities, TenantBackendConfig
from joynexus.models.backbone import BackboneFeatures, BackboneSource
from joynexus.models.placement import DevicePlacement, cpu_copy
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import TrainingJob
from joynexus.services.residency import DEFAULT_MAX_RESIDENT_TENANTS, ResidencyLimits, pins_during_call
from joynexus.services.training.foreign import ForeignWeightsError, install_foreign_state
from joynexus.services.training.grouped import GroupTrainer
from joynexus.services.training.job_groups import JobGroupTrainer
from joynexus.services.training.packing import DEFAULT_MAX_ACTIVE_TENANTS, ActiveSlots
from joynexus.services.training.primitives import LowerLayerPrimitives
from joynexus.services.training.sampling import PolicySampler
from joynexus.services.training.slot_table import SlotTable, manifest_dict
from joynexus.services.training.slots import TenantSlot, TenantSlotError, UnknownTenant, microbatch_to_tensors
from joynexus.services.training.state_control import load_slot_state
from joynexus.services.training.trainer import RL_FIELDS, SFT_FIELDS, SlotTrainer

__all__ = [
    "RL_FIELDS",
    "SFT_FIELDS",
    "TRAINING_SERVICE_ACTOR_NAME",
    "TenantSlot",
    "TenantSlotError",
    "TrainingModelService",
    "UnknownTenant",
    "microbatch_to_tensors",
]

TRAINING_SERVICE_ACTOR_NAME = "joynexus.training_service"


class TrainingModelService:
    """The actor. Every public method but `heartbeat` and `save` pins the slots it uses until it
    returns (`@pins_during_call("_slots")`): a slot is never paged out in the middle of a step, even
    when one call (train_group) uses more tenants than the resident bound. `save` pins tenants one at
    a time, each in its own scope (one scope for all would page every tenant in at once);
    `heartbeat` uses no slot and must never wait."""

    FORWARD_BACKWARD_LOSSES = FORWARD_BACKWARD_LOSSES

    def __init__(
        self,
        backbone_source: BackboneSource | dict[str, Any],
        checkpoint_root: str | Path | CheckpointStore,
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
        self.checkpoints = (  # a store given as the root: a data-parallel rank's view of the group's
            checkpoint_root
            if isinstance(checkpoint_root, CheckpointStore)
            else CheckpointStore(checkpoint_root, keep_last=keep_last)
        )
        self.queue = service_handle(TrainingQueue, queue) if queue is not None else None
        limits = ResidencyLimits(
            max_resident_tenants, max_resident_tenant_bytes, ("max_resident_tenants", "max_resident_tenant_bytes")
        )
        self.slot_table = SlotTable(self.backbone, self.checkpoints, self._active, limits, spill_dir)
        # Every registered tenant's slot, resident or paged out (a mapping of tenant ids); the pins' residency.
        self._slots = self.slot_table.residency
        self.trainer = SlotTrainer(self.backbone, self.slot_table, self.queue)
        self.grouped = GroupTrainer(self.trainer, self.slot_table)
        self.job_groups = JobGroupTrainer(self.trainer, self.slot_table)
        self.primitives = LowerLayerPrimitives(self.trainer, self.slot_table)
        self.sampler = PolicySampler(self.trainer, self.slot_table)
        # Which life of this role is answering: a Ray restart in place builds a new one (empty slots),
        # and the Master's Health Manager restores the tenants when it sees the change.
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        service_metrics()  # this process's signals endpoint (JOYNEXUS_METRICS_PORT)

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
    @pins_during_call("_slots")
    def backbone_info(self) -> dict[str, Any]:
        return {
            "model_id": self.backbone.model_id,
            "instances_created": type(self.backbone).instances_created,
            "backbone_object_id": id(self.backbone),
            "parameter_count": self.backbone.parameter_count(),
            "prefix_key": list(self.backbone.prefix_key),
            "pid": os.getpid(),
            "tenants": sorted(self._slots),
            **self.backbone.placement_info(),
        }

    @pins_during_call("_slots")
    def capabilities(self) -> BaseModelCapabilities:
        return BaseModelCapabilities.of_backbone(self.backbone)

    @pins_during_call("_slots")
    def tenants(self) -> list[str]:
        return sorted(self._slots)

    @pins_during_call("_slots")
    def policy_version(self, tenant_id: str) -> int:
        return self._slot(tenant_id).version

    @pins_during_call("_slots")
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

    @pins_during_call("_slots")
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

    @pins_during_call("_slots")
    def residency_stats(self) -> dict[str, Any]:
        """Tenant slots in memory and paged out: counts, bytes, hits, page-ins and page-outs."""
        return self._slots.stats()

    # -- slots ------------------------------------------------------------------------------
    @pins_during_call("_slots")
    def add_tenant(self, config: TenantBackendConfig | dict[str, Any], resume: bool = True) -> dict[str, Any]:
        """Create the tenant's slot; with `resume`, restore its last checkpoint if one exists."""
        config = TenantBackendConfig.model_validate(config) if isinstance(config, dict) else config
        return self.slot_table.add(config, resume)

    @pins_during_call("_slots")
    def remove_tenant(self, tenant_id: str) -> bool:
        """Drop the tenant's slot (module, adapter, optimizer, pending gradients) from memory, and its
        paged-out copy from the spill folder; its checkpoints stay (CheckpointStore.delete_tenant
        removes those). False if it had no slot."""
        return self.slot_table.remove(tenant_id)

    @pins_during_call("_slots")
    def slot_bytes(self, tenant_id: str) -> int:
        """Bytes of the tenant's slot in memory (module, optimizer, adapter): what shard placement weighs."""
        return self._slot(tenant_id).nbytes()

    @pins_during_call("_slots")  # a scope without pins: `detach` refuses a slot that another call pinned
    def page_out_tenant(self, tenant_id: str) -> bytes:
        """Take the tenant's slot out of this service in the paging format (`SlotTable.detach`), to
        `page_in_tenant` on another shard; its checkpoints stay where they are (shared storage)."""
        return self.slot_table.detach(tenant_id)

    @pins_during_call("_slots")
    def page_in_tenant(self, data: bytes) -> dict[str, Any]:
        """A slot `page_out_tenant` took out elsewhere, resident here bit-exact (`SlotTable.attach`)."""
        return self.slot_table.attach(bytes(data))

    def _slot(self, tenant_id: str) -> TenantSlot:
        """The tenant's slot (`SlotTable.slot`), pinned until the calling method returns."""
        return self.slot_table.slot(tenant_id)

    # -- training ---------------------------------------------------------------------------
    @pins_during_call("_slots")
    def train_batch(self, tenant_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        """One optimizer step on one tenant's slot from supplied samples (the lower-layer primitive)."""
        return self.trainer.train_batch(tenant_id, batch)

    @pins_during_call("_slots")
    def train_job(self, job: TrainingJob | dict[str, Any]) -> dict[str, Any]:
        """Consume a leased job's partition in microbatches; one optimizer step per microbatch,
        then bump only this tenant's policy version and (per its config) checkpoint it. An RL job
        runs PPO over its rollout partition (paper A.6)."""
        return self.trainer.train_job(job)

    @pins_during_call("_slots")
    def train_jobs(self, jobs: list[TrainingJob | dict[str, Any]]) -> list[dict[str, Any]]:
        """Several tenants' leased SFT and RL jobs (one each) trained together: each round steps
        the next microbatch of every job (an RL job's next PPO microbatch) through ONE shared
        backbone forward (`GroupTrainer.train_members`), then each tenant's own update. Per-job
        results in order, `train_job`'s fields, or `error` for a job that failed alone (NaN, bad
        data, empty partition) while the others completed (`job_groups`)."""
        return self.job_groups.train_jobs(jobs)

    @pins_during_call("_slots")
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
        return self.grouped.train_group(batches)

    @pins_during_call("_slots")
    def encode(
        self,
        images: list[list[torch.Tensor]],
        instructions: list[str],
        adapters: list[str | None] | None = None,
        grad: bool = False,
    ) -> BackboneFeatures:
        """The shared frozen forward; no graph is kept (only tenant modules learn) unless `grad`:
        then the graph reaches the LoRA adapters named per sample in `adapters` (tenant ids)."""
        return self.trainer.encode(images, instructions, adapters, grad)

    # -- export and checkpoints -------------------------------------------------------------
    @pins_during_call("_slots")
    def export_params(self, tenant_id: str) -> bytes:
        """The tenant's payload as safetensors bytes with its manifest: the action module's tensors
        and, for an adapter tenant, the adapter's (under `adapter/`); no backbone tensor. Exports of
        one version are byte-identical (the manifest's created_at is the version's)."""
        return self.slot_table.export(self._slot(tenant_id))

    def save(self, tenant_ids: list[str] | None = None, include_optim: bool = True) -> list[dict[str, Any]]:
        ids = sorted(self._slots) if tenant_ids is None else tenant_ids
        manifests = []
        for tenant_id in ids:  # one tenant pinned at a time: its pin's release packs it again past the bound
            with self._slots.scope():
                manifests.append(manifest_dict(self.slot_table.save(self._slot(tenant_id), include_optim)))
        return manifests

    @pins_during_call("_slots")
    def fork_checkpoint(self, source_id: str, version: int, new_tenant: str) -> dict[str, Any]:
        """Copy the source's checkpointed `version` as `new_tenant`'s version 0 (a fork); here,
        where tensors live, so a fork moves no weight through the Master. Returns the manifest."""
        return manifest_dict(self.checkpoints.fork_version(source_id, version, new_tenant))

    @pins_during_call("_slots")
    def install_weights(self, tenant_id: str, weights: bytes) -> dict[str, Any]:
        """Install weights trained elsewhere (safetensors bytes of the tenant's state dict) as the
        tenant's next version, checkpointed; each tensor is checked against the slot's own
        (`foreign.check_foreign_state`: names, shapes, float dtypes, finite). Returns the manifest."""
        from safetensors import SafetensorError
        from safetensors.torch import load as load_safetensors

        try:
            state = load_safetensors(bytes(weights))
        except (SafetensorError, ValueError, RuntimeError) as error:
            raise ForeignWeightsError("weights", f"not a safetensors file: {error}") from None
        return manifest_dict(install_foreign_state(self.slot_table, self._slot(tenant_id), state))

    # -- lower-layer composition primitives (used by joynexus/api) ---------------------------
    @pins_during_call("_slots")
    def forward_backward(
        self, tenant_id: str, batch: dict[str, Any], loss: str = "default", loss_config: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Loss and gradients of one microbatch, summed into the tenant's pending gradients; no
        optimizer step, no version change (call `optim_step` to apply them).

        `loss`: "default" is the module's own loss (what train_batch optimizes);
        "advantage_weighted" is mean_i(advantages[i] * loss_i) over the module's per-sample losses
        (advantage-weighted regression, any module); "policy_gradient" is
        -mean_i(advantages[i] * log pi(action_i | obs_i)) under the tenant's Gaussian policy
        (REINFORCE; stochastic modules, i.e. RL tenants). Both take `batch["advantages"]` of shape
        (N,). "importance_sampling" and "ppo_clip" (`algorithms.policy_losses`; stochastic modules)
        also take `batch["sampling_logprobs"]` (N,), the log-probabilities the actions were drawn
        with; `loss_config` holds a loss's parameters ("ppo_clip": `clip_eps` in (0, 1)). Bad
        annotations, an unknown loss or parameter, bad advantages or log-probabilities or a
        non-finite loss raise and leave the pending gradients as they were.
        """
        return self.primitives.forward_backward(tenant_id, batch, loss, loss_config)

    @pins_during_call("_slots")
    def optim_step(self, tenant_id: str, adamw: dict[str, Any] | None = None) -> dict[str, Any]:
        """Apply the pending gradients of `forward_backward` calls: clip (norm 1.0, as train_batch),
        AdamW step, zero them, bump the tenant's version. `adamw`: this step's own `lr`, `betas`,
        `weight_decay`, `grad_clip` (`algorithms.adamw_step`; unset ones keep the tenant's)."""
        return self.primitives.optim_step(tenant_id, adamw)

    # -- state control (issue 28.3) ----------------------------------------------------------
    @pins_during_call("_slots")
    def load_state(self, tenant_id: str, version: int) -> dict[str, Any]:
        """Roll the tenant's slot (module, adapter, optimizer, counters) back to a checkpointed
        version (`state_control`); pending gradients are discarded. All or nothing."""
        return load_slot_state(self.slot_table, self._slot(tenant_id), version)

    @pins_during_call("_slots")
    def discard_pending_gradients(self, tenant_id: str, expect: tuple[int, int] | None = None) -> dict[str, Any]:
        """Drop the gradients `forward_backward` calls summed since the last optimizer step (an
        abandoned chain of futures, `services.call_futures`); parameters, optimizer state and
        version stay. `expect`: (version, accumulated microbatches) the chain's last call left;
        other pending gradients (someone stepped or added since) are kept. What was dropped:
        microbatches and samples (0 and 0 if nothing)."""
        slot = self._slot(tenant_id)
        pending = self.primitives.pending.get(tenant_id)
        if pending is not None and expect is not None and tuple(expect) != (slot.version, pending.microbatches):
            pending = None
        if pending is not None:
            del self.primitives.pending[tenant_id]
            slot.optimizer.zero_grad(set_to_none=True)
        return {
            "tenant_id": tenant_id,
            "microbatches": pending.microbatches if pending else 0,
            "samples": pending.samples if pending else 0,
            "version": slot.version,
        }

    # -- forward-only sampling on the training slot (`sampling`) ------------------------------
    @pins_during_call("_slots")
    def sample(
        self, tenant_id: str, batch: dict[str, Any], n: int = 1, temperature: float = 1.0, seed: int = 0
    ) -> dict[str, Any]:
        """`n` action chunks per observation from the slot's current policy, (N, n, chunk, dim),
        with their log-probabilities (N, n) for a Gaussian policy head (None for a flow-matching
        head); the same seed gives the same draws. No graph, no gradient, no version change.
        `batch`: train_batch's columns without `action` / `action_is_pad` (see `sampling`)."""
        return self.sampler.sample(tenant_id, batch, n, temperature, seed)

    @pins_during_call("_slots")
    def compute_logprobs(self, tenant_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        """log pi(action_i | obs_i) under the slot's current Gaussian policy, summed over each
        sample's unpadded steps: (N,). Forward only: no gradient, no version change."""
        return self.sampler.compute_logprobs(tenant_id, batch)
