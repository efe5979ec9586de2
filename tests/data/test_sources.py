"""Dataset sources (issue 24.2): admin paths only under JOYNEXUS_DATASET_ROOTS, with one answer for
missing and disallowed paths; `dataset.uri: s3://...` fetched (boto3 against moto) into a
content-addressed cache with its manifest, pinned by `dataset.sha256`; `dataset.id`: one of the
spec's tenant's uploads. Every resolved spec records the content digest."""

from __future__ import annotations

import json
import os
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from joynexus.data.lerobot_dataset import inspect_dataset
from joynexus.data.sources import (
    DATASET_MANIFEST_FILE,
    DatasetSourceError,
    check_dataset_root,
    content_digest,
    fetch_s3_dataset,
    parse_dataset_roots,
    resolve_dataset_source,
)
from joynexus.settings import Settings
from joynexus.spec import SpecError, parse_workload_spec
from tests.helpers import sft_spec, tar_dataset, write_dataset_for

BUCKET = "robot-data"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    spec = sft_spec("src", tmp_path_factory.mktemp("ds") / "pick")
    return write_dataset_for(spec, episodes=2, length=6) and Path(spec["dataset"]["root"])


def _refusal(root: str, allowed: list[Path]) -> str:
    with pytest.raises(DatasetSourceError) as caught:
        check_dataset_root(root, allowed)
    assert caught.value.field == "dataset.root"
    return caught.value.reason.replace(repr(root), "<root>")


def test_admin_paths_only_under_allowed_roots_and_refusals_look_alike(dataset, tmp_path):
    allowed = [dataset.parent]
    assert check_dataset_root(str(dataset), allowed) == dataset.resolve()
    assert check_dataset_root(str(tmp_path / "anything"), []) == tmp_path / "anything"  # no roots: as given
    outside = tmp_path / "outside"
    outside.mkdir()
    (dataset.parent / "escape").symlink_to(outside)  # a link under the root that leaves it
    reasons = {
        _refusal(str(outside), allowed),  # exists, not allowed
        _refusal(str(dataset.parent / "missing"), allowed),  # allowed place, missing
        _refusal("/etc", allowed),
        _refusal(str(dataset.parent / "escape"), allowed),
        _refusal(str(dataset.parent / ".." / dataset.parent.name / ".." / "outside"), allowed),
        _refusal(str(dataset.parent), allowed),  # the root itself is not a dataset
    }
    assert len(reasons) == 1  # nothing tells a caller which server paths exist
    assert str(dataset.parent) not in reasons.pop()


def test_dataset_roots_setting_is_absolute_paths(tmp_path):
    assert parse_dataset_roots(f"{tmp_path}{os.pathsep} {os.pathsep}/srv/data") == (tmp_path, Path("/srv/data"))
    with pytest.raises(ValueError, match="JOYNEXUS_DATASET_ROOTS: 'relative' is not an absolute path"):
        parse_dataset_roots("relative")


def _upload(client, root: Path, prefix: str) -> None:
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        client.upload_file(str(file), BUCKET, f"{prefix}/{file.relative_to(root).as_posix()}")


@mock_aws
def test_s3_dataset_is_fetched_into_a_content_addressed_cache(dataset, tmp_path):
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    _upload(client, dataset, "teams/a/pick")
    _upload(client, dataset, "teams/b/copy")  # the same bytes under another prefix
    cache = tmp_path / "cache"
    first = fetch_s3_dataset(f"s3://{BUCKET}/teams/a/pick", cache, client)
    assert first.root == cache / first.sha256 and inspect_dataset(first.root).num_frames == 12
    manifest = json.loads((first.root / DATASET_MANIFEST_FILE).read_text())
    assert manifest["uri"] == f"s3://{BUCKET}/teams/a/pick" and manifest["sha256"] == first.sha256
    local = {p.relative_to(dataset).as_posix() for p in dataset.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == local
    again = fetch_s3_dataset(f"s3://{BUCKET}/teams/b/copy/", cache, client, expected_sha256=first.sha256)
    assert again.root == first.root and len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 1
    client.put_object(Bucket=BUCKET, Key="teams/a/pick/extra.txt", Body=b"changed")
    with pytest.raises(DatasetSourceError, match=f"dataset.sha256: .* not {first.sha256}"):
        fetch_s3_dataset(f"s3://{BUCKET}/teams/a/pick", cache, client, expected_sha256=first.sha256)
    with pytest.raises(DatasetSourceError, match="dataset.uri: no objects under"):
        fetch_s3_dataset(f"s3://{BUCKET}/nothing", cache, client)
    client.put_object(Bucket=BUCKET, Key="bad/../../etc/x", Body=b"x")
    with pytest.raises(DatasetSourceError, match="is not a safe relative file path"):
        fetch_s3_dataset(f"s3://{BUCKET}/bad", cache, client)
    with pytest.raises(DatasetSourceError, match="dataset.uri: cannot list"):
        fetch_s3_dataset("s3://no-such-bucket/x", cache, client)


@mock_aws
def test_a_spec_with_a_uri_resolves_to_the_cache_and_records_the_checksum(dataset, tmp_path):
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    _upload(client, dataset, "pick")
    raw = sft_spec("uri-tenant", "unused")
    raw["dataset"] = {"uri": f"s3://{BUCKET}/pick", "repo_id": "test/pick"}
    settings = Settings(data_dir=tmp_path, dataset_roots=str(dataset.parent))
    spec = resolve_dataset_source(parse_workload_spec(raw), settings, s3_client=client)
    assert Path(spec.dataset.root).parent == tmp_path / "datasets" / "s3" and len(spec.dataset.sha256) == 64
    assert parse_workload_spec(spec.model_dump(mode="json")) == spec  # the resolved spec round-trips
    by_path = sft_spec("path-tenant", str(tmp_path / "elsewhere"))
    with pytest.raises(SpecError) as refused:
        resolve_dataset_source(parse_workload_spec(by_path), settings)
    assert refused.value.fields == ["dataset.root"]


@mock_aws
def test_a_server_path_records_the_digest_its_s3_copy_gets_and_a_pin_is_checked(dataset, tmp_path):
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    _upload(client, dataset, "same")
    fetched = fetch_s3_dataset(f"s3://{BUCKET}/same", tmp_path / "cache", client)
    assert content_digest(dataset) == fetched.sha256 == content_digest(fetched.root)  # its manifest left out
    settings = Settings(data_dir=tmp_path)
    spec = resolve_dataset_source(parse_workload_spec(sft_spec("by-path", dataset)), settings)
    assert spec.dataset.sha256 == fetched.sha256
    pinned = sft_spec("pinned", dataset)
    pinned["dataset"]["sha256"] = "f" * 64
    with pytest.raises(SpecError) as refused:
        resolve_dataset_source(parse_workload_spec(pinned), settings)
    assert refused.value.fields == ["dataset.sha256"]


def test_a_dataset_id_resolves_only_among_the_spec_tenants_uploads(dataset, tmp_path):
    from joynexus.data.uploads import delete_tenant_dataset, store_uploaded_dataset, tenant_datasets
    from joynexus.data.validation import DatasetExpectation

    expectation = DatasetExpectation(cameras=("front",), image_size=(32, 32), state_dim=4, action_dim=3)
    datasets = tmp_path / "datasets"
    stored = store_uploaded_dataset(
        tar_dataset(dataset, gz=False), tenant_id="owner", repo_id="team/pick", datasets_dir=datasets,
        expectation=expectation, max_unpacked_bytes=1 << 30,
    )  # fmt: skip
    assert [(d.sha256, d.repo_id, d.nbytes) for d in tenant_datasets(datasets, "owner")] == [
        (stored.sha256, "team/pick", stored.nbytes)
    ]
    settings = Settings(data_dir=tmp_path)
    raw = sft_spec("owner", "unused")
    raw["dataset"] = {"id": stored.sha256, "repo_id": "team/pick"}
    spec = resolve_dataset_source(parse_workload_spec(raw), settings)
    assert spec.dataset.root == str(stored.root) and spec.dataset.sha256 == stored.sha256
    assert parse_workload_spec(spec.model_dump(mode="json")) == spec  # the resolved spec round-trips
    with pytest.raises(SpecError) as refused:
        resolve_dataset_source(parse_workload_spec({**raw, "tenant": "stranger"}), settings)
    assert refused.value.fields == ["dataset.id"] and "owner" not in str(refused.value)
    with pytest.raises(SpecError) as both:
        parse_workload_spec({**raw, "dataset": {**raw["dataset"], "uri": "s3://b/p"}})
    assert both.value.fields == ["dataset"] and "dataset.id" in str(both.value)
    assert delete_tenant_dataset(datasets, "stranger", stored.sha256) is None
    assert delete_tenant_dataset(datasets, "owner", stored.sha256) == stored
    assert tenant_datasets(datasets, "owner") == [] and not stored.root.exists()
    with pytest.raises(SpecError):
        resolve_dataset_source(parse_workload_spec(raw), settings)
