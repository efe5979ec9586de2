"""Datasets by reference and by upload through the API (issue 24.2): an admin creates a tenant
whose dataset is an S3 prefix (moto), which the Master fetches into its cache and pins by sha256;
a tenant uploads a LeRobot dataset (tar or zip), validated against its interface before it is
kept, listed only for that tenant, refused when it escapes its folder or passes the quota."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from tests.helpers import sft_spec, write_dataset_for


@mock_aws
def test_admin_creates_a_tenant_from_an_s3_dataset_pinned_by_its_checksum(api, tmp_path):
    local = sft_spec("s3-src", tmp_path / "pick", state_dim=4, action_dim=3, action_chunk=2)
    write_dataset_for(local, episodes=2, length=8)
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket="team-data")
    root = Path(local["dataset"]["root"])
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        client.upload_file(str(file), "team-data", f"pick/{file.relative_to(root).as_posix()}")
    spec = api.spec("s3ds", "arm")
    spec["observation"]["cameras"] = ["front"]  # the synthetic dataset above has one camera
    spec["observation"]["image_size"] = [32, 32]
    spec["dataset"] = {"uri": "s3://team-data/pick", "repo_id": "test/pick"}
    r = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert r.status_code == 201, r.text
    dataset = api.cluster.master.get_tenant(spec["tenant"]).spec.dataset
    assert dataset.uri == "s3://team-data/pick" and len(dataset.sha256) == 64
    assert Path(dataset.root).name == dataset.sha256 and (Path(dataset.root) / "meta" / "info.json").is_file()
    missing = {**spec, "tenant": spec["tenant"] + "-x", "dataset": {"uri": "s3://team-data/none", "repo_id": "a/b"}}
    r = api.client.post("/v1/admin/tenants", json=missing, headers=api.admin)
    assert r.status_code == 422 and "dataset.uri" in r.text and "no objects under" in r.text


@pytest.fixture(scope="module")
def arm_dataset(tmp_path_factory) -> Path:
    """A dataset of the "arm" interface (tests/api/conftest.py SHAPES)."""
    from tests.api.conftest import SHAPES

    spec = sft_spec("upload-src", tmp_path_factory.mktemp("upload") / "arm", **SHAPES["arm"])
    write_dataset_for(spec, episodes=2, length=6)
    return Path(spec["dataset"]["root"])


def _tar(root: Path, *, gz: bool = True, extra: dict[str, bytes] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gz else "w") as tar:
        tar.add(root, arcname="arm")
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _zip(root: Path) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            archive.write(file, file.relative_to(root).as_posix())
    return buffer.getvalue()


def _upload(api, tenant, body: bytes):
    return api.client.post("/v1/datasets?repo_id=team/arm", content=body, headers=tenant.headers)


def test_a_tenant_uploads_a_dataset_that_only_it_sees(api, arm_dataset):
    mine, other = api.tenant("up"), api.tenant("up-other")
    first = _upload(api, mine, _tar(arm_dataset, gz=False))  # gzip stamps a time: plain tar is byte-stable
    assert first.status_code == 201, first.text
    zipped = _upload(api, mine, _zip(arm_dataset))
    assert zipped.status_code == 201, zipped.text
    again = _upload(api, mine, _tar(arm_dataset, gz=False))  # the same archive is the same dataset
    assert again.json()["dataset_id"] == first.json()["dataset_id"]
    listed = api.client.get("/v1/datasets", headers=mine.headers).json()
    assert sorted(d["dataset_id"] for d in listed) == sorted({first.json()["dataset_id"], zipped.json()["dataset_id"]})
    assert all(d["bytes"] > 0 for d in listed)
    assert api.client.get("/v1/datasets", headers=other.headers).json() == []


def test_uploads_are_refused_when_unsafe_invalid_or_over_quota(api, arm_dataset, tmp_path):
    tenant = api.tenant("up-bad")
    escape = _upload(api, tenant, _tar(arm_dataset, extra={"../../escaped.txt": b"x"}))
    assert escape.status_code == 422 and "is not a relative path inside the archive" in escape.text
    assert not any(api.data_dir.rglob("escaped.txt"))
    assert _upload(api, tenant, b"not an archive").status_code == 422
    flow = api.tenant("up-flow", "flow")  # its interface (one camera, 6-D state) is not the dataset's
    mismatch = _upload(api, flow, _tar(arm_dataset))
    assert mismatch.status_code == 422, mismatch.text
    assert api.client.get("/v1/datasets", headers=flow.headers).json() == []  # nothing kept
    quota = api.client.put(
        f"/v1/admin/tenants/{tenant.tenant_id}/quota", json={"max_storage_bytes": 1024}, headers=api.admin
    )
    assert quota.status_code == 200, quota.text
    over = _upload(api, tenant, _tar(arm_dataset))
    assert over.status_code == 429 and "quota.max_storage_bytes" in over.text
    assert api.client.get("/v1/datasets", headers=tenant.headers).json() == []
