"""Tenant health marks and deletion: delete removes every row of one tenant in one transaction and
leaves the other tenants' rows untouched."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from joynexus.core.store import (
    ApiKeyRecord,
    Base,
    TenantQuotaRecord,
    TenantRecord,
    TrainingJobRecord,
    TrainingPolicyRecord,
    UsageRecord,
    WorkloadRecord,
)
from tests.master.test_spec_checks import creator_for, rl_spec

ROW_KINDS = (
    TenantRecord,
    TrainingPolicyRecord,
    TrainingJobRecord,
    WorkloadRecord,
    ApiKeyRecord,
    TenantQuotaRecord,
    UsageRecord,
)


def populate(store, creator, tenant_id: str) -> None:
    """A tenant with one row of every kind the control plane keeps about it."""
    creator.create(rl_spec(tenant_id))
    job = creator.scheduler.reserve(tenant_id=tenant_id, task_type="rl", sample_count=4)
    assert job is not None
    with store.transaction() as s:
        s.add(WorkloadRecord(workload_id=f"wl-{tenant_id}", tenant_id=tenant_id, task="rl", state="running"))
        s.add(ApiKeyRecord(key_id=f"k-{tenant_id}", tenant_id=tenant_id, role="tenant", key_sha256="0" * 64))
        s.add(TenantQuotaRecord(tenant_id=tenant_id, max_device_seconds=10.0))
        s.add(UsageRecord(tenant_id=tenant_id, category="training", operation="train_batch", samples=4))


def counts(store, tenant_id: str) -> dict[str, int]:
    """Rows of `tenant_id` in every table that has a tenant_id column."""
    out = {}
    with store.transaction() as s:
        for table in Base.metadata.sorted_tables:
            if "tenant_id" in table.c:
                out[table.name] = s.scalar(
                    select(func.count()).select_from(table).where(table.c.tenant_id == tenant_id)
                )
    return out


def test_delete_removes_every_row_of_the_tenant_and_only_its_rows(store):
    creator = creator_for(store)
    populate(store, creator, "doomed")
    populate(store, creator, "kept")
    with store.transaction() as s:  # an admin key belongs to no tenant and must survive
        s.add(ApiKeyRecord(key_id="admin", tenant_id=None, role="admin", key_sha256="1" * 64))
    before = counts(store, "doomed")
    assert all(before[kind.__tablename__] >= 1 for kind in ROW_KINDS), before
    kept = counts(store, "kept")

    creator.delete("doomed")

    assert set(counts(store, "doomed").values()) == {0}
    assert counts(store, "kept") == kept
    assert [t.tenant_id for t in creator.list()] == ["kept"]
    with store.transaction() as s:
        assert s.get(ApiKeyRecord, "admin") is not None
    with pytest.raises(KeyError, match="no tenant"):
        creator.get("doomed")
    # The id is free again: a new tenant under it starts with no leftovers.
    creator.create(rl_spec("doomed"))
    assert counts(store, "doomed")["training_jobs"] == 0


def test_deleting_a_missing_tenant_raises_key_error(store):
    creator = creator_for(store)
    with pytest.raises(KeyError, match="no tenant 'ghost'"):
        creator.delete("ghost")
    creator.create(rl_spec("once"))
    creator.delete("once")
    with pytest.raises(KeyError, match="no tenant 'once'"):
        creator.delete("once")


def test_mark_unhealthy_and_healthy_round_trip(store):
    creator = creator_for(store)
    created = creator.create(rl_spec("fragile"))
    creator.create(rl_spec("steady"))
    assert (created.status, created.status_reason) == ("active", None)

    creator.mark_unhealthy("fragile", "slot build failed: Overflow when unpacking long long")
    tenant = creator.get("fragile")
    assert tenant.status == "unhealthy"
    assert tenant.status_reason == "slot build failed: Overflow when unpacking long long"
    assert {t.tenant_id: t.status for t in creator.list()} == {"fragile": "unhealthy", "steady": "active"}

    creator.mark_healthy("fragile")
    assert (creator.get("fragile").status, creator.get("fragile").status_reason) == ("active", None)
    for mark in (lambda: creator.mark_unhealthy("ghost", "x"), lambda: creator.mark_healthy("ghost")):
        with pytest.raises(KeyError, match="no tenant"):
            mark()
