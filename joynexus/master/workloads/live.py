"""The workloads this Master runs now: their live progress, and which are being finished.

`LiveWorkloads` is the one piece of state the workload manager's parts share, behind a narrow
interface and its own lock. It never touches the store: readers of the store take its lock while
they hold a transaction (`WorkloadRecords.get`), so the other order would deadlock on SQLite.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from joynexus.core.tenants import Tenant

if TYPE_CHECKING:
    from joynexus.spec import DatasetSpec

QUEUED, RUNNING = "queued", "running"
WORKLOAD_COMPLETED, WORKLOAD_FAILED, CANCELLED = "completed", "failed", "cancelled"
FINAL_WORKLOAD_STATES = frozenset({WORKLOAD_COMPLETED, WORKLOAD_FAILED, CANCELLED})


@dataclass(eq=False)
class RunningWorkload:
    """A training workload this Master runs: its live progress (its producer runs on a replica).
    The counters change under `lock` (the actor loop's outcomes); readers take `progress()`."""

    workload_id: str
    tenant: Tenant
    target_jobs: int
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
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

    def progress(self) -> dict[str, Any]:
        """What a status shows of the live workload (over its recorded row)."""
        with self.lock:
            return {
                "completed_jobs": self.completed_jobs,
                "version": self.version,
                "optimizer_steps": self.optimizer_steps,
                "last_loss": self.losses[-1] if self.losses else None,
                "run_id": self.run_id,
            }

    def loss_history(self) -> list[float]:
        with self.lock:
            return list(self.losses)


class LiveWorkloads:
    """Running workloads by id, the ones being finished (publish, export) with their tenant, and
    whether the manager still admits work. A tenant runs one workload at a time: its next one
    waits until the last is finished, so it never trains under a concurrent export."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, RunningWorkload] = {}
        self._finishing: dict[str, str] = {}  # workload id -> its tenant id ("" when it was not running here)
        self._closed = False

    def get(self, workload_id: str | None) -> RunningWorkload | None:
        with self._lock:
            return self._running.get(workload_id)  # type: ignore[arg-type]

    def all(self) -> list[RunningWorkload]:
        with self._lock:
            return list(self._running.values())

    def count(self) -> int:
        with self._lock:
            return len(self._running)

    def add(self, running: RunningWorkload) -> None:
        with self._lock:
            self._running[running.workload_id] = running

    def discard(self, workload_id: str) -> None:
        with self._lock:
            self._running.pop(workload_id, None)

    def is_current(self, running: RunningWorkload) -> bool:
        """False once the workload was cancelled or finished (between its admission and its launch)."""
        with self._lock:
            return self._running.get(running.workload_id) is running

    def is_finishing(self, workload_id: str) -> bool:
        with self._lock:
            return workload_id in self._finishing

    def begin_finish(self, workload_id: str) -> tuple[bool, RunningWorkload | None]:
        """(False, None) when another path (a cancel, the last job, a failing producer) is finishing
        it already; else (True, the running workload or None), no longer running but finishing."""
        with self._lock:
            if workload_id in self._finishing:
                return False, None
            running = self._running.pop(workload_id, None)
            self._finishing[workload_id] = running.tenant.tenant_id if running is not None else ""
            return True, running

    def end_finish(self, workload_id: str) -> None:
        with self._lock:
            self._finishing.pop(workload_id, None)

    def enter_admitted(
        self, queued: list[tuple[str, str, int]], tenants: dict[str, Tenant], max_running: int
    ) -> list[RunningWorkload]:
        """Of `queued` (workload id, tenant id, target jobs; oldest first), the ones that may start
        now, entered as running: at most `max_running` in all, one per tenant (a tenant that runs or
        finishes one keeps its place in the queue), none of a tenant not in `tenants`."""
        admitted: list[RunningWorkload] = []
        with self._lock:
            if self._closed:
                return []
            busy = {w.tenant.tenant_id for w in self._running.values()} | set(self._finishing.values())
            for workload_id, tenant_id, target in queued:
                if len(self._running) + len(admitted) >= max_running:
                    break
                if tenant_id in busy or workload_id in self._running or workload_id in self._finishing:
                    continue
                tenant = tenants.get(tenant_id)
                if tenant is None:
                    continue
                busy.add(tenant_id)
                admitted.append(RunningWorkload(workload_id, tenant, target))
            for running in admitted:
                self._running[running.workload_id] = running
        return admitted

    def close(self) -> None:
        """Admit nothing more (the manager stops)."""
        with self._lock:
            self._closed = True
