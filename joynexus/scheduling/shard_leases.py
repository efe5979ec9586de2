"""Leases of one Training Model Service shard (issue 45.1): the actor's lease order of
`TrainingScheduler.lease_next`, restricted to the tenants the shard holds (`ShardPlacement.leasing`).

The same compare-and-set as every lease (`state = 'ready'` repeated in the UPDATE), so shards
leasing side by side never take one job twice; a tenant is placed on exactly one shard, so no two
shards lease the same tenant's jobs. The tenant list varies per call, so these statements are
built per call (an expanding IN list) rather than `Prepared` once like the scheduler's hot path.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from sqlalchemy import select, update

from joynexus.core.store import TrainingJobRecord, utcnow
from joynexus.scheduling.job_grouping import lease_companions
from joynexus.scheduling.training_jobs import LEASED, READY, TrainingJob

if TYPE_CHECKING:
    from joynexus.scheduling.training_scheduler import TrainingScheduler

__all__ = ["lease_companions_among", "lease_next_among"]

_JOBS = TrainingJobRecord.__table__


def lease_next_among(
    scheduler: TrainingScheduler,
    tenant_ids: Collection[str],
    *,
    consumer_role: str = "actor",
    domains: Iterable[str] = ("vla",),
    owner: str = "",
) -> TrainingJob | None:
    """The highest-priority ready job (FIFO by ready_seq within a priority) of one of `tenant_ids`,
    leased to `owner`; None when none of them has a ready job."""
    domains, tenants = list(domains), sorted(tenant_ids)
    if not domains or not tenants:
        return None
    head = _JOBS.alias("head")
    candidate = (
        select(head.c.job_id)
        .where(
            head.c.state == READY,
            head.c.consumer_role == consumer_role,
            head.c.domain.in_(domains),
            head.c.tenant_id.in_(tenants),
        )
        .order_by(head.c.priority.desc(), head.c.ready_seq.asc())
        .limit(1)
    )
    for _attempt in range(32):
        now = utcnow()
        take = (
            update(_JOBS)
            .where(_JOBS.c.job_id == candidate.scalar_subquery(), _JOBS.c.state == READY)
            .values(state=LEASED, lease_owner=owner or None, leased_at=now, updated_at=now)
            .returning(*_JOBS.c)
        )
        with scheduler.store.connection() as conn:
            row = conn.execute(take).first()
            if row is not None:
                return TrainingJob.from_tuple(tuple(row))
            if conn.execute(candidate).first() is None:
                return None
        # Another leaser took the head between the pick and the UPDATE: try the next one.
    return None


def lease_companions_among(
    scheduler: TrainingScheduler,
    first: TrainingJob,
    max_n: int,
    tenant_ids: Collection[str],
    *,
    domains: Iterable[str] = ("vla",),
    owner: str = "",
) -> list[TrainingJob]:
    """`lease_companions` (group key, lease order, one job per tenant) among `tenant_ids` only."""
    return lease_companions(scheduler, first, max_n, domains=domains, owner=owner, tenant_ids=tenant_ids)
