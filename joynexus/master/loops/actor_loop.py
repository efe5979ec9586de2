"""The actor loop (paper Fig. 6/7 right, Appendix A.6): lease the next ready job of any tenant,
drop it if its behavior policy is too stale (eq. 1), otherwise let the Training Model Service train
it; every outcome reaches a terminal state, which releases the job's partition."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from joynexus.actors import role_unavailable
from joynexus.scheduling.training_scheduler import InvalidTransition, TrainingJob, TrainingScheduler

log = logging.getLogger(__name__)

POLICY_STALE = "policy_stale"
LOST = "lost"  # the actor's lease was taken back (job abandoned or re-queued); not a terminal outcome


@dataclass(frozen=True)
class ActorOutcome:
    job: TrainingJob
    state: str  # completed | failed | dropped | lost
    metrics: dict[str, Any] | None
    reason: str | None


def is_stale(job: TrainingJob, actor_version: int) -> bool:
    """Eq. 1: v_actor - v_behavior > Δmax. Not applied to SFT (demonstrations do not age)."""
    return (
        job.task_type == "rl"
        and job.max_policy_staleness is not None
        and job.behavior_policy_version is not None
        and actor_version - job.behavior_policy_version > job.max_policy_staleness
    )


class ActorLoop:
    def __init__(
        self,
        scheduler: TrainingScheduler,
        training_service: Any,  # TrainingModelService or its Ray actor handle
        *,
        owner: str = "actor-0",
        domains: tuple[str, ...] = ("vla",),
        on_outcome: Callable[[ActorOutcome], None] | None = None,
        on_unavailable: Callable[[str], None] | None = None,
        max_attempts: int = 3,
        service_restarting: Callable[[Exception, str], bool] | None = None,
        retired: threading.Event | None = None,
    ):
        self.scheduler = scheduler
        self.service = training_service
        self.owner = owner
        self.domains = domains
        self.on_outcome = on_outcome
        # Called with the reason when the Training Model Service is down or restarting (the
        # Health Manager checks at once instead of at its next tick).
        self.on_unavailable = on_unavailable
        self.max_attempts = max_attempts
        # (error, tenant_id) -> the service is gone or restarting, not failing the job; the
        # default knows Ray's actor errors only (the Master also knows which tenants exist).
        self.service_restarting = service_restarting or (lambda error, _tenant_id: role_unavailable(error))
        # Set when the Health Manager replaced this loop (it stopped beating): a job it still holds
        # was re-queued for the replacement, so it must not train it too.
        self.retired = retired

    def step(self, wait_s: float = 0.5) -> ActorOutcome | None:
        """Lease, train and finish one job. Every scheduler call names this loop's owner, so a job
        abandoned or re-queued while it trained is not resurrected: that comes back as a `lost`
        outcome, which `on_outcome` does not see (the job's real outcome is someone else's)."""
        job = self.scheduler.lease_next(consumer_role="actor", domains=self.domains, owner=self.owner)
        if job is None:
            self.scheduler.wait_for_ready(consumer_role="actor", domains=self.domains, timeout_s=wait_s)
            return None
        try:
            actor_version = self.service.policy_version(job.tenant_id)
            if self.retired is not None and self.retired.is_set():
                return self._lost(job, InvalidTransition(job.job_id, job.state, "retired"))
            if is_stale(job, actor_version):
                dropped = self.scheduler.drop(job.job_id, POLICY_STALE, owner=self.owner)
                outcome = ActorOutcome(dropped, "dropped", None, POLICY_STALE)
            else:
                metrics = self.service.train_job(job)
                result = {k: v for k, v in metrics.items() if k != "losses"}
                result["mean_loss"] = sum(metrics["losses"]) / len(metrics["losses"])
                done = self.scheduler.complete(job.job_id, result, owner=self.owner)
                outcome = ActorOutcome(done, "completed", metrics, None)
        except InvalidTransition as lost:
            return self._lost(job, lost)
        except Exception as error:  # one tenant's failure must not stop the actor for the others
            if self.service_restarting(error, job.tenant_id):
                return self._give_back(job, error)
            cause = getattr(error, "cause", None) or error  # unwrap Ray's RayTaskError
            reason = f"{type(cause).__name__}: {cause}"
            log.warning("training job %s of tenant %s failed: %s", job.job_id, job.tenant_id, reason)
            try:
                failed = self.scheduler.fail(job.job_id, reason, owner=self.owner)
                outcome = ActorOutcome(failed, "failed", None, reason)
            except InvalidTransition as lost:
                return self._lost(job, lost)
        if self.on_outcome is not None:
            try:
                self.on_outcome(outcome)
            except Exception:  # the Master's bookkeeping failing must not stop training for every tenant
                log.exception("handling the outcome of job %s failed", job.job_id)
        return outcome

    def _give_back(self, job: TrainingJob, error: Exception) -> ActorOutcome:
        reason = f"the Training Model Service is unavailable: {type(error).__name__}: {error}"
        log.warning("training job %s of tenant %s re-queued: %s", job.job_id, job.tenant_id, reason)
        if self.on_unavailable is not None:
            self.on_unavailable(reason)
        try:
            after = self.scheduler.release_lease(job.job_id, reason, owner=self.owner, max_attempts=self.max_attempts)
        except InvalidTransition as lost:
            return self._lost(job, lost)
        if after.state == "failed" and self.on_outcome is not None:
            outcome = ActorOutcome(after, "failed", None, after.terminal_reason)
            try:
                self.on_outcome(outcome)
            except Exception:
                log.exception("handling the outcome of job %s failed", job.job_id)
            return outcome
        time.sleep(0.5)  # the service is coming back; do not spin through the queue meanwhile
        return ActorOutcome(after, LOST, None, reason)

    def _lost(self, job: TrainingJob, error: InvalidTransition) -> ActorOutcome:
        log.warning("training job %s of tenant %s: lease lost, result discarded: %s", job.job_id, job.tenant_id, error)
        try:
            current = self.scheduler.get(job.job_id)
        except Exception:  # the outcome is informational; never stop the loop for it
            current = job
        return ActorOutcome(current, LOST, None, str(error))

    def run(self, stop: threading.Event, wait_s: float = 0.2) -> None:
        while not stop.is_set():
            self.step(wait_s)
