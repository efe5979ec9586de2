"""Leases of one Training Model Service shard (issue 45.1): the actor's lease order of
`TrainingScheduler.lease_next`, restricted to the tenants the shard holds (`ShardPlacement.leasing`).

The same compare-and-set as every lease (`state = 'ready'` repeated in the UPDATE), so shards
leasing side by side never take one job twice; a tenant is placed on exactly one shard, so no two
shards lease the same tenant's jobs. The tenant list varies per call: it is padded to a power of
two of binds, so a few `Prepared` shapes (compiled once, one DBAPI call each) serve every shard size.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from sqlalchemy import bindparam, select, update

from joynexus.core.store import Prepared, TrainingJobRecord, utcnow
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
    width = _bucket(len(tenants))
    candidate, take = _statements(len(domains), width)
    params: dict[str, Any] = {"b_consumer_role": consumer_role, "owner": owner or None}
    params.update((f"domain_{i}", domain) for i, domain in enumerate(domains))
    # The list padded to its bucket with its last id (IN is unchanged by repeats).
    params.update((f"tenant_{i}", tenants[min(i, len(tenants) - 1)]) for i in range(width))
    for _attempt in range(32):
        with scheduler.store.fast(single_statement=True) as conn:
            params["now"] = utcnow()
            row = conn.first(take, params)
            if row is not None:
                return TrainingJob.from_tuple(row)
            if conn.first(candidate, params) is None:
                return None
        # Another leaser took the head between the pick and the UPDATE: try the next one.
    return None


def _bucket(n: int) -> int:
    """The IN list's width: the next power of two (a few compiled shapes serve every shard size)."""
    return 1 << max(0, n - 1).bit_length()


_STATEMENTS: dict[tuple[int, int], tuple[Prepared, Prepared]] = {}


def _statements(n_domains: int, n_tenants: int) -> tuple[Prepared, Prepared]:
    """(pick the head candidate, take it) among `tenant_0` .. `tenant_<n-1>`, compiled once per
    shape like the scheduler's own lease (`training_scheduler._lease_statements`)."""
    key = (n_domains, n_tenants)
    statements = _STATEMENTS.get(key)
    if statements is None:
        head = _JOBS.alias("head")
        candidate = (
            select(head.c.job_id)
            .where(
                head.c.state == READY,
                head.c.consumer_role == bindparam("b_consumer_role"),
                head.c.domain.in_([bindparam(f"domain_{i}") for i in range(n_domains)]),
                head.c.tenant_id.in_([bindparam(f"tenant_{i}") for i in range(n_tenants)]),
            )
            .order_by(head.c.priority.desc(), head.c.ready_seq.asc())
            .limit(1)
        )
        take = (
            update(_JOBS)
            .where(_JOBS.c.job_id == candidate.scalar_subquery(), _JOBS.c.state == READY)
            .values(
                state=LEASED, lease_owner=bindparam("owner"), leased_at=bindparam("now"), updated_at=bindparam("now")
            )
            .returning(*_JOBS.c)
        )
        statements = _STATEMENTS[key] = (Prepared(candidate), Prepared(take))
    return statements


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
