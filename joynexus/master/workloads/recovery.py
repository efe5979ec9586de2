"""Reconciling the store with a Master that (re)starts (paper 4.4: restart from recorded progress)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from joynexus.master.workloads.evaluation import Evaluations
from joynexus.master.workloads.live import RUNNING
from joynexus.master.workloads.records import WorkloadRecords
from joynexus.master.workloads.training import TrainingWorkloads
from joynexus.scheduling.training_scheduler import TERMINAL_STATES

if TYPE_CHECKING:
    from joynexus.master.deployment import Deployment

log = logging.getLogger(__name__)


class Reconciler:
    """Re-queues or fails the jobs a dead owner held, releases the jobs no running workload will
    finish, and resumes each running workload (`training.resume`, `evaluations.rerun`) or ends it
    `failed` with the reason. `actor_owner` is this Master's actor loop (its leases are not orphans)."""

    def __init__(
        self,
        deployment: Deployment,
        records: WorkloadRecords,
        *,
        training: TrainingWorkloads,
        evaluations: Evaluations,
        actor_owner: str,
        max_job_attempts: int = 3,
    ):
        self.deployment = deployment
        self._records, self._training, self._evaluations = records, training, evaluations
        self.actor_owner, self.max_job_attempts = actor_owner, max_job_attempts

    def reconcile(self, has_partition: Callable[[str], bool] | None = None) -> dict[str, Any]:
        """Leases held by another owner (a dead Master's actor loop or advantage stage) are re-queued
        or failed with bounded retries; jobs of workloads that ended are released; jobs a dead
        producer was still writing are failed; each running training workload resumes from its
        recorded progress, or ends `failed` with the reason; an evaluation interrupted midway runs
        again whole (or ends `failed`)."""
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
        states = self._records.states()
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
                self._evaluations.rerun(workload_id)
                return True
            except Exception as error:
                self._records.fail(
                    workload_id, f"interrupted by a restart of the Master Service and cannot run again: {error}"
                )
                return False
        try:
            self._training.resume(workload_id)
            return True
        except Exception as error:
            log.exception("workload %s cannot resume", workload_id)
            self._records.fail(workload_id, f"cannot resume after a restart: {type(error).__name__}: {error}")
            return False
