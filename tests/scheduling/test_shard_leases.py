"""A shard's leases (issue 45.1): the plain lease order restricted to the shard's tenants, on SQLite
and PostgreSQL; companions only among them; every tenant count (the bind list is padded)."""

from __future__ import annotations

from joynexus.scheduling.shard_leases import lease_companions_among, lease_next_among
from joynexus.scheduling.training_scheduler import LEASED, READY, TrainingScheduler


def _ready(scheduler, tenant_id, priority=0):
    scheduler.register_policy(tenant_id, "sft", priority=priority, max_in_flight=8)
    job = scheduler.reserve(tenant_id=tenant_id, task_type="sft", sample_count=1)
    return scheduler.mark(job.job_id, READY)


def test_a_shard_leases_only_its_tenants_in_lease_order(store):
    scheduler = TrainingScheduler(store)
    jobs = {t: _ready(scheduler, t) for t in ("a", "b", "c", "d", "e")}
    urgent = _ready(scheduler, "x", priority=5)  # another shard's tenant, first in the global order
    mine = ["b", "d", "e"]
    taken = [lease_next_among(scheduler, mine, owner="shard-1") for _ in range(3)]
    assert [j.job_id for j in taken] == [jobs[t].job_id for t in mine]  # FIFO among mine, x untouched
    assert all(j.state == LEASED and j.lease_owner == "shard-1" for j in taken)
    assert lease_next_among(scheduler, mine, owner="shard-1") is None
    assert scheduler.get(urgent.job_id).state == READY
    assert lease_next_among(scheduler, [], owner="shard-1") is None
    # One tenant (a list of one) and a list wider than a bucket both work.
    assert lease_next_among(scheduler, ["a"], owner="s").job_id == jobs["a"].job_id
    assert lease_next_among(scheduler, [f"t{i}" for i in range(9)] + ["x"], owner="s").job_id == urgent.job_id


def test_companions_come_from_the_shards_tenants_only(store):
    scheduler = TrainingScheduler(store)
    for t in ("a", "b", "c", "d"):
        _ready(scheduler, t)
    head = lease_next_among(scheduler, ["a", "c", "d"], owner="s")
    companions = lease_companions_among(scheduler, head, 4, ["a", "c", "d"], owner="s")
    assert head.tenant_id == "a" and sorted(j.tenant_id for j in companions) == ["c", "d"]
    assert scheduler.counts().get(READY) == 1  # b's job waits for its own shard
