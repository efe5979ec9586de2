"""Master Service: the workload orchestrator (paper section 4.1.1).

A workload is one run of a tenant's declared task ("train 12 more SFT jobs"). The manager
materializes the roles it needs — for SFT a producer that turns the tenant's dataset into
Training Queue partitions — while ONE shared actor loop consumes every tenant's ready jobs from
the Training Scheduler, so tenants interleave on the single Training Model Service. On
completion the workload checkpoints, exports and registers the tenant's policy in MLflow.

`WorkloadManager` is the facade of four parts over one shared state (base.py) and one collaborator:

* roles.py: the supervisor of the Master's own threads (actor loop, producer follower, admission);
* admission.py: submit checks, quotas and the durable admission queue;
* training.py: the training-workload lifecycle (launch, producer reports, outcomes, finish, publish);
* evaluation.py: evaluation workloads (their episodes run on a producer replica);
* promotion.py: `Promoter`, the promotion rule every publish goes through, an object of its own.

The data work (producers, episodes, measurements, weight moves) runs on the producer replicas
(`deployment.producers`, `services/producers/`).

Durable: the admission queue IS the store (workloads in state `queued`, oldest first), workload
progress and events are rows, so a restarted Master Service continues: `reconcile()` re-queues or
fails the jobs a dead owner held, releases the jobs of workloads that ended, and resumes each
running workload from its recorded progress (or ends it `failed` with the reason it cannot resume).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from joynexus.core.store import WorkloadRecord
from joynexus.master.errors import AdmissionRefused, UnknownWorkload
from joynexus.master.workloads.admission import Admission
from joynexus.master.workloads.base import (
    CANCELLED,
    FINAL_WORKLOAD_STATES,
    RUNNING,
    _RunningWorkload,
)
from joynexus.master.workloads.evaluation import Evaluations
from joynexus.master.workloads.promotion import Promoter
from joynexus.master.workloads.roles import RoleSupervisor
from joynexus.master.workloads.training import TrainingWorkloads
from joynexus.protocol.schemas import WorkloadInfo
from joynexus.scheduling.training_scheduler import TERMINAL_STATES

if TYPE_CHECKING:
    from joynexus.master.deployment import Deployment

# Importers of the manager's errors and states find them here (they are defined in base.py).
__all__ = ["FINAL_WORKLOAD_STATES", "AdmissionRefused", "UnknownWorkload", "WorkloadManager"]

log = logging.getLogger(__name__)


class WorkloadManager(RoleSupervisor, Admission, TrainingWorkloads, Evaluations):
    def __init__(
        self,
        deployment: Deployment,
        *,
        owner: str = "master",
        max_running: int = 8,
        max_failures_per_workload: int = 3,
        admission_check: Callable[[str], None] | None = None,  # raises AdmissionRefused to stop new work
        max_queued: Callable[[str], int | None] | None = None,  # a tenant's limit of waiting workloads
        max_job_attempts: int = 3,  # a job whose lease owner died is re-queued at most this often
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.deployment = deployment
        self.owner = owner
        self.max_running = max_running
        self.max_failures = max_failures_per_workload
        self.admission_check = admission_check
        self.max_queued = max_queued
        self.max_job_attempts = max_job_attempts
        self.on_event = on_event
        self.on_unavailable = None
        self.admission_paused = None
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._running: dict[str, _RunningWorkload] = {}
        self._finishing: dict[str, str] = {}
        self._stop = threading.Event()
        self._roles = {}
        self._admission = threading.RLock()
        self._producer_restarts = 0
        self._producer_waits: dict[str, int] = {}
        deployment.producers.on_move = self._on_producer_moved
        # A collaborator, not a mixin: the promotion rule has its own object and narrow interface.
        self.promoter = Promoter(deployment, emit=self._emit, through_restarts=self._through_restarts)

    # -- lifecycle ----------------------------------------------------------------------------------
    def stop(self, *, cancel_running: bool = True) -> None:
        """Stop the Master's roles (actor loop, producer follower, admission). `cancel_running=False`
        leaves running workloads `running` in the store and their producers running on their
        replicas (a Master shutting down for a restart follows them again)."""
        with self._lock:
            running = list(self._running.values())
        for workload in running:
            if cancel_running:
                self.cancel(workload.workload_id)
            else:
                workload.stop.set()
        self._stop.set()
        self._stop_roles()

    def reconcile(self, *, has_partition: Callable[[str], bool] | None = None) -> dict[str, Any]:
        """Bring the store in line with a Master that (re)starts now (paper 4.4: restart from
        recorded progress). Call before `start()`. Leases held by another owner (a dead Master's
        actor loop or advantage stage) are re-queued or failed with bounded retries; jobs of
        workloads that ended are released; jobs a dead producer was still writing are failed; each
        running training workload resumes from its recorded progress, or ends `failed` with the
        reason; an evaluation interrupted midway ends `failed` (it is cheap to submit again)."""
        has_partition = has_partition or self.deployment.queue.has_partition
        report: dict[str, Any] = {"requeued": [], "released": [], "resumed": [], "failed": []}
        producers = self.deployment.producers
        producers.sync()  # what the replicas run now: their producers and advantage leases live on
        recovered = self.deployment.scheduler.recover_orphans(
            {self.actor_owner} | producers.live_owners(), has_partition=has_partition,
            max_attempts=self.max_job_attempts,
        )  # fmt: skip
        report["requeued"] = [j.job_id for j in recovered if j.state not in TERMINAL_STATES]
        report["released"] = [j.job_id for j in recovered if j.state in TERMINAL_STATES]
        with self.deployment.store.transaction() as s:
            states = {r.workload_id: (r.state, r.task) for r in s.scalars(select(WorkloadRecord))}
        report["released"] += self._release_orphaned_jobs(states, has_partition)
        for workload_id, (state, task) in states.items():
            if state == RUNNING:
                resumed = self._resume_after_restart(workload_id, task)
                report["resumed" if resumed else "failed"].append(workload_id)
        return report

    def _release_orphaned_jobs(
        self, states: dict[str, tuple[str, str]], has_partition: Callable[[str], bool]
    ) -> list[str]:
        """Release the live jobs no running workload will finish; returns their ids."""
        released = []
        producing = self.deployment.producers.running_workloads()  # their reserved jobs are being written
        for job in self.deployment.scheduler.jobs():
            if job.state in TERMINAL_STATES:
                continue
            workload_id = job.metadata.get("workload_id")
            state, _task = states.get(workload_id, (None, None))
            reason = None
            if state != RUNNING:
                reason = f"workload {workload_id} is {state or 'unknown'}"
            elif job.state == "reserved":  # its producer writes it, unless no replica runs that producer
                reason = None if workload_id in producing else "its producer stopped before the data was written"
            elif not has_partition(job.partition_id):
                reason = "its partition was lost with the Training Queue"
            if reason is not None:
                self.deployment.scheduler.abandon(job.job_id, f"reconciled after a restart: {reason}")
                released.append(job.job_id)
        return released

    def _resume_after_restart(self, workload_id: str, task: str) -> bool:
        """Resume a workload the previous Master left running; False when it ended `failed` instead."""
        if task == "eval":
            try:  # an evaluation is cheap and its episodes are seeded by index: run it again whole
                self._rerun_evaluation(workload_id)
                return True
            except Exception as error:
                self._fail_record(
                    workload_id, f"interrupted by a restart of the Master Service and cannot run again: {error}"
                )
                return False
        try:
            self._resume(workload_id)
            return True
        except Exception as error:
            log.exception("workload %s cannot resume", workload_id)
            self._fail_record(workload_id, f"cannot resume after a restart: {type(error).__name__}: {error}")
            return False

    # -- queries ------------------------------------------------------------------------------------
    def running_count(self) -> int:
        with self._lock:
            return len(self._running)

    def count(self, tenant_id: str, state: str) -> int:
        return self._count(tenant_id, state)

    def publish_weights(self, tenant_id: str) -> int:
        return self._publish_weights(tenant_id)

    def cancel(self, workload_id: str, tenant_id: str | None = None) -> WorkloadInfo:
        status = self.get(workload_id, tenant_id)
        if status.state in FINAL_WORKLOAD_STATES:
            return status
        self._finish(workload_id, CANCELLED, error="cancelled by request")
        return self.get(workload_id)

    def wait(self, workload_id: str, timeout_s: float = 3600.0) -> WorkloadInfo:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.get(workload_id)
            if status.state in FINAL_WORKLOAD_STATES or time.monotonic() >= deadline:
                return status
            with self._changed:
                self._changed.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))

    def wait_all(self, workload_ids: list[str], timeout_s: float = 3600.0) -> list[WorkloadInfo]:
        deadline = time.monotonic() + timeout_s
        return [self.wait(w, max(0.0, deadline - time.monotonic())) for w in workload_ids]

    def promote(self, tenant_id: str, registry_version: int | None = None, *, measure: bool = True) -> dict[str, Any]:
        return self.promoter.promote(tenant_id, registry_version, measure=measure)

    def measure_version(self, tenant: Any, registry_version: int, policy_version: int) -> dict[str, float]:
        return self.promoter.measure_version(tenant, registry_version, policy_version)

    def losses(self, workload_id: str) -> list[float]:
        with self._lock:
            running = self._running.get(workload_id)
            if running is not None:
                return list(running.losses)
        return [e["loss"] for e in self.events(workload_id) if e["kind"] == "step"]
