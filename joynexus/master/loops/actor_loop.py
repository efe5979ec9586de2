"""The actor loop (paper Fig. 6/7 right, Appendix A.6): lease the next ready job of any tenant,
drop it if its behavior policy is too stale (eq. 1), otherwise let the Training Model Service train
it; every outcome reaches a terminal state, which releases the job's partition.

Grouped training (paper 5.2): with `group_max` > 1 the loop also leases up to `group_max` - 1 ready
jobs of other tenants with the head job's group key (`TrainingScheduler.lease_companions`: lease
order, one job per tenant, only admitted jobs) and steps them together (`train_jobs`: one shared
backbone forward per round). Every job still gets its own staleness check and its own terminal
outcome: one tenant's NaN or failure fails that job only. A head job with no companion trains
alone (`train_job`), as with `group_max` = 1."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from joynexus.actors import role_unavailable
from joynexus.scheduling.training_scheduler import InvalidTransition, TrainingJob, TrainingScheduler

if TYPE_CHECKING:  # names the type only: the Master never imports the service's model stack
    from joynexus.services.training.service import TrainingModelService

log = logging.getLogger(__name__)

POLICY_STALE = "policy_stale"
LOST = "lost"  # the actor's lease was taken back (job abandoned or re-queued); not a terminal outcome

# How many tenants' jobs one grouped step may train together; 1 trains one job at a time.
DEFAULT_TRAINING_GROUP_MAX = 8


def training_group_max_from_env() -> int:
    """JOYNEXUS_TRAINING_GROUP_MAX (default 8; 1 = one job at a time)."""
    text = os.environ.get("JOYNEXUS_TRAINING_GROUP_MAX", "").strip()
    if not text:
        return DEFAULT_TRAINING_GROUP_MAX
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"JOYNEXUS_TRAINING_GROUP_MAX must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise ValueError(f"JOYNEXUS_TRAINING_GROUP_MAX must be an integer >= 1, got {value}")
    return value


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
        training_service: TrainingModelService,  # the service or its handle (local or a Ray actor)
        *,
        owner: str = "actor-0",
        domains: tuple[str, ...] = ("vla",),
        on_outcome: Callable[[ActorOutcome], None] | None = None,
        on_unavailable: Callable[[str], None] | None = None,
        max_attempts: int = 3,
        service_restarting: Callable[[Exception, str], bool] | None = None,
        retired: threading.Event | None = None,
        group_max: int | None = None,
        on_trained: Callable[[TrainingJob, dict[str, Any]], None] | None = None,
    ):
        """`group_max`: how many tenants' jobs one step may train together (None: from
        JOYNEXUS_TRAINING_GROUP_MAX, default 8; 1: one job at a time). `on_trained(job, metrics)`
        runs after a job trained and before it is completed (the Master publishes an RL update
        there: completing frees the tenant's in-flight slot, and the rollout that slot starts must
        act with the new version, not the one before it, which the staleness bound would drop)."""
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
        self.on_trained = on_trained
        self.group_max = training_group_max_from_env() if group_max is None else group_max
        if self.group_max < 1:
            raise ValueError(f"group_max must be >= 1, got {self.group_max}")

    def step(self, wait_s: float = 0.5) -> ActorOutcome | None:
        """Lease, train and finish the next job (and its companions, `step_all`); the head job's
        outcome. Every scheduler call names this loop's owner, so a job abandoned or re-queued while
        it trained is not resurrected: that comes back as a `lost` outcome, which `on_outcome` does
        not see (the job's real outcome is someone else's)."""
        outcomes = self.step_all(wait_s)
        return outcomes[0] if outcomes else None

    def step_all(self, wait_s: float = 0.5) -> list[ActorOutcome]:
        """Lease the head job and up to `group_max` - 1 companions, train them, finish each; their
        outcomes, head first ([] when no job was ready within `wait_s`)."""
        jobs = self._lease_jobs()
        if not jobs:
            self._wait_for_ready(wait_s)
            return []
        return self._train_leased(jobs)

    # The three steps of `step_all`, overridden by a shard's loop (`shard_loops.ShardActorLoop`).
    def _lease_jobs(self) -> list[TrainingJob]:
        """The head job and its companions, leased to this loop ([] when none is ready)."""
        job = self.scheduler.lease_next(consumer_role="actor", domains=self.domains, owner=self.owner)
        if job is None:
            return []
        companions: list[TrainingJob] = []
        if self.group_max > 1:
            try:
                companions = self.scheduler.lease_companions(
                    job, self.group_max - 1, domains=self.domains, owner=self.owner
                )
            except Exception:  # the head job still trains; companions are an optimization
                log.exception("leasing companions of job %s failed", job.job_id)
        return [job, *companions]

    def _wait_for_ready(self, wait_s: float) -> None:
        self.scheduler.wait_for_ready(consumer_role="actor", domains=self.domains, timeout_s=wait_s)

    def _train_leased(self, jobs: list[TrainingJob]) -> list[ActorOutcome]:
        return [self._single(jobs[0])] if len(jobs) == 1 else self._group(jobs)

    def _single(self, job: TrainingJob) -> ActorOutcome:
        try:
            actor_version = self.service.policy_version(job.tenant_id)
            if self.retired is not None and self.retired.is_set():
                return self._lost(job, InvalidTransition(job.job_id, job.state, "retired"))
            if is_stale(job, actor_version):
                dropped = self.scheduler.drop(job.job_id, POLICY_STALE, owner=self.owner)
                outcome = ActorOutcome(dropped, "dropped", None, POLICY_STALE)
            else:
                metrics = self.service.train_job(job)
                self._trained(job, metrics)
                done = self.scheduler.complete(job.job_id, _job_result(metrics), owner=self.owner)
                outcome = ActorOutcome(done, "completed", metrics, None)
        except InvalidTransition as lost:
            return self._lost(job, lost)
        except Exception as error:  # one tenant's failure must not stop the actor for the others
            return self._failed_or_given_back(job, error)
        return self._notify(outcome)

    def _group(self, jobs: list[TrainingJob]) -> list[ActorOutcome]:
        """Train several tenants' jobs in one `train_jobs` call; each job's outcome is its own."""
        outcomes: dict[str, ActorOutcome] = {}
        train: list[TrainingJob] = []
        for job in jobs:
            try:
                actor_version = self.service.policy_version(job.tenant_id)
                if self.retired is not None and self.retired.is_set():
                    outcomes[job.job_id] = self._lost(job, InvalidTransition(job.job_id, job.state, "retired"))
                elif is_stale(job, actor_version):
                    dropped = self.scheduler.drop(job.job_id, POLICY_STALE, owner=self.owner)
                    outcomes[job.job_id] = self._notify(ActorOutcome(dropped, "dropped", None, POLICY_STALE))
                else:
                    train.append(job)
            except InvalidTransition as lost:
                outcomes[job.job_id] = self._lost(job, lost)
            except Exception as error:
                outcomes[job.job_id] = self._failed_or_given_back(job, error)
        if len(train) == 1:
            outcomes[train[0].job_id] = self._single(train[0])
        elif train:
            try:
                results = self.service.train_jobs(train)
            except Exception as error:  # the whole call failed: the service, not one tenant
                for job in train:
                    outcomes[job.job_id] = self._failed_or_given_back(job, error)
            else:
                for job, metrics in zip(train, results, strict=True):
                    outcomes[job.job_id] = self._finish(job, metrics)
        return [outcomes[job.job_id] for job in jobs]

    def _finish(self, job: TrainingJob, metrics: dict[str, Any]) -> ActorOutcome:
        """One grouped job's terminal move from its own result."""
        try:
            if "error" in metrics:
                reason = str(metrics["error"])
                log.warning("training job %s of tenant %s failed: %s", job.job_id, job.tenant_id, reason)
                failed = self.scheduler.fail(job.job_id, reason, owner=self.owner)
                return self._notify(ActorOutcome(failed, "failed", None, reason))
            self._trained(job, metrics)
            done = self.scheduler.complete(job.job_id, _job_result(metrics), owner=self.owner)
            return self._notify(ActorOutcome(done, "completed", metrics, None))
        except InvalidTransition as lost:
            return self._lost(job, lost)

    def _trained(self, job: TrainingJob, metrics: dict[str, Any]) -> None:
        if self.on_trained is None:
            return
        try:
            self.on_trained(job, metrics)
        except Exception:  # the update happened; a failed publication must not fail the job
            log.exception("handling the trained job %s failed", job.job_id)

    def _failed_or_given_back(self, job: TrainingJob, error: Exception) -> ActorOutcome:
        if self.service_restarting(error, job.tenant_id):
            return self._give_back(job, error)
        cause = getattr(error, "cause", None) or error  # unwrap Ray's RayTaskError
        reason = f"{type(cause).__name__}: {cause}"
        log.warning("training job %s of tenant %s failed: %s", job.job_id, job.tenant_id, reason)
        try:
            failed = self.scheduler.fail(job.job_id, reason, owner=self.owner)
        except InvalidTransition as lost:
            return self._lost(job, lost)
        return self._notify(ActorOutcome(failed, "failed", None, reason))

    def _notify(self, outcome: ActorOutcome) -> ActorOutcome:
        if self.on_outcome is not None:
            try:
                self.on_outcome(outcome)
            except Exception:  # the Master's bookkeeping failing must not stop training for every tenant
                log.exception("handling the outcome of job %s failed", outcome.job.job_id)
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
        if after.state == "failed":
            return self._notify(ActorOutcome(after, "failed", None, after.terminal_reason))
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
            self.step_all(wait_s)


def _job_result(metrics: dict[str, Any]) -> dict[str, Any]:
    """What the scheduler records of a trained job: the metrics without the per-step losses."""
    result = {k: v for k, v in metrics.items() if k != "losses"}
    result["mean_loss"] = sum(metrics["losses"]) / len(metrics["losses"])
    return result
