"""The slot model of the Training Model Service: one tenant's training state (`TenantSlot`), the
errors a slot call raises, a microbatch as tensors, and the small rules every update path shares
(annotation checks, the loss randomness, adapter routing keys).

A slot is active (module and AdamW as live objects) or packed (`packing.PackedTrainingState`);
reading `module` or `optimizer` materializes a packed slot, so callers never see the difference.
Which slots are resident, active, packed or paged out is `SlotTable`'s business (`slot_table`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from joynexus.core.tenants import TenantBackendConfig
from joynexus.models.action_modules import ActionModule
from joynexus.models.adapters import LoraAdapterConfig
from joynexus.services.residency import tensor_bytes
from joynexus.services.training.errors import TenantSlotError, UnknownTenant
from joynexus.services.training.packing import ActiveSlots, PackedTrainingState

__all__ = [
    "Microbatch",
    "PendingGradients",
    "TenantSlot",
    "TenantSlotError",
    "UnknownTenant",
    "adapter_keys",
    "check_annotations",
    "loss_generator",
    "microbatch_to_tensors",
]


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
        "datasets",
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
        datasets: tuple[str, ...] = (),
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
        # Content digests of the datasets whose jobs trained these weights, the latest last (from the
        # jobs' `dataset_sha256`): every checkpoint and export records them, so a version says which
        # data trained it. Restored with the version.
        self.datasets = tuple(datasets)

    def note_dataset(self, job_metadata: dict[str, Any]) -> None:
        """Record the dataset a job trained the slot on (its `dataset_sha256`; none: nothing to record)."""
        digest = job_metadata.get("dataset_sha256")
        if isinstance(digest, str) and digest:
            self.datasets = (*(d for d in self.datasets if d != digest), digest)

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

    def schedule_learning_rate(self) -> float:
        """Set the learning rate of the slot's next step on its AdamW and return it: the config's
        rate, decayed linearly over the first `lr_decay_jobs` versions to `lr_final_fraction` of
        it (constant without a schedule)."""
        cfg = self.config
        lr = cfg.learning_rate
        if cfg.lr_decay_jobs:
            lr *= 1.0 - min(1.0, self.version / cfg.lr_decay_jobs) * (1.0 - cfg.lr_final_fraction)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

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


@dataclass
class PendingGradients:
    """What `forward_backward` calls have summed into a slot's gradients since its last optimizer
    step, waiting for `optim_step` (a slot with pending gradients is never packed or paged out)."""

    optimizer_steps: int  # the slot's step count when they started: another step in between voids them
    microbatches: int = 0
    samples: int = 0
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
class Microbatch:
    """One tenant's microbatch as tensors, blank instructions filled with the tenant's default."""

    images: list[list[torch.Tensor]]
    instructions: list[str]
    state: torch.Tensor
    action: torch.Tensor
    action_is_pad: torch.Tensor

    def __len__(self) -> int:
        return len(self.images)


def check_annotations(data: dict[str, Any], tenant_id: str, signature: str) -> None:
    """Every sample must carry this tenant and schema: one tenant–schema group per optimizer microbatch."""
    for name, expected in (("tenant_id", tenant_id), ("schema_signature", signature)):
        values = data.get(name)
        if values is None:
            raise TenantSlotError(f"microbatch has no {name!r} annotation")
        bad = {str(v) for v in values if str(v) != expected}
        if bad:
            raise TenantSlotError(f"microbatch mixes {name} values {sorted(bad)} into {expected!r}'s update")


def loss_generator(slot: TenantSlot) -> torch.Generator:
    """The randomness of a tenant's next loss (flow-matching noise and times).

    A function of the tenant's seed and optimizer step only: serial and grouped training draw the
    same values, other tenants' work never shifts them, and a resumed slot continues the sequence.
    """
    seed = np.random.SeedSequence([slot.config.seed % 2**64, slot.optimizer_steps]).generate_state(1, np.uint64)[0]
    device = next(slot.module.parameters()).device
    return torch.Generator(device=device).manual_seed(int(seed))


def adapter_keys(slot: TenantSlot, batch: Microbatch) -> list[str | None]:
    """Per-sample adapter keys of a tenant's rows in a shared forward (its id, or None)."""
    key = slot.config.tenant_id if slot.adapter is not None else None
    return [key] * len(batch)
