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
