"""Grouped training of leased jobs (paper 5.2 in the actor loop): several tenants' SFT and RL jobs
consumed together, round by round — each round takes the next microbatch of every job still running
and steps them through ONE shared backbone forward (`GroupTrainer.train_members`), then each
tenant's own loss, backward, clip and AdamW step on its own rows (`JobGroupTrainer.train_jobs`).

An RL job's round is its PPO run's next microbatch (`ppo.PpoRun`: its epochs and shuffled order, its
own clipped objective, value head and advantage normalization); a plain head reuses the frozen
backbone's features of the samples it saw in earlier epochs, so its later rounds join no forward.
Each job ends like `SlotTrainer.train_job`: one new policy version per job (not per step), its
checkpoint per the tenant's config, the same result fields. Outcomes are per job: a tenant whose
microbatch is malformed, whose loss or gradients are not finite, or whose partition is empty gets
`error` in its result and leaves the group; the others go on. Staleness (eq. 1) is checked on every
job by the actor loop before it joins a group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from joynexus.core.metering import split_group_seconds
from joynexus.core.service_metrics import service_metrics
from joynexus.scheduling.training_scheduler import TrainingJob
from joynexus.services.training.grouped import GroupMember, GroupTrainer
from joynexus.services.training.ppo import PpoMicrobatch, PpoRun
from joynexus.services.training.slot_table import SlotTable
from joynexus.services.training.slots import Microbatch, TenantSlot, TenantSlotError, check_annotations
from joynexus.services.training.trainer import SFT_FIELDS, SlotTrainer

__all__ = ["JobGroupTrainer"]


@dataclass
class _Running:
    """One job of a group while its partition is consumed."""

    job: TrainingJob
    slot: TenantSlot
    start_version: int = 0
    learning_rate: float = 0.0  # the rate its steps ran at (the slot's schedule at the job's start)
    ppo: PpoRun | None = None  # an RL job's PPO update
    losses: list[float] = field(default_factory=list)  # an SFT job's
    samples: int = 0  # an SFT job's
    error: str | None = None
    done: bool = False

    @property
    def stepped(self) -> bool:
        return bool(self.ppo.losses if self.ppo is not None else self.losses)

    @property
    def rows_stepped(self) -> int:
        """Rows this job stepped over all its rounds (its share of the group's time)."""
        return self.ppo.rows_stepped if self.ppo is not None else self.samples


# One round's step of a job: an SFT microbatch, or an RL job's PPO microbatch.
_Step = Microbatch | PpoMicrobatch


class JobGroupTrainer:
    """`train_jobs` over the table's slots. Its GroupTrainer numbers no version per step: a job's
    steps make ONE new version when the job ends, as the serial `train_job` does."""

    def __init__(self, trainer: SlotTrainer, table: SlotTable) -> None:
        self.trainer = trainer
        self.table = table
        self.grouped = GroupTrainer(trainer, table, issue_versions=False)

    def train_jobs(self, jobs: list[TrainingJob | dict[str, Any]]) -> list[dict[str, Any]]:
        """Results in the order of `jobs`: `train_job`'s fields plus `group_size` and
        `group_seconds` (`seconds`: the job's share of the group's time, by samples), or
        {job_id, tenant_id, error} for a job that failed."""
        queue = self.trainer.queue
        if queue is None:
            raise TenantSlotError("this Training Model Service was started without a Training Queue")
        parsed = [job if isinstance(job, TrainingJob) else TrainingJob(**job) for job in jobs]
        tenants = [job.tenant_id for job in parsed]
        if len(set(tenants)) != len(tenants):
            raise ValueError(f"train_jobs takes at most one job per tenant (one step per round), got {tenants}")
        started = time.perf_counter()
        results: dict[str, dict[str, Any]] = {}
        running: list[_Running] = []
        for job in parsed:
            try:
                slot = self.trainer.job_slot(job)
                run = _Running(job, slot, slot.version, slot.schedule_learning_rate())
                if job.task_type == "rl":  # its proximal pass (decoupled objective) runs here, alone
                    run.ppo = self.trainer.ppo_run(queue, slot, job)
            except Exception as exc:
                results[job.job_id] = _failed(job, exc)
                continue
            running.append(run)
        group_size = len(running)
        while True:
            batch = [(run, step) for run in running if (step := self._next_step(queue, run)) is not None]
            if not batch:
                break
            self._round(batch)
        # A job's `seconds` (metered as its tenant's training device-seconds) is its share of the
        # group's time by rows stepped, as grouped inference splits a shared batch; `group_seconds` is all of it.
        group_seconds = time.perf_counter() - started
        shares = split_group_seconds(group_seconds, [run.rows_stepped for run in running])
        for run, share in zip(running, shares, strict=True):
            results[run.job.job_id] = self._finish(run, group_size, share, group_seconds)
        return [results[job.job_id] for job in parsed]

    def _next_step(self, queue: Any, run: _Running) -> _Step | None:
        """The job's next microbatch, checked and as tensors; None when it is done or failed."""
        if run.done or run.error is not None:
            return None
        try:
            if run.ppo is not None:
                step = run.ppo.next_microbatch()
                run.done = step is None
                return step
            meta = queue.get_meta(
                run.job.partition_id, SFT_FIELDS, run.slot.config.microbatch_size, run.job.read_task("train")
            )
            if meta is None:
                run.done = True
                return None
            data = queue.get_data(meta)
            check_annotations(data, run.job.tenant_id, run.slot.config.schema_signature)
            prepared = self.trainer.prepare(run.slot, data)
        except Exception as exc:
            run.error = f"{type(exc).__name__}: {exc}"
            return None
        run.samples += meta.size
        return prepared

    def _round(self, batch: list[tuple[_Running, _Step]]) -> None:
        """One step of every job in `batch`: grouped when more than one, else the serial step."""
        if len(batch) > 1:
            started = time.perf_counter()
            try:
                outcomes = self.grouped.train_members([_member(run, step) for run, step in batch])
            except Exception:  # refused before any tenant stepped (e.g. the shared forward): one by one
                outcomes = None
            if outcomes is not None:
                service_metrics().training_step_seconds.labels("grouped").observe(time.perf_counter() - started)
                for (run, step), out in zip(batch, outcomes, strict=True):
                    if "error" in out:
                        run.error = out["error"]
                    elif isinstance(step, PpoMicrobatch):
                        run.ppo.record(step, float(out["loss"]))  # type: ignore[union-attr]
                    else:
                        run.losses.append(float(out["loss"]))
                return
        for run, step in batch:
            try:
                if isinstance(step, PpoMicrobatch):
                    run.ppo.step_alone(step)  # type: ignore[union-attr]
                else:
                    run.losses.append(self.trainer.update(run.slot, self.trainer.encode_slot(run.slot, step), step))
            except Exception as exc:
                run.error = f"{type(exc).__name__}: {exc}"

    def _finish(self, run: _Running, group_size: int, seconds: float, group_seconds: float) -> dict[str, Any]:
        job, slot = run.job, run.slot
        if run.error is not None:
            if run.stepped:  # steps taken changed the parameters: number them, though the job failed
                self.table.issue_version(slot)
            return {"job_id": job.job_id, "tenant_id": job.tenant_id, "error": run.error}
        losses, samples, extra = (run.losses, run.samples, {}) if run.ppo is None else run.ppo.finish()
        try:
            return self.trainer.finish_job(
                slot,
                job,
                losses,
                samples,
                start_version=run.start_version,
                seconds=seconds,
                learning_rate=run.learning_rate,
                group_size=group_size,
                group_seconds=group_seconds,
                **extra,
            )
        except TenantSlotError as exc:  # an empty partition: this job fails, the others stand
            return _failed(job, exc)


def _member(run: _Running, step: _Step) -> GroupMember:
    """A job's step as a group member: an RL step brings its PPO objective and, once its rows were
    encoded in an earlier epoch, their features (it joins no forward then)."""
    if isinstance(step, PpoMicrobatch):
        ppo = run.ppo
        assert ppo is not None
        return GroupMember(
            run.slot,
            step.batch,
            objective=lambda features: ppo.objective(step, features),
            features=ppo.cached_features(step),
        )
    return GroupMember(run.slot, step)


def _failed(job: TrainingJob, exc: Exception) -> dict[str, Any]:
    return {"job_id": job.job_id, "tenant_id": job.tenant_id, "error": f"{type(exc).__name__}: {exc}"}
