"""Admission: the checks a submitted workload passes (task, target, spend, queued quota), and the
durable admission queue, which IS the store (workloads in state `queued`, oldest first).

One running workload per tenant (its training policy has one completion target) and at most
`max_running` overall; further submissions wait in FIFO order with a visible position.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from joynexus.core.store import WorkloadRecord
from joynexus.core.tenants import Tenant
from joynexus.master.errors import AdmissionRefused
from joynexus.master.workloads.live import QUEUED, LiveWorkloads, RunningWorkload
from joynexus.master.workloads.records import WorkloadRecords
from joynexus.master.workloads.restarts import ServiceWaits
from joynexus.protocol.schemas import WorkloadInfo

if TYPE_CHECKING:
    from joynexus.master.deployment import Deployment

log = logging.getLogger(__name__)


class Admission:
    """Submits and starts training workloads. `launch(running)` starts an admitted one (it raises
    when it cannot start), `fail(workload_id, reason)` ends one that could not; `paused()` (when
    set) holds queued work while true (a hung role escalated by the Health Manager)."""

    def __init__(
        self,
        deployment: Deployment,
        records: WorkloadRecords,
        live: LiveWorkloads,
        waits: ServiceWaits,
        *,
        launch: Callable[[RunningWorkload], None],
        fail: Callable[[str, str], None],
        max_running: int = 8,
        check: Callable[[str], None] | None = None,  # raises AdmissionRefused to stop new work
        max_queued: Callable[[str], int | None] | None = None,  # a tenant's limit of waiting workloads
    ):
        self.deployment = deployment
        self._records, self._live, self._waits = records, live, waits
        self._launch, self._fail = launch, fail
        self.max_running = max_running
        self._check, self.max_queued = check, max_queued
        self.paused: Callable[[], bool] | None = None
        # One admission at a time; reentrant: a launch that fails finishes, which admits.
        self._one_at_a_time = threading.RLock()

    def check(self, tenant_id: str) -> None:
        """The spend check every new piece of work passes (AdmissionRefused)."""
        if self._check is not None:
            self._check(tenant_id)

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
        self.check(tenant_id)
        workload_id = f"wl-{uuid.uuid4().hex[:12]}"
        self._check_queued_quota(tenant_id)
        with self.deployment.store.transaction() as s:
            s.add(
                WorkloadRecord(
                    workload_id=workload_id, tenant_id=tenant_id, task=task, state=QUEUED, target_jobs=target,
                    dataset=dataset,
                )
            )  # fmt: skip
        self._records.emit(workload_id, "queued", target_jobs=target)
        self.admit()
        return self._records.get(workload_id)

    def _check_queued_quota(self, tenant_id: str) -> None:
        if self.max_queued is None:
            return
        limit = self.max_queued(tenant_id)
        queued = self._records.count(tenant_id, QUEUED)
        if limit is not None and queued >= limit:
            raise AdmissionRefused(
                f"{queued} workloads of tenant {tenant_id!r} are already waiting (quota.max_queued_workloads = "
                f"{limit}); wait for one to start or cancel one"
            )

    def admit(self) -> None:
        """Start queued workloads in FIFO order while capacity allows (skipping tenants that
        already run one, without letting them lose their place); also after a restart. One
        admission at a time: a submit returns after a launch in progress (the timer's) has marked
        its workload running."""
        with self._one_at_a_time:
            for running in self._take_admissible():
                self._start_admitted(running)

    def _take_admissible(self) -> list[RunningWorkload]:
        """The queued workloads that may start now, entered as running."""
        if self.paused is not None and self.paused():
            return []  # a hung role's restart budget is spent: queued work waits until it answers
        queued = self._records.queued()
        # Store reads happen before the live table's lock is taken, never under it (live.py).
        tenants: dict[str, Tenant] = {}
        for tenant_id in {tenant_id for _, tenant_id, _ in queued}:
            try:
                tenants[tenant_id] = self.deployment.creator.get(tenant_id)
            except KeyError:  # deleted meanwhile
                pass
        return self._live.enter_admitted(queued, tenants, self.max_running)

    def _start_admitted(self, running: RunningWorkload) -> None:
        workload_id = running.workload_id
        if not self._live.is_current(running):
            return  # cancelled between its admission and its launch
        try:
            self._launch(running)
        except Exception as error:
            if self._waits.restarting(error, running.tenant.tenant_id):
                # A service it needs is restarting in place: it stays queued, in its place; the
                # admission tick starts it again once the service is back.
                log.warning("workload %s waits for a restarting service: %s", workload_id, error)
                self._live.discard(workload_id)
                self._waits.unavailable(f"launch: {type(error).__name__}")
                return
            log.exception("workload %s failed to start", workload_id)
            self._fail(workload_id, f"start: {type(error).__name__}: {error}")
