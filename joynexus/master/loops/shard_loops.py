"""One actor loop per Training Model Service shard (issue 45.1): `ShardActorLoop`, `ShardLoops`.

Each loop leases only the jobs of the tenants its shard holds (`scheduling.shard_leases`, inside a
`ShardPlacement.leasing` window), counts them in flight until they end, and trains them on its
shard; M loops in M threads keep M shards busy at once. A loop whose shard stops answering asks the
shard set to check it (`TrainingShards.check_shard`): a lost shard's tenants resume on the others,
and the job it held goes back to `ready` (the plain loop's give-back) for the tenant's new shard.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from joynexus.master.loops.actor_loop import ActorLoop, ActorOutcome
from joynexus.scheduling.shard_leases import lease_companions_among, lease_next_among
from joynexus.scheduling.shard_placement import PlacementError
from joynexus.scheduling.training_scheduler import InvalidTransition, TrainingJob, TrainingScheduler

if TYPE_CHECKING:  # names the type only: the Master never imports the service's model stack
    from joynexus.services.training.shards import TrainingShards

__all__ = ["ShardActorLoop", "ShardLoops", "is_shard_set"]

log = logging.getLogger(__name__)


def is_shard_set(training: Any) -> bool:
    """Whether a deployment's training service is a shard set (`TrainingShards`), told by its
    shape, so the Master need not import the service's module (torch) to ask."""
    return (
        hasattr(training, "placement")
        and hasattr(training, "shard_count")
        and callable(getattr(type(training), "shard", None))
    )


class ShardActorLoop(ActorLoop):
    """The actor loop of shard `index`: `ActorLoop`'s staleness checks, grouping and outcomes, its
    leases restricted to the shard's tenants."""

    def __init__(self, scheduler: TrainingScheduler, shards: TrainingShards, index: int, **kwargs: Any) -> None:
        owner = f"{kwargs.pop('owner', 'actor-0')}/shard-{index}"
        on_unavailable = kwargs.pop("on_unavailable", None)

        def unavailable(reason: str) -> None:
            # Find out now whether the shard is gone (its tenants then resume elsewhere at once).
            try:
                shards.check_shard(index)
            except Exception:
                log.exception("checking shard %d failed", index)
            if on_unavailable is not None:
                on_unavailable(reason)

        super().__init__(scheduler, shards.shard(index), owner=owner, on_unavailable=unavailable, **kwargs)
        self.shards, self.index = shards, index
        self._seen = scheduler.generation

    def _lease_jobs(self) -> list[TrainingJob]:
        placement = self.shards.placement
        self._seen = self.scheduler.generation  # before the look: a change after it wakes the wait
        with placement.leasing(self.index) as tenants:
            if not tenants:
                return []
            job = lease_next_among(self.scheduler, tenants, domains=self.domains, owner=self.owner)
            if job is None:
                return []
            jobs = [job]
            if self.group_max > 1:
                try:
                    jobs += lease_companions_among(
                        self.scheduler, job, self.group_max - 1, tenants, domains=self.domains, owner=self.owner
                    )
                except Exception:  # the head job still trains; companions are an optimization
                    log.exception("leasing companions of job %s failed", job.job_id)
            return [j for j in jobs if self._begin(j)]

    def _begin(self, job: TrainingJob) -> bool:
        """Count the job in flight on this shard; a tenant that left the shard meanwhile (its shard
        was declared lost) gets its job back in `ready` for its new shard."""
        try:
            self.shards.placement.begin(job.tenant_id, self.index)
            return True
        except PlacementError as error:
            try:
                self.scheduler.release_lease(job.job_id, str(error), owner=self.owner, max_attempts=1 << 30)
            except InvalidTransition:
                pass  # taken back meanwhile: someone else's now
            return False

    def _wait_for_ready(self, wait_s: float) -> None:
        # Other shards' tenants may have ready jobs: wait for a change, not for any ready job.
        self.scheduler.wait_for_change(self._seen, wait_s)

    def _train_leased(self, jobs: list[TrainingJob]) -> list[ActorOutcome]:
        placement = self.shards.placement
        started = time.perf_counter()
        try:
            return super()._train_leased(jobs)
        finally:
            seconds = (time.perf_counter() - started) / len(jobs)
            for job in jobs:
                placement.record_training(job.tenant_id, seconds)
                placement.end(job.tenant_id, self.index)


class ShardLoops:
    """A `ShardActorLoop` per shard, each in its own thread (`start` / `stop`)."""

    def __init__(self, scheduler: TrainingScheduler, shards: TrainingShards, **loop_kwargs: Any) -> None:
        self.loops = [ShardActorLoop(scheduler, shards, i, **loop_kwargs) for i in range(shards.shard_count)]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._steps: dict[int, concurrent.futures.Future[list[ActorOutcome]]] = {}

    def step_round(self, wait_s: float = 0.2) -> list[ActorOutcome]:
        """Start a step of every shard's loop that is not stepping already, then wait up to
        `wait_s` for one to finish; the outcomes of the steps that finished. For a caller with one
        beating thread (the Master's actor-loop role): the shards still step side by side."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(len(self.loops), thread_name_prefix="shard-loop")
        for loop in self.loops:
            if loop.index not in self._steps:
                self._steps[loop.index] = self._pool.submit(loop.step_all, wait_s)
        concurrent.futures.wait(self._steps.values(), timeout=wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
        outcomes: list[ActorOutcome] = []
        for index, future in list(self._steps.items()):
            if future.done():
                del self._steps[index]
                try:
                    outcomes += future.result()
                except Exception:  # one shard's step failing must not stop the others' loops
                    log.exception("a step of shard %d's loop failed", index)
        return outcomes

    def start(self, wait_s: float = 0.2) -> None:
        self._stop.clear()
        self._threads = [
            threading.Thread(target=loop.run, args=(self._stop, wait_s), name=f"shard-loop-{loop.index}", daemon=True)
            for loop in self.loops
        ]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        self._threads = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool, self._steps = None, {}
