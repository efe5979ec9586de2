"""Datasets by reference and by upload through the API (issue 24.2): an admin creates a tenant
whose dataset is an S3 prefix (moto), which the Master fetches into its cache and pins by sha256;
a tenant uploads a LeRobot dataset (tar or zip), validated against its interface before it is
kept, listed only for that tenant, refused when it escapes its folder or passes the quota."""

from __future__ import annotations

import io
import time
import zipfile
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from tests.helpers import sft_spec, tar_dataset, write_dataset_for


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
    return tar_dataset(root, gz=gz, extra=extra)


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


def test_the_same_files_in_another_archive_are_the_same_upload_stored_and_billed_once(api, arm_dataset):
    """Issue 41.18: the same folder uploaded twice (another archive format, a gzip's new time stamp)
    was stored and billed twice under two ids."""
    tenant = api.tenant("up-same")
    first = _upload(api, tenant, _tar(arm_dataset, gz=False))
    assert first.status_code == 201, first.text
    bytes_once = api.client.get("/v1/usage", headers=tenant.headers).json()["dataset_bytes"]
    for body in (_zip(arm_dataset), _tar(arm_dataset, gz=True)):
        again = _upload(api, tenant, body)
        assert again.status_code == 201 and again.json()["dataset_id"] == first.json()["dataset_id"], again.text
    assert [d["dataset_id"] for d in api.client.get("/v1/datasets", headers=tenant.headers).json()] == [
        first.json()["dataset_id"]
    ]
    assert api.client.get("/v1/usage", headers=tenant.headers).json()["dataset_bytes"] == bytes_once
    renamed = api.client.post("/v1/datasets?repo_id=team/arm2", content=_zip(arm_dataset), headers=tenant.headers)
    assert renamed.json()["dataset_id"] != first.json()["dataset_id"]  # another repo id: another dataset
    other = api.tenant("up-same-other")  # per tenant: another tenant's copy is its own
    assert _upload(api, other, _zip(arm_dataset)).status_code == 201
    assert len(api.client.get("/v1/datasets", headers=other.headers).json()) == 1


def test_malformed_archives_answer_422_naming_the_member_and_no_server_path(api, arm_dataset):
    """Issue 41.4 / 41.7: these answered 500 (and dropped the connection), or named a staging path."""
    from tests.data.test_upload_archives import MALFORMED

    tenant = api.tenant("up-malformed")
    for case in ("tar file then folder", "truncated tar.gz", "zip corrupt member", "zip file then folder", "garbage"):
        body, expected = MALFORMED[case]
        answer = _upload(api, tenant, body)
        assert answer.status_code == 422, (case, answer.text)
        problem = answer.json()["problems"][0]
        assert problem["field"] == "archive" and expected in problem["reason"], (case, answer.text)
        assert str(api.data_dir) not in answer.text and ".upload-" not in answer.text, (case, answer.text)
    wrong = _upload(api, api.tenant("up-wrong", "flow"), _tar(arm_dataset))  # validation names files inside it
    assert wrong.status_code == 422 and str(api.data_dir) not in wrong.text, wrong.text
    assert api.client.get("/v1/datasets", headers=tenant.headers).json() == []


def _wait(api, tenant, workload_id: str, timeout_s: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = api.client.get(f"/v1/workloads/{workload_id}", headers=tenant.headers).json()
        if info["state"] in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def _naming(tenant, dataset_id: str) -> dict:
    """A workload body whose spec names an upload (everything else as the tenant was created)."""
    spec = {**tenant.spec, "dataset": {"id": dataset_id, "repo_id": "team/arm"}}
    return {"jobs": 1, "spec": spec}


def test_an_sft_workload_trains_on_the_upload_its_spec_names_and_versions_record_it(api, arm_dataset):
    from joynexus.data.sources import content_digest
    from joynexus.registry import ExperimentTracker
    from joynexus.settings import local_tracking_uri

    tenant = api.tenant("up-train")
    uploaded = _upload(api, tenant, _tar(arm_dataset, gz=False))
    assert uploaded.status_code == 201, uploaded.text
    dataset_id = uploaded.json()["dataset_id"]
    own = api.cluster.master.get_tenant(tenant.tenant_id).spec.dataset
    assert own.sha256 == content_digest(own.root) != dataset_id  # a server path records its digest too

    r = api.client.post("/v1/workloads", json=_naming(tenant, dataset_id), headers=tenant.headers)
    assert r.status_code == 202, r.text
    info = _wait(api, tenant, r.json()["workload_id"])
    assert info["state"] == "completed" and info["dataset_id"] == dataset_id, info
    version = info["version"]
    manifest = api.client.get(f"/v1/checkpoints/{version}/manifest", headers=tenant.headers).json()
    assert manifest["extra"]["dataset_sha256"] == dataset_id and manifest["extra"]["datasets"] == [dataset_id]
    exported = api.client.get(f"/v1/versions/{version}/export?format=json", headers=tenant.headers)
    assert exported.status_code == 200, exported.text
    assert exported.json()["manifest"]["extra"]["dataset_sha256"] == dataset_id
    tags = ExperimentTracker(local_tracking_uri(api.data_dir)).model_version_tags(
        tenant.tenant_id, info["registered_version"]
    )
    assert tags["dataset_sha256"] == dataset_id, tags
    # The next workload on the tenant's own dataset: the version records both, its own digest last.
    r = api.client.post("/v1/workloads", json={"jobs": 1}, headers=tenant.headers)
    info = _wait(api, tenant, r.json()["workload_id"])
    assert info["state"] == "completed" and info["dataset_id"] is None, info
    manifest = api.client.get(f"/v1/checkpoints/{info['version']}/manifest", headers=tenant.headers).json()
    assert manifest["extra"]["datasets"] == [dataset_id, own.sha256]
    assert manifest["extra"]["dataset_sha256"] == own.sha256


def test_a_spec_naming_another_tenants_or_an_unknown_upload_is_refused_alike(api, arm_dataset):
    mine, other = api.tenant("up-mine"), api.tenant("up-theirs")
    theirs = _upload(api, other, _tar(arm_dataset, gz=False)).json()["dataset_id"]
    unknown = "0" * 64
    answers = []
    for dataset_id in (theirs, unknown):
        r = api.client.post("/v1/workloads", json=_naming(mine, dataset_id), headers=mine.headers)
        assert r.status_code == 422, r.text
        problems = {p["field"]: p["reason"] for p in r.json()["problems"]}
        assert set(problems) == {"spec.dataset.id"} and other.tenant_id not in r.text, r.text
        answers.append(problems["spec.dataset.id"].replace(dataset_id, "<id>"))
    assert answers[0] == answers[1]  # nothing tells another tenant's upload from no upload
    assert api.client.get("/v1/workloads", headers=mine.headers).json() == []
    bad = api.client.post("/v1/workloads", json=_naming(mine, "not-a-digest"), headers=mine.headers)
    assert bad.status_code == 422 and "spec.dataset.id" in bad.text
    spec = {**api.spec("up-admin"), "dataset": {"id": theirs, "repo_id": "team/arm"}}  # a new tenant has no uploads
    r = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert r.status_code == 422 and "dataset.id" in {p["field"] for p in r.json()["problems"]}, r.text


def test_a_tenant_created_on_its_upload_trains_on_it_and_cannot_delete_it(api, arm_dataset):
    from joynexus.data.uploads import store_uploaded_dataset
    from joynexus.data.validation import DatasetExpectation
    from tests.api.conftest import SHAPES

    spec = api.spec("up-created")
    shape = SHAPES["arm"]
    expectation = DatasetExpectation(
        cameras=shape["cameras"], image_size=shape["image_size"], state_dim=4, action_dim=3
    )
    # As POST /v1/datasets keeps it (the same store function), before its tenant exists.
    stored = store_uploaded_dataset(
        _tar(arm_dataset, gz=False), tenant_id=spec["tenant"], repo_id="team/arm",
        datasets_dir=api.data_dir / "datasets", expectation=expectation, max_unpacked_bytes=1 << 30,
    )  # fmt: skip
    spec["dataset"] = {"id": stored.sha256, "repo_id": "team/arm"}
    r = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert r.status_code == 201, r.text
    tenant_dataset = api.cluster.master.get_tenant(spec["tenant"]).spec.dataset
    assert tenant_dataset.root == str(stored.root) and tenant_dataset.sha256 == stored.sha256
    headers = {"Authorization": f"Bearer {r.json()['key']['api_key']}"}
    deleted = api.client.delete(f"/v1/datasets/{stored.sha256}", headers=headers)
    assert deleted.status_code == 409 and "your tenant's spec trains on it" in deleted.text
    # A fork names the same upload: it is resolved among its source's uploads.
    forked = api.client.post("/v1/fork", json={"new_tenant": f"{spec['tenant']}-fork"}, headers=headers)
    assert forked.status_code == 201, forked.text
    assert api.cluster.master.get_tenant(f"{spec['tenant']}-fork").spec.dataset.root == str(stored.root)


def test_upload_bytes_are_in_the_usage_ledger_and_deleting_gives_them_back(api, arm_dataset):
    tenant, other = api.tenant("up-usage"), api.tenant("up-usage-other")
    before = api.client.get("/v1/usage", headers=tenant.headers).json()
    assert before["dataset_bytes"] == 0
    uploaded = _upload(api, tenant, _tar(arm_dataset, gz=False)).json()
    usage = api.client.get("/v1/usage", headers=tenant.headers).json()
    assert usage["dataset_bytes"] == uploaded["bytes"] > 0
    assert usage["storage_bytes"] == before["storage_bytes"] + uploaded["bytes"]
    admin_view = {u["tenant_id"]: u for u in api.client.get("/v1/admin/usage", headers=api.admin).json()}
    assert admin_view[tenant.tenant_id]["dataset_bytes"] == uploaded["bytes"]
    # The quota counts what the ledger shows: uploads alone at the quota stop new work.
    quota = {"max_storage_bytes": usage["storage_bytes"]}
    set_quota = api.client.put(f"/v1/admin/tenants/{tenant.tenant_id}/quota", json=quota, headers=api.admin)
    assert set_quota.status_code == 200, set_quota.text
    refused = api.client.post("/v1/workloads", json={"jobs": 1}, headers=tenant.headers)
    assert refused.status_code == 429 and "quota.max_storage_bytes" in refused.text, refused.text

    dataset_id = uploaded["dataset_id"]
    assert api.client.delete(f"/v1/datasets/{dataset_id}", headers=other.headers).status_code == 404
    deleted = api.client.delete(f"/v1/datasets/{dataset_id}", headers=tenant.headers)
    assert deleted.status_code == 200, deleted.text
    assert deleted.json()["bytes"] == uploaded["bytes"] and deleted.json()["storage_bytes"] == before["storage_bytes"]
    after = api.client.get("/v1/usage", headers=tenant.headers).json()
    assert after["dataset_bytes"] == 0 and after["storage_bytes"] == before["storage_bytes"]
    assert api.client.get("/v1/datasets", headers=tenant.headers).json() == []
    again = api.client.delete(f"/v1/datasets/{dataset_id}", headers=tenant.headers)
    assert again.status_code == 404 and "dataset_id" in again.text
    accepted = api.client.post("/v1/workloads", json={"jobs": 1}, headers=tenant.headers)
    assert accepted.status_code == 202, accepted.text  # the bytes given back: under the quota again
    api.client.post(f"/v1/workloads/{accepted.json()['workload_id']}/cancel", headers=tenant.headers)


def test_a_tenant_deleted_with_its_artifacts_takes_its_uploads_along(api, arm_dataset):
    tenant = api.tenant("up-gone")
    assert _upload(api, tenant, _tar(arm_dataset, gz=False)).status_code == 201
    home = api.data_dir / "datasets" / "tenants" / tenant.tenant_id
    assert any(home.iterdir())
    r = api.client.delete(f"/v1/admin/tenants/{tenant.tenant_id}?delete_artifacts=true", headers=api.admin)
    assert r.status_code == 200, r.text
    assert r.json()["removed"]["uploaded_datasets"] == "1" and not home.exists()
    assert r.json()["removed"]["tenant_id_reusable"] == "yes"  # a new tenant under the id starts with none
