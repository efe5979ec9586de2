"""Uploads shared through the artifact store (issue 43.3): an upload stored by one API replica is
found by the Master (and any other replica) on another disk, through the tenant's own prefix
s3://<bucket>/datasets/<tenant>/uploads/ (boto3 against moto); a copy that does not match its record
is refused; deleting it through any replica removes it for every process."""

from __future__ import annotations

import boto3
import pytest
from moto import mock_aws

from joynexus.data.shared_uploads import (
    delete_shared_upload,
    fetch_shared_upload,
    publish_upload,
    shared_upload_records,
    upload_store,
)
from joynexus.data.sources import resolve_dataset
from joynexus.data.uploads import find_tenant_dataset, store_uploaded_dataset
from joynexus.data.validation import DatasetExpectation
from joynexus.settings import Settings
from joynexus.spec import DatasetSpec, SpecError
from tests.helpers import sft_spec, tar_dataset, write_dataset_for

BUCKET = "joynexus-artifacts-test"


@pytest.fixture
def archive(tmp_path):
    spec = sft_spec("src", tmp_path / "src" / "pick")
    write_dataset_for(spec, episodes=2, length=6)
    return tar_dataset(tmp_path / "src" / "pick", gz=False), spec


@pytest.fixture
def bucket(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


def _settings(tmp_path, name: str) -> Settings:
    return Settings(data_dir=tmp_path / name, s3_bucket=BUCKET)


def _expectation(spec: dict) -> DatasetExpectation:
    obs = spec["observation"]
    return DatasetExpectation(
        cameras=tuple(obs["cameras"]), image_size=tuple(obs["image_size"]),
        state_dim=obs["state_dim"], action_dim=obs["action_dim"],
    )  # fmt: skip


def _upload_through(settings: Settings, data: bytes, spec: dict, tenant: str = "acme"):
    stored = store_uploaded_dataset(
        data, tenant_id=tenant, repo_id="acme/pick", datasets_dir=settings.data_dir / "datasets",
        expectation=_expectation(spec), max_unpacked_bytes=1 << 30,
    )  # fmt: skip
    store = upload_store(settings)
    publish_upload(store, tenant, stored)
    return stored, store


def test_an_upload_through_one_replica_is_found_by_the_master_on_another_disk(tmp_path, bucket, archive):
    data, spec = archive
    api_a, master = _settings(tmp_path, "api-a"), _settings(tmp_path, "master")
    stored, store = _upload_through(api_a, data, spec)
    keys = [o["Key"] for o in bucket.list_objects_v2(Bucket=BUCKET)["Contents"]]
    assert keys and all(k.startswith(f"datasets/acme/uploads/{stored.sha256}") for k in keys)  # the tenant's prefix
    assert f"datasets/acme/uploads/{stored.sha256}.json" in keys
    assert find_tenant_dataset(master.data_dir / "datasets", "acme", stored.sha256) is None  # not on its disk
    resolved = resolve_dataset(DatasetSpec(id=stored.sha256, repo_id="acme/pick"), "acme", master)
    assert resolved.sha256 == stored.sha256
    assert resolved.root.startswith(str(master.data_dir))  # fetched onto the Master's own disk
    local = find_tenant_dataset(master.data_dir / "datasets", "acme", stored.sha256)
    assert local is not None and local.nbytes == stored.nbytes and local.repo_id == "acme/pick"
    # another tenant's id lookup never reaches this tenant's prefix
    with pytest.raises(SpecError):
        resolve_dataset(DatasetSpec(id=stored.sha256, repo_id="acme/pick"), "other", master)
    assert set(shared_upload_records(store, "acme")) == {stored.sha256} and shared_upload_records(store, "other") == {}
    publish_upload(store, "acme", stored)  # idempotent: the record is there


def test_a_shared_copy_that_does_not_match_its_record_is_refused(tmp_path, bucket, archive):
    data, spec = archive
    stored, store = _upload_through(_settings(tmp_path, "api-a"), data, spec)
    key = next(o["Key"] for o in bucket.list_objects_v2(Bucket=BUCKET)["Contents"] if o["Key"].endswith("info.json"))
    bucket.put_object(Bucket=BUCKET, Key=key, Body=b'{"tampered": true}')
    master = _settings(tmp_path, "master")
    with pytest.raises(OSError, match="does not match its record"):
        fetch_shared_upload(store, master.data_dir / "datasets", "acme", stored.sha256)
    assert find_tenant_dataset(master.data_dir / "datasets", "acme", stored.sha256) is None


def test_deleting_through_any_replica_removes_it_for_every_process(tmp_path, bucket, archive):
    data, spec = archive
    stored, store = _upload_through(_settings(tmp_path, "api-a"), data, spec)
    assert delete_shared_upload(store, "acme", stored.sha256)
    assert bucket.list_objects_v2(Bucket=BUCKET).get("KeyCount", 0) == 0
    assert not delete_shared_upload(store, "acme", stored.sha256)
    with pytest.raises(SpecError, match="no uploaded dataset"):
        resolve_dataset(DatasetSpec(id=stored.sha256, repo_id="acme/pick"), "acme", _settings(tmp_path, "master"))


def test_without_a_bucket_nothing_is_shared(tmp_path):
    assert upload_store(Settings(data_dir=tmp_path, s3_bucket=None)) is None
