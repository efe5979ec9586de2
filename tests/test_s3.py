"""S3 artifacts against a real S3-compatible HTTP server (moto_server, started per module):
checkpoints written, read back and verified by digest, corruption detected, conditional publish,
and a whole SFT workload whose checkpoints and MLflow artifacts live in the bucket."""

from __future__ import annotations

import hashlib
import pickle
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from joynexus.artifacts import (
    ACTION_MODULE_FILE,
    MANIFEST_FILE,
    CheckpointError,
    CheckpointStore,
    TenantManifest,
    decode_tenant_payload,
)
from joynexus.artifacts.codec import NORMALIZATION_FILE
from joynexus.artifacts.s3 import S3BlobStore, split_s3_uri
from joynexus.ops.supervisor import free_port

boto3 = pytest.importorskip("boto3")

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on a free port (memory only), stopped at teardown."""
    moto = Path(sys.executable).parent / "moto_server"
    if not moto.exists():
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    port = free_port()
    with pytest.MonkeyPatch.context() as env:
        for key, value in AWS_ENV.items():
            env.setenv(key, value)
        env.delenv("AWS_ENDPOINT_URL", raising=False)
        env.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        process = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            endpoint = f"http://127.0.0.1:{port}"
            client = boto3.client("s3", endpoint_url=endpoint)
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.list_buckets()
                    break
                except Exception:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            yield endpoint
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def bucket(s3_endpoint):
    name = f"joynexus-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3(s3_endpoint, bucket):
    return boto3.client("s3", endpoint_url=s3_endpoint)


def _save(store: CheckpointStore, version: int, model: torch.nn.Module, opt=None) -> TenantManifest:
    return store.save_tenant(
        tenant_id="acme",
        policy_version=version,
        schema_signature="sig",
        base_model_id="tiny",
        module_kind="linear",
        module_config={"in_features": 4, "out_features": 3},
        module_state=model.state_dict(),
        optimizer_state=opt.state_dict() if opt is not None else None,
    )


def test_checkpoint_written_read_back_and_verified_by_digest(s3_endpoint, bucket, s3):
    store = CheckpointStore(S3BlobStore(bucket, "team/checkpoints", endpoint_url=s3_endpoint))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    manifest = _save(store, 1, model, opt)

    prefix = "team/checkpoints/tenants/acme/v000001/"
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"])
    assert [k.removeprefix(prefix) for k in keys] == sorted([*manifest.files, MANIFEST_FILE])
    for name, digest in manifest.files.items():  # the bytes in the bucket are the ones the manifest names
        body = s3.get_object(Bucket=bucket, Key=prefix + name)["Body"].read()
        assert hashlib.sha256(body).hexdigest() == digest
    latest = s3.get_object(Bucket=bucket, Key="team/checkpoints/tenants/acme/LATEST")["Body"].read()
    assert latest == b"1\n"

    loaded, state, opt_state = store.load_tenant("acme")
    assert loaded.digest == manifest.digest
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value)
    assert set(opt_state["state"]) == {0, 1}
    assert store.versions("acme") == [1] and store.tenants() == ["acme"] and store.latest_version("acme") == 1

    _save(store, 2, model)
    assert store.versions("acme") == [1, 2] and store.latest_version("acme") == 2
    with pytest.raises(FileExistsError, match="immutable"):
        _save(store, 2, model)


def test_a_corrupted_or_missing_object_is_detected(s3_endpoint, bucket, s3):
    store = CheckpointStore(S3BlobStore(bucket, endpoint_url=s3_endpoint))
    _save(store, 1, torch.nn.Linear(4, 3))
    key = f"tenants/acme/v000001/{ACTION_MODULE_FILE}"
    good = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=key, Body=good[:-1] + bytes([good[-1] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=f"file {ACTION_MODULE_FILE} is corrupted"):
        store.load_tenant("acme", 1)
    s3.delete_object(Bucket=bucket, Key=key)
    with pytest.raises(CheckpointError, match=f"file {ACTION_MODULE_FILE} is missing"):
        store.load_tenant("acme", 1)


def test_publish_is_manifest_last_and_never_overwrites(s3_endpoint, bucket, s3):
    blobs = S3BlobStore(bucket, "p", endpoint_url=s3_endpoint)
    order = []
    real_put = blobs.client.put_object

    def recording_put(**kwargs):
        order.append((kwargs["Key"].rsplit("/", 1)[-1], kwargs.get("IfNoneMatch")))
        return real_put(**kwargs)

    blobs.client.put_object = recording_put
    blobs.publish_dir("v1", {"a.bin": b"a", "b.bin": b"b", MANIFEST_FILE: b"{}"})
    assert order == [("a.bin", "*"), ("b.bin", "*"), (MANIFEST_FILE, "*")]  # conditional, manifest last
    assert blobs.list_dir("") == ["v1"] and blobs.list_dir("v1") == ["a.bin", "b.bin", MANIFEST_FILE]
    assert blobs.exists("v1") and blobs.exists("v1/a.bin") and not blobs.exists("v2")
    with pytest.raises(FileExistsError):
        blobs.publish_dir("v1", {"a.bin": b"other"})

    # A writer that passed the existence check but lost the race on the first file writes nothing.
    s3.put_object(Bucket=bucket, Key="p/v2/a.bin", Body=b"winner")
    blobs.exists = lambda key: False
    with pytest.raises(FileExistsError, match="another writer"):
        blobs.publish_dir("v2", {"a.bin": b"loser", MANIFEST_FILE: b"{}"})
    assert s3.get_object(Bucket=bucket, Key="p/v2/a.bin")["Body"].read() == b"winner"
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="p/v2/")["Contents"]] == ["p/v2/a.bin"]

    # A publish that fails half way removes what it uploaded: no manifest-less leftovers.
    def failing_put(**kwargs):
        if kwargs["Key"].endswith(MANIFEST_FILE):
            raise ConnectionError("network down")
        return real_put(**kwargs)

    blobs.client.put_object = failing_put
    with pytest.raises(ConnectionError):
        blobs.publish_dir("v3", {"a.bin": b"a", MANIFEST_FILE: b"{}"})
    assert s3.list_objects_v2(Bucket=bucket, Prefix="p/v3/")["KeyCount"] == 0


def test_missing_keys_bad_keys_and_uris(s3_endpoint, bucket, monkeypatch):
    blobs = S3BlobStore(bucket, endpoint_url=s3_endpoint)
    with pytest.raises(FileNotFoundError):
        blobs.read("tenants/none/LATEST")
    assert blobs.list_dir("tenants") == [] and not blobs.exists("tenants")
    for bad in ("", "../x", "a//b", "/abs"):
        with pytest.raises(ValueError, match="invalid storage key"):
            blobs.read(bad)
    assert split_s3_uri("s3://b/x/y/") == ("b", "x/y")
    for bad in ("s3://", "http://b/x", "s3://b/x?endpoint=1"):
        with pytest.raises(ValueError, match="invalid S3 URI"):
            split_s3_uri(bad)

    # What a Ray actor receives: a location string; the endpoint comes from its environment.
    monkeypatch.setenv("JOYNEXUS_S3_ENDPOINT_URL", s3_endpoint)
    store = CheckpointStore(f"s3://{bucket}/ckpt")
    assert isinstance(store.blobs, S3BlobStore) and store.blobs.endpoint_url == s3_endpoint
    _save(store, 3, torch.nn.Linear(4, 3))
    again = pickle.loads(pickle.dumps(store.blobs))  # ships to actors without its boto3 client
    assert CheckpointStore(again).latest_version("acme") == 3


def test_sft_workload_checkpoints_and_registers_through_s3(tmp_path, s3_endpoint, bucket, s3, monkeypatch):
    """An in-process deployment configured with a bucket: the training service checkpoints into it,
    MLflow logs the payload into s3://<bucket>/mlflow, and the version fetched back by alias loads
    into the Inference Model Service and predicts exactly what the trained slot predicts."""
    from joynexus.master.deployment import Deployment
    from joynexus.master.workloads.manager import WorkloadManager
    from joynexus.registry import CHAMPION_ALIAS, PAYLOAD_ARTIFACT_DIR
    from joynexus.scheduling.inference_queue import Observation
    from joynexus.settings import Settings
    from tests.helpers import sft_spec, write_dataset_for

    monkeypatch.delenv("MLFLOW_S3_ENDPOINT_URL", raising=False)  # the deployment sets it from Settings
    settings = Settings(data_dir=tmp_path / "data", s3_bucket=bucket, s3_endpoint_url=s3_endpoint, torch_threads=1)
    spec = sft_spec("s3-tenant", tmp_path / "dataset", jobs=1, samples_per_job=8)
    write_dataset_for(spec, episodes=2, length=8)
    dep = Deployment.in_process(settings)
    workloads = WorkloadManager(dep).start()
    try:
        dep.creator.create({**spec, "base_model": dep.training_service.backbone.model_id})
        status = workloads.wait(workloads.submit("s3-tenant").workload_id, timeout_s=300)
        assert status.state == "completed", status.error
        assert status.registered_version == 1

        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
        assert f"checkpoints/tenants/s3-tenant/v{status.version:06d}/{MANIFEST_FILE}" in keys
        assert not (settings.checkpoint_root / "tenants").exists()  # nothing on local disk
        payload_keys = [k for k in keys if k.startswith("mlflow/") and f"/{PAYLOAD_ARTIFACT_DIR}/" in k]
        # an SFT version carries its dataset's normalizer beside the weights
        assert {k.rsplit("/", 1)[-1] for k in payload_keys} == {ACTION_MODULE_FILE, MANIFEST_FILE, NORMALIZATION_FILE}

        dep.tracker.set_alias("s3-tenant", CHAMPION_ALIAS, 1)
        payload, manifest = dep.tracker.fetch_tenant_payload("s3-tenant", alias=CHAMPION_ALIAS)
        slot_tensors, slot_manifest = decode_tenant_payload(dep.training_service.export_params("s3-tenant"))
        assert manifest.policy_version == slot_manifest.policy_version == status.version
        fetched_tensors, _ = decode_tenant_payload(payload)
        assert slot_tensors.keys() == fetched_tensors.keys()
        assert all(torch.equal(slot_tensors[k], fetched_tensors[k]) for k in slot_tensors)
        rng = np.random.default_rng(0)
        observations = [
            Observation(images=(rng.random((3, 32, 32), dtype=np.float32),), state=rng.random(4, dtype=np.float32))
            for _ in range(3)
        ]
        inference = dep.inference_service
        trained = inference.predict("s3-tenant", observations, policy_version=manifest.policy_version)["actions"]
        inference.load_weights(payload)  # replaces the same version with the registry's copy
        fetched = inference.predict("s3-tenant", observations, policy_version=manifest.policy_version)["actions"]
        np.testing.assert_array_equal(trained, fetched)
    finally:
        workloads.stop()
        dep.shutdown()


def test_the_api_reads_checkpoints_through_the_store_on_s3(tmp_path, s3_endpoint, bucket, monkeypatch):
    """With a bucket, the API's versions, manifests, exports of older versions and storage usage come
    from the bucket (the checkpoint store), not from a local folder that does not exist."""
    from fastapi.testclient import TestClient

    from joynexus.api.app import create_app
    from joynexus.connect import in_process
    from joynexus.settings import Settings
    from tests.helpers import TINY_MODEL_ID, sft_spec, write_dataset_for

    monkeypatch.delenv("MLFLOW_S3_ENDPOINT_URL", raising=False)
    settings = Settings(data_dir=tmp_path / "data", s3_bucket=bucket, s3_endpoint_url=s3_endpoint, torch_threads=1)
    spec = sft_spec("s3-api", tmp_path / "dataset", jobs=2, samples_per_job=8, base_model=TINY_MODEL_ID)
    spec["training"] = {**spec.get("training", {}), "checkpoint_every_jobs": 1}
    write_dataset_for(spec, episodes=2, length=8)
    cluster = in_process(settings)
    admin = {"Authorization": "Bearer jnx_admin_s3test"}
    try:
        with TestClient(create_app(cluster, admin_key="jnx_admin_s3test")) as client:
            created = client.post("/v1/admin/tenants", json=spec, headers=admin)
            assert created.status_code == 201, created.text
            me = {"Authorization": f"Bearer {created.json()['key']['api_key']}"}
            submitted = client.post("/v1/workloads", json={"jobs": 2}, headers=me).json()
            final = cluster.wait_workload(submitted["workload_id"], 300)
            assert final.state == "completed", final.error
            versions = client.get("/v1/versions", headers=me).json()
            checkpoints = {c["version"]: c for c in versions["checkpoints"]}
            assert set(checkpoints) >= {1, 2} and all(c["size_bytes"] > 0 for c in checkpoints.values())
            manifest = client.get("/v1/checkpoints/1/manifest", headers=me).json()
            assert manifest["digest"] == checkpoints[1]["checkpoint_digest"] and manifest["tenant_id"] == "s3-api"
            old = client.get("/v1/versions/1/export", headers=me)
            assert old.status_code == 200 and len(old.content) > 0
            usage = client.get("/v1/usage", headers=me).json()
            assert usage["storage_bytes"] >= sum(c["size_bytes"] for c in checkpoints.values())
        assert not (settings.checkpoint_root / "tenants").exists()  # nothing on local disk
    finally:
        cluster.close()
