"""Control-plane recovery: leases of dead owners are re-queued (FIFO kept) or failed (bounded retries,
lost partitions), jobs of a gone workload are abandoned from any state, a lease holder that lost its
lease cannot resurrect the job, a tenant is never blocked by orphans, and an old database gains the
new column on start."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, inspect

from joynexus.core.store import ControlPlaneStore
from joynexus.master.loops.actor_loop import LOST, ActorLoop
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import (
    COMPLETED,
    COMPUTING_ACTOR_FORWARD,
    COMPUTING_ADVANTAGES,
    FAILED,
    LEASED,
    NEEDS_ACTOR_FORWARD,
    NEEDS_ADVANTAGES,
    READY,
    RESERVED,
    InvalidTransition,
    LeaseLost,
    TrainingScheduler,
)


class Released(list):
    """A release hook that clears the queue and remembers what it released."""

    def __init__(self, queue: TrainingQueue):
        super().__init__()
        self.queue = queue

    def __call__(self, partition_id: str) -> None:
        self.append(partition_id)
        self.queue.clear(partition_id)


def make(store):
    queue = TrainingQueue()
    released = Released(queue)
    return TrainingScheduler(store, release_partition=released), queue, released


def ready_job(sched, queue, tenant="t1", task="sft"):
    job = sched.reserve(tenant_id=tenant, task_type=task, sample_count=1, metadata={"schema_signature": "sig"})
    assert job is not None
    queue.put(job.partition_id, {"x": [1]})
    return sched.mark(job.job_id, READY)


def test_a_dead_owners_leases_are_requeued_in_fifo_order(store):
    sched, queue, released = make(store)
    sched.register_policy("t1", "sft", max_in_flight=5)
    jobs = [ready_job(sched, queue) for _ in range(4)]
    assert [sched.lease_next(owner="dead").job_id for _ in range(2)] == [jobs[0].job_id, jobs[1].job_id]
    assert sched.lease_next(owner="alive").job_id == jobs[2].job_id

    changed = sched.recover_orphans(["alive"], has_partition=queue.has_partition)
    assert [j.job_id for j in changed] == [jobs[0].job_id, jobs[1].job_id]
    for job, before in zip(changed, jobs, strict=False):
        assert job.state == READY and job.lease_owner is None and job.attempts == 1
        assert job.ready_seq == before.ready_seq  # keeps its place in line
    assert sched.get(jobs[2].job_id).state == LEASED and sched.get(jobs[2].job_id).lease_owner == "alive"
    assert sched.get(jobs[3].job_id).state == READY and sched.get(jobs[3].job_id).attempts == 0
    assert released == []
    # Re-queued jobs come before the one that was waiting behind them.
    order = [sched.lease_next(owner="new").job_id for _ in range(3)]
    assert order == [jobs[0].job_id, jobs[1].job_id, jobs[3].job_id]
    assert sched.recover_orphans(["alive", "new"]) == []  # nothing left to recover


def test_retries_are_bounded_then_the_job_fails_and_releases(store):
    sched, queue, released = make(store)
    sched.register_policy("t1", "sft", max_in_flight=1)
    job = ready_job(sched, queue)
    for attempt in (1, 2):
        assert sched.lease_next(owner=f"actor-{attempt}").job_id == job.job_id
        (back,) = sched.recover_orphans([], max_attempts=2)
        assert back.state == READY and back.attempts == attempt
    sched.lease_next(owner="actor-3")
    (failed,) = sched.recover_orphans([], max_attempts=2)
    assert failed.state == FAILED and failed.attempts == 3
    assert "actor-3" in failed.terminal_reason and "retries exhausted" in failed.terminal_reason
    assert released == [job.partition_id] and not queue.has_partition(job.partition_id)


def test_a_lost_partition_fails_the_job_naming_the_owner(store):
    sched, queue, released = make(store)
    sched.register_policy("t1", "sft", max_in_flight=2)
    lost, kept = ready_job(sched, queue), ready_job(sched, queue)
    sched.lease_next(owner="dead")
    sched.lease_next(owner="dead")
    queue.clear(lost.partition_id)  # e.g. the Training Queue restarted too (it is memory only)
    changed = {j.job_id: j for j in sched.recover_orphans(["someone-else"], has_partition=queue.has_partition)}
    assert changed[lost.job_id].state == FAILED
    assert "'dead'" in changed[lost.job_id].terminal_reason and "lost" in changed[lost.job_id].terminal_reason
    assert changed[kept.job_id].state == READY
    assert released == [lost.partition_id]


def test_stage_leases_go_back_to_waiting_for_their_stage(store):
    sched, queue, _ = make(store)
    sched.register_policy("t1", "rl", max_in_flight=2)
    a = sched.reserve(tenant_id="t1", task_type="rl", sample_count=1)
    b = sched.reserve(tenant_id="t1", task_type="rl", sample_count=1)
    sched.mark(a.job_id, NEEDS_ADVANTAGES)
    sched.mark(b.job_id, NEEDS_ACTOR_FORWARD)
    staged = sched.lease_stage(state=NEEDS_ADVANTAGES, leased_state=COMPUTING_ADVANTAGES, owner="adv-dead")
    assert staged.lease_owner == "adv-dead"  # stage leases record their owner too
    sched.lease_stage(state=NEEDS_ACTOR_FORWARD, leased_state=COMPUTING_ACTOR_FORWARD, owner="fwd-dead")
    changed = {j.job_id: j for j in sched.recover_orphans(["adv-live"])}
    assert changed[a.job_id].state == NEEDS_ADVANTAGES and changed[a.job_id].attempts == 1
    assert changed[b.job_id].state == NEEDS_ACTOR_FORWARD
    # The dead stage cannot finish the job another replica now holds.
    sched.lease_stage(state=NEEDS_ADVANTAGES, leased_state=COMPUTING_ADVANTAGES, owner="adv-live")
    with pytest.raises(LeaseLost):
        sched.mark(a.job_id, READY, owner="adv-dead")
    assert sched.mark(a.job_id, READY, owner="adv-live").state == READY


def test_a_requeued_job_cannot_be_finished_by_its_old_owner(store):
    sched, queue, _ = make(store)
    sched.register_policy("t1", "sft", max_in_flight=1)
    job = ready_job(sched, queue)
    sched.lease_next(owner="old")
    sched.recover_orphans(["new"])
    with pytest.raises(LeaseLost):
        sched.complete(job.job_id, owner="old")  # re-queued: not leased at all
    sched.lease_next(owner="new")
    for finish in (
        lambda: sched.complete(job.job_id, owner="old"),
        lambda: sched.fail(job.job_id, "x", owner="old"),
        lambda: sched.drop(job.job_id, "x", owner="old"),
    ):
        with pytest.raises(LeaseLost):
            finish()
    assert sched.get(job.job_id).lease_owner == "new"
    assert sched.complete(job.job_id, owner="new").state == COMPLETED


def _to_state(sched, queue, state):
    if state in (NEEDS_ACTOR_FORWARD, COMPUTING_ACTOR_FORWARD, NEEDS_ADVANTAGES, COMPUTING_ADVANTAGES):
        job = sched.reserve(tenant_id="t1", task_type="sft", sample_count=1)
        waiting = NEEDS_ADVANTAGES if "advantages" in state else NEEDS_ACTOR_FORWARD
        sched.mark(job.job_id, waiting)
        if state != waiting:
            leased = {NEEDS_ADVANTAGES: COMPUTING_ADVANTAGES, NEEDS_ACTOR_FORWARD: COMPUTING_ACTOR_FORWARD}[waiting]
            sched.lease_stage(state=waiting, leased_state=leased, owner="stage")
        return sched.get(job.job_id)
    if state == RESERVED:
        return sched.reserve(tenant_id="t1", task_type="sft", sample_count=1)
    job = ready_job(sched, queue)
    if state == LEASED:
        sched.lease_next(owner="actor")
    return sched.get(job.job_id)


@pytest.mark.parametrize(
    "state",
    [RESERVED, NEEDS_ACTOR_FORWARD, COMPUTING_ACTOR_FORWARD, NEEDS_ADVANTAGES, COMPUTING_ADVANTAGES, READY, LEASED],
)
def test_abandon_fails_a_job_from_every_live_state_once(store, state):
    sched, queue, released = make(store)
    sched.register_policy("t1", "sft", max_in_flight=1)
    job = _to_state(sched, queue, state)
    assert job.state == state
    gone = sched.abandon(job.job_id, "workload w1 cancelled")
    assert gone.state == FAILED and gone.terminal_reason == "workload w1 cancelled"
    assert released == [job.partition_id]
    again = sched.abandon(job.job_id, "another reason")
    assert again == gone and released == [job.partition_id]  # idempotent, no second release
    # The actor or stage that held it cannot resurrect it.
    for finish in (
        lambda: sched.complete(job.job_id),
        lambda: sched.fail(job.job_id, "late"),
        lambda: sched.drop(job.job_id, "late"),
    ):
        with pytest.raises(InvalidTransition):
            finish()
    with pytest.raises(InvalidTransition):
        sched.mark(job.job_id, READY)
    assert sched.get(job.job_id).state == FAILED


@pytest.mark.parametrize("how", ["requeue", "exhausted", "abandon"])
def test_a_tenant_admits_new_jobs_after_its_orphans_are_handled(store, how):
    sched, queue, _ = make(store)
    sched.register_policy("t1", "sft", max_in_flight=1)
    orphan = ready_job(sched, queue)
    sched.lease_next(owner="dead-master/actor")
    assert sched.reserve(tenant_id="t1", task_type="sft", sample_count=1) is None  # blocked by the orphan
    if how == "abandon":
        sched.abandon(orphan.job_id, "workload gone")
    else:
        sched.recover_orphans(["new-master/actor"], max_attempts=0 if how == "exhausted" else 3)
    if how == "requeue":
        # The orphan itself is live again: the new actor trains it, then the tenant goes on.
        assert sched.lease_next(owner="new-master/actor").job_id == orphan.job_id
        sched.complete(orphan.job_id, owner="new-master/actor")
    assert sched.reserve(tenant_id="t1", task_type="sft", sample_count=1) is not None


class _FakeService:
    """Stands in for the Training Model Service; `during` runs while the job 'trains'."""

    def __init__(self, during, raises=False):
        self.during, self.raises = during, raises

    def policy_version(self, tenant_id):
        return 0

    def train_job(self, job):
        self.during(job)
        if self.raises:
            raise RuntimeError("partition vanished")
        return {"losses": [1.0], "version": 1}


@pytest.mark.parametrize("raises", [False, True])
def test_the_actor_discards_a_job_abandoned_while_it_trained(store, raises):
    sched, queue, _ = make(store)
    sched.register_policy("t1", "sft", max_in_flight=1)
    job = ready_job(sched, queue)
    seen = []
    service = _FakeService(lambda j: sched.abandon(j.job_id, "workload cancelled"), raises=raises)
    outcome = ActorLoop(sched, service, owner="actor-a", on_outcome=seen.append).step()
    assert outcome.state == LOST and outcome.job.state == FAILED
    assert seen == []  # not an outcome of this actor
    final = sched.get(job.job_id)
    assert final.state == FAILED and final.terminal_reason == "workload cancelled"


def test_the_actor_does_not_complete_a_job_requeued_and_leased_by_another(store):
    sched, queue, _ = make(store)
    sched.register_policy("t1", "sft", max_in_flight=1)
    job = ready_job(sched, queue)

    def presumed_dead(j):
        sched.recover_orphans(["actor-b"])
        sched.lease_next(owner="actor-b")

    outcome = ActorLoop(sched, _FakeService(presumed_dead), owner="actor-a").step()
    assert outcome.state == LOST
    current = sched.get(job.job_id)
    assert current.state == LEASED and current.lease_owner == "actor-b" and current.attempts == 1


def test_an_old_database_gains_the_attempts_column(store_url):
    first = ControlPlaneStore(store_url)
    sched = TrainingScheduler(first)
    sched.register_policy("t1", "sft", max_in_flight=2)
    job = sched.reserve(tenant_id="t1", task_type="sft", sample_count=1)
    sched.mark(job.job_id, READY)
    sched.lease_next(owner="dead")
    first.dispose()
    # Turn it into a database written before the column existed.
    engine = create_engine(store_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE training_jobs DROP COLUMN attempts")
    assert "attempts" not in {c["name"] for c in inspect(engine).get_columns("training_jobs")}
    engine.dispose()

    upgraded = ControlPlaneStore(store_url)
    try:
        columns = {c["name"]: c for c in inspect(upgraded.engine).get_columns("training_jobs")}
        assert "attempts" in columns and not columns["attempts"]["nullable"]
        again = TrainingScheduler(upgraded)
        assert again.get(job.job_id).attempts == 0  # the existing row got the default
        (back,) = again.recover_orphans([])
        assert back.attempts == 1 and back.state == READY
        assert again.reserve(tenant_id="t1", task_type="sft", sample_count=1).attempts == 0
        ControlPlaneStore(store_url).dispose()  # a second start finds nothing to add
    finally:
        upgraded.dispose()
