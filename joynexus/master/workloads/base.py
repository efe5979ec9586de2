"""The state every part of the workload manager shares, the workload rows and events, and the
waits through a restarting service.

`WorkloadManager` (manager.py) is composed of four parts, each a mixin over this base: the role
supervisor (roles.py), admission (admission.py), the training-workload lifecycle (training.py) and
evaluations (evaluation.py). The data work runs on the producer replicas (`deployment.producers`).
The facade's `__init__` creates the state declared here.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from joynexus.actors import role_unavailable
from joynexus.core.store import WorkloadEventRecord, WorkloadRecord, utcnow
from joynexus.core.tenants import Tenant
from joynexus.master.errors import UnknownWorkload
from joynexus.master.loops.actor_loop import ActorOutcome
from joynexus.protocol.schemas import WorkloadInfo
from joynexus.services.environment.service import SessionLimitExceeded
from joynexus.services.training.errors import UnknownTenant

if TYPE_CHECKING:
    from joynexus.master.deployment import Deployment
    from joynexus.master.workloads.promotion import Promoter
    from joynexus.scheduling.training_scheduler import TrainingJob
    from joynexus.spec import DatasetSpec

log = logging.getLogger(__name__)

QUEUED, RUNNING = "queued", "running"
WORKLOAD_COMPLETED, WORKLOAD_FAILED, CANCELLED = "completed", "failed", "cancelled"
FINAL_WORKLOAD_STATES = frozenset({WORKLOAD_COMPLETED, WORKLOAD_FAILED, CANCELLED})

R = TypeVar("R")


@dataclass
class _RunningWorkload:
    """A training workload this Master runs: its live progress (its producer runs on a replica)."""

    workload_id: str
    tenant: Tenant
    target_jobs: int
    stop: threading.Event = field(default_factory=threading.Event)
    completed_jobs: int = 0
    failed_jobs: int = 0
    stale_drops: int = 0  # RL jobs dropped by the staleness bound (not failures; bounded on their own)
    optimizer_steps: int = 0
    losses: list[float] = field(default_factory=list)
    version: int = 0
    run_id: str | None = None
    failures: list[str] = field(default_factory=list)
    resumed: bool = False
    produced: bool = False  # the producer returned with its target covered (not a dead producer)
    dataset: DatasetSpec | None = None  # SFT: what its jobs train on (the tenant's, or one the workload named)


class WorkloadBase:
    """Shared state (created by `WorkloadManager.__init__`) and what every part uses."""

    deployment: Deployment
    owner: str  # lease owner prefix of this Master's actor loop and advantage stage
    max_running: int
    max_failures: int
    admission_check: Callable[[str], None] | None  # raises AdmissionRefused to stop new work
    max_queued: Callable[[str], int | None] | None  # a tenant's limit of waiting workloads
    max_job_attempts: int  # a job whose lease owner died is re-queued at most this often
    on_event: Callable[[dict[str, Any]], None] | None
    # Called when a role finds a service down or restarting (the Health Manager checks at once).
    on_unavailable: Callable[[str], None] | None
    # True while admission is paused (a hung role escalated by the Health Manager); queued work waits.
    admission_paused: Callable[[], bool] | None
    _lock: threading.RLock
    _changed: threading.Condition  # notified on every event: `wait` wakes up
    _running: dict[str, _RunningWorkload]
    _stop: threading.Event
    # Workloads being finished (publish, export) -> their tenant: the tenant's next workload
    # waits until its policy is published, so it never trains under a concurrent export.
    _finishing: dict[str, str]
    _producer_restarts: int  # producers that waited for a restarting service (reported with the roles)
    _producer_waits: dict[str, int]  # per workload, the waits its replica reported last
    promoter: Promoter  # the promotion rule (promotion.py), a collaborator with its own interface

    # -- what one part calls of another (defined there; the base comes last in the MRO) ---------------
    def _admit(self) -> None:
        raise NotImplementedError  # admission.py

    def _launch(self, running: _RunningWorkload) -> None:
        raise NotImplementedError  # training.py

    def _on_trained(self, job: TrainingJob, metrics: dict[str, Any]) -> None:
        raise NotImplementedError  # training.py

    def _on_outcome(self, outcome: ActorOutcome) -> None:
        raise NotImplementedError  # training.py

    def _finish(self, workload_id: str, state: str, error: str | None = None) -> None:
        raise NotImplementedError  # training.py

    def _rerun_evaluation(self, workload_id: str) -> None:
        raise NotImplementedError  # evaluation.py

    def _on_producer_report(self, running: _RunningWorkload, report: dict[str, Any]) -> None:
        raise NotImplementedError  # training.py

    def _on_evaluation_report(self, workload_id: str, report: dict[str, Any]) -> None:
        raise NotImplementedError  # evaluation.py

    # -- workload rows ------------------------------------------------------------------------------
    def get(self, workload_id: str, tenant_id: str | None = None) -> WorkloadInfo:
        with self.deployment.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            if record is None or (tenant_id is not None and record.tenant_id != tenant_id):
                raise UnknownWorkload(workload_id)  # another tenant's id looks exactly like a missing one
            return self._status(record, s)

    def list(self, tenant_id: str | None = None) -> list[WorkloadInfo]:
        query = select(WorkloadRecord).order_by(WorkloadRecord.created_at)
        if tenant_id is not None:
            query = query.where(WorkloadRecord.tenant_id == tenant_id)
        with self.deployment.store.transaction() as s:
            return [self._status(r, s) for r in s.scalars(query)]

    def events(self, workload_id: str, after: int = 0, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """The workload's events after its `after`-th one. `seq` numbers a workload's own events
        1, 2, 3, ... (the store's row ids are global: they would show how much every other tenant
        did in between). Events are only appended, and per workload in order (`_emit_many` locks
        the workload's row), so the n-th event stays the n-th."""
        self.get(workload_id, tenant_id)
        query = (
            select(WorkloadEventRecord)
            .where(WorkloadEventRecord.workload_id == workload_id)
            .order_by(WorkloadEventRecord.seq)
            .offset(after)
        )
        with self.deployment.store.read() as s:
            return [_event_dict(r, seq=after + n) for n, r in enumerate(s.scalars(query), start=1)]

    def _count(self, tenant_id: str, state: str) -> int:
        query = select(func.count()).where(WorkloadRecord.tenant_id == tenant_id, WorkloadRecord.state == state)
        with self.deployment.store.transaction() as s:
            return int(s.scalar(query) or 0)

    def _status(self, record: WorkloadRecord, session: Session) -> WorkloadInfo:
        position = None
        if record.state == QUEUED:
            ahead = select(func.count()).where(
                WorkloadRecord.state == QUEUED, WorkloadRecord.created_at < record.created_at
            )
            position = int(session.scalar(ahead) or 0) + 1  # the caller's transaction: one at a time
        with self._lock:
            running = self._running.get(record.workload_id)
        live = {}
        if running is not None:
            live = {
                "completed_jobs": running.completed_jobs,
                "version": running.version,
                "optimizer_steps": running.optimizer_steps,
                "last_loss": running.losses[-1] if running.losses else None,
                "run_id": running.run_id,
            }
        recorded = {
            "workload_id": record.workload_id,
            "tenant_id": record.tenant_id,
            "task": record.task,
            "state": record.state,
            "position": position,
            "completed_jobs": record.completed_jobs,
            "target_jobs": record.target_jobs,
            "version": record.version,
            "optimizer_steps": record.optimizer_steps,
            "last_loss": record.last_loss,
            "registered_version": record.registered_version,
            "run_id": record.run_id,
            "error": record.error,
            "created_at": _iso(record.created_at),
            "started_at": _iso(record.started_at),
            "finished_at": _iso(record.finished_at),
            "result": record.result,
            "dataset_id": (record.dataset or {}).get("id"),
        }
        return WorkloadInfo(**{**recorded, **live})

    def _fail_record(self, workload_id: str, reason: str) -> None:
        with self.deployment.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            record.state, record.error, record.finished_at = WORKLOAD_FAILED, reason, utcnow()
        self._emit(workload_id, WORKLOAD_FAILED, error=reason)

    # -- events -------------------------------------------------------------------------------------
    def _emit(self, workload_id: str, kind: str, **data: Any) -> None:
        self._emit_many(workload_id, [(kind, data)])

    def _emit_many(self, workload_id: str, events: list[tuple[str, dict[str, Any]]]) -> None:
        """Append events (kind, data) to the workload's stream in ONE transaction (a job's step
        events come together)."""
        now = time.time()
        with self.deployment.store.transaction() as s:
            # The row lock orders one workload's appends (its events' per-workload numbers, `events`).
            record = s.get(WorkloadRecord, workload_id, with_for_update=True)
            tenant_id = record.tenant_id if record is not None else ""
            rows = [
                WorkloadEventRecord(
                    workload_id=workload_id, tenant_id=tenant_id, kind=kind, data=_jsonable(data), time=now
                )
                for kind, data in events
            ]
            s.add_all(rows)
            s.flush()
            emitted = [_event_dict(row) for row in rows]
        with self._lock:
            self._changed.notify_all()
        if self.on_event is not None:
            for event in emitted:
                self.on_event(event)

    # -- services that restart in place -------------------------------------------------------------
    def _publish_weights(self, tenant_id: str) -> int:
        """Training -> inference weight sync (paper A.1): the only cross-queue dependency. It runs
        on the tenant's producer replica: the payload goes from service to service, not through here."""
        return self.deployment.producers.publish_weights(tenant_id)

    def _tenant_exists(self, tenant_id: str) -> bool:
        try:
            self.deployment.creator.get(tenant_id)
            return True
        except KeyError:
            return False

    def _must_wait(self, error: BaseException, tenant_id: str) -> bool:
        """Wait and try again (not a failure of the work): a service restarting, or full."""
        # (A producer's own waits, for a version served again, happen on its replica.)
        return isinstance(error, SessionLimitExceeded) or self._service_restarting(error, tenant_id)

    def _service_restarting(self, error: BaseException, tenant_id: str) -> bool:
        """A service is gone or restarting in place (its call failed), or it is back without the
        tenant's slot yet (the Health Manager restores slots on its next round)."""
        if role_unavailable(error):
            return True
        return isinstance(error, UnknownTenant) and self._tenant_exists(tenant_id)

    def _through_restarts(self, call: Callable[[], R], tenant_id: str, what: str, wait_s: float = 120.0) -> R:
        """`call()`, waited through a restart in place of the service it calls (bounded)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return call()
            except Exception as error:
                if not self._must_wait(error, tenant_id) or time.monotonic() > deadline:
                    raise
                log.warning("%s of tenant %s waits for a restarting service: %s", what, tenant_id, error)
                if self.on_unavailable is not None:
                    self.on_unavailable(f"{what}: {type(error).__name__}")
                time.sleep(1.0)


def _event_dict(record: WorkloadEventRecord, seq: int | None = None) -> dict[str, Any]:
    """An event as callers see it; `seq`: its number within its workload (None: the store's row id,
    for the Master's own listeners)."""
    return {
        "seq": record.seq if seq is None else seq, "workload_id": record.workload_id, "kind": record.kind,
        "time": record.time, **(record.data or {}),
    }  # fmt: skip


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    """Event data as JSON the store keeps (numpy scalars and tuples become plain values)."""
    return json.loads(json.dumps(data, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None
