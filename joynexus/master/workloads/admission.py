"""Admission: the checks a submitted workload passes (task, target, spend, queued quota), and the
durable admission queue, which IS the store (workloads in state `queued`, oldest first).

One running workload per tenant (its training policy has one completion target) and at most
`max_running` overall; further submissions wait in FIFO order with a visible position.
"""

from __future__ import annotations

import logging
import threading
import uuid

from sqlalchemy import select

from joynexus.core.store import WorkloadRecord
from joynexus.core.tenants import Tenant
from joynexus.master.errors import AdmissionRefused
from joynexus.master.workloads.base import (
    QUEUED,
    WORKLOAD_FAILED,
    WorkloadBase,
    _RunningWorkload,
)
from joynexus.protocol.schemas import WorkloadInfo

log = logging.getLogger(__name__)


class Admission(WorkloadBase):
    _admission: threading.RLock  # one admission at a time; reentrant: a launch that fails finishes, which admits

    def submit(self, tenant_id: str, *, jobs: int | None = None, dataset: dict | None = None) -> WorkloadInfo:
        """Queue a workload running the tenant's declared task for `jobs` training jobs (default:
        the spec's completion target); `dataset` (SFT: a resolved DatasetSpec as JSON) trains on
        that dataset instead of the tenant's own."""
        tenant = self.deployment.creator.get(tenant_id)
        task = tenant.spec.task.value
        if task not in ("sft", "rl"):
            raise ValueError(
                f"task: tenant {tenant_id!r} is a {task!r} tenant; training workloads run 'sft' or 'rl' tenants "
                "(evaluate any tenant with evaluate())"
            )
        if dataset is not None and task != "sft":
            raise ValueError(f"dataset: tenant {tenant_id!r} is a {task!r} tenant; only SFT workloads name a dataset")
        target = jobs if jobs is not None else tenant.spec.scheduling.completion_target
        if target is None or target < 1:
            raise ValueError("jobs: give the number of training jobs (>= 1); the spec has no completion_target")
        if self.admission_check is not None:
            self.admission_check(tenant_id)
        workload_id = f"wl-{uuid.uuid4().hex[:12]}"
        self._check_queued_quota(tenant_id)
        with self.deployment.store.transaction() as s:
            s.add(
                WorkloadRecord(
                    workload_id=workload_id,
                    tenant_id=tenant_id,
                    task=task,
                    state=QUEUED,
                    target_jobs=target,
                    dataset=dataset,
                )  # fmt: skip
            )
        self._emit(workload_id, "queued", target_jobs=target)
        self._admit()
        return self.get(workload_id)

    def _check_queued_quota(self, tenant_id: str) -> None:
        if self.max_queued is None:
            return
        limit = self.max_queued(tenant_id)
        queued = self._count(tenant_id, QUEUED)
        if limit is not None and queued >= limit:
            raise AdmissionRefused(
                f"{queued} workloads of tenant {tenant_id!r} are already waiting (quota.max_queued_workloads = "
                f"{limit}); wait for one to start or cancel one"
            )

    def admit(self) -> None:
        """Start queued workloads while capacity allows (also after a restart)."""
        self._admit()

    def _admit(self) -> None:
        """Start queued workloads in FIFO order while capacity allows (skipping tenants that
        already run one, without letting them lose their place). One admission at a time: a
        submit returns after a launch in progress (the timer's) has marked its workload running."""
        with self._admission:
            for running in self._take_admissible():
                self._start_admitted(running)

    def _take_admissible(self) -> list[_RunningWorkload]:
        """The queued workloads that may start now, entered as running."""
        if self.admission_paused is not None and self.admission_paused():
            return []  # a hung role's restart budget is spent: queued work waits until it answers
        waiting = select(WorkloadRecord).where(WorkloadRecord.state == QUEUED).order_by(WorkloadRecord.created_at)
        with self.deployment.store.transaction() as s:
            queued = [(r.workload_id, r.tenant_id, r.target_jobs) for r in s.scalars(waiting)]
        # Store reads happen before taking self._lock, never under it: readers hold a transaction
        # while they take the lock (_status), so the other order would deadlock on SQLite.
        tenants: dict[str, Tenant] = {}
        for tenant_id in {tenant_id for _, tenant_id, _ in queued}:
            try:
                tenants[tenant_id] = self.deployment.creator.get(tenant_id)
            except KeyError:  # deleted meanwhile
                pass
        admitted: list[_RunningWorkload] = []
        with self._lock:
            if self._stop.is_set():
                return []
            running_tenants = {w.tenant.tenant_id for w in self._running.values()} | set(self._finishing.values())
            for workload_id, tenant_id, target in queued:
                if len(self._running) + len(admitted) >= self.max_running:
                    break
                if tenant_id in running_tenants or workload_id in self._running or workload_id in self._finishing:
                    continue
                tenant = tenants.get(tenant_id)
                if tenant is None:
                    continue
                running_tenants.add(tenant_id)
                admitted.append(_RunningWorkload(workload_id, tenant, target))
            for running in admitted:
                self._running[running.workload_id] = running
        return admitted

    def _start_admitted(self, running: _RunningWorkload) -> None:
        workload_id = running.workload_id
        with self._lock:
            if self._running.get(workload_id) is not running:
                return  # cancelled between its admission and its launch
        try:
            self._launch(running)
        except Exception as error:
            if self._service_restarting(error, running.tenant.tenant_id):
                # A service it needs is restarting in place: it stays queued, in its place; the
                # admission tick starts it again once the service is back.
                log.warning("workload %s waits for a restarting service: %s", workload_id, error)
                with self._lock:
                    self._running.pop(workload_id, None)
                if self.on_unavailable is not None:
                    self.on_unavailable(f"launch: {type(error).__name__}")
                return
            log.exception("workload %s failed to start", workload_id)
            self._finish(workload_id, WORKLOAD_FAILED, error=f"start: {type(error).__name__}: {error}")
