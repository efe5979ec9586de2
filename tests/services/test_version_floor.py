"""Training Model Service durability: a restarted service never reissues a policy version number with
other weights (the per-tenant issued-version high-water mark), a corrupt checkpoint fails only its
own tenant with a clear error, and a tenant's slot and checkpoints can be removed."""

from __future__ import annotations

import hashlib

import pytest

from joynexus.actors import service_handle
from joynexus.artifacts import ACTION_MODULE_FILE, CheckpointError, CheckpointStore, decode_tenant_payload
from joynexus.artifacts.blobs import LocalBlobStore
from joynexus.master.loops.actor_loop import ActorLoop
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import COMPLETED
from joynexus.services.producers.sft import SFTProducer
from joynexus.services.training.service import TrainingModelService, UnknownTenant


def producer(world, name):
    tenant = world["tenants"][name]
    spec = tenant.spec.dataset
    return SFTProducer.from_dataset(
        tenant.backend_config,
        world["scheduler"],
        service_handle(TrainingQueue, world["queue"]),
        spec.root,
        spec.repo_id,
    )


def fresh_service(world, root):
    return TrainingModelService(BackboneSource(preset="tiny"), root, queue=world["queue"], num_threads=1)


def digest(service, tenant_id):
    """(version, sha256 of the exported weights) as a consumer of export_params sees them."""
    tensors, manifest = decode_tenant_payload(service.export_params(tenant_id))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().tobytes())
    return manifest.policy_version, h.hexdigest()


def train_one(world, service, name="alpha"):
    assert producer(world, name).produce_once() is not None
    outcome = ActorLoop(world["scheduler"], service).step()
    assert outcome.state == COMPLETED, outcome.reason
    return outcome.metrics["version"]


def test_a_restarted_service_never_reissues_a_version_with_other_weights(world):
    root = world["tmp"] / "ckpt-floor"
    config = world["tenants"]["alpha"].backend_config.model_copy(update={"checkpoint_every_jobs": 0})
    seen: dict[int, set[str]] = {}

    def observe(service):
        version, sha = digest(service, "alpha")
        seen.setdefault(version, set()).add(sha)
        return version

    first = fresh_service(world, root)
    first.add_tenant(config)
    assert train_one(world, first) == 1
    first.save(["alpha"])  # the only checkpoint: v1
    observe(first)
    for expected in (2, 3):
        assert train_one(world, first) == expected
        observe(first)  # v2, v3 were exported (e.g. published to inference), never checkpointed
    assert CheckpointStore(root).latest_version("alpha") == 1
    assert CheckpointStore(root).issued_version("alpha") == 3
    issued_before = set(seen)
    del first  # "crash": nothing more is written

    restarted = fresh_service(world, root)
    info = restarted.add_tenant(config)
    assert info["resumed"] is True and info["version"] == 1  # the weights it holds are v1's
    assert restarted.policy_version("alpha") == 1
    assert observe(restarted) == 1  # v1 restored: same digest as before the crash
    version = train_one(world, restarted)
    assert version > max(issued_before)
    assert observe(restarted) == version
    assert all(len(shas) == 1 for shas in seen.values()), seen
    # A checkpoint of the new weights gets the new number, and LATEST moves to it.
    restarted.save(["alpha"])
    assert CheckpointStore(root).latest_version("alpha") == version


def test_the_high_water_mark_only_moves_forward(tmp_path):
    store = CheckpointStore(tmp_path)
    assert store.issued_version("t1") is None
    store.record_issued_version("t1", 5)
    store.record_issued_version("t1", 3)
    assert store.issued_version("t1") == 5
    assert store.tenants() == []  # ISSUED alone is not a checkpoint
    (tmp_path / "tenants" / "t1" / "ISSUED").write_text("garbage\n")
    with pytest.raises(CheckpointError, match=r"t1.*ISSUED"):
        store.issued_version("t1")


def test_a_corrupt_checkpoint_fails_only_its_tenant_with_a_clear_error(world):
    service = world["service"]
    for name in ("alpha", "beta"):
        train_one(world, service, name)  # checkpoint_every_jobs=1: v1 of each saved
    path = world["tmp"] / "ckpt" / "tenants" / "alpha" / "v000001" / ACTION_MODULE_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    restarted = fresh_service(world, world["tmp"] / "ckpt")
    assert restarted.add_tenant(world["tenants"]["beta"].backend_config)["resumed"] is True
    with pytest.raises(CheckpointError, match=rf"'alpha'.*{ACTION_MODULE_FILE}.*corrupted"):
        restarted.add_tenant(world["tenants"]["alpha"].backend_config)
    assert restarted.tenants() == ["beta"]  # no half-built slot for alpha
    assert train_one(world, restarted, "beta") == 2  # beta trains on


def test_remove_tenant_and_delete_its_checkpoints(world):
    service = world["service"]
    train_one(world, service, "alpha")
    train_one(world, service, "beta")
    store = service.checkpoints
    assert store.latest_version("alpha") == 1 and store.issued_version("alpha") == 1

    assert service.remove_tenant("alpha") is True
    assert service.remove_tenant("alpha") is False
    assert service.tenants() == ["beta"]
    with pytest.raises(UnknownTenant):
        service.policy_version("alpha")

    removed = store.delete_tenant("alpha")
    assert removed >= 4  # manifest, module file, LATEST, ISSUED (+ optimizer files)
    assert store.latest_version("alpha") is None and store.issued_version("alpha") is None
    assert store.versions("alpha") == [] and store.tenants() == ["beta"]
    assert store.delete_tenant("alpha") == 0
    assert store.latest_version("beta") == 1  # the other tenant untouched


def test_local_delete_prefix_counts_files_and_refuses_the_root(tmp_path):
    blobs = LocalBlobStore(tmp_path)
    blobs.publish_dir("a/v1", {"x": b"1", "y": b"2"})
    blobs.put_atomic("a/LATEST", b"1\n")
    blobs.put_atomic("b/LATEST", b"1\n")
    assert blobs.delete_prefix("a/LATEST") == 1
    assert blobs.delete_prefix("a") == 2
    assert not blobs.exists("a") and blobs.exists("b/LATEST")
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # no temp folder left behind
    with pytest.raises(ValueError):
        blobs.delete_prefix("")


def test_s3_delete_prefix_removes_every_object_under_it(monkeypatch):
    moto = pytest.importorskip("moto")
    boto3 = pytest.importorskip("boto3")
    from joynexus.artifacts.s3 import S3BlobStore

    for key, value in {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    with moto.mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="ckpt")
        blobs = S3BlobStore("ckpt", "root", client=client)
        store = CheckpointStore(blobs)
        blobs.publish_dir("tenants/t1/v000001", {f"f{i}": b"x" for i in range(3)})
        store.record_issued_version("t1", 1)
        blobs.put_atomic("tenants/t10/LATEST", b"1\n")  # shares the string prefix, not the folder
        assert store.delete_tenant("t1") == 4
        assert blobs.list_dir("tenants") == ["t10"]
        assert store.delete_tenant("t1") == 0
