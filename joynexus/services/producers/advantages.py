"""The advantage stage (paper Appendix A.5): leases RL jobs waiting for advantages, reads their
rollout partitions through the Training Queue's metadata/data interface, computes returns and
advantages with the tenant's estimator (PPO-style GAE or GRPO-style group-relative), writes them
back against the same samples, and marks the job ready for the actor."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from joynexus.algorithms.rl import gae, grpo_advantages
from joynexus.core.tenants import TenantBackendConfig
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import (
    CHANGE_POLL_S,
    COMPUTING_ADVANTAGES,
    NEEDS_ADVANTAGES,
    READY,
    InvalidTransition,
    TrainingJob,
    TrainingScheduler,
)
from joynexus.spec import RLSpec

log = logging.getLogger(__name__)

ADVANTAGE_INPUT_FIELDS = ("reward", "value", "done", "bootstrap_value")
# Written by the rollout producer since time-limit truncation and GRPO groups are recorded; a
# partition without them (an older producer, a lower-layer client) is read as before: every
# episode end a termination, every env's first attempt in one group.
OPTIONAL_ADVANTAGE_FIELDS = ("truncated", "group")


def compute_advantages(data: dict[str, np.ndarray], num_envs: int, horizon: int, rl: RLSpec) -> dict[str, np.ndarray]:
    """Rows are time-major (row = t * num_envs + env); returns flat `advantage` and `return`.

    `done` marks an episode end (the env was reset after the step); `truncated` the ends that were
    a time limit, which GAE bootstraps from `bootstrap_value` (V of the observation cut at), as it
    does at the horizon (the last row's `bootstrap_value`). GRPO normalizes within `group`."""
    shape = (horizon, num_envs)
    rewards = np.asarray(data["reward"], dtype=np.float32).reshape(shape)
    dones = np.asarray(data["done"], dtype=bool).reshape(shape)
    if rl.advantage == "grpo":
        groups = np.asarray(data["group"], dtype=np.int64).reshape(shape) if "group" in data else None
        advantages, returns = grpo_advantages(rewards, dones, groups, gamma=rl.gamma)
    else:
        values = np.asarray(data["value"], dtype=np.float32).reshape(shape)
        bootstrap = np.asarray(data["bootstrap_value"], dtype=np.float32).reshape(shape)
        truncated = np.asarray(data["truncated"], dtype=bool).reshape(shape) if "truncated" in data else None
        advantages, returns = gae(
            rewards, values, dones, bootstrap[-1], gamma=rl.gamma, lam=rl.gae_lambda,
            truncated=truncated, truncation_values=bootstrap,
        )  # fmt: skip
    return {"advantage": advantages.reshape(-1), "return": returns.reshape(-1)}


class AdvantageStage:
    def __init__(
        self,
        scheduler: TrainingScheduler,
        queue: TrainingQueue,
        tenant_config: Callable[[str], TenantBackendConfig],
        *,
        owner: str = "advantage-0",
    ):
        self.scheduler, self.queue = scheduler, queue
        self.tenant_config = tenant_config
        self.owner = owner

    def step(self) -> TrainingJob | None:
        """Process one waiting job (None when there is none)."""
        job = self.scheduler.lease_stage(state=NEEDS_ADVANTAGES, leased_state=COMPUTING_ADVANTAGES, owner=self.owner)
        if job is None:
            return None
        try:
            rl = self.tenant_config(job.tenant_id).rl
            if rl is None:
                raise ValueError(f"tenant {job.tenant_id!r} has no rl section")
            present = set(self.queue.describe(job.partition_id)["fields"])
            fields = ADVANTAGE_INPUT_FIELDS + tuple(f for f in OPTIONAL_ADVANTAGE_FIELDS if f in present)
            meta = self.queue.get_meta(
                job.partition_id, fields, job.sample_count, job.read_task("compute_advantages_and_returns")
            )
            if meta is None or meta.size != job.sample_count:
                raise ValueError(f"partition {job.partition_id} holds {0 if meta is None else meta.size} samples, "
                                 f"the job planned {job.sample_count}")  # fmt: skip
            derived = compute_advantages(
                self.queue.get_data(meta), int(job.metadata["num_envs"]), int(job.metadata["horizon"]), rl
            )
            self.queue.put(job.partition_id, derived, metadata=meta)
        except Exception as error:
            reason = f"advantages: {type(error).__name__}: {error}"
            log.warning("job %s: %s", job.job_id, reason)
            return self._settle(lambda: self.scheduler.fail(job.job_id, reason, owner=self.owner), job)
        return self._settle(lambda: self.scheduler.mark(job.job_id, READY, owner=self.owner), job)

    def _settle(self, transition: Callable[[], TrainingJob], job: TrainingJob) -> TrainingJob:
        """Apply the stage's outcome unless the job was taken from us meanwhile (its workload ended,
        or a restarted Master re-queued it): then it is not ours to move, and the stage goes on."""
        try:
            return transition()
        except InvalidTransition as lost:
            log.info("job %s is no longer this stage's: %s", job.job_id, lost)
            return job

    def run(self, stop: threading.Event, idle_wait_s: float = CHANGE_POLL_S) -> None:
        while not stop.is_set():
            self.step_or_wait(idle_wait_s)

    def step_or_wait(self, idle_wait_s: float = CHANGE_POLL_S) -> TrainingJob | None:
        """One `step`; with nothing to do, wait until the scheduler changes (a job marked for this
        stage) or `idle_wait_s` passes."""
        seen = self.scheduler.generation
        job = self.step()
        if job is None:
            self.scheduler.wait_for_change(seen, idle_wait_s)
        return job
