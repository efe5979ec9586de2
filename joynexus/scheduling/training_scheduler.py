"""Training Scheduler (paper Appendix A.2, Tables 3 and 4).

Owns the control state of training jobs in the SQL store: admission by tenant–task policy
(in-flight bound, completion target), the job state machine, stage leases for preprocessing, and
the actor's lease order (highest priority first, FIFO by `ready_seq` within a priority).

Leasing is a compare-and-set: pick the best candidate, then `UPDATE ... WHERE state = <expected>`
and accept only if exactly one row changed; a loser retries with the next candidate. That is safe
across processes on SQLite (writers serialized by BEGIN IMMEDIATE) and PostgreSQL (row locks).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from joynexus.core.store import (
    ControlPlaneStore,
    TrainingJobRecord,
    TrainingPolicyRecord,
    utcnow,
)

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

# Transitions a producer or stage may request with `mark`; leases and terminal moves have their own calls.
_MARK_TRANSITIONS: dict[str, frozenset[str]] = {
    RESERVED: frozenset({READY, NEEDS_ACTOR_FORWARD, NEEDS_ADVANTAGES}),
    COMPUTING_ACTOR_FORWARD: frozenset({NEEDS_ADVANTAGES, READY}),
    COMPUTING_ADVANTAGES: frozenset({READY}),
}


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

    @classmethod
    def from_record(cls, record: TrainingJobRecord) -> TrainingJob:
        return cls(
            job_id=record.job_id,
            policy_key=record.policy_key,
            tenant_id=record.tenant_id,
            task_type=record.task_type,
            partition_id=record.partition_id,
            sample_count=record.sample_count,
            domain=record.domain,
            metadata=dict(record.job_metadata or {}),
            priority=record.priority,
            created_seq=record.created_seq,
            ready_seq=record.ready_seq,
            behavior_policy_version=record.behavior_policy_version,
            max_policy_staleness=record.max_policy_staleness,
            producer_role=record.producer_role,
            consumer_role=record.consumer_role,
            state=record.state,
            lease_owner=record.lease_owner,
            terminal_reason=record.terminal_reason,
            result=dict(record.result) if record.result is not None else None,
            attempts=record.attempts or 0,
        )


def policy_key(tenant_id: str, task_type: str) -> str:
    return f"{tenant_id}/{task_type}"


def partition_id_for(job_id: str, domain: str, tenant_id: str, task_type: str) -> str:
    """Derived from job, domain, tenant and task: unique per job, readable in logs."""
    return f"{domain}/{tenant_id}/{task_type}/{job_id}"


class TrainingScheduler:
    """Training-job control plane. `release_partition` is called on every terminal outcome, so a
    completed, failed or dropped job never leaves its data behind in the Training Queue."""

    def __init__(self, store: ControlPlaneStore, release_partition: Callable[[str], Any] | None = None):
        self.store = store
        self.release_partition = release_partition

    # -- policies ---------------------------------------------------------------------------
    def register_policy(
        self,
        tenant_id: str,
        task_type: str,
        *,
        priority: int = 0,
        max_in_flight: int = 1,
        completion_target: int | None = None,
        max_policy_staleness: int | None = None,
        session: Session | None = None,
    ) -> str:
        key = policy_key(tenant_id, task_type)
        values = dict(
            tenant_id=tenant_id,
            task_type=task_type,
            priority=priority,
            max_in_flight=max_in_flight,
            completion_target=completion_target,
            max_policy_staleness=max_policy_staleness,
        )

        def _upsert(s: Session) -> None:
            record = s.get(TrainingPolicyRecord, key, with_for_update=True)
            if record is None:
                s.add(TrainingPolicyRecord(policy_key=key, reservations=0, **values))
            else:
                for name, value in values.items():
                    setattr(record, name, value)

        if session is not None:
            _upsert(session)
        else:
            with self.store.transaction() as s:
                _upsert(s)
        return key

    def policy(self, tenant_id: str, task_type: str) -> TrainingPolicyRecord:
        with self.store.transaction() as s:
            record = s.get(TrainingPolicyRecord, policy_key(tenant_id, task_type))
            if record is None:
                raise SchedulerError(f"no training policy {policy_key(tenant_id, task_type)!r}")
            s.expunge(record)
            return record

    # -- producer side ----------------------------------------------------------------------
    def reserve(
        self,
        *,
        tenant_id: str,
        task_type: str,
        sample_count: int,
        domain: str = "vla",
        behavior_policy_version: int | None = None,
        producer_role: str = "producer",
        consumer_role: str = "actor",
        metadata: dict[str, Any] | None = None,
    ) -> TrainingJob | None:
        """Admit one job for the tenant–task policy, or return None when its in-flight bound or
        completion target is reached (completed + in flight >= target: never over-produce)."""
        if sample_count < 1:
            raise ValueError(f"sample_count must be >= 1, got {sample_count}")
        key = policy_key(tenant_id, task_type)
        with self.store.transaction() as s:
            policy = s.get(TrainingPolicyRecord, key, with_for_update=True, populate_existing=True)
            if policy is None:
                raise SchedulerError(f"no training policy {key!r}: create the tenant first")
            policy.reservations += 1  # the write that serializes concurrent reservations of this policy
            s.flush()
            counts = dict(
                s.execute(
                    select(TrainingJobRecord.state, func.count())
                    .where(TrainingJobRecord.policy_key == key)
                    .group_by(TrainingJobRecord.state)
                ).all()
            )
            in_flight = sum(n for state, n in counts.items() if state not in TERMINAL_STATES)
            completed = counts.get(COMPLETED, 0)
            if in_flight >= policy.max_in_flight:
                return None
            if policy.completion_target is not None and completed + in_flight >= policy.completion_target:
                return None
            job_id = uuid.uuid4().hex
            record = TrainingJobRecord(
                job_id=job_id,
                policy_key=key,
                tenant_id=tenant_id,
                task_type=task_type,
                partition_id=partition_id_for(job_id, domain, tenant_id, task_type),
                sample_count=sample_count,
                domain=domain,
                job_metadata=dict(metadata or {}),
                priority=policy.priority,
                created_seq=self.store.next_sequence(s, "created_seq"),
                behavior_policy_version=behavior_policy_version,
                max_policy_staleness=policy.max_policy_staleness,
                producer_role=producer_role,
                consumer_role=consumer_role,
                state=RESERVED,
            )
            s.add(record)
            s.flush()
            return TrainingJob.from_record(record)

    def mark(self, job_id: str, state: str, *, owner: str | None = None) -> TrainingJob:
        """Producer / stage transition (reserved → ready | needs_*; computing_* → next). A stage
        passes its `owner` so a job re-queued or re-leased meanwhile raises LeaseLost."""
        with self.store.transaction() as s:
            record = self._locked(s, job_id)
            self._check_owner(record, owner, state)
            allowed = _MARK_TRANSITIONS.get(record.state, frozenset())
            if state not in allowed:
                raise InvalidTransition(job_id, record.state, state)
            record.state = state
            record.lease_owner = None
            record.updated_at = utcnow()
            if state == READY:
                record.ready_seq = self.store.next_sequence(s, "ready_seq")
                record.ready_at = record.updated_at
            s.flush()
            return TrainingJob.from_record(record)

    def lease_stage(
        self, *, state: str, leased_state: str, consumer_role: str = "actor", domain: str = "vla", owner: str = ""
    ) -> TrainingJob | None:
        """Lease the oldest job waiting for a preprocessing stage (e.g. needs_advantages → computing_advantages)."""
        if STAGE_LEASES.get(state) != leased_state:
            raise SchedulerError(f"{state!r} is not leased as {leased_state!r}; stage leases: {STAGE_LEASES}")
        order = (TrainingJobRecord.created_seq.asc(),)
        return self._lease(state, leased_state, [domain], consumer_role, owner, order)

    # -- actor side -------------------------------------------------------------------------
    def lease_next(
        self, *, consumer_role: str = "actor", domains: Iterable[str] = ("vla",), owner: str = ""
    ) -> TrainingJob | None:
        """Highest priority ready job, FIFO by ready_seq within a priority."""
        order = (TrainingJobRecord.priority.desc(), TrainingJobRecord.ready_seq.asc())
        return self._lease(READY, LEASED, list(domains), consumer_role, owner, order)

    def wait_for_ready(
        self, *, consumer_role: str = "actor", domains: Iterable[str] = ("vla",), timeout_s: float = 1.0
    ) -> bool:
        """Poll until a ready job exists (True) or the timeout passes (False)."""
        deadline = time.monotonic() + timeout_s
        domains = list(domains)
        while True:
            with self.store.transaction() as s:
                found = s.execute(
                    select(TrainingJobRecord.job_id)
                    .where(
                        TrainingJobRecord.state == READY,
                        TrainingJobRecord.consumer_role == consumer_role,
                        TrainingJobRecord.domain.in_(domains),
                    )
                    .limit(1)
                ).first()
            if found is not None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def complete(
        self, job_id: str, result: dict[str, Any] | None = None, *, owner: str | None = None
    ) -> TrainingJob:
        """Leased → completed. With `owner`, only while that owner still holds the lease (LeaseLost
        otherwise); a terminal job (e.g. abandoned meanwhile) always raises InvalidTransition."""
        return self._finish(job_id, COMPLETED, reason=None, result=result, from_states={LEASED}, owner=owner)

    def fail(self, job_id: str, reason: str, *, owner: str | None = None) -> TrainingJob:
        """Any nonterminal job may fail (with `owner`: only a job that owner holds leased)."""
        return self._finish(job_id, FAILED, reason=reason, result=None, from_states=None, owner=owner)

    def drop(self, job_id: str, reason: str, *, owner: str | None = None) -> TrainingJob:
        """Drop a leased job without training it (e.g. `policy_stale`, eq. 1)."""
        return self._finish(job_id, DROPPED, reason=reason, result=None, from_states={LEASED}, owner=owner)

    def abandon(self, job_id: str, reason: str) -> TrainingJob:
        """Fail a job from any nonterminal state, leased included (its workload was cancelled or is
        gone), releasing its partition. Idempotent: a terminal job is returned unchanged. A holder
        of the lease then gets InvalidTransition from complete/fail/drop, so it cannot resurrect it."""
        try:
            return self._finish(job_id, FAILED, reason=reason, result=None, from_states=None)
        except InvalidTransition as error:
            if error.current in TERMINAL_STATES:
                return self.get(job_id)
            raise

    # -- recovery ---------------------------------------------------------------------------
    def recover_orphans(
        self,
        live_owners: Collection[str],
        *,
        has_partition: Callable[[str], bool] | None = None,
        max_attempts: int = 3,
    ) -> list[TrainingJob]:
        """Take back the leases of owners that are gone (a restarted Master, a dead actor or stage).

        Every job in a leased state (leased, computing_*) whose lease owner is not in `live_owners`
        (a lease taken without an owner counts as orphaned) goes back to the state it was leased
        from (ready, resp. needs_*) with `attempts` + 1 and no owner, keeping its ready_seq so it
        keeps its FIFO place. It fails instead, naming the dead owner, when its partition is gone
        (`has_partition` false) or attempts + 1 > `max_attempts`; failed jobs release their
        partition. Returns the jobs it changed, as they are now.
        """
        if max_attempts < 0:
            raise ValueError(f"max_attempts must be >= 0, got {max_attempts}")
        live = set(live_owners)
        with self.store.transaction() as s:
            leased = s.scalars(
                select(TrainingJobRecord)
                .where(TrainingJobRecord.state.in_(list(LEASED_STATES)))
                .order_by(TrainingJobRecord.created_seq)
            )
            orphans = [TrainingJob.from_record(r) for r in leased if r.lease_owner not in live]
        # Ask the Training Queue outside any transaction (a remote call must not hold the write lock).
        plans: list[tuple[TrainingJob, str | None]] = []
        for job in orphans:
            attempts = job.attempts + 1
            if has_partition is not None and not has_partition(job.partition_id):
                reason: str | None = f"lease owner {job.lease_owner!r} is gone and partition {job.partition_id} is lost"
            elif attempts > max_attempts:
                reason = f"lease owner {job.lease_owner!r} is gone; retries exhausted ({attempts} > {max_attempts})"
            else:
                reason = None
            plans.append((job, reason))
        changed: list[TrainingJob] = []
        with self.store.transaction() as s:
            now = utcnow()
            for job, reason in plans:
                if reason is None:
                    values: dict[str, Any] = dict(state=LEASED_STATES[job.state], lease_owner=None, leased_at=None)
                else:
                    values = dict(state=FAILED, terminal_reason=reason, finished_at=now)
                # Compare-and-set on what we saw: a job that finished or moved meanwhile is left alone.
                owner_is = (
                    TrainingJobRecord.lease_owner.is_(None)
                    if job.lease_owner is None
                    else TrainingJobRecord.lease_owner == job.lease_owner
                )
                hit = s.execute(
                    update(TrainingJobRecord)
                    .where(
                        TrainingJobRecord.job_id == job.job_id,
                        TrainingJobRecord.state == job.state,
                        TrainingJobRecord.attempts == job.attempts,
                        owner_is,
                    )
                    .values(attempts=job.attempts + 1, updated_at=now, **values)
                    .execution_options(synchronize_session=False)
                ).rowcount
                if hit == 1:
                    record = s.get(TrainingJobRecord, job.job_id, populate_existing=True)
                    changed.append(TrainingJob.from_record(record))
        if self.release_partition is not None:
            for job in changed:
                if job.state == FAILED:
                    self.release_partition(job.partition_id)
        return changed

    # -- queries ----------------------------------------------------------------------------
    def get(self, job_id: str) -> TrainingJob:
        with self.store.transaction() as s:
            record = s.get(TrainingJobRecord, job_id)
            if record is None:
                raise UnknownJob(job_id)
            return TrainingJob.from_record(record)

    def jobs(self, *, tenant_id: str | None = None, states: Iterable[str] | None = None) -> list[TrainingJob]:
        query = select(TrainingJobRecord).order_by(TrainingJobRecord.created_seq)
        if tenant_id is not None:
            query = query.where(TrainingJobRecord.tenant_id == tenant_id)
        if states is not None:
            query = query.where(TrainingJobRecord.state.in_(list(states)))
        with self.store.transaction() as s:
            return [TrainingJob.from_record(r) for r in s.scalars(query)]

    def counts(self, tenant_id: str | None = None) -> dict[str, int]:
        query = select(TrainingJobRecord.state, func.count()).group_by(TrainingJobRecord.state)
        if tenant_id is not None:
            query = query.where(TrainingJobRecord.tenant_id == tenant_id)
        with self.store.transaction() as s:
            return {state: n for state, n in s.execute(query).all()}

    # -- internals --------------------------------------------------------------------------
    def _locked(self, s: Session, job_id: str) -> TrainingJobRecord:
        record = s.get(TrainingJobRecord, job_id, with_for_update=True, populate_existing=True)
        if record is None:
            raise UnknownJob(job_id)
        return record

    @staticmethod
    def _check_owner(record: TrainingJobRecord, owner: str | None, requested: str) -> None:
        """With an owner: the job must still be leased by it (leases store "" as None)."""
        if owner is None:
            return
        if record.state not in LEASED_STATES or record.lease_owner != (owner or None):
            raise LeaseLost(record.job_id, record.state, requested, owner, record.lease_owner)

    def _lease(
        self, state: str, leased_state: str, domains: list[str], consumer_role: str, owner: str, order: tuple
    ) -> TrainingJob | None:
        for _attempt in range(32):
            with self.store.transaction() as s:
                candidate = s.execute(
                    select(TrainingJobRecord.job_id)
                    .where(
                        TrainingJobRecord.state == state,
                        TrainingJobRecord.consumer_role == consumer_role,
                        TrainingJobRecord.domain.in_(domains),
                    )
                    .order_by(*order)
                    .limit(1)
                ).scalar_one_or_none()
                if candidate is None:
                    return None
                now = utcnow()
                changed = s.execute(
                    update(TrainingJobRecord)
                    .where(TrainingJobRecord.job_id == candidate, TrainingJobRecord.state == state)
                    .values(state=leased_state, lease_owner=owner or None, leased_at=now, updated_at=now)
                    .execution_options(synchronize_session=False)
                ).rowcount
                if changed == 1:
                    record = s.get(TrainingJobRecord, candidate, populate_existing=True)
                    return TrainingJob.from_record(record)
            # Another process took it between our SELECT and UPDATE: try the next candidate.
        raise SchedulerError("could not lease a job after 32 contended attempts")

    def _finish(
        self,
        job_id: str,
        state: str,
        *,
        reason: str | None,
        result: dict[str, Any] | None,
        from_states: set[str] | None,
        owner: str | None = None,
    ) -> TrainingJob:
        with self.store.transaction() as s:
            record = self._locked(s, job_id)
            self._check_owner(record, owner, state)
            if record.state in TERMINAL_STATES or (from_states is not None and record.state not in from_states):
                raise InvalidTransition(job_id, record.state, state)
            record.state = state
            record.terminal_reason = reason
            record.result = result
            record.finished_at = record.updated_at = utcnow()
            s.flush()
            job = TrainingJob.from_record(record)
        # After the state is durable: a crash between the two leaves a terminal job whose partition
        # can be cleared again (clear is idempotent), never a live job without data.
        if self.release_partition is not None:
            self.release_partition(job.partition_id)
        return job
