"""The actor loop (paper Fig. 6/7 right, Appendix A.6): lease the next ready job of any tenant,
drop it if its behavior policy is too stale (eq. 1), otherwise let the Training Model Service train
it; every outcome reaches a terminal state, which releases the job's partition."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from joynexus.scheduling.training_scheduler import TrainingJob, TrainingScheduler

log = logging.getLogger(__name__)

POLICY_STALE = "policy_stale"


@dataclass(frozen=True)
class ActorOutcome:
    job: TrainingJob
    state: str  # completed | failed | dropped
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
    ):
        self.scheduler = scheduler
        self.service = training_service
        self.owner = owner
        self.domains = domains
        self.on_outcome = on_outcome

    def step(self, wait_s: float = 0.5) -> ActorOutcome | None:
        job = self.scheduler.lease_next(consumer_role="actor", domains=self.domains, owner=self.owner)
        if job is None:
            self.scheduler.wait_for_ready(consumer_role="actor", domains=self.domains, timeout_s=wait_s)
            return None
        try:
            actor_version = self.service.policy_version(job.tenant_id)
            if is_stale(job, actor_version):
                outcome = ActorOutcome(self.scheduler.drop(job.job_id, POLICY_STALE), "dropped", None, POLICY_STALE)
            else:
                metrics = self.service.train_job(job)
                result = {k: v for k, v in metrics.items() if k != "losses"}
                result["mean_loss"] = sum(metrics["losses"]) / len(metrics["losses"])
                outcome = ActorOutcome(self.scheduler.complete(job.job_id, result), "completed", metrics, None)
        except Exception as error:  # one tenant's failure must not stop the actor for the others
            cause = getattr(error, "cause", None) or error  # unwrap Ray's RayTaskError
            reason = f"{type(cause).__name__}: {cause}"
            log.warning("training job %s of tenant %s failed: %s", job.job_id, job.tenant_id, reason)
            outcome = ActorOutcome(self.scheduler.fail(job.job_id, reason), "failed", None, reason)
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        return outcome

    def run(self, stop: threading.Event, wait_s: float = 0.2) -> None:
        while not stop.is_set():
            self.step(wait_s)
