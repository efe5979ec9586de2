"""Checkpoint retention (keep the last K + pinned + LATEST) and the one-listing version index."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from joynexus.artifacts import (
    MANIFEST_FILE,
    CheckpointError,
    CheckpointStore,
    LocalBlobStore,
    VersionInfo,
    export_manifest,
)
from tests.test_s3 import bucket, s3_endpoint  # noqa: F401  (fixtures: a moto S3 server and a bucket)


class CountingBlobStore(LocalBlobStore):
    """The real local store, counting the calls that touch storage (listings, reads, probes)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def list_sizes(self, prefix: str) -> dict[str, int]:
        self._count("list_sizes")
        return super().list_sizes(prefix)

    def list_dir(self, prefix: str) -> list[str]:
        self._count("list_dir")
        return super().list_dir(prefix)

    def total_bytes(self, prefix: str) -> int:
        self._count("total_bytes")
        return super().total_bytes(prefix)

    def exists(self, key: str) -> bool:
        self._count("exists")
        return super().exists(key)

    def read(self, key: str) -> bytes:
        self._count("read")
        return super().read(key)


def _save(store: CheckpointStore, version: int, tenant: str = "acme") -> None:
    torch.manual_seed(version)
    model = torch.nn.Linear(16, 8)
    store.save_tenant(
        tenant_id=tenant,
        policy_version=version,
        schema_signature="sig",
        base_model_id="base",
        module_kind="linear",
        module_config={"in_features": 16, "out_features": 8},
        module_state=model.state_dict(),
        optimizer_state=None,
    )


def _folders(root: Path, tenant: str = "acme") -> list[str]:
    return sorted(p.name for p in (root / "tenants" / tenant).iterdir() if p.is_dir())


def test_keeps_the_last_k_plus_versions_pinned_by_another_instance(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    master = CheckpointStore(root)  # the Master's store pins; the Training Model Service's prunes
    trainer = CheckpointStore(root, keep_last=2)
    _save(trainer, 1)
    master.pin("acme", 1)  # registered as soon as it was saved, like a workload's publication
    master.pin("acme", 1)  # idempotent
    _save(trainer, 2)
    _save(trainer, 3)
    trainer.record_issued_version("acme", 9)
    assert trainer.pinned("acme") == {1}
    sizes = {v: trainer.version_bytes("acme", v) for v in (1, 2, 3)}
    before = trainer.tenant_bytes("acme")
    assert trainer.versions("acme") == [1, 2, 3]  # v1 pinned, v2 v3 are the last 2

    _save(trainer, 4)
    _save(trainer, 5)

    assert trainer.versions("acme") == master.versions("acme") == [1, 4, 5]
    assert _folders(root) == ["v000001", "v000004", "v000005"]  # pruned folders wholly gone, no leftovers
    after = trainer.tenant_bytes("acme")
    added = trainer.version_bytes("acme", 4) + trainer.version_bytes("acme", 5)
    assert after == before - sizes[2] - sizes[3] + added
    assert (trainer.latest_version("acme"), trainer.issued_version("acme")) == (5, 9)  # pointers untouched
    assert trainer.load_tenant("acme", 1)[0].policy_version == 1  # the pinned version still loads

    # A restarted service (a fresh instance) sees the durable pin and keeps pruning by it.
    restarted = CheckpointStore(root, keep_last=2)
    assert restarted.pinned("acme") == {1}
    _save(restarted, 6)
    assert restarted.versions("acme") == [1, 5, 6] and restarted.latest_version("acme") == 6


def test_the_latest_pointer_version_is_kept_even_outside_the_last_k(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    trainer = CheckpointStore(root, keep_last=1)
    _save(trainer, 5)
    # v6 was published but its save died before LATEST moved: LATEST still names v5.
    _save(CheckpointStore(root), 6)
    trainer.blobs.put_atomic("tenants/acme/LATEST", b"5\n")
    assert trainer.prune("acme") == []
    assert trainer.versions("acme") == [5, 6]
    _save(trainer, 7)
    assert trainer.versions("acme") == [7] and trainer.latest_version("acme") == 7


def test_keep_all_by_default_and_bad_keep_last_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    for version in range(4):
        _save(store, version)
    assert store.versions("acme") == [0, 1, 2, 3] and store.prune("acme") == []
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="keep_last"):
            CheckpointStore(tmp_path / "ckpt", keep_last=bad)


def test_an_unreadable_pin_file_stops_pruning_but_not_the_save(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    trainer = CheckpointStore(root, keep_last=1)
    _save(trainer, 1)
    trainer.blobs.put_atomic("tenants/acme/PINS", b"{not json")
    with pytest.raises(CheckpointError, match="PINS"):
        trainer.pinned("acme")
    _save(trainer, 2)  # saved; pruning refused to guess which versions are registered
    assert trainer.versions("acme") == [1, 2] and trainer.latest_version("acme") == 2
    trainer.delete_tenant("acme")  # the pins go with the tenant
    assert not (root / "tenants" / "acme").exists()


def test_version_infos_pages_from_one_listing(tmp_path: Path) -> None:
    blobs = CountingBlobStore(tmp_path / "ckpt")
    store = CheckpointStore(blobs)
    for version in (0, 1, 2, 3, 4):
        _save(store, version)
    (tmp_path / "ckpt" / "tenants" / "acme" / "v000009").mkdir()  # no manifest: not a version

    blobs.calls.clear()
    page = store.version_infos("acme", limit=2)
    assert [i.version for i in page] == [0, 1]  # the default includes version 0
    assert blobs.calls == {"list_sizes": 1, "read": 2}  # one listing + one manifest per version

    for info in page:
        manifest = store.read_manifest("acme", info.version)
        assert info == VersionInfo(
            info.version,
            manifest.created_at,
            manifest.digest,
            info.size_bytes,
            export_digest=export_manifest(manifest).digest,
        )
        assert info.size_bytes == store.version_bytes("acme", info.version) > 0

    blobs.calls.clear()
    assert [i.version for i in store.version_infos("acme", after=page[-1].version, limit=2)] == [2, 3]
    assert [i.version for i in store.version_infos("acme", after=3)] == [4]
    assert store.version_infos("acme", after=4) == [] and store.version_infos("acme", limit=0) == []
    assert blobs.calls["list_sizes"] == 4 and blobs.calls["read"] == 3
    assert store.version_infos("nobody") == []
    with pytest.raises(ValueError, match="limit"):
        store.version_infos("acme", limit=-1)

    blobs.calls.clear()
    assert store.versions("acme") == [0, 1, 2, 3, 4]
    assert blobs.calls == {"list_sizes": 1}  # no probe per version


def test_a_version_whose_manifest_is_gone_is_not_listed(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    store = CheckpointStore(root)
    _save(store, 1)
    _save(store, 2)
    (root / "tenants" / "acme" / "v000001" / MANIFEST_FILE).unlink()  # what pruning removes first
    assert store.versions("acme") == [2]
    assert [i.version for i in store.version_infos("acme")] == [2]


def test_retention_and_version_infos_on_s3(s3_endpoint, bucket) -> None:  # noqa: F811
    from joynexus.artifacts.s3 import S3BlobStore

    trainer = CheckpointStore(S3BlobStore(bucket, "ckpt", endpoint_url=s3_endpoint), keep_last=1)
    master = CheckpointStore(S3BlobStore(bucket, "ckpt", endpoint_url=s3_endpoint))  # a second instance
    _save(trainer, 1)
    master.pin("acme", 1)
    for version in (2, 3):
        _save(trainer, version)
    assert trainer.versions("acme") == [1, 3] and trainer.latest_version("acme") == 3
    keys = trainer.blobs.list_sizes("tenants/acme")
    assert not [k for k in keys if k.startswith("v000002/")]  # every object of the pruned version went
    infos = master.version_infos("acme")
    assert [(i.version, i.size_bytes) for i in infos] == [(v, master.version_bytes("acme", v)) for v in (1, 3)]
    assert master.tenant_bytes("acme") == sum(keys.values())
