"""Training jobs as the Training Scheduler sees them (paper Appendix A.2, Tables 3 and 4): the
states of the job state machine, the descriptor snapshot `TrainingJob` (with its mapping from a
row of the training_jobs table), the scheduler's errors, and how policy keys and partition ids are
derived. `joynexus.scheduling.training_scheduler` holds the scheduler that moves jobs between states.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Row

from joynexus.core.store import TrainingJobRecord

__all__ = [
    "COMPLETED",
    "COMPUTING_ACTOR_FORWARD",
    "COMPUTING_ADVANTAGES",
    "DROPPED",
    "FAILED",
    "LEASED",
    "LEASED_STATES",
    "NEEDS_ACTOR_FORWARD",
    "NEEDS_ADVANTAGES",
    "NONTERMINAL_STATES",
    "READY",
    "RESERVED",
    "STAGE_LEASES",
    "TERMINAL_STATES",
    "InvalidTransition",
    "LeaseLost",
    "SchedulerError",
    "TrainingJob",
    "UnknownJob",
    "partition_id_for",
    "policy_key",
]

# States of Table 4. needs_* are "waiting for a preprocessing stage"; computing_* are that stage's lease.
RESERVED = "reserved"
NEEDS_ACTOR_FORWARD = "needs_actor_forward"
COMPUTING_ACTOR_FORWARD = "computing_actor_forward"
NEEDS_ADVANTAGES = "needs_advantages"
COMPUTING_ADVANTAGES = "computing_advantages"
READY = "ready"
LEASED = "leased"
COMPLETED = "completed"
FAILED = "failed"
DROPPED = "dropped"

TERMINAL_STATES = frozenset({COMPLETED, FAILED, DROPPED})
STAGE_LEASES = {NEEDS_ACTOR_FORWARD: COMPUTING_ACTOR_FORWARD, NEEDS_ADVANTAGES: COMPUTING_ADVANTAGES}
# A leased state and the state its job returns to when the lease owner dies (recover_orphans).
LEASED_STATES = {LEASED: READY, **{leased: waiting for waiting, leased in STAGE_LEASES.items()}}
NONTERMINAL_STATES = (
    RESERVED,
    NEEDS_ACTOR_FORWARD,
    COMPUTING_ACTOR_FORWARD,
    NEEDS_ADVANTAGES,
    COMPUTING_ADVANTAGES,
    READY,
    LEASED,
)

_JOBS = TrainingJobRecord.__table__
# Positions of the columns in a row of every column of training_jobs (RETURNING *_JOBS.c).
_J_JOB_ID, _J_POLICY_KEY, _J_TENANT_ID, _J_TASK_TYPE, _J_PARTITION_ID, _J_SAMPLE_COUNT, _J_DOMAIN = (
    [c.name for c in _JOBS.c].index(name)
    for name in ("job_id", "policy_key", "tenant_id", "task_type", "partition_id", "sample_count", "domain")
)
_J_METADATA, _J_PRIORITY, _J_CREATED_SEQ, _J_READY_SEQ, _J_BEHAVIOR_POLICY_VERSION, _J_MAX_POLICY_STALENESS = (
    [c.name for c in _JOBS.c].index(name)
    for name in (
        "metadata", "priority", "created_seq", "ready_seq", "behavior_policy_version", "max_policy_staleness"
    )
)  # fmt: skip
_J_PRODUCER_ROLE, _J_CONSUMER_ROLE, _J_STATE, _J_LEASE_OWNER, _J_TERMINAL_REASON, _J_RESULT, _J_ATTEMPTS = (
    [c.name for c in _JOBS.c].index(name)
    for name in ("producer_role", "consumer_role", "state", "lease_owner", "terminal_reason", "result", "attempts")
)


class SchedulerError(RuntimeError):
    pass


class InvalidTransition(SchedulerError):
    def __init__(self, job_id: str, current: str, requested: str):
        super().__init__(f"job {job_id}: cannot move from {current!r} to {requested!r}")
        self.job_id, self.current, self.requested = job_id, current, requested


class LeaseLost(InvalidTransition):
    """The caller no longer holds the job's lease: it was re-queued (its owner was presumed dead),
    leased again by another owner, or abandoned. The caller must drop its work on the job."""

    def __init__(self, job_id: str, current: str, requested: str, owner: str, holder: str | None):
        super().__init__(job_id, current, requested)
        self.args = (f"job {job_id}: {owner!r} lost its lease (state {current!r}, lease owner {holder!r})",)
        self.owner, self.holder = owner, holder


class UnknownJob(SchedulerError, KeyError):
    def __init__(self, job_id: str):
        super().__init__(f"no training job with job_id {job_id!r}")


@dataclass(frozen=True)
class TrainingJob:
    """A snapshot of one descriptor (Table 3); plain data, safe to hand to Ray actors."""

    job_id: str
    policy_key: str
    tenant_id: str
    task_type: str
    partition_id: str
    sample_count: int
    domain: str
    metadata: dict[str, Any]
    priority: int
    created_seq: int
    ready_seq: int | None
    behavior_policy_version: int | None
    max_policy_staleness: int | None
    producer_role: str
    consumer_role: str
    state: str
    lease_owner: str | None
    terminal_reason: str | None
    result: dict[str, Any] | None = field(default=None)
    attempts: int = 0  # re-queues after a lease owner died

    @property
    def schema_signature(self) -> str | None:
        return self.metadata.get("schema_signature")

    def read_task(self, name: str) -> str:
        """The Training Queue task name this attempt reads its partition under. A job re-queued
        from a replaced (hung, not dead) lease owner is read from its start by the next owner,
        whatever the retired one consumed meanwhile: each attempt has its own cursors."""
        return f"{name}@{self.attempts}"

    @classmethod
    def from_row(cls, row: Row) -> TrainingJob:
        """From a Core row of the training_jobs table (a SELECT or an UPDATE ... RETURNING)."""
        return cls.from_mapping(row._mapping)

    @classmethod
    def from_tuple(cls, row: tuple) -> TrainingJob:
        """From a `Prepared` row holding every column of the training_jobs table in table order."""
        return cls(
            job_id=row[_J_JOB_ID],
            policy_key=row[_J_POLICY_KEY],
            tenant_id=row[_J_TENANT_ID],
            task_type=row[_J_TASK_TYPE],
            partition_id=row[_J_PARTITION_ID],
            sample_count=row[_J_SAMPLE_COUNT],
            domain=row[_J_DOMAIN],
            metadata=dict(row[_J_METADATA] or {}),
            priority=row[_J_PRIORITY],
            created_seq=row[_J_CREATED_SEQ],
            ready_seq=row[_J_READY_SEQ],
            behavior_policy_version=row[_J_BEHAVIOR_POLICY_VERSION],
            max_policy_staleness=row[_J_MAX_POLICY_STALENESS],
            producer_role=row[_J_PRODUCER_ROLE],
            consumer_role=row[_J_CONSUMER_ROLE],
            state=row[_J_STATE],
            lease_owner=row[_J_LEASE_OWNER],
            terminal_reason=row[_J_TERMINAL_REASON],
            result=dict(row[_J_RESULT]) if row[_J_RESULT] is not None else None,
            attempts=row[_J_ATTEMPTS] or 0,
        )

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> TrainingJob:
        """From the table's column values by column name (the same conversion as `from_tuple`)."""
        return cls.from_tuple(tuple(m[column.name] for column in _JOBS.c))


def policy_key(tenant_id: str, task_type: str) -> str:
    return f"{tenant_id}/{task_type}"


def partition_id_for(job_id: str, domain: str, tenant_id: str, task_type: str) -> str:
    """Derived from job, domain, tenant and task: unique per job, readable in logs."""
    return f"{domain}/{tenant_id}/{task_type}/{job_id}"
