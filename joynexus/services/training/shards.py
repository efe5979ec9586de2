"""M Training Model Service shards behind one tenant-keyed interface (issue 45.1): `TrainingShards`.

Each shard is a whole `TrainingModelService` (its own backbone, on its own device: in Ray a named
actor on its own bundle of a placement group, `services.configs.TrainingServiceConfig.shard_actors`)
holding a subset of the tenants. `ShardPlacement` (the Training Scheduler's placement) decides
where each tenant lives; this class carries the decisions out on the shards:

- `add_tenant` places the tenant and creates its slot there; tenant-keyed calls (`policy_version`,
  `train_job`, `export_params`, `forward_backward`, ...) go to the tenant's shard;
- `move_tenant` stops leasing the tenant, waits until none of its jobs is in flight, then takes its
  slot out of the old shard in the paging format (`page_out_tenant`: the same bytes a page-out
  writes) and into the new one (`page_in_tenant`), bit-exact, optimizer state included;
- `shard_lost` resumes a lost shard's tenants on the live shards from their last checkpoints (the
  checkpoint store is shared by every shard); version numbers continue after the highest ever
  issued (`CheckpointStore.issued_version`), so no number is reissued.

One actor loop per shard leases only its shard's tenants' jobs (`master.loops.shard_loops`), so the
shards train at once and a tenant's jobs only ever run where its slot is.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from joynexus.actors import RoleUnavailable, handle_of, role_unavailable, service_handle
from joynexus.core.tenants import TenantBackendConfig
from joynexus.scheduling.shard_placement import PlacementError, ShardPlacement
from joynexus.scheduling.training_jobs import TrainingJob
from joynexus.services.training.service import TrainingModelService

__all__ = ["TENANT_KEYED_METHODS", "TrainingShards", "placement_group_key"]

log = logging.getLogger(__name__)

# The service's methods whose first argument is a tenant id: each runs on that tenant's shard.
TENANT_KEYED_METHODS = frozenset(
    {
        "policy_version", "tenant_status", "tenant_state", "train_batch", "export_params", "install_weights",
        "forward_backward", "optim_step", "load_state", "discard_pending_gradients", "sample",
        "compute_logprobs", "slot_bytes",
    }
)  # fmt: skip


def placement_group_key(config: TenantBackendConfig) -> Hashable:
    """Tenants with equal keys step together best: a grouped step (`train_jobs`) groups jobs of one
    task type, and tenants of one module config batch their losses into one computation
    (`models.module_batching`); a LoRA adapter changes the forward (autograd through the backbone)."""
    module = json.dumps(config.action_module, sort_keys=True, default=str)
    return (config.task_type, config.base_model_id, module, config.adapter is not None)


class TrainingShards:
    """The shards, the placement, and each tenant's backend config (to resume it after a loss)."""

    def __init__(
        self,
        shards: Sequence[Any],
        placement: ShardPlacement | None = None,
        *,
        group_size: int = 8,
        max_tenants_per_shard: int | None = None,
        max_bytes_per_shard: int | None = None,
        move_timeout_s: float = 120.0,
        fence: Callable[[int], None] | None = None,
        probe_timeout_s: float = 10.0,
    ) -> None:
        """`shards`: the services or their Ray actors, shard i at index i. `fence(i)`: makes sure a
        shard declared lost computes nothing more (Ray: kill its actor), so no tenant of it can train
        in two places; None: nothing to fence (an in-process shard that was dropped)."""
        if not shards:
            raise ValueError("TrainingShards needs at least one shard")
        self._handles = [service_handle(TrainingModelService, s) for s in shards]
        self.placement = placement or ShardPlacement(
            len(shards),
            group_size=group_size,
            max_tenants_per_shard=max_tenants_per_shard,
            max_bytes_per_shard=max_bytes_per_shard,
        )
        if self.placement.shard_count != len(shards):
            raise ValueError(f"placement has {self.placement.shard_count} shards, {len(shards)} given")
        self.move_timeout_s = move_timeout_s
        self.fence = fence
        self.probe_timeout_s = probe_timeout_s
        # The set's own life: one lost shard is handled here, not as a restart of the whole role.
        self.incarnation, self.started_at = uuid.uuid4().hex[:12], time.time()
        self._configs: dict[str, TenantBackendConfig] = {}
        self._incarnations: list[str | None] = [None] * len(shards)
        self._lifecycle = threading.RLock()  # adds, moves and recoveries one at a time

    # -- shards ----------------------------------------------------------------------------
    @property
    def shard_count(self) -> int:
        return len(self._handles)

    def shard(self, index: int) -> TrainingModelService:
        return self._handles[index]

    def shard_for(self, tenant_id: str) -> TrainingModelService:
        return self._handles[self.placement.shard_of(tenant_id)]

    def replace_shard(self, index: int, service: Any) -> None:
        """Point shard `index` at a new service (a fresh actor after a loss); it takes tenants again."""
        handle_of(self._handles[index]).retarget(handle_of(service).target)
        self._incarnations[index] = None
        self.placement.revive(index)

    def adopt(self) -> dict[str, int]:
        """Place every slot the shards already hold where it is (a new Master over running shards);
        a tenant found on two shards (a move cut short) keeps the first and is removed from the
        other. Tenant -> shard."""
        adopted: dict[str, int] = {}
        with self._lifecycle:
            for index in self.placement.live_shards():
                for tenant_id in self._handles[index].tenants():
                    if tenant_id in adopted or self.placement.is_placed(tenant_id):
                        self._handles[index].remove_tenant(tenant_id)
                        continue
                    self.placement.assign(tenant_id, index, nbytes=self._handles[index].slot_bytes(tenant_id))
                    adopted[tenant_id] = index
        return adopted

    # -- tenant lifecycle ------------------------------------------------------------------
    def add_tenant(self, config: TenantBackendConfig | dict[str, Any], resume: bool = True) -> dict[str, Any]:
        config = TenantBackendConfig.model_validate(config) if isinstance(config, dict) else config
        with self._lifecycle:
            was_placed = self.placement.is_placed(config.tenant_id)
            index = self.placement.place(config.tenant_id, placement_group_key(config))
            try:
                result = self._handles[index].add_tenant(config, resume)
                self.placement.update_bytes(config.tenant_id, self._handles[index].slot_bytes(config.tenant_id))
            except BaseException:
                if not was_placed:  # no slot was made: the placement goes with the failure
                    self.placement.unplace(config.tenant_id)
                raise
            self._configs[config.tenant_id] = config
            return {**result, "shard": index}

    def remove_tenant(self, tenant_id: str) -> bool:
        with self._lifecycle:
            try:
                index = self.placement.shard_of(tenant_id)
            except PlacementError:
                return False
            removed = self._handles[index].remove_tenant(tenant_id)
            self.placement.unplace(tenant_id)
            self._configs.pop(tenant_id, None)
            return removed

    def move_tenant(self, tenant_id: str, destination: int | None = None) -> dict[str, Any]:
        """Move the tenant's slot to `destination` (None: where placement would put it now) through
        the paging format; its jobs wait meanwhile (none is leased, none in flight)."""
        with self._lifecycle:
            source = self.placement.start_move(tenant_id)
            try:
                target = self.placement.choose_destination(tenant_id) if destination is None else destination
                if target == source:
                    raise PlacementError(f"tenant {tenant_id!r} is on shard {source} already")
                if not self.placement.wait_idle(tenant_id, self.move_timeout_s):
                    raise PlacementError(f"tenant {tenant_id!r} still has a job in flight after {self.move_timeout_s}s")
                data = self._handles[source].page_out_tenant(tenant_id)
                try:
                    result = self._handles[target].page_in_tenant(data)
                except BaseException:
                    self._handles[source].page_in_tenant(data)  # back where it was, unchanged
                    raise
            except BaseException:
                self.placement.cancel_move(tenant_id)
                raise
            self.placement.finish_move(tenant_id, target)
            return {**result, "from": source, "to": target, "bytes": len(data)}

    def rebalance(self) -> list[dict[str, Any]]:
        """Move tenants off shards over their slot-bytes bound (`ShardPlacement.over_bytes`)."""
        return [self.move_tenant(tenant_id) for tenant_id, _shard in self.placement.over_bytes()]

    # -- losing a shard --------------------------------------------------------------------
    def check_shard(self, index: int, timeout_s: float = 10.0) -> bool:
        """Probe the shard's heartbeat: False (and its tenants resumed elsewhere) if it is gone, or
        if it answers as a new life (a restart in place lost every slot it held)."""
        try:
            beat = handle_of(self._handles[index]).probe("heartbeat", timeout_s)
        except Exception as error:
            if not (role_unavailable(error) or isinstance(error, TimeoutError) or _is_timeout(error)):
                raise
            self.shard_lost(index)
            return False
        incarnation = beat.get("incarnation")
        known = self._incarnations[index]
        self._incarnations[index] = incarnation
        if known is not None and incarnation != known:
            self.shard_lost(index)
            self.placement.revive(index)  # alive again, empty: it takes tenants like any other shard
            return False
        return True

    def shard_lost(self, index: int) -> list[dict[str, Any]]:
        """Shard `index` is gone: fence it, then resume each of its tenants on a live shard from its
        last checkpoint (the placement rules pick the shard). Per tenant: where and at which version."""
        with self._lifecycle:
            if index not in self.placement.live_shards():
                return []
            if self.fence is not None:
                try:
                    self.fence(index)
                except Exception:  # already dead: nothing left to stop
                    log.debug("fencing shard %d failed", index, exc_info=True)
            lost = self.placement.lose(index)
            resumed = []
            for tenant_id in lost:
                config = self._configs.get(tenant_id)
                if config is None:
                    continue
                result = self.add_tenant(config, resume=True)
                log.warning("tenant %s of lost shard %d resumed on shard %d at v%s", tenant_id, index,
                            result["shard"], result["version"])  # fmt: skip
                resumed.append(result)
            return resumed

    # -- calls the Master makes ------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name not in TENANT_KEYED_METHODS:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

        def on_tenants_shard(tenant_id: str, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.shard_for(tenant_id), name)(tenant_id, *args, **kwargs)

        on_tenants_shard.__name__ = name
        return on_tenants_shard

    def train_job(self, job: TrainingJob | dict[str, Any]) -> dict[str, Any]:
        tenant_id = job.tenant_id if isinstance(job, TrainingJob) else job["tenant_id"]
        return self.shard_for(tenant_id).train_job(job)

    def train_jobs(self, jobs: list[TrainingJob | dict[str, Any]]) -> list[dict[str, Any]]:
        """One grouped call: every job's tenant must be on one shard (a shard's loop leases so)."""
        tenants = [j.tenant_id if isinstance(j, TrainingJob) else j["tenant_id"] for j in jobs]
        shards = {self.placement.shard_of(t) for t in tenants}
        if len(shards) != 1:
            raise PlacementError(f"train_jobs: tenants {tenants} are on shards {sorted(shards)}, not one")
        return self._handles[shards.pop()].train_jobs(jobs)

    def tenants(self) -> list[str]:
        return sorted(t for index in self.placement.live_shards() for t in self.placement.tenants_of(index))

    def save(self, tenant_ids: list[str] | None = None, include_optim: bool = True) -> list[dict[str, Any]]:
        ids = self.tenants() if tenant_ids is None else tenant_ids
        by_shard: dict[int, list[str]] = {}
        for tenant_id in ids:
            by_shard.setdefault(self.placement.shard_of(tenant_id), []).append(tenant_id)
        saved = {m["tenant_id"]: m for i, t in by_shard.items() for m in self._handles[i].save(t, include_optim)}
        return [saved[t] for t in ids]

    def capabilities(self) -> Any:
        return self._first_live().capabilities()

    def backbone_info(self) -> dict[str, Any]:
        return self._first_live().backbone_info()

    def heartbeat(self) -> dict[str, Any]:
        """Probe every live shard (`check_shard`: a lost one's tenants resume on the others), then
        answer for the set: its own incarnation (a lost shard is not a restart of the role), every
        tenant, and each shard's summary. Raises RoleUnavailable once every shard is lost."""
        for index in self.placement.live_shards():
            self.check_shard(index, self.probe_timeout_s)
        if not self.placement.live_shards():
            raise RoleUnavailable("training_service", "every Training Model Service shard is lost")
        return {
            "role": "training",
            "incarnation": self.incarnation,
            "started_at": self.started_at,
            "pid": os.getpid(),
            "tenants": self.tenants(),
            "shards": self.placement.summary(),
        }

    def _first_live(self) -> TrainingModelService:
        live = self.placement.live_shards()
        if not live:
            raise PlacementError("every Training Model Service shard is lost")
        return self._handles[live[0]]


def _is_timeout(error: BaseException) -> bool:
    try:
        from ray.exceptions import GetTimeoutError
    except ImportError:  # pragma: no cover - ray is a hard dependency
        return False
    return isinstance(error, GetTimeoutError)
