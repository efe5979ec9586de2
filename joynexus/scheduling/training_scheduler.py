"""Training Scheduler (paper Appendix A.2, Tables 3 and 4).

Owns the control state of training jobs in the SQL store: admission by tenant–task policy
(in-flight bound, completion target), the job state machine, stage leases for preprocessing, and
the actor's lease order (highest priority first, FIFO by `ready_seq` within a priority).

Leasing is a compare-and-set: pick the best candidate, then `UPDATE ... WHERE state = <expected>`
and accept only if exactly one row changed; a loser retries with the next candidate. That is safe
across processes on SQLite (writers serialized by BEGIN IMMEDIATE) and PostgreSQL (row locks).

The hot calls (reserve, mark, lease_*, complete / fail / drop) run statements compiled once per
dialect straight on the DBAPI connection (`ControlPlaneStore.fast`); on PostgreSQL each of mark,
lease and complete is ONE autocommit statement (ready_seq drawn in the same UPDATE), and reserve is
two statements (lock the policy; insert the job if admitted) sent as one script: a reserve -> ready
-> lease -> complete cycle takes 4 round trips (it took 21, 4 of them pool pre-pings; then 8). The
counters are server sequences there, so concurrent reserves do not queue on a counter row until commit.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, bindparam, case, func, insert, literal, select, true, update
from sqlalchemy.orm import Session

from joynexus.core.store import (
    POSTGRES_SEQUENCES,
    ControlPlaneStore,
    FastConnection,
    Prepared,
    TrainingJobRecord,
    TrainingPolicyRecord,
    utcnow,
)
from joynexus.scheduling.job_grouping import lease_companions
from joynexus.scheduling.training_jobs import (
    COMPLETED,
    COMPUTING_ACTOR_FORWARD,
    COMPUTING_ADVANTAGES,
    DROPPED,
    FAILED,
    LEASED,
    LEASED_STATES,
    NEEDS_ACTOR_FORWARD,
    NEEDS_ADVANTAGES,
    NONTERMINAL_STATES,
    READY,
    RESERVED,
    STAGE_LEASES,
    TERMINAL_STATES,
    InvalidTransition,
    LeaseLost,
    SchedulerError,
    TrainingJob,
    UnknownJob,
    partition_id_for,
    policy_key,
)

log = logging.getLogger(__name__)

# How often a waiter looks at the store again without being woken (a change made by another process).
CHANGE_POLL_S = 0.25

# Transitions a producer or stage may request with `mark`; leases and terminal moves have their own calls.
_MARK_TRANSITIONS: dict[str, frozenset[str]] = {
    RESERVED: frozenset({READY, NEEDS_ACTOR_FORWARD, NEEDS_ADVANTAGES}),
    COMPUTING_ACTOR_FORWARD: frozenset({NEEDS_ADVANTAGES, READY}),
    COMPUTING_ADVANTAGES: frozenset({READY}),
}

# Hot paths run Core statements on these tables (one round trip per step, RETURNING instead of a re-read).
_JOBS = TrainingJobRecord.__table__
_POLICIES = TrainingPolicyRecord.__table__


class TrainingScheduler:
    """Training-job control plane. `release_partition` is called on every terminal outcome, so a
    completed, failed or dropped job never leaves its data behind in the Training Queue."""

    def __init__(self, store: ControlPlaneStore, release_partition: Callable[[str], Any] | None = None):
        self.store = store
        self.release_partition = release_partition
        # Every transition made through this object bumps the generation and wakes its waiters (the
        # producers, the advantage stage, the actor loop), which otherwise polled the store 20x/s
        # each; they still look again after a short timeout for changes made by another process.
        self._changes = threading.Condition()
        self._generation = 0

    # -- change notifications ---------------------------------------------------------------
    @property
    def generation(self) -> int:
        """A counter of the job and policy changes made through this scheduler."""
        return self._generation

    def wait_for_change(self, since: int, timeout_s: float) -> bool:
        """Block until a change after generation `since` (True) or `timeout_s` passes (False). Read
        `generation` before the check that found nothing to do, so a change between the two is seen."""
        with self._changes:
            return self._changes.wait_for(lambda: self._generation != since, timeout=max(0.0, timeout_s))

    def _changed(self) -> None:
        with self._changes:
            self._generation += 1
            self._changes.notify_all()

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
        """Registered ONCE per tenant, at its creation (`TenantCreator`, in the tenant's transaction)."""
        key = policy_key(tenant_id, task_type)
        values = dict(
            tenant_id=tenant_id, task_type=task_type, priority=priority, max_in_flight=max_in_flight,
            completion_target=completion_target, max_policy_staleness=max_policy_staleness,
        )  # fmt: skip
        with nullcontext(session) if session is not None else self.store.transaction() as s:
            record = s.get(TrainingPolicyRecord, key, with_for_update=True)
            if record is None:
                s.add(TrainingPolicyRecord(policy_key=key, reservations=0, **values))
            else:
                for name, value in values.items():
                    setattr(record, name, value)
        self._changed()  # a raised target or in-flight bound lets a waiting producer go on
        return key

    def set_completion_target(self, tenant_id: str, task_type: str, completion_target: int | None) -> None:
        """Set only the policy's completion target (a workload's jobs on top of the completed ones)."""
        key = policy_key(tenant_id, task_type)
        with self.store.transaction() as s:
            record = s.get(TrainingPolicyRecord, key, with_for_update=True)
            if record is None:
                raise SchedulerError(f"no training policy {key!r}: the tenant's creation registers it")
            record.completion_target = completion_target
        self._changed()  # a raised target lets a waiting producer go on

    def policy(self, tenant_id: str, task_type: str) -> TrainingPolicyRecord:
        with self.store.read() as s:
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
        values = _new_job_values(
            key, tenant_id, task_type, sample_count, domain, metadata, behavior_policy_version, producer_role,
            consumer_role,
        )  # fmt: skip
        if not self.store.is_sqlite:
            return self._reserve_postgres(key, values)
        with self.store.fast() as conn:
            # The write that serializes concurrent reservations of this policy (SQLite holds the
            # write lock since BEGIN IMMEDIATE), returning the policy.
            policy = conn.first(_RESERVE_POLICY, {"key": key})
            if policy is None:
                raise SchedulerError(f"no training policy {key!r}: create the tenant first")
            priority, max_in_flight, completion_target, max_policy_staleness = policy
            # Counted on the (policy_key, state) index: in flight always, completed only under a target.
            counted = _COUNT_IN_FLIGHT if completion_target is None else _COUNT_IN_FLIGHT_COMPLETED
            in_flight, completed = conn.first(counted, {"key": key}) or (0, 0)
            if in_flight >= max_in_flight:
                return None
            if completion_target is not None and completed + in_flight >= completion_target:
                return None
            values.update(priority=priority, max_policy_staleness=max_policy_staleness)
            values["created_seq"] = self.store.next_sequence(conn, "created_seq")
            conn.execute(_INSERT_JOB, values)
            return TrainingJob.from_mapping(values)

    def _reserve_postgres(self, key: str, values: dict[str, Any]) -> TrainingJob | None:
        """PostgreSQL: lock the policy, then insert the job if the policy admits it, the two
        statements sent as ONE script (one round trip, one implicit transaction). Each statement of
        it takes its own snapshot (READ COMMITTED), so the INSERT's count, which starts once the
        UPDATE holds the policy's row lock, sees the jobs of every reservation that held the lock
        before this one. created_seq is nextval of its server sequence (no lock until commit)."""
        with self.store.fast(single_statement=True) as conn:
            (policy, _), (inserted, _) = conn.script([(_RESERVE_POLICY, {"key": key}), (_INSERT_IF_ADMITTED, values)])
        if policy is None:
            raise SchedulerError(f"no training policy {key!r}: create the tenant first")
        if inserted is None:
            return None  # the in-flight bound or the completion target is reached
        values["created_seq"], values["priority"], values["max_policy_staleness"] = inserted
        return TrainingJob.from_mapping(values)

    def mark(
        self, job_id: str, state: str, *, owner: str | None = None, behavior_policy_version: int | None = None
    ) -> TrainingJob:
        """Producer / stage transition (reserved → ready | needs_*; computing_* → next). A stage
        passes its `owner` so a job re-queued or re-leased meanwhile raises LeaseLost. A producer
        passes `behavior_policy_version` when its data was made with another version than the one
        it reserved with (it read the served version again once the job was admitted)."""
        sources = [current for current, targets in _MARK_TRANSITIONS.items() if state in targets]
        now = utcnow()
        values: dict[str, Any] = dict(state=state, lease_owner=None, updated_at=now)
        if behavior_policy_version is not None:
            values["behavior_policy_version"] = behavior_policy_version
        # On PostgreSQL, ready_seq is nextval of its server sequence in the same UPDATE: one autocommit
        # statement. A refused transition still consumed a number: gaps keep the order.
        ready_from_cte = state == READY and not self.store.is_sqlite
        with self.store.fast(single_statement=state != READY or ready_from_cte) as conn:
            if state == READY:
                values["ready_at"] = now
                if not ready_from_cte:  # SQLite holds the write lock: allocate, then move (a refusal rolls back)
                    values["ready_seq"] = self.store.next_sequence(conn, "ready_seq")
            row = self._transition(
                conn,
                job_id,
                state,
                owner,
                sources=sources,
                values=values,
                permitted=lambda current: state in _MARK_TRANSITIONS.get(current, frozenset()),
                ready_seq_from_sequence=ready_from_cte,
            )
        self._changed()  # after the commit: a woken stage or actor loop reads the new state
        return TrainingJob.from_tuple(row)

    def lease_stage(
        self, *, state: str, leased_state: str, consumer_role: str = "actor", domain: str = "vla", owner: str = ""
    ) -> TrainingJob | None:
        """Lease the oldest job waiting for a preprocessing stage (e.g. needs_advantages → computing_advantages)."""
        if STAGE_LEASES.get(state) != leased_state:
            raise SchedulerError(f"{state!r} is not leased as {leased_state!r}; stage leases: {STAGE_LEASES}")
        order = ("created_seq",)
        return self._lease(state, leased_state, [domain], consumer_role, owner, order)

    # -- actor side -------------------------------------------------------------------------
    def lease_next(
        self, *, consumer_role: str = "actor", domains: Iterable[str] = ("vla",), owner: str = ""
    ) -> TrainingJob | None:
        """Highest priority ready job, FIFO by ready_seq within a priority."""
        order = ("-priority", "ready_seq")
        return self._lease(READY, LEASED, list(domains), consumer_role, owner, order)

    def lease_companions(
        self, first: TrainingJob, max_n: int, *, domains: Iterable[str] = ("vla",), owner: str = ""
    ) -> list[TrainingJob]:
        """Up to `max_n` more ready jobs to train in one group with `first` (other tenants, same
        group key, lease order; `scheduling.job_grouping`)."""
        return lease_companions(self, first, max_n, domains=domains, owner=owner)

    def wait_for_ready(
        self, *, consumer_role: str = "actor", domains: Iterable[str] = ("vla",), timeout_s: float = 1.0
    ) -> bool:
        """Wait until a ready job exists (True) or the timeout passes (False): woken by this
        scheduler's changes, and looking again every `CHANGE_POLL_S` for other processes'."""
        deadline = time.monotonic() + timeout_s
        domains = list(domains)
        while True:
            seen = self._generation
            with self.store.read() as s:
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
            self.wait_for_change(seen, min(CHANGE_POLL_S, deadline - time.monotonic()))

    def complete(self, job_id: str, result: dict[str, Any] | None = None, *, owner: str | None = None) -> TrainingJob:
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
        partition. Returns the jobs it changed, as they are now."""
        if max_attempts < 0:
            raise ValueError(f"max_attempts must be >= 0, got {max_attempts}")
        live = set(live_owners)
        query = select(_JOBS).where(_JOBS.c.state.in_(list(LEASED_STATES))).order_by(_JOBS.c.created_seq)
        with self.store.read() as s:
            orphans = [TrainingJob.from_row(r) for r in s.execute(query) if r.lease_owner not in live]
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
                    changed.append(TrainingJob.from_row(s.execute(_SELECT_JOB, {"b_job_id": job.job_id}).one()))
        for job in changed:
            if job.state == FAILED:
                self._release(job.partition_id)
        if changed:
            self._changed()
        return changed

    # -- queries ----------------------------------------------------------------------------
    def get(self, job_id: str) -> TrainingJob:
        with self.store.read() as s:
            row = s.execute(_SELECT_JOB, {"b_job_id": job_id}).first()
        if row is None:
            raise UnknownJob(job_id)
        return TrainingJob.from_row(row)

    def jobs(self, *, tenant_id: str | None = None, states: Iterable[str] | None = None) -> list[TrainingJob]:
        query = select(_JOBS).order_by(_JOBS.c.created_seq)
        if tenant_id is not None:
            query = query.where(_JOBS.c.tenant_id == tenant_id)
        if states is not None:
            query = query.where(_JOBS.c.state.in_(list(states)))
        with self.store.read() as s:
            return [TrainingJob.from_row(r) for r in s.execute(query)]

    def counts(self, tenant_id: str | None = None) -> dict[str, int]:
        query = select(TrainingJobRecord.state, func.count()).group_by(TrainingJobRecord.state)
        if tenant_id is not None:
            query = query.where(TrainingJobRecord.tenant_id == tenant_id)
        with self.store.read() as s:
            return {state: n for state, n in s.execute(query).all()}

    # -- internals --------------------------------------------------------------------------
    @staticmethod
    def _check_owner(record: Any, owner: str | None, requested: str) -> None:
        """With an owner: the job must still be leased by it (leases store "" as None)."""
        if owner is None:
            return
        if record.state not in LEASED_STATES or record.lease_owner != (owner or None):
            raise LeaseLost(record.job_id, record.state, requested, owner, record.lease_owner)

    @staticmethod
    def _transition(
        conn: FastConnection,
        job_id: str,
        requested: str,
        owner: str | None,
        *,
        sources: Iterable[str] | None,
        values: dict[str, Any],
        permitted: Callable[[str], bool],
        ready_seq_from_sequence: bool = False,
    ) -> tuple:
        """One compare-and-set UPDATE ... RETURNING: the job moves only from a state in `sources`
        (None: any nonterminal one) and, with an `owner`, only while that owner holds its lease.
        When nothing matched, the row is read (locked) to raise the same error as a read-check-write
        would: UnknownJob, LeaseLost (owner check first), or InvalidTransition (`permitted` false)."""
        statement = _transition_statement(
            None if sources is None else tuple(sorted(sources)),
            None if owner is None else bool(owner),
            tuple(values),
            ready_seq_from_sequence,
        )
        params = {"b_job_id": job_id, "owner": owner, **{f"v_{name}": value for name, value in values.items()}}
        for _attempt in range(8):
            row = conn.first(statement, params)
            if row is not None:
                return row
            found = conn.first(_LOCK_JOB, {"b_job_id": job_id})
            if found is None:
                raise UnknownJob(job_id)
            current = _JobState(*found)
            TrainingScheduler._check_owner(current, owner, requested)
            if not permitted(current.state):
                raise InvalidTransition(job_id, current.state, requested)
            # The row moved between the UPDATE and the read (PostgreSQL); it is locked now: try again.
        raise SchedulerError(f"job {job_id}: could not move to {requested!r} after 8 contended attempts")

    def _lease(
        self, state: str, leased_state: str, domains: list[str], consumer_role: str, owner: str, order: tuple
    ) -> TrainingJob | None:
        """`order`: column names, "-name" for descending. The candidate is picked and taken in one
        UPDATE whose WHERE repeats `state = <expected>` (the compare-and-set)."""
        if not domains:
            return None  # no domain to lease from
        candidate, take = _lease_statements(state, leased_state, order, len(domains))
        params: dict[str, Any] = {"b_consumer_role": consumer_role, "owner": owner or None}
        params.update((f"domain_{i}", domain) for i, domain in enumerate(domains))
        for _attempt in range(32):
            # One compare-and-set UPDATE (autocommit on PostgreSQL); the pick is read-only.
            with self.store.fast(single_statement=True) as conn:
                params["now"] = utcnow()
                row = conn.first(take, params)
                if row is not None:
                    return TrainingJob.from_tuple(row)
                if conn.first(candidate, params) is None:
                    return None
            # Another process took it between our pick and our UPDATE: try the next candidate.
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
        with self.store.fast(single_statement=True) as conn:
            now = utcnow()
            row = self._transition(
                conn,
                job_id,
                state,
                owner,
                sources=None if from_states is None else [s for s in from_states if s not in TERMINAL_STATES],
                values=dict(state=state, terminal_reason=reason, result=result, finished_at=now, updated_at=now),
                permitted=lambda current: (
                    current not in TERMINAL_STATES and (from_states is None or current in from_states)
                ),
            )
            job = TrainingJob.from_tuple(row)
        # After the state is durable: a crash between the two leaves a terminal job whose partition
        # can be cleared again (clear is idempotent), never a live job without data.
        self._release(job.partition_id)
        self._changed()  # the tenant's in-flight slot is free: its producer can reserve the next job
        return job

    def _release(self, partition_id: str) -> None:
        """Best effort: the outcome is already durable, and a Training Queue that is restarting lost
        the partition anyway; raising here would make a caller think the transition failed."""
        if self.release_partition is None:
            return
        try:
            self.release_partition(partition_id)
        except Exception as error:
            log.warning("could not release partition %s: %s: %s", partition_id, type(error).__name__, error)

    def release_lease(self, job_id: str, reason: str, *, owner: str, max_attempts: int = 3) -> TrainingJob:
        """Give a leased job back (its holder could not run it because a role it needs is down or
        restarting): to the state it was leased from with `attempts` + 1 and no owner, keeping its
        FIFO place; `failed` with the reason once attempts + 1 > `max_attempts`. Owner-checked like
        every transition (LeaseLost if `owner` no longer holds it)."""
        job = self.get(job_id)
        if job.state not in LEASED_STATES:
            raise InvalidTransition(job_id, job.state, "released")
        attempts = job.attempts + 1
        if attempts > max_attempts:
            return self.fail(job_id, f"{reason}; retries exhausted ({attempts} > {max_attempts})", owner=owner)
        with self.store.fast(single_statement=True) as conn:
            row = self._transition(
                conn,
                job_id,
                LEASED_STATES[job.state],
                owner,
                sources=[job.state],
                values=dict(
                    state=LEASED_STATES[job.state], lease_owner=None, leased_at=None, attempts=attempts,
                    updated_at=utcnow(),
                ),
                permitted=lambda current: current == job.state,
            )  # fmt: skip
        self._changed()
        return TrainingJob.from_tuple(row)


# -- prebuilt statements (compiled once per dialect: each call is one DBAPI execute) ----------------
_SELECT_JOB = select(_JOBS).where(_JOBS.c.job_id == bindparam("b_job_id"))
_RESERVE_POLICY = Prepared(
    update(_POLICIES)
    .where(_POLICIES.c.policy_key == bindparam("key"))
    .values(reservations=_POLICIES.c.reservations + 1)
    .returning(
        _POLICIES.c.priority,
        _POLICIES.c.max_in_flight,
        _POLICIES.c.completion_target,
        _POLICIES.c.max_policy_staleness,
    )
)
_IN_FLIGHT = func.coalesce(func.sum(case((_JOBS.c.state.in_(NONTERMINAL_STATES), 1), else_=0)), 0)
_COUNT_IN_FLIGHT = Prepared(
    select(_IN_FLIGHT, literal(0)).where(_JOBS.c.policy_key == bindparam("key"), _JOBS.c.state.in_(NONTERMINAL_STATES))
)
_COUNT_IN_FLIGHT_COMPLETED = Prepared(
    select(_IN_FLIGHT, func.coalesce(func.sum(case((_JOBS.c.state == COMPLETED, 1), else_=0)), 0)).where(
        _JOBS.c.policy_key == bindparam("key"), _JOBS.c.state.in_((*NONTERMINAL_STATES, COMPLETED))
    )
)
# Every column named, so the compiled INSERT binds each one by its column name.
_INSERT_JOB = Prepared(insert(_JOBS).values({c.name: bindparam(c.name, type_=c.type) for c in _JOBS.c}))


def _insert_if_admitted() -> Prepared:
    """PostgreSQL's reserve INSERT: the job's row only if its policy admits it (in flight below
    max_in_flight and, under a completion target, completed + in flight below it), with the
    policy's priority and staleness bound and created_seq from its server sequence. Returns
    (created_seq, priority, max_policy_staleness), or no row when refused or the policy is absent."""
    policy = _POLICIES
    of_policy = _JOBS.c.policy_key == bindparam("policy_key")
    in_flight = select(func.count()).where(of_policy, _JOBS.c.state.in_(NONTERMINAL_STATES)).scalar_subquery()
    completed = select(func.count()).where(of_policy, _JOBS.c.state == COMPLETED).scalar_subquery()
    # CASE evaluates only the branch it takes: completed jobs are counted only under a target.
    under_target = case(
        (policy.c.completion_target.is_(None), true()), else_=in_flight + completed < policy.c.completion_target
    )
    from_policy = {"priority": policy.c.priority, "max_policy_staleness": policy.c.max_policy_staleness,
                   "created_seq": POSTGRES_SEQUENCES["created_seq"].next_value()}  # fmt: skip
    row = (
        select(*[from_policy.get(c.name, bindparam(c.name, type_=c.type)) for c in _JOBS.c])
        .select_from(policy)
        .where(policy.c.policy_key == bindparam("policy_key"), in_flight < policy.c.max_in_flight, under_target)
    )
    returned = (_JOBS.c.created_seq, _JOBS.c.priority, _JOBS.c.max_policy_staleness)
    return Prepared(insert(_JOBS).from_select([c.name for c in _JOBS.c], row).returning(*returned))


_INSERT_IF_ADMITTED = _insert_if_admitted()


def _new_job_values(
    key: str, tenant_id: str, task_type: str, sample_count: int, domain: str, metadata: dict[str, Any] | None,
    behavior_policy_version: int | None, producer_role: str, consumer_role: str,
) -> dict[str, Any]:  # fmt: skip
    """A new job's columns; created_seq, priority and max_policy_staleness come with the reservation."""
    job_id = uuid.uuid4().hex
    now = utcnow()
    return dict(
        job_id=job_id, policy_key=key, tenant_id=tenant_id, task_type=task_type,
        partition_id=partition_id_for(job_id, domain, tenant_id, task_type), sample_count=sample_count,
        domain=domain, metadata=dict(metadata or {}), priority=None, created_seq=None, ready_seq=None,
        behavior_policy_version=behavior_policy_version, max_policy_staleness=None,
        producer_role=producer_role, consumer_role=consumer_role, state=RESERVED, lease_owner=None, attempts=0,
        terminal_reason=None, result=None, created_at=now, updated_at=now, ready_at=None, leased_at=None,
        finished_at=None,
    )  # fmt: skip


_LOCK_JOB = Prepared(
    select(_JOBS.c.job_id, _JOBS.c.state, _JOBS.c.lease_owner)
    .where(_JOBS.c.job_id == bindparam("b_job_id"))
    .with_for_update()
)


@dataclass(frozen=True)
class _JobState:
    """What `_transition` reads of a job whose compare-and-set matched nothing."""

    job_id: str
    state: str
    lease_owner: str | None


_STATEMENTS: dict[tuple, Any] = {}


def _transition_statement(
    sources: tuple[str, ...] | None,
    named_owner: bool | None,
    columns: tuple[str, ...],
    ready_seq_from_sequence: bool = False,
) -> Prepared:
    """The compare-and-set UPDATE of `_transition`, per shape: from `sources` (None: any nonterminal
    state), with no owner check (None), an owner "" (lease_owner IS NULL) or a named owner. With
    `ready_seq_from_sequence` (PostgreSQL only) it also sets ready_seq to nextval of the `ready_seq`
    server sequence (no lock: a refused transition leaves a gap, which keeps the order)."""
    key = ("transition", sources, named_owner, columns, ready_seq_from_sequence)
    statement = _STATEMENTS.get(key)
    if statement is None:
        guard = [_JOBS.c.job_id == bindparam("b_job_id")]
        guard.append(_JOBS.c.state.not_in(TERMINAL_STATES) if sources is None else _JOBS.c.state.in_(sources))
        if named_owner is not None:
            guard.append(_JOBS.c.state.in_(list(LEASED_STATES)))
            guard.append(_JOBS.c.lease_owner == bindparam("owner") if named_owner else _JOBS.c.lease_owner.is_(None))
        values: dict[str, Any] = {name: bindparam(f"v_{name}") for name in columns}
        core = update(_JOBS).where(and_(*guard))
        if ready_seq_from_sequence:
            values["ready_seq"] = POSTGRES_SEQUENCES["ready_seq"].next_value()
        statement = _STATEMENTS[key] = Prepared(core.values(values).returning(*_JOBS.c))
    return statement


def _lease_statements(state: str, leased_state: str, order: tuple[str, ...], n_domains: int) -> tuple[Any, Any]:
    """(pick the head candidate, take it): the take is one UPDATE whose WHERE picks the head and
    repeats `state = <expected>` (the compare-and-set). `order`: column names, "-name" descending.
    The domains are binds `domain_0` .. `domain_<n-1>` (one statement per count of domains)."""
    key = ("lease", state, leased_state, order, n_domains)
    statements = _STATEMENTS.get(key)
    if statements is None:
        if n_domains < 1:
            raise SchedulerError("lease: domains must name at least one domain")
        head = _JOBS.alias("head")
        ordering = [head.c[name[1:]].desc() if name.startswith("-") else head.c[name].asc() for name in order]
        candidate = (
            select(head.c.job_id)
            .where(
                head.c.state == state,
                head.c.consumer_role == bindparam("b_consumer_role"),
                head.c.domain.in_([bindparam(f"domain_{i}") for i in range(n_domains)]),
            )
            .order_by(*ordering)
            .limit(1)
        )
        take = (
            update(_JOBS)
            .where(_JOBS.c.job_id == candidate.scalar_subquery(), _JOBS.c.state == state)
            .values(
                state=leased_state,
                lease_owner=bindparam("owner"),
                leased_at=bindparam("now"),
                updated_at=bindparam("now"),
            )
            .returning(*_JOBS.c)
        )
        statements = _STATEMENTS[key] = (Prepared(candidate), Prepared(take))
    return statements
