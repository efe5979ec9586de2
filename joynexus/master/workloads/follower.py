"""The producer follower: what the Master learns from the producer replicas, one round at a time
(the `producer_follower` role, roles.py): moved work, each workload's events and reports, the
waits its producer made for a restarting service, and the leases of a replica that went."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from joynexus.master.workloads.evaluation import Evaluations
from joynexus.master.workloads.live import FINAL_WORKLOAD_STATES, LiveWorkloads
from joynexus.master.workloads.records import WorkloadRecords
from joynexus.master.workloads.restarts import ServiceWaits
from joynexus.master.workloads.training import TrainingWorkloads

if TYPE_CHECKING:
    from joynexus.master.deployment import Deployment

log = logging.getLogger(__name__)


class ProducerFollower:
    """Applies the replicas' reports: a training workload's to `training`, an evaluation's to
    `evaluations`; `recover_orphans()` re-queues the leases of a replica that went."""

    def __init__(
        self,
        deployment: Deployment,
        records: WorkloadRecords,
        live: LiveWorkloads,
        waits: ServiceWaits,
        *,
        training: TrainingWorkloads,
        evaluations: Evaluations,
        recover_orphans: Callable[[], None],
    ):
        self.deployment = deployment
        self._records, self._live, self._waits = records, live, waits
        self._training, self._evaluations = training, evaluations
        self._recover_orphans = recover_orphans
        self._lock = threading.Lock()
        self._restarts = 0  # producers that waited for a restarting service (reported with the roles)
        self._waits_seen: dict[str, int] = {}  # per workload, the waits its replica reported last

    @property
    def restarts(self) -> int:
        with self._lock:
            return self._restarts

    def step(self) -> None:
        """One round of following the producer replicas: moved work, reports, lost leases."""
        producers = self.deployment.producers
        reports = producers.poll()
        if producers.take_lost_owners():  # a replica went: its advantage leases go back to the queue
            self._recover_orphans()
        for workload_id, report in reports.items():
            try:
                self._apply(workload_id, report)
            except Exception:  # one workload's record must not stop following the others
                log.exception("applying the producer report of workload %s failed", workload_id)

    def _apply(self, workload_id: str, report: dict[str, Any]) -> None:
        records = self._records
        if report.get("moved_to") is not None:
            records.emit(workload_id, "producer_moved", replica=report["moved_to"])
        for kind, data in report["events"]:
            records.emit(workload_id, kind, **data)
        if report["waits"]:
            with self._lock:
                seen = self._waits_seen.get(workload_id, 0)
                self._waits_seen[workload_id] = report["waits"]
                self._restarts += max(0, report["waits"] - seen)
            if report["waits"] > seen:
                self._waits.unavailable("producer: a service it writes to is restarting")
        if report["kind"] == "eval":
            if report["state"] != "running":
                self._evaluations.on_report(workload_id, report)
            return
        running = self._live.get(workload_id)
        if running is not None:
            self._training.on_producer_report(running, report)
        elif not self._live.is_finishing(workload_id) and records.get(workload_id).state in FINAL_WORKLOAD_STATES:
            self.deployment.producers.stop_workload(workload_id)  # ended under a previous Master
