"""The admission check every predict runs reads quotas and usage without taking the store's write
lock (issue 17): on SQLite a `BEGIN IMMEDIATE` per predict queued concurrent requests behind each
other and behind every writer (the usage meter's flushes, the Master), a tail of tens of ms."""

from __future__ import annotations

import threading

from sqlalchemy import text

from joynexus.core.store import ControlPlaneStore
from joynexus.master.usage import UsageLedger
from joynexus.protocol.schemas import QuotaUpdate


def test_admission_reads_do_not_wait_for_a_writer(store: ControlPlaneStore) -> None:
    ledger = UsageLedger(store)
    ledger.set_quota("acme", QuotaUpdate(max_device_seconds=100.0, max_queued_workloads=3))
    holding, release = threading.Event(), threading.Event()

    def writer() -> None:  # holds a write transaction (SQLite: the database's write lock) open
        with store.transaction() as session:
            session.execute(text("UPDATE tenant_quotas SET max_queued_workloads = 3 WHERE tenant_id = 'acme'"))
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        assert holding.wait(10)
        answers: list[object] = []
        reader = threading.Thread(
            target=lambda: answers.append((ledger.quota("acme"), ledger.check_spend("acme", storage=False))),
            daemon=True,
        )
        reader.start()
        reader.join(10)  # a write transaction here would wait for the writer (busy timeout: 60 s)
        assert not reader.is_alive(), "the admission check waited for another transaction's write lock"
        quota, _ = answers[0]
        assert quota.max_device_seconds == 100.0 and quota.max_queued_workloads == 3
    finally:
        release.set()
        thread.join(10)
