"""Training Scheduler: Table 4 state machine, priority / FIFO, admission, durable concurrent leasing."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import threading

import pytest

from joynexus.core.store import ControlPlaneStore
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import (
    COMPLETED,
    COMPUTING_ADVANTAGES,
    DROPPED,
    FAILED,
    LEASED,
    NEEDS_ADVANTAGES,
    READY,
    RESERVED,
    InvalidTransition,
    SchedulerError,
    TrainingScheduler,
    partition_id_for,
)


def make(store, **policy):
    queue = TrainingQueue()
    sched = TrainingScheduler(store, release_partition=queue.clear)
    return sched, queue


def reserve(sched, tenant="t1", task="sft", **kw):
    return sched.reserve(tenant_id=tenant, task_type=task, sample_count=4, metadata={"schema_signature": "sig"}, **kw)


def test_sft_state_sequence_and_descriptor_fields(store):
    sched, queue = make(store)
    sched.register_policy("t1", "sft", max_in_flight=2)
    job = reserve(sched, producer_role="sft")
    assert job.state == RESERVED and job.ready_seq is None and job.created_seq >= 1
    assert job.partition_id == partition_id_for(job.job_id, "vla", "t1", "sft")
    assert job.schema_signature == "sig" and job.producer_role == "sft" and job.consumer_role == "actor"
    queue.put(job.partition_id, {"x": [1, 2, 3, 4]})
    ready = sched.mark(job.job_id, READY)
    assert ready.state == READY and ready.ready_seq is not None
    leased = sched.lease_next(owner="actor-a")
    assert leased.job_id == job.job_id and leased.state == LEASED and leased.lease_owner == "actor-a"
    done = sched.complete(job.job_id, {"version": 1})
    assert done.state == COMPLETED and done.result == {"version": 1}
    assert not queue.has_partition(job.partition_id)
    assert sched.get(job.job_id).state == COMPLETED


def test_waiters_are_woken_by_the_transitions_they_wait_for_not_by_polling(store):
    # The producers wait for a free slot, the advantage stage and the actor loop for work: on the
    # scheduler's changes (after the commit, so the woken thread reads the new state).
    sched, queue = make(store)
    sched.register_policy("t1", "sft", max_in_flight=1)
    job = reserve(sched)
    assert reserve(sched) is None  # the tenant's one slot is taken
    seen = sched.generation
    assert sched.wait_for_change(seen, 0.01) is False  # nothing changed
    found_ready: list[bool] = []
    actor = threading.Thread(target=lambda: found_ready.append(sched.wait_for_ready(timeout_s=60)))
    actor.start()
    queue.put(job.partition_id, {"x": [1, 2, 3, 4]})
    sched.mark(job.job_id, READY)
    actor.join(60)
    assert found_ready == [True]
    assert sched.lease_next(owner="a").job_id == job.job_id
    seen = sched.generation
    reserved: list = []

    def producer() -> None:
        if sched.wait_for_change(seen, 60):
            reserved.append(reserve(sched))

    waiting = threading.Thread(target=producer)
    waiting.start()
    sched.complete(job.job_id, {"version": 1}, owner="a")  # frees the slot
    waiting.join(60)
    assert len(reserved) == 1 and reserved[0] is not None and reserved[0].state == RESERVED
    seen = sched.generation
    sched.fail(reserved[0].job_id, "gone")
    assert sched.wait_for_change(seen, 0) is True  # a change before the wait is not missed


def test_rl_state_sequence_with_advantage_stage_lease(store):
    sched, queue = make(store)
    sched.register_policy("t1", "rl", max_in_flight=2, max_policy_staleness=1)
    job = reserve(sched, task="rl", behavior_policy_version=3, producer_role="rollout")
    assert job.behavior_policy_version == 3 and job.max_policy_staleness == 1
    sched.mark(job.job_id, NEEDS_ADVANTAGES)
    assert sched.lease_next() is None  # not ready until advantages exist
    staged = sched.lease_stage(state=NEEDS_ADVANTAGES, leased_state=COMPUTING_ADVANTAGES, owner="adv-1")
    assert staged.state == COMPUTING_ADVANTAGES
    assert sched.lease_stage(state=NEEDS_ADVANTAGES, leased_state=COMPUTING_ADVANTAGES) is None  # one replica only
    sched.mark(job.job_id, READY)
    assert sched.lease_next().state == LEASED
    assert sched.complete(job.job_id).state == COMPLETED


@pytest.mark.parametrize("terminal", ["failed", "dropped", "completed"])
def test_every_terminal_outcome_clears_the_partition_and_keeps_the_reason(store, terminal):
    sched, queue = make(store)
    sched.register_policy("t1", "sft", max_in_flight=1)
    job = reserve(sched)
    queue.put(job.partition_id, {"x": [1]})
    sched.mark(job.job_id, READY)
    sched.lease_next()
    if terminal == "failed":
        sched.fail(job.job_id, "boom: tenant module raised")
    elif terminal == "dropped":
        sched.drop(job.job_id, "policy_stale")
    else:
        sched.complete(job.job_id)
    assert not queue.has_partition(job.partition_id)
    final = sched.get(job.job_id)
    assert final.state == terminal
    assert final.terminal_reason == {"failed": "boom: tenant module raised", "dropped": "policy_stale"}.get(terminal)


def test_a_reserved_job_can_fail_and_illegal_moves_are_refused(store):
    sched, queue = make(store)
    sched.register_policy("t1", "sft", max_in_flight=3)
    job = reserve(sched)
    with pytest.raises(InvalidTransition):
        sched.complete(job.job_id)  # never leased
    with pytest.raises(InvalidTransition):
        sched.mark(job.job_id, LEASED)  # leases go through lease_next
    assert sched.fail(job.job_id, "producer crashed").state == FAILED
    with pytest.raises(InvalidTransition):
        sched.fail(job.job_id, "again")  # terminal is final
    with pytest.raises(InvalidTransition):
        sched.mark(job.job_id, READY)


def test_priority_first_then_fifo_by_ready_seq(store):
    sched, _ = make(store)
    sched.register_policy("low", "sft", priority=0, max_in_flight=5)
    sched.register_policy("high", "sft", priority=5, max_in_flight=5)
    low = [reserve(sched, tenant="low") for _ in range(3)]
    high = [reserve(sched, tenant="high") for _ in range(2)]
    # Ready order differs from creation order: FIFO is by ready_seq, not created_seq.
    for job in (low[2], low[0], high[1], low[1], high[0]):
        sched.mark(job.job_id, READY)
    order = [sched.lease_next().job_id for _ in range(5)]
    assert order == [high[1].job_id, high[0].job_id, low[2].job_id, low[0].job_id, low[1].job_id]
    assert sched.lease_next() is None


def test_reserve_refuses_at_the_in_flight_limit_and_the_completion_target(store):
    sched, _ = make(store)
    sched.register_policy("t1", "sft", max_in_flight=2, completion_target=3)
    a, b = reserve(sched), reserve(sched)
    assert a and b and reserve(sched) is None  # 2 in flight
    for job in (a, b):
        sched.mark(job.job_id, READY)
        sched.lease_next()
        sched.complete(job.job_id)
    c = reserve(sched)
    assert c is not None
    assert reserve(sched) is None  # 2 completed + 1 in flight = target 3
    sched.fail(c.job_id, "x")  # failed work does not count toward the target
    d = reserve(sched)
    assert d is not None
    sched.mark(d.job_id, READY)
    sched.lease_next()
    sched.complete(d.job_id)
    assert reserve(sched) is None  # target reached
    assert sched.counts("t1") == {COMPLETED: 3, FAILED: 1}


def test_concurrent_reservations_never_exceed_the_in_flight_limit_or_the_target(store_url):
    # Admission counts the jobs of every reservation that held the policy's lock before it: 8
    # threads racing (each with its own connection) admit exactly the bound, then the target.
    store = ControlPlaneStore(store_url)
    try:
        sched = TrainingScheduler(store)
        sched.register_policy("t1", "sft", max_in_flight=3, completion_target=5)
        start = threading.Barrier(8)

        def race() -> list:
            start.wait()
            return [job for _ in range(4) if (job := reserve(sched)) is not None]

        def admitted_by_racers() -> list:
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                return [job for jobs in pool.map(lambda _: race(), range(8)) for job in jobs]

        first = admitted_by_racers()
        assert len(first) == 3  # the in-flight bound
        for job in first:
            sched.mark(job.job_id, READY)
            sched.complete(sched.lease_next().job_id)
        assert len(admitted_by_racers()) == 2  # 3 completed + 2 in flight = the target
        assert sched.counts("t1") == {COMPLETED: 3, RESERVED: 2}
    finally:
        store.dispose()


def test_policies_are_per_tenant_and_task(store):
    sched, _ = make(store)
    sched.register_policy("t1", "sft", max_in_flight=1)
    sched.register_policy("t2", "sft", max_in_flight=1)
    assert reserve(sched, tenant="t1") is not None
    assert reserve(sched, tenant="t1") is None
    assert reserve(sched, tenant="t2") is not None  # t1's limit does not block t2
    with pytest.raises(SchedulerError, match="no training policy"):
        reserve(sched, tenant="ghost")


def test_state_is_durable_across_store_instances(store_url):
    first = ControlPlaneStore(store_url)
    sched = TrainingScheduler(first)
    sched.register_policy("t1", "sft", max_in_flight=3)
    job = reserve(sched)
    sched.mark(job.job_id, READY)
    first.dispose()
    second = ControlPlaneStore(store_url)  # a restarted Master Service
    again = TrainingScheduler(second)
    assert again.get(job.job_id).state == READY
    assert again.lease_next().job_id == job.job_id
    second.dispose()


def _lease_all(url: str, owner: str, out: mp.Queue) -> None:
    store = ControlPlaneStore(url)
    sched = TrainingScheduler(store)
    got = []
    while True:
        job = sched.lease_next(owner=owner)
        if job is None:
            break
        got.append(job.job_id)
    store.dispose()
    out.put((owner, got))


def test_two_processes_leasing_at_once_never_get_the_same_job(store_url):
    store = ControlPlaneStore(store_url)
    sched = TrainingScheduler(store)
    sched.register_policy("t1", "sft", max_in_flight=200)
    ids = []
    for _ in range(60):
        job = reserve(sched)
        sched.mark(job.job_id, READY)
        ids.append(job.job_id)
    store.dispose()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_lease_all, args=(store_url, f"actor-{i}", out)) for i in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    leased = results["actor-0"] + results["actor-1"]
    assert len(leased) == len(set(leased)), "a job was leased twice"
    assert sorted(leased) == sorted(ids)
    check = TrainingScheduler(ControlPlaneStore(store_url))
    assert {j.lease_owner for j in check.jobs(states=[LEASED])} <= {"actor-0", "actor-1"}
    assert len(check.jobs(states=[LEASED])) == 60
    check.store.dispose()


def test_drop_is_only_for_leased_jobs(store):
    sched, _ = make(store)
    sched.register_policy("t1", "rl", max_in_flight=2)
    job = reserve(sched, task="rl", behavior_policy_version=0)
    with pytest.raises(InvalidTransition):
        sched.drop(job.job_id, "policy_stale")
    sched.mark(job.job_id, READY)
    sched.lease_next()
    assert sched.drop(job.job_id, "policy_stale").state == DROPPED
