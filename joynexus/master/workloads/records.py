"""The workloads' rows and event streams in the store: what a status, a listing and an event
stream read, and the one writer of events (`emit`), which wakes the waiters (`wait_for_change`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from joynexus.core.store import ControlPlaneStore, WorkloadEventRecord, WorkloadRecord, utcnow
from joynexus.master.errors import UnknownWorkload
from joynexus.master.workloads.live import QUEUED, WORKLOAD_FAILED, LiveWorkloads
from joynexus.protocol.schemas import WorkloadInfo


class WorkloadRecords:
    """Reads and writes workload rows and events. `live` supplies the progress of the workloads
    running now (it is newer than their rows); `on_event` sees every event appended."""

    def __init__(
        self,
        store: ControlPlaneStore,
        live: LiveWorkloads,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.store = store
        self._live = live
        self.on_event = on_event
        self._changed = threading.Condition()  # notified on every event: `WorkloadManager.wait` wakes up

    # -- reads --------------------------------------------------------------------------------------
    def get(self, workload_id: str, tenant_id: str | None = None) -> WorkloadInfo:
        with self.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            if record is None or (tenant_id is not None and record.tenant_id != tenant_id):
                raise UnknownWorkload(workload_id)  # another tenant's id looks exactly like a missing one
            return self._status(record, s)

    def list(self, tenant_id: str | None = None) -> list[WorkloadInfo]:
        query = select(WorkloadRecord).order_by(WorkloadRecord.created_at)
        if tenant_id is not None:
            query = query.where(WorkloadRecord.tenant_id == tenant_id)
        with self.store.transaction() as s:
            return [self._status(r, s) for r in s.scalars(query)]

    def events(self, workload_id: str, after: int = 0, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """The workload's events after its `after`-th one. `seq` numbers a workload's own events
        1, 2, 3, ... (the store's row ids are global: they would show how much every other tenant
        did in between). Events are only appended, and per workload in order (`emit_many` locks
        the workload's row), so the n-th event stays the n-th."""
        self.get(workload_id, tenant_id)
        query = (
            select(WorkloadEventRecord)
            .where(WorkloadEventRecord.workload_id == workload_id)
            .order_by(WorkloadEventRecord.seq)
            .offset(after)
        )
        with self.store.read() as s:
            return [_event_dict(r, seq=after + n) for n, r in enumerate(s.scalars(query), start=1)]

    def count(self, tenant_id: str, state: str) -> int:
        query = select(func.count()).where(WorkloadRecord.tenant_id == tenant_id, WorkloadRecord.state == state)
        with self.store.transaction() as s:
            return int(s.scalar(query) or 0)

    def states(self) -> dict[str, tuple[str, str]]:
        """Every workload's (state, task), by id."""
        with self.store.transaction() as s:
            return {r.workload_id: (r.state, r.task) for r in s.scalars(select(WorkloadRecord))}

    def queued(self) -> list[tuple[str, str, int]]:
        """The admission queue: (workload id, tenant id, target jobs) of the queued ones, oldest first."""
        waiting = select(WorkloadRecord).where(WorkloadRecord.state == QUEUED).order_by(WorkloadRecord.created_at)
        with self.store.transaction() as s:
            return [(r.workload_id, r.tenant_id, r.target_jobs) for r in s.scalars(waiting)]

    def _status(self, record: WorkloadRecord, session: Session) -> WorkloadInfo:
        position = None
        if record.state == QUEUED:
            ahead = select(func.count()).where(
                WorkloadRecord.state == QUEUED, WorkloadRecord.created_at < record.created_at
            )
            position = int(session.scalar(ahead) or 0) + 1  # the caller's transaction: one at a time
        running = self._live.get(record.workload_id)
        live = running.progress() if running is not None else {}
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

    # -- writes -------------------------------------------------------------------------------------
    def fail(self, workload_id: str, reason: str) -> None:
        """End the workload `failed` with `reason` (row and event)."""
        with self.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            record.state, record.error, record.finished_at = WORKLOAD_FAILED, reason, utcnow()
        self.emit(workload_id, WORKLOAD_FAILED, error=reason)

    def emit(self, workload_id: str, kind: str, **data: Any) -> None:
        self.emit_many(workload_id, [(kind, data)])

    def emit_many(self, workload_id: str, events: list[tuple[str, dict[str, Any]]]) -> None:
        """Append events (kind, data) to the workload's stream in ONE transaction (a job's step
        events come together)."""
        now = time.time()
        with self.store.transaction() as s:
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
        with self._changed:
            self._changed.notify_all()
        if self.on_event is not None:
            for event in emitted:
                self.on_event(event)

    def wait_for_change(self, timeout_s: float) -> None:
        """Block until the next event or `timeout_s`."""
        with self._changed:
            self._changed.wait(timeout=max(0.0, timeout_s))


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
