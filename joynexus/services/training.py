"""Training Model Service, the actor (paper sections 4.1.2, A.6).

Keeps ONE resident frozen backbone and a slot per tenant (action module, optimizer state, policy
version). `train_job` consumes a leased job's Training Queue partition in microbatches: it checks
that every sample carries the job's tenant and schema signature, runs the shared backbone forward
without gradients, then that tenant's loss, backward and optimizer step. `train_group` is the
group-batched form (paper 5.2): one shared backbone forward over several tenants' microbatches,
then each tenant's own update on its own rows. Nothing here is ever averaged or shared across
tenants. Deployed as a named Ray actor (`training_service_actor`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from joynexus.artifacts import CheckpointStore, TenantManifest, encode_tenant_payload
from joynexus.master.tenant_creator import BaseModelCapabilities, TenantBackendConfig
from joynexus.models.action_modules import ActionModule, ActionModuleConfig, build_action_module
from joynexus.models.backbone import BackboneFeatures, ResidentBackbone, TinyBackboneSpec
from joynexus.scheduling.training_queue import TrainingQueueClient
from joynexus.scheduling.training_scheduler import TrainingJob

TRAINING_SERVICE_ACTOR_NAME = "joynexus.training_service"

# Fields an SFT partition carries per sample; tenant and schema annotations travel with each row.
SFT_FIELDS = ("images", "state", "action", "action_is_pad", "task", "tenant_id", "schema_signature")


class BackboneSource(BaseModel):
    """Where the resident backbone comes from: a built-in random-weight preset, or a local directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: str | None = "tiny"
    path: str | None = None
    seed: int = 0

    def build(self) -> ResidentBackbone:
        if self.path is not None:
            return ResidentBackbone.from_pretrained(self.path)
        if self.preset is None:
            raise ValueError("BackboneSource needs either `preset` or `path`")
        return ResidentBackbone.build_tiny(TinyBackboneSpec.preset(self.preset), seed=self.seed)


class TenantSlotError(RuntimeError):
    pass


class UnknownTenant(TenantSlotError, KeyError):
    def __init__(self, tenant_id: str):
        super().__init__(f"tenant {tenant_id!r} has no slot in this Training Model Service")


@dataclass
class TenantSlot:
    config: TenantBackendConfig
    module: ActionModule
    optimizer: torch.optim.Optimizer
    version: int = 0
    optimizer_steps: int = 0
    jobs_completed: int = 0
    samples_trained: int = 0
    losses: list[float] = field(default_factory=list)


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
    ):
        if num_threads:
            torch.set_num_threads(num_threads)
        source = (
            BackboneSource.model_validate(backbone_source) if isinstance(backbone_source, dict) else backbone_source
        )
        self.backbone = source.build()
        self.checkpoints = CheckpointStore(checkpoint_root)
        self.queue = TrainingQueueClient(queue) if queue is not None else None
        self._slots: dict[str, TenantSlot] = {}

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
        """Copies of the slot's parameters and optimizer state (tests check isolation with these)."""
        slot = self._slot(tenant_id)
        return {
            "version": slot.version,
            "module": {k: v.detach().clone() for k, v in slot.module.state_dict().items()},
            "optimizer": _clone_optimizer_state(slot.optimizer.state_dict()),
        }

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
            return {"tenant_id": config.tenant_id, "version": self._slots[config.tenant_id].version, "resumed": False}
        module_config = ActionModuleConfig.model_validate(config.action_module)
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            module = build_action_module(module_config)
        optimizer = torch.optim.AdamW(module.parameters(), lr=config.learning_rate)
        slot = TenantSlot(config=config, module=module, optimizer=optimizer)
        resumed = False
        if resume and self.checkpoints.latest_version(config.tenant_id) is not None:
            self._restore(slot)
            resumed = True
        self._slots[config.tenant_id] = slot
        return {"tenant_id": config.tenant_id, "version": slot.version, "resumed": resumed}

    def _restore(self, slot: TenantSlot) -> None:
        tenant_id = slot.config.tenant_id
        manifest, module_state, optimizer_state = self.checkpoints.load_tenant(tenant_id)
        if manifest.schema_signature != slot.config.schema_signature:
            raise TenantSlotError(
                f"checkpoint of tenant {tenant_id!r} v{manifest.policy_version} has schema signature "
                f"{manifest.schema_signature}, the tenant's spec has {slot.config.schema_signature}"
            )
        slot.module.load_state_dict(module_state)
        if optimizer_state is not None:
            slot.optimizer.load_state_dict(optimizer_state)
        slot.version = manifest.policy_version
        slot.optimizer_steps = int(manifest.extra.get("optimizer_steps", 0))
        slot.jobs_completed = int(manifest.extra.get("jobs_completed", 0))
        slot.samples_trained = int(manifest.extra.get("samples_trained", 0))

    def _slot(self, tenant_id: str) -> TenantSlot:
        slot = self._slots.get(tenant_id)
        if slot is None:
            raise UnknownTenant(tenant_id)
        return slot

    # -- training ---------------------------------------------------------------------------
    def train_batch(self, tenant_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        """One optimizer step on one tenant's slot from supplied samples (the lower-layer primitive)."""
        slot = self._slot(tenant_id)
        _check_annotations(batch, tenant_id, slot.config.schema_signature)
        loss = self._step(slot, batch)
        slot.version += 1  # every parameter change is a new version: exports and checkpoints stay unambiguous
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
        slot.version += 1
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
        }

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
        features = self.encode(
            [cams for batch in prepared for cams in batch.images],
            [text for batch in prepared for text in batch.instructions],
        )
        encode_seconds = time.perf_counter() - started

        results: list[dict[str, Any]] = []
        for slot, batch, own_rows in zip(slots, prepared, rows, strict=True):
            started = time.perf_counter()
            error: str | None = None
            try:
                # trimmed(): drop the padding columns other tenants' longer prompts added, so the
                # head sees exactly the shapes a forward of its own microbatch would give.
                loss: float | None = self._update(slot, features.select(own_rows).trimmed(), batch)
            except Exception as exc:  # one tenant's failure is its own; the group goes on
                loss, error = None, f"{type(exc).__name__}: {exc}"
            else:
                slot.version += 1  # as train_batch: every parameter change is a new version
            result = {
                "tenant_id": slot.config.tenant_id,
                "loss": loss,
                "optimizer_steps": slot.optimizer_steps,
                "version": slot.version,
                "encode_seconds": encode_seconds,
                "module_seconds": time.perf_counter() - started,
            }
            if error is not None:
                result["error"] = error
            results.append(result)
        return results

    def _prepare(self, slot: TenantSlot, data: dict[str, Any]) -> _Microbatch:
        images, instructions, state, action, pad = microbatch_to_tensors(data)
        if slot.config.instruction:
            instructions = [text or slot.config.instruction for text in instructions]
        return _Microbatch(images, instructions, state, action, pad)

    def _step(self, slot: TenantSlot, data: dict[str, Any]) -> float:
        """Serial path: this microbatch's own backbone forward, then the tenant's update."""
        batch = self._prepare(slot, data)
        return self._update(slot, self.encode(batch.images, batch.instructions), batch)

    def _update(self, slot: TenantSlot, features: BackboneFeatures, batch: _Microbatch) -> float:
        """The per-tenant update both paths share: loss, backward, clip, AdamW step, on this slot only.

        Anything raised before the optimizer step leaves the slot's parameters, optimizer state and
        counters as they were (and drops the partial gradients).
        """
        slot.module.train()
        slot.optimizer.zero_grad(set_to_none=True)
        try:
            loss = slot.module.loss(
                features, batch.state, batch.action, batch.action_is_pad, generator=_loss_generator(slot)
            )
            if not torch.isfinite(loss):
                raise TenantSlotError(f"tenant {slot.config.tenant_id!r}: non-finite loss {loss.item()}")
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(slot.module.parameters(), 1.0)
            if not torch.isfinite(grad_norm):
                raise TenantSlotError(f"tenant {slot.config.tenant_id!r}: non-finite gradient norm {grad_norm.item()}")
        except BaseException:
            slot.optimizer.zero_grad(set_to_none=True)
            raise
        slot.optimizer.step()
        slot.optimizer_steps += 1
        slot.samples_trained += len(batch)
        value = float(loss.detach())
        slot.losses.append(value)
        return value

    def encode(self, images: list[list[torch.Tensor]], instructions: list[str]) -> BackboneFeatures:
        """The shared frozen forward; no graph is kept (only tenant modules learn)."""
        return self.backbone.encode(images, instructions)

    # -- export and checkpoints -------------------------------------------------------------
    def _manifest(self, slot: TenantSlot) -> TenantManifest:
        cfg = slot.config
        return TenantManifest(
            created_at=datetime.now(UTC).isoformat(),
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
        return {
            "optimizer_steps": slot.optimizer_steps,
            "jobs_completed": slot.jobs_completed,
            "samples_trained": slot.samples_trained,
        }

    def export_params(self, tenant_id: str) -> bytes:
        """The tenant's action-module payload as safetensors bytes with its manifest; no backbone tensor."""
        slot = self._slot(tenant_id)
        state = {k: v.detach().cpu().contiguous() for k, v in slot.module.state_dict().items()}
        return encode_tenant_payload(state, self._manifest(slot))

    def save(self, tenant_ids: list[str] | None = None, include_optim: bool = True) -> list[dict[str, Any]]:
        ids = sorted(self._slots) if tenant_ids is None else tenant_ids
        return [_manifest_dict(self._save_slot(self._slot(t), include_optim)) for t in ids]

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
            module_state=slot.module.state_dict(),
            optimizer_state=slot.optimizer.state_dict() if include_optim else None,
            extra=self._extra(slot),
        )


def _manifest_dict(manifest: TenantManifest) -> dict[str, Any]:
    import json

    return {**json.loads(manifest.to_json()), "digest": manifest.digest}


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


def _clone_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    def clone(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: clone(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clone(v) for v in value]
        return value

    return clone(state)


def training_service_actor(
    backbone_source: BackboneSource,
    checkpoint_root: str | Path,
    queue: Any,
    *,
    num_threads: int = 1,
    num_cpus: float = 1,
    namespace: str | None = None,
    detached: bool = False,
):  # type: ignore[no-untyped-def]
    """Get or create the named Training Model Service actor (Ray must be initialized)."""
    import ray

    actor_cls = ray.remote(TrainingModelService)
    return actor_cls.options(
        name=TRAINING_SERVICE_ACTOR_NAME,
        namespace=namespace,
        get_if_exists=True,
        num_cpus=num_cpus,
        lifetime="detached" if detached else None,
    ).remote(backbone_source, str(checkpoint_root), queue, num_threads)
