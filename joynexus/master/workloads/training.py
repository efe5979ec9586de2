"""The training-workload lifecycle: launch (the tenant's slot, its training policy's target, the
MLflow run, and its producer, SFT demonstrations or RL rollouts, started on a producer replica),
the actor loop's outcomes and the producer's reports, then finish: checkpoint, export, serve and
register the tenant's policy as trained (on the producer replica), and promote it (promotion.py:
`candidate` always, `champion` by the tenant's declared metric).

The shared actor loop (roles.py) trains every tenant's ready jobs; `on_outcome` counts them
towards their workload. A restarted Master resumes a running workload from its recorded progress.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from joynexus.core.store import WorkloadRecord, utcnow
from joynexus.core.tenants import Tenant
from joynexus.master.loops.actor_loop import POLICY_STALE, ActorOutcome
from joynexus.master.tenant_slots import ensure_slot
from joynexus.master.workloads.live import (
    FINAL_WORKLOAD_STATES,
    RUNNING,
    WORKLOAD_COMPLETED,
    WORKLOAD_FAILED,
    LiveWorkloads,
    RunningWorkload,
)
from joynexus.master.workloads.promotion import Promoter
from joynexus.master.workloads.records import WorkloadRecords
from joynexus.master.workloads.restarts import ServiceWaits
from joynexus.scheduling.training_scheduler import COMPLETED, DROPPED, TERMINAL_STATES, TrainingJob
from joynexus.spec import DatasetSpec

if TYPE_CHECKING:
    from joynexus.master.deployment import Deployment

log = logging.getLogger(__name__)


class TrainingWorkloads:
    """Training workloads from launch to publish. It runs the workloads in `live`, writes their rows
    and events through `records`, waits through restarting services with `waits`, promotes what it
    publishes with `promoter`, and calls `admit()` after each finish (the tenant's next one may start)."""

    def __init__(
        self,
        deployment: Deployment,
        records: WorkloadRecords,
        live: LiveWorkloads,
        waits: ServiceWaits,
        promoter: Promoter,
        *,
        admit: Callable[[], None],
        max_failures: int = 3,
    ):
        self.deployment = deployment
        self._records, self._live, self._waits, self.promoter = records, live, waits, promoter
        self._admit = admit
        self.max_failures = max_failures

    # -- launch -------------------------------------------------------------------------------------
    def resume(self, workload_id: str) -> None:
        """Continue a workload a previous Master left `running`, from its recorded progress."""
        with self.deployment.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            target, completed, version, steps, run_id, tenant_id = (
                record.target_jobs, record.completed_jobs, record.version, record.optimizer_steps, record.run_id,
                record.tenant_id,
            )  # fmt: skip
        # The scheduler is the truth for jobs: the dead Master may have completed one whose progress
        # row it did not write yet; counting from the record alone would train one job too many.
        done = sum(
            1
            for job in self.deployment.scheduler.jobs(tenant_id=tenant_id, states=[COMPLETED])
            if job.metadata.get("workload_id") == workload_id
        )
        completed = max(completed, done)
        tenant = self.deployment.creator.get(tenant_id)
        if getattr(tenant, "status", "active") != "active":
            raise RuntimeError(f"tenant {tenant_id!r} is {tenant.status}: {getattr(tenant, 'status_reason', '')}")
        running = RunningWorkload(workload_id, tenant, target, resumed=True)
        running.completed_jobs, running.version, running.optimizer_steps = completed, version, steps
        running.run_id = run_id
        self._live.add(running)
        if completed >= target:
            self.finish(workload_id, WORKLOAD_COMPLETED)
            return
        try:
            self.launch(running)
        except Exception:
            self._live.discard(workload_id)
            raise

    def launch(self, running: RunningWorkload) -> None:
        """Start an admitted (or resumed) workload: its slot's version, its policy's target, its
        MLflow run, its row `running`, and its producer on a producer replica."""
        deployment, tenant = self.deployment, running.tenant
        running.version = ensure_slot(deployment.training_service, tenant)  # registered at its creation
        done = deployment.scheduler.counts(tenant.tenant_id).get(COMPLETED, 0)
        # The policy's completion target covers exactly this workload's remaining jobs on top of
        # every completed one (a resumed workload has some of its own among them already); the
        # policy registered at tenant creation has the spec's target, not this workload's.
        deployment.scheduler.set_completion_target(
            tenant.tenant_id, tenant.spec.task.value, done + running.target_jobs - running.completed_jobs
        )
        running.dataset = self._training_dataset(running)
        if running.run_id is None:
            tags = {"task": tenant.spec.task.value}
            if running.dataset is not None and running.dataset.sha256:  # which data this run trains on
                tags["dataset_sha256"] = running.dataset.sha256
            running.run_id = deployment.tracker.start_workload_run(
                tenant.tenant_id, running.workload_id, _run_params(tenant, running.target_jobs), tags=tags
            )
        with deployment.store.transaction() as s:
            record = s.get(WorkloadRecord, running.workload_id)
            record.state, record.run_id = RUNNING, running.run_id
            record.started_at = record.started_at or utcnow()
        self._records.emit(running.workload_id, "resumed" if running.resumed else "started", version=running.version)
        # The producer runs on a producer replica (issue 40); one already running there (this Master
        # restarted) keeps running: the replica's start is idempotent and the front sticky.
        dataset = running.dataset.model_dump(mode="json") if running.dataset is not None else None
        deployment.producers.start_workload(
            running.workload_id, tenant.tenant_id, task=tenant.spec.task.value, dataset=dataset,
            max_failures=self.max_failures,
        )  # fmt: skip

    def _training_dataset(self, running: RunningWorkload) -> DatasetSpec | None:
        """What an SFT workload trains on: the dataset it named when submitted, else its tenant's."""
        if running.tenant.spec.task.value != "sft":
            return None
        with self.deployment.store.transaction() as s:
            named = s.get(WorkloadRecord, running.workload_id).dataset
        return DatasetSpec.model_validate(named) if named else running.tenant.spec.dataset

    def on_producer_report(self, running: RunningWorkload, report: dict[str, Any]) -> None:
        """What the workload's producer replica says (the producer follower, follower.py)."""
        if report["state"] == "produced":
            running.produced = True  # done producing: the last jobs train, then the workload ends
        elif report["state"] == "failed":
            # In a thread of its own: finishing publishes, and the follower keeps following the others.
            threading.Thread(
                target=self.finish, args=(running.workload_id, WORKLOAD_FAILED, report["error"]),
                name=f"finish-{running.workload_id}", daemon=True,
            ).start()  # fmt: skip

    def on_producer_moved(self, workload_id: str, tenant_id: str, lost_owners: set[str]) -> None:
        """Before a workload whose producer replica was lost starts on another: the job the lost
        producer was writing is released (never marked ready, so no version comes of it), and the
        tenant's environment sessions, all opened on that replica (sticky), are closed."""
        scheduler = self.deployment.scheduler
        for job in scheduler.jobs(tenant_id=tenant_id, states=["reserved"]):
            if job.metadata.get("workload_id") == workload_id:
                scheduler.abandon(job.job_id, "its producer replica was lost before the data was written")
        try:
            self.deployment.environment_service.close_tenant(tenant_id)
        except Exception as error:  # the service is away: its restart drops the sessions anyway
            log.warning("closing tenant %s's sessions after a lost replica: %s", tenant_id, error)

    # -- outcomes -----------------------------------------------------------------------------------
    def publish_weights(self, tenant_id: str) -> int:
        """Training -> inference weight sync (paper A.1): the only cross-queue dependency. It runs
        on the tenant's producer replica: the payload goes from service to service, not through here."""
        return self.deployment.producers.publish_weights(tenant_id)

    def on_trained(self, job: TrainingJob, metrics: dict[str, Any]) -> None:
        """Before the actor completes a trained RL job of a running workload: publish the update, so
        the rollout its freed in-flight slot starts acts with it (paper A.1's weight sync)."""
        running = self._live.get(job.metadata.get("workload_id"))
        if running is not None and job.task_type == "rl":
            self.publish_weights(job.tenant_id)

    def on_outcome(self, outcome: ActorOutcome) -> None:
        workload_id = outcome.job.metadata.get("workload_id")
        running = self._live.get(workload_id)
        if running is None:
            return  # a job of a cancelled or finished workload
        finish: tuple[str, str | None] | None = None
        trained = outcome.state == COMPLETED and outcome.metrics is not None
        # A stale drop is the staleness bound at work (paper eq. 1), not a fault: the job's slot is
        # free again and the producer rolls out from the newer policy. Several tenants at once can
        # delay a publication past the bound now and then; only a workload whose jobs keep going
        # stale (more than two drops per job it is to train) fails, naming the settings that cause it.
        stale = outcome.state == DROPPED and outcome.reason == POLICY_STALE
        with running.lock:
            if trained:
                first = running.optimizer_steps
                losses = outcome.metrics["losses"]
                running.losses.extend(losses)
                running.optimizer_steps += len(losses)
                running.completed_jobs += 1
                running.version = outcome.metrics["version"]
            elif stale:
                running.stale_drops += 1
            else:
                running.failed_jobs += 1
                running.failures.append(outcome.reason or outcome.state)
            if running.completed_jobs >= running.target_jobs:
                finish = (WORKLOAD_COMPLETED, None)
            elif running.failed_jobs >= self.max_failures:
                finish = (WORKLOAD_FAILED, f"{running.failed_jobs} training jobs failed; last: {running.failures[-1]}")
            elif running.stale_drops > 2 * running.target_jobs + self.max_failures:
                finish = (WORKLOAD_FAILED, _too_stale(running.stale_drops, outcome))
        if trained:
            self._record_trained_job(running, outcome, first, losses)
        else:
            kind = "job_dropped" if stale else "job_failed"
            self._records.emit(workload_id, kind, job_id=outcome.job.job_id, reason=outcome.reason)
        self._persist_progress(running)
        if finish is not None:
            self.finish(workload_id, *finish)

    def _record_trained_job(
        self, running: RunningWorkload, outcome: ActorOutcome, first_step: int, losses: list[float]
    ) -> None:
        """Step events, one MLflow batch and (RL) the weight sync after a job trained."""
        workload_id = running.workload_id
        steps = [(first_step + i + 1, loss) for i, loss in enumerate(losses)]
        self._records.emit_many(workload_id, [("step", {"step": step, "loss": loss}) for step, loss in steps])
        # One MLflow batch per job (each batch is a store transaction on the actor loop's time).
        points = [("train/loss", loss, step) for step, loss in steps]
        points += [
            ("policy_version", running.version, running.optimizer_steps),
            ("jobs_completed", running.completed_jobs, running.optimizer_steps),
        ]
        if outcome.job.task_type == "rl":  # (its update was published before it completed: `_on_trained`)
            rollout = self.deployment.producers.rollout_stats(workload_id)
            rl_metrics = {**outcome.metrics.get("rl_stats", {})}
            if rollout.get("episodes"):
                rl_metrics.update({f"rollout/{k}": v for k, v in rollout.items() if k != "episodes"})
            rl_metrics["rollout/env_steps"] = rollout.get("env_steps", 0)  # steps of its rollouts so far, every job
            points += [(key, value, running.optimizer_steps) for key, value in rl_metrics.items()]
            self._records.emit(workload_id, "rl_update", version=running.version, **rl_metrics)
        self.deployment.tracker.log_metric_points(running.run_id, points)
        self._records.emit(
            workload_id, "job_completed", job_id=outcome.job.job_id, version=running.version,
            completed_jobs=running.completed_jobs, target_jobs=running.target_jobs,
        )  # fmt: skip

    def _persist_progress(self, running: RunningWorkload) -> None:
        with self.deployment.store.transaction() as s:
            record = s.get(WorkloadRecord, running.workload_id)
            record.completed_jobs = running.completed_jobs
            record.version = running.version
            record.optimizer_steps = running.optimizer_steps
            record.last_loss = running.losses[-1] if running.losses else None

    # -- finish -------------------------------------------------------------------------------------
    def finish(self, workload_id: str, state: str, error: str | None = None) -> None:
        """End the workload in `state` (once: a cancel, the last job and a failing producer may race),
        publishing what it trained; then admit the next queued work."""
        first, running = self._live.begin_finish(workload_id)
        if not first:
            return  # another path is finishing it
        try:
            self._finish_unguarded(workload_id, running, state, error)
        finally:
            self._live.end_finish(workload_id)
        self._admit()

    def _finish_unguarded(
        self, workload_id: str, running: RunningWorkload | None, state: str, error: str | None
    ) -> None:
        if running is None and self._records.get(workload_id).state in FINAL_WORKLOAD_STATES:
            return  # finished already
        registered = promotion = None
        if running is not None:
            running.stop.set()
            # Let the producer finish the job it is writing, so none is marked ready after the release.
            self.deployment.producers.stop_workload(workload_id)
            self._release_pending_jobs(running, reason=error or state)
            if running.completed_jobs:
                try:
                    registered = self._publish(running)
                except Exception as publish_error:  # the training happened; say what failed after it
                    log.exception("publishing workload %s failed", workload_id)
                    state, error = WORKLOAD_FAILED, f"export/register: {type(publish_error).__name__}: {publish_error}"
                else:  # candidate moves; champion by the tenant's metric (promotion.py), before `completed`
                    promotion = self.promoter.promote_published(workload_id, running.tenant.tenant_id, registered)
            if running.run_id is not None:
                self.deployment.tracker.end_run(running.run_id, "FINISHED" if state == WORKLOAD_COMPLETED else "FAILED")
            self._persist_progress(running)
        with self.deployment.store.transaction() as s:
            record = s.get(WorkloadRecord, workload_id)
            if record is not None and record.state not in FINAL_WORKLOAD_STATES:
                record.state, record.error, record.finished_at = state, error, utcnow()
                record.registered_version = registered
                if promotion is not None:
                    record.result = {"promotion": promotion}
        self._records.emit(workload_id, state, error=error, registered_version=registered)

    def _release_pending_jobs(self, running: RunningWorkload, reason: str) -> None:
        """Fail the workload's jobs that the actor has not leased yet (clearing their partitions)."""
        scheduler = self.deployment.scheduler
        for job in scheduler.jobs(tenant_id=running.tenant.tenant_id):
            if job.metadata.get("workload_id") != running.workload_id or job.state in TERMINAL_STATES:
                continue
            try:  # a leased job too: the actor's outcome for it is then refused and ignored
                scheduler.abandon(job.job_id, f"workload {running.workload_id} ended: {reason}")
            except Exception:  # it finished concurrently
                pass

    def _publish(self, running: RunningWorkload) -> int:
        """Checkpoint, export, serve and register the tenant's policy as trained by this workload
        (on the tenant's producer replica: the payload never enters the Master)."""
        tenant_id = running.tenant.tenant_id
        return self._waits.through(
            lambda: self.deployment.producers.publish_trained(tenant_id, running.run_id), tenant_id, "publishing"
        )


def _run_params(tenant: Tenant, jobs: int) -> dict[str, object]:
    cfg = tenant.backend_config
    return {
        "tenant_id": cfg.tenant_id,
        "base_model_id": cfg.base_model_id,
        "schema_signature": cfg.schema_signature,
        "cameras": ",".join(cfg.cameras),
        "image_size": "x".join(str(s) for s in cfg.image_size),
        "state_dim": cfg.state_dim,
        "action_dim": cfg.action_dim,
        "action_chunk": cfg.action_chunk,
        "action_module": cfg.action_module["kind"],
        "action_module_size": cfg.action_module.get("size"),
        "learning_rate": cfg.learning_rate,
        "microbatch_size": cfg.microbatch_size,
        "samples_per_job": cfg.samples_per_job,
        "jobs": jobs,
        "max_in_flight_jobs": tenant.spec.scheduling.max_in_flight_jobs,
        "priority": tenant.spec.scheduling.priority,
    }


def _too_stale(drops: int, outcome: ActorOutcome) -> str:
    job = outcome.job
    return (
        f"{drops} RL jobs dropped as stale (behavior policy more than scheduling.max_policy_staleness="
        f"{job.max_policy_staleness} versions behind the learner): raise scheduling.max_policy_staleness "
        "or lower scheduling.max_in_flight_jobs"
    )
