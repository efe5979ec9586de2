"""The store's hot path: `Prepared` statements on `ControlPlaneStore.fast()` (types both ways, errors
as SQLAlchemy's, rollback) and the idle-connection ping that replaced `pool_pre_ping`."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import NullPool, bindparam, create_engine, insert, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError

from joynexus.core import store as store_module
from joynexus.core.store import Prepared, SequenceRecord, TrainingJobRecord
from joynexus.scheduling.training_scheduler import LEASED, READY, TrainingScheduler

_SEQUENCES = SequenceRecord.__table__
_ADD_SEQUENCE = Prepared(insert(_SEQUENCES).values(name=bindparam("name"), value=bindparam("value")))
_SEQUENCE_VALUE = Prepared(select(_SEQUENCES.c.value).where(_SEQUENCES.c.name == bindparam("name")))


def test_fast_path_round_trips_json_and_datetimes_like_the_orm(store):
    sched = TrainingScheduler(store)
    sched.register_policy("t1", "sft", max_in_flight=2)
    job = sched.reserve(tenant_id="t1", task_type="sft", sample_count=3, metadata={"schema_signature": "s", "n": [1]})
    assert job is not None
    ready = sched.mark(job.job_id, READY)
    leased = sched.lease_next(owner="actor")
    assert leased is not None and leased.job_id == job.job_id and leased.state == LEASED
    assert leased.metadata == {"schema_signature": "s", "n": [1]} and leased.ready_seq == ready.ready_seq
    done = sched.complete(job.job_id, {"loss": 0.5, "steps": [1, 2]}, owner="actor")
    with store.read() as s:  # what the ORM reads back is what the fast path wrote
        record = s.get(TrainingJobRecord, job.job_id)
        assert record.job_metadata == {"schema_signature": "s", "n": [1]}
        assert record.result == done.result == {"loss": 0.5, "steps": [1, 2]}
        assert record.created_seq == job.created_seq and record.ready_seq == ready.ready_seq
        moments = [record.created_at, record.ready_at, record.leased_at, record.finished_at]
        assert all(isinstance(moment, dt.datetime) for moment in moments)
        naive = [moment.replace(tzinfo=None) for moment in moments]  # SQLite stores them without a zone
        assert naive == sorted(naive)


def test_fast_path_errors_are_sqlalchemy_errors_and_roll_back(store):
    with pytest.raises(IntegrityError):
        with store.fast() as conn:
            conn.execute(_ADD_SEQUENCE, {"name": "written-then-rolled-back", "value": 7})
            conn.execute(_ADD_SEQUENCE, {"name": "created_seq", "value": 1})  # exists: unique violation
    with store.fast() as conn:
        assert conn.first(_SEQUENCE_VALUE, {"name": "written-then-rolled-back"}) is None
        conn.execute(_ADD_SEQUENCE, {"name": "committed", "value": 9})
    with store.fast(single_statement=True) as conn:
        assert conn.first(_SEQUENCE_VALUE, {"name": "committed"}) == (9,)


def _kill_other_connections(url: str) -> int:
    """Terminate every other server connection to this database, as a server restart would."""
    admin = create_engine(url, poolclass=NullPool)
    try:
        with admin.connect() as conn:
            killed = conn.execute(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
    finally:
        admin.dispose()
    return killed


@pytest.mark.postgres
def test_idle_pooled_connection_killed_by_the_server_is_replaced_at_checkout(store_url, monkeypatch):
    if not store_url.startswith("postgresql"):
        pytest.skip("the server closes connections only on PostgreSQL")
    from joynexus.core.store import ControlPlaneStore

    store = ControlPlaneStore(store_url)
    try:
        sched = TrainingScheduler(store)
        sched.register_policy("t1", "sft", max_in_flight=10)
        assert sched.reserve(tenant_id="t1", task_type="sft", sample_count=1) is not None

        # Without the idle ping, the dead pooled connection fails the next call, which invalidates it.
        monkeypatch.setattr(store_module, "PING_IDLE_AFTER_S", 3600.0)
        assert _kill_other_connections(store_url) >= 1
        with pytest.raises(DBAPIError) as failure:
            sched.reserve(tenant_id="t1", task_type="sft", sample_count=1)
        assert failure.value.connection_invalidated
        assert sched.reserve(tenant_id="t1", task_type="sft", sample_count=1) is not None  # a fresh connection

        # With it (any idle time counts here), checkout pings, finds the connection gone and replaces it.
        monkeypatch.setattr(store_module, "PING_IDLE_AFTER_S", 0.0)
        assert _kill_other_connections(store_url) >= 1
        assert sched.reserve(tenant_id="t1", task_type="sft", sample_count=1) is not None
        assert len(sched.jobs()) == 3
    finally:
        store.dispose()


@pytest.mark.postgres
def test_postgres_counters_continue_after_the_numbers_an_older_store_drew(store_url):
    # A database made before the server sequences: its counters are rows of `sequences` (and the
    # numbers its jobs hold). Opening it creates the sequences past both, so FIFO order survives.
    if not store_url.startswith("postgresql"):
        pytest.skip("the counters are server sequences only on PostgreSQL")
    from joynexus.core.store import POSTGRES_SEQUENCES, ControlPlaneStore

    store = ControlPlaneStore(store_url)
    sched = TrainingScheduler(store)
    sched.register_policy("t1", "sft", max_in_flight=10)
    old = sched.mark(sched.reserve(tenant_id="t1", task_type="sft", sample_count=1).job_id, READY)
    with store.connection() as conn:  # back to the older schema, its counters moved on meanwhile
        for sequence in POSTGRES_SEQUENCES.values():
            conn.execute(text(f"DROP SEQUENCE {sequence.name}"))
        conn.execute(text("UPDATE sequences SET value = 41 WHERE name = 'created_seq'"))
    store.dispose()

    store = ControlPlaneStore(store_url)
    try:
        sched = TrainingScheduler(store)
        new = sched.mark(sched.reserve(tenant_id="t1", task_type="sft", sample_count=1).job_id, READY)
        assert new.created_seq == 42  # after the sequences row
        assert new.ready_seq == old.ready_seq + 1  # after the highest number a job holds
        assert [job.job_id for job in sched.jobs()] == [old.job_id, new.job_id]
        assert sched.lease_next(owner="a").job_id == old.job_id  # FIFO across the upgrade
        ControlPlaneStore(store_url).dispose()  # opening it again leaves the sequences as they are
        assert sched.reserve(tenant_id="t1", task_type="sft", sample_count=1).created_seq == 43
    finally:
        store.dispose()


@pytest.mark.postgres
def test_concurrent_reservations_draw_distinct_increasing_numbers(store_url):
    import threading

    from joynexus.core.store import ControlPlaneStore

    store = ControlPlaneStore(store_url)
    try:
        sched = TrainingScheduler(store)
        for i in range(4):
            sched.register_policy(f"t{i}", "sft", max_in_flight=100)
        drawn: list[tuple[int, int]] = []

        def produce(tenant: str) -> None:
            for _ in range(20):
                job = sched.reserve(tenant_id=tenant, task_type="sft", sample_count=1)
                drawn.append((job.created_seq, sched.mark(job.job_id, READY).ready_seq))

        threads = [threading.Thread(target=produce, args=(f"t{i}",)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        created, ready = zip(*drawn, strict=True)
        assert len(set(created)) == len(set(ready)) == 80
        leased = [sched.lease_next(owner="a").ready_seq for _ in range(80)]
        assert leased == sorted(ready)  # FIFO by ready_seq
    finally:
        store.dispose()
