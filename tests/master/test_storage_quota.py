"""Storage quota: a tenant whose checkpoints take its `max_storage_bytes` gets no new work admitted,
until the quota is raised; registered versions are pinned against checkpoint retention."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch

from joynexus.artifacts import CheckpointStore
from joynexus.core.store import ControlPlaneStore
from joynexus.master.usage import SpendCapReached, StorageQuotaReached, UsageLedger
from joynexus.protocol.schemas import Quota, QuotaUpdate
from tests.helpers import sft_spec, write_dataset_for


def _save(store: CheckpointStore, tenant: str, version: int) -> None:
    store.save_tenant(
        tenant_id=tenant,
        policy_version=version,
        schema_signature="sig",
        base_model_id="base",
        module_kind="linear",
        module_config={"in_features": 16, "out_features": 8},
        module_state=torch.nn.Linear(16, 8).state_dict(),
        optimizer_state=None,
    )


def test_storage_quota_refuses_admission_until_raised(store: ControlPlaneStore, tmp_path: Path) -> None:
    checkpoints = CheckpointStore(tmp_path / "ckpt")
    _save(checkpoints, "acme", 1)
    used = checkpoints.tenant_bytes("acme")
    ledger = UsageLedger(store, checkpoints=checkpoints, default_max_storage_bytes=used)

    with pytest.raises(StorageQuotaReached) as refused:  # the default quota, reached exactly
        ledger.check_spend("acme")
    assert isinstance(refused.value, SpendCapReached)  # so every spend-cap handler refuses it too
    message = str(refused.value)
    assert "quota.max_storage_bytes" in message and f"{used:,} bytes" in message and "'acme'" in message
    ledger.check_spend("acme", storage=False)  # calls that write no checkpoint are not storage-bound
    ledger.check_spend("other")  # another tenant stores nothing

    ledger.set_max_storage_bytes("acme", used + 1)  # raised for this tenant only
    assert ledger.max_storage_bytes("acme") == used + 1
    ledger.check_spend("acme")
    _save(checkpoints, "acme", 2)  # more checkpoints: over the raised quota again
    with pytest.raises(StorageQuotaReached, match=r"quota\.max_storage_bytes"):
        ledger.check_spend("acme")

    ledger.set_max_storage_bytes("acme", None)  # back to the server default
    assert ledger.max_storage_bytes("acme") == used
    with pytest.raises(ValueError, match="max_storage_bytes"):
        ledger.set_max_storage_bytes("acme", -1)
    assert UsageLedger(store, checkpoints=checkpoints).max_storage_bytes("acme") is None  # unlimited default


def test_quota_updates_keep_or_set_the_storage_quota(store: ControlPlaneStore, tmp_path: Path) -> None:
    ledger = UsageLedger(store, checkpoints=CheckpointStore(tmp_path / "ckpt"), default_max_storage_bytes=10)
    ledger.set_max_storage_bytes("acme", 1000)
    if "max_storage_bytes" in QuotaUpdate.model_fields:  # the API can name it: it is set like the others
        quota = ledger.set_quota("acme", QuotaUpdate(max_device_seconds=5.0, max_storage_bytes=2000))
        assert (ledger.max_storage_bytes("acme"), quota.max_storage_bytes) == (2000, 2000)
    else:  # an update that cannot name it leaves it as it was
        quota = ledger.set_quota("acme", QuotaUpdate(max_device_seconds=5.0))
        assert ledger.max_storage_bytes("acme") == 1000
    assert quota.max_device_seconds == 5.0
    if "max_storage_bytes" in Quota.model_fields:
        assert ledger.quota("other").max_storage_bytes == 10


def test_an_older_database_gains_the_storage_quota_column(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:  # tenant_quotas as it was before max_storage_bytes
        conn.execute(
            "CREATE TABLE tenant_quotas (tenant_id VARCHAR(64) PRIMARY KEY, max_device_seconds FLOAT, "
            "max_queued_workloads INTEGER, updated_at DATETIME)"
        )
        conn.execute("INSERT INTO tenant_quotas VALUES ('acme', 3.0, 2, '2026-01-01 00:00:00')")
    store = ControlPlaneStore(f"sqlite:///{path}")
    try:
        ledger = UsageLedger(store, default_max_storage_bytes=7)
        assert ledger.max_storage_bytes("acme") == 7 and ledger.quota("acme").max_device_seconds == 3.0
        ledger.set_max_storage_bytes("acme", 5 * 2**40)  # more than 32 bits
        assert ledger.max_storage_bytes("acme") == 5 * 2**40
    finally:
        store.dispose()


def test_the_master_refuses_workloads_over_the_storage_quota_and_pins_what_it_registers(tmp_path: Path) -> None:
    from joynexus.master.deployment import Deployment
    from joynexus.master.service import MasterService
    from joynexus.master.workloads.manager import AdmissionRefused
    from joynexus.settings import Settings

    spec = sft_spec("alpha", tmp_path / "dataset", jobs=1)
    write_dataset_for(spec)
    settings = Settings(data_dir=tmp_path / "data", torch_threads=1, checkpoint_keep_last=1)
    master = MasterService(deployment=Deployment.in_process(settings))
    try:
        master.deployment.creator.create(spec)
        first = master.workloads.wait(master.submit_workload("alpha", jobs=1).workload_id, 120)
        assert first.state == "completed" and first.registered_version == 1
        checkpoints = master.deployment.checkpoints
        # Registered, so pinned on the shared root: the service's keep_last=1 never prunes it.
        assert checkpoints.pinned("alpha") == {first.version} and checkpoints.versions("alpha") == [first.version]

        used = master.ledger.storage_bytes("alpha")
        assert used > 0
        master.ledger.set_max_storage_bytes("alpha", used)
        with pytest.raises(AdmissionRefused, match=r"quota\.max_storage_bytes") as refused:
            master.submit_workload("alpha", jobs=1)
        assert f"{used:,} bytes" in str(refused.value)
        assert [w.workload_id for w in master.workloads.list()] == [first.workload_id]  # nothing queued

        master.ledger.set_max_storage_bytes("alpha", used * 10)
        second = master.workloads.wait(master.submit_workload("alpha", jobs=1).workload_id, 120)
        assert second.state == "completed" and second.version > first.version
        assert checkpoints.pinned("alpha") == {first.version, second.version}
        assert checkpoints.versions("alpha") == [first.version, second.version]
    finally:
        master.close()
