"""Grouped leases for the actor (paper 5.2): after `lease_next` took the head job, take the next
ready jobs of OTHER tenants whose group key matches it, so that one grouped forward/backward steps
them together (`TrainingScheduler.lease_companions`).

Fairness and limits are the plain lease's: companions are picked in the actor's lease order
(priority, then FIFO by `ready_seq`); at most one job per tenant (a tenant's jobs stay in order and a
group takes one optimizer step per tenant); only jobs already admitted (`ready`), so the in-flight
bound and completion target, enforced at `reserve`, hold unchanged. Each take is the same
compare-and-set as `lease_next` (`state = 'ready'` in the UPDATE), safe beside other leasers.
Staleness (eq. 1) is the caller's check on every leased job, as for the head job.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from sqlalchemy import bindparam, select, update

from joynexus.core.store import Prepared, TrainingJobRecord, utcnow
from joynexus.scheduling.training_jobs import LEASED, READY, TrainingJob

if TYPE_CHECKING:
    from joynexus.scheduling.training_scheduler import TrainingScheduler

__all__ = ["GROUPABLE_TASK_TYPES", "group_key", "lease_companions"]

_JOBS = TrainingJobRecord.__table__

# Task types whose jobs the Training Model Service steps as a group (`train_jobs`): SFT microbatches
# and RL jobs' PPO microbatches share one backbone forward per round, in any mix.
GROUPABLE_TASK_TYPES = frozenset({"sft", "rl"})

# How many candidates one read considers per wanted companion (others are skipped: same tenant,
# another group key, or taken by a concurrent leaser).
_CANDIDATES_PER_SLOT = 4

_TAKE = Prepared(
    update(_JOBS)
    .where(_JOBS.c.job_id == bindparam("b_job_id"), _JOBS.c.state == READY)
    .values(state=LEASED, lease_owner=bindparam("owner"), leased_at=bindparam("now"), updated_at=bindparam("now"))
    .returning(*_JOBS.c)
)


def group_key(job: TrainingJob) -> tuple[Any, ...] | None:
    """Jobs with equal keys may share one grouped step; None: the job trains alone. One Training
    Model Service holds one frozen backbone, so the frozen-prefix boundary (base model, canonical
    prefix shape) is the same for all its tenants; what differs is who consumes the job and the base
    model a producer may name in the job's metadata. SFT and RL jobs mix (each keeps its own
    objective and its own staleness check)."""
    if job.task_type not in GROUPABLE_TASK_TYPES:
        return None
    return (job.consumer_role, job.metadata.get("base_model"))


def lease_companions(
    scheduler: TrainingScheduler,
    first: TrainingJob,
    max_n: int,
    *,
    domains: Iterable[str] = ("vla",),
    owner: str = "",
    tenant_ids: Collection[str] | None = None,
) -> list[TrainingJob]:
    """Lease up to `max_n` ready jobs of tenants other than `first`'s (one each) with `first`'s
    group key, in lease order; [] when `first` trains alone. `tenant_ids`: only these tenants' jobs
    (a Training Model Service shard's, `scheduling.shard_leases`); None: any tenant's."""
    key = group_key(first)
    domains = list(domains)
    if key is None or max_n < 1 or not domains:
        return []
    with scheduler.store.read() as s:
        rows = s.execute(
            select(_JOBS.c.job_id, _JOBS.c.tenant_id, _JOBS.c["metadata"])
            .where(
                _JOBS.c.state == READY,
                _JOBS.c.consumer_role == first.consumer_role,
                _JOBS.c.task_type.in_(sorted(GROUPABLE_TASK_TYPES)),
                _JOBS.c.domain.in_(domains),
                _JOBS.c.tenant_id != first.tenant_id,
                *([] if tenant_ids is None else [_JOBS.c.tenant_id.in_(sorted(tenant_ids))]),
            )
            .order_by(_JOBS.c.priority.desc(), _JOBS.c.ready_seq.asc())
            .limit(max_n * _CANDIDATES_PER_SLOT)
        ).all()
    taken: list[TrainingJob] = []
    tenants = {first.tenant_id}
    for job_id, tenant_id, metadata in rows:
        if len(taken) >= max_n:
            break
        if tenant_id in tenants:
            continue  # this tenant's later job waits for its earlier one
        if (metadata or {}).get("base_model") != first.metadata.get("base_model"):
            continue  # another base model: another group (it stays at its place in the order)
        with scheduler.store.fast(single_statement=True) as conn:
            row = conn.first(_TAKE, {"b_job_id": job_id, "owner": owner or None, "now": utcnow()})
        if row is None:
            continue  # another leaser took it between our read and our UPDATE
        tenants.add(tenant_id)
        taken.append(TrainingJob.from_tuple(row))
    return taken
