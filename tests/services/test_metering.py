"""Usage metering inside the services: the UsageMeter aggregates in memory and flushes to the
control-plane store; the Inference Model Service records each request's share of its batch time;
the Environment Service records env steps. Also the Training Queue's bulk clears and the ledger's
storage bytes from a CheckpointStore."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from sqlalchemy import select

from joynexus.actors import service_handle
from joynexus.core.metering import UsageMeter, split_group_seconds
from joynexus.core.store import ControlPlaneStore, UsageRecord
from joynexus.master.usage import UsageLedger
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.inference_queue import Observation
from joynexus.scheduling.training_queue import TrainingQueue, TrainingQueueError
from joynexus.scheduling.training_scheduler import partition_id_for
from joynexus.services.environment.service import EnvironmentService
from joynexus.services.inference.service import InferenceModelService
from joynexus.services.training.service import TrainingModelService
from tests.helpers import compiled_config

SHAPES = {
    "arm": dict(cameras=("front", "wrist"), image_size=(32, 32), state_dim=4, action_dim=7, action_chunk=2),
    "gripper": dict(
        cameras=("top",), image_size=(24, 40), state_dim=2, action_dim=2, action_chunk=4, module="flow_matching"
    ),
}
PUSHT_STATE = {"simulator": "pusht", "task": "PushT-v0"}


def rows(store: ControlPlaneStore) -> list[tuple]:
    with store.transaction() as session:
        found = session.execute(
            select(
                UsageRecord.tenant_id,
                UsageRecord.category,
                UsageRecord.operation,
                UsageRecord.device_seconds,
                UsageRecord.samples,
                UsageRecord.env_steps,
            ).order_by(UsageRecord.tenant_id, UsageRecord.category, UsageRecord.operation)
        )
        return [tuple(row) for row in found]


# -- UsageMeter --------------------------------------------------------------------------------
def test_meter_aggregates_in_memory_and_flushes_one_row_per_key(store_url):
    """Runs on SQLite and (marked postgres) on PostgreSQL, the meter building its own store from the URL."""
    meter = UsageMeter.from_url(store_url, start=False)
    try:
        for _ in range(100):
            meter.record("t1", "inference", "predict", device_seconds=0.01, samples=2)
            meter.record("t1", "environment", "env_step", env_steps=1)
        meter.record("t2", "inference", "rollout", device_seconds=0.5, samples=3)
        meter.record("t2", "inference", "rollout", device_seconds=-1.0)  # clamped: never negative usage
        meter.record("t2", "training", "train_batch")  # nothing to add: no row
        assert rows(meter.store) == []  # nothing written per call
        assert meter.pending()[("t1", "inference", "predict")]["samples"] == 200

        assert meter.flush() == 3
        written = rows(meter.store)
        assert [r[:3] for r in written] == [
            ("t1", "environment", "env_step"),
            ("t1", "inference", "predict"),
            ("t2", "inference", "rollout"),
        ]
        assert written[0][5] == 100
        assert written[1][3] == pytest.approx(1.0) and written[1][4] == 200
        assert written[2][3:] == (pytest.approx(0.5), 3, 0)
        assert meter.pending() == {} and meter.flush() == 0

        # what the ledger reads back
        ledger = UsageLedger(meter.store)
        assert ledger.device_seconds("t1").inference == pytest.approx(1.0)
        assert ledger.summary("t1").env_steps == 100
        assert ledger.summary("t2").samples_predicted == 3
    finally:
        meter.close()


def test_meter_background_thread_flushes_and_close_writes_the_rest(tmp_path):
    store = ControlPlaneStore(f"sqlite:///{tmp_path / 'control.db'}")
    meter = UsageMeter(store, flush_interval_s=0.05)
    meter.record("t1", "environment", "env_step", env_steps=3)
    deadline = time.monotonic() + 10
    while not rows(store) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rows(store) == [("t1", "environment", "env_step", 0.0, 0, 3)]
    meter.record("t1", "environment", "env_step", env_steps=4)
    meter.close()
    assert sum(r[5] for r in rows(store)) == 7
    assert not meter._thread.is_alive()
    store.dispose()


def test_a_failed_flush_keeps_the_amounts_for_the_next_try(tmp_path, caplog):
    store = ControlPlaneStore(f"sqlite:///{tmp_path / 'control.db'}")
    meter = UsageMeter(store, start=False)
    real = store.transaction
    failures = {"left": 1}

    @contextmanager
    def flaky():
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("database is down")
        with real() as session:
            yield session

    store.transaction = flaky
    meter.record("t1", "inference", "predict", device_seconds=1.0, samples=1)
    assert meter.try_flush() is False
    assert "will retry" in caplog.text
    meter.record("t1", "inference", "predict", device_seconds=2.0, samples=1)  # merges with the kept amounts
    assert meter.pending()[("t1", "inference", "predict")] == {"device_seconds": 3.0, "samples": 2, "env_steps": 0}
    assert meter.flush() == 1
    assert rows(store) == [("t1", "inference", "predict", pytest.approx(3.0), 2, 0)]
    meter.close()
    store.dispose()


def test_meter_is_thread_safe_and_refuses_bad_rows(tmp_path):
    store = ControlPlaneStore(f"sqlite:///{tmp_path / 'control.db'}")
    meter = UsageMeter(store, flush_interval_s=0.01)  # flushes race with the recorders

    def hammer(tenant: str) -> None:
        for _ in range(2000):
            meter.record(tenant, "environment", "env_step", env_steps=1)

    threads = [threading.Thread(target=hammer, args=(f"t{i % 2}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    meter.close()
    totals: dict[str, int] = {}
    for tenant, *_, steps in rows(store):
        totals[tenant] = totals.get(tenant, 0) + steps
    assert totals == {"t0": 8000, "t1": 8000}

    with pytest.raises(ValueError, match="category"):
        meter.record("t1", "gpu", "predict", device_seconds=1.0)
    with pytest.raises(ValueError, match="operation"):
        meter.record("t1", "inference", "x" * 33, device_seconds=1.0)
    with pytest.raises(ValueError, match="tenant_id"):
        meter.record("", "inference", "predict", device_seconds=1.0)
    store.dispose()


def test_split_group_seconds():
    assert split_group_seconds(1.0, [1, 3]) == [0.25, 0.75]
    assert split_group_seconds(1.0, [0, 0]) == [0.0, 0.0]


# -- Inference Model Service -------------------------------------------------------------------
@pytest.fixture(scope="module")
def payloads(tmp_path_factory):
    torch.set_num_threads(1)
    trainer = TrainingModelService(BackboneSource(preset="tiny"), tmp_path_factory.mktemp("ckpt"))
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        trainer.add_tenant(compiled_config(name, trainer.capabilities(), **shape).model_copy(update={"seed": i}))
        out[name] = trainer.export_params(name)
    return out


def observation(name: str, rng: np.random.Generator) -> Observation:
    shape = SHAPES[name]
    h, w = shape["image_size"]
    images = tuple(rng.random((3, h, w), dtype=np.float32) for _ in shape["cameras"])
    return Observation(
        images=images, state=rng.standard_normal(shape["state_dim"]).astype(np.float32), instruction="go"
    )


def test_inference_meters_each_tenants_share_of_a_grouped_batch(tmp_path, payloads):
    store = ControlPlaneStore(f"sqlite:///{tmp_path / 'control.db'}")
    meter = UsageMeter(store, start=False)
    service = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False, meter=meter)
    try:
        for payload in payloads.values():
            service.load_weights(payload)
        rng = np.random.default_rng(0)
        futures = [
            service.submit("arm", [observation("arm", rng) for _ in range(3)]),
            service.submit("gripper", [observation("gripper", rng)], operation="rollout"),
            service.submit("arm", [observation("arm", rng) for _ in range(2)], operation="rollout"),
        ]
        batch = service.queue.collect_prefix(service.max_batch_size, 0.0)
        assert len(batch) == 3  # one shared forward for both tenants
        started = time.perf_counter()
        service.execute(batch)
        elapsed = time.perf_counter() - started
        results = [f.result(timeout=5) for f in futures]
        assert all(r["batch_samples"] == 6 for r in results)

        shares = [r["device_seconds"] for r in results]
        assert all(s > 0 for s in shares)
        assert sum(shares) <= elapsed + 1e-6  # the batch time, split
        assert sum(shares) == pytest.approx(elapsed, rel=0.5)  # all of it but the settling
        per_sample = shares[0] / 3
        assert shares[1] == pytest.approx(per_sample) and shares[2] == pytest.approx(2 * per_sample)

        # nothing written until the meter flushes; then one row per (tenant, operation)
        assert rows(store) == []
        meter.flush()
        assert rows(store) == [
            ("arm", "inference", "predict", pytest.approx(shares[0]), 3, 0),
            ("arm", "inference", "rollout", pytest.approx(shares[2]), 2, 0),
            ("gripper", "inference", "rollout", pytest.approx(shares[1]), 1, 0),
        ]
        ledger = UsageLedger(store)
        assert ledger.device_seconds("arm").inference == pytest.approx(shares[0] + shares[2])
        assert ledger.device_seconds("gripper").total == pytest.approx(shares[1])

        # predict() returns the share too (the API hands it to clients)
        worker = threading.Thread(target=lambda: service.execute(service.queue.collect_prefix(32, 5.0)))
        worker.start()
        result = service.predict("gripper", [observation("gripper", rng)], timeout_s=30)
        worker.join()
        assert result["device_seconds"] > 0
        with pytest.raises(ValueError, match="operation"):
            service.submit("arm", [observation("arm", rng)], operation="")
    finally:
        service.close()
        meter.close()
        store.dispose()
    assert sum(r[4] for r in rows(store) if r[0] == "gripper") == 2  # close() wrote the last request


def test_inference_without_meter_records_nothing_but_still_reports_device_seconds(payloads):
    service = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False)
    try:
        service.load_weights(payloads["arm"])
        future = service.submit("arm", [observation("arm", np.random.default_rng(1))])
        service.execute(service.queue.collect_prefix(32, 0.0))
        assert service.meter is None and future.result(timeout=5)["device_seconds"] > 0
    finally:
        service.close()


def test_inference_builds_its_own_meter_from_a_database_url(tmp_path, payloads):
    url = f"sqlite:///{tmp_path / 'control.db'}"
    service = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False, database_url=url)
    service.load_weights(payloads["arm"])
    future = service.submit("arm", [observation("arm", np.random.default_rng(2))])
    service.execute(service.queue.collect_prefix(32, 0.0))
    seconds = future.result(timeout=5)["device_seconds"]
    service.close()  # closes the meter it owns, writing what is pending
    store = ControlPlaneStore(url)
    assert rows(store) == [("arm", "inference", "predict", pytest.approx(seconds), 1, 0)]
    store.dispose()
    with pytest.raises(ValueError, match="either"):
        InferenceModelService(
            BackboneSource(preset="tiny"), start_worker=False, meter=UsageMeter(store, start=False), database_url=url
        )


# -- Environment Service -----------------------------------------------------------------------
def test_environment_meters_env_steps_per_tenant(tmp_path):
    store = ControlPlaneStore(f"sqlite:///{tmp_path / 'control.db'}")
    meter = UsageMeter(store, start=False)
    service = EnvironmentService(step_timeout_s=20.0, reset_timeout_s=120.0, meter=meter)
    try:
        a1 = service.open_session("tenant-a", "r1", PUSHT_STATE)
        a2 = service.open_session("tenant-a", "r2", PUSHT_STATE)
        b = service.open_session("tenant-b", "r1", PUSHT_STATE)
        for tenant, sid in (("tenant-a", a1), ("tenant-a", a2), ("tenant-b", b)):
            service.reset(tenant, sid, seed=0)
        for i in range(3):
            service.step("tenant-a", a1, [200.0 + i, 300.0])
        out = service.batch_step("tenant-a", {a1: [1.0, 2.0], a2: [3.0, 4.0], "env-nope": [0.0, 0.0]})
        assert out["env-nope"]["error_type"] == "UnknownSession"  # not metered
        service.step("tenant-b", b, [10.0, 10.0])
        assert meter.pending() == {
            ("tenant-a", "environment", "env_step"): {"device_seconds": 0.0, "samples": 0, "env_steps": 5},
            ("tenant-b", "environment", "env_step"): {"device_seconds": 0.0, "samples": 0, "env_steps": 1},
        }
        # per-session counts are unchanged by metering
        steps = {s["session_id"]: s["steps"] for s in service.sessions("tenant-a")}
        assert steps == {a1: 4, a2: 1}
    finally:
        service.close_all()  # flushes the meter
    ledger = UsageLedger(store)
    assert ledger.summary("tenant-a").env_steps == 5
    assert ledger.summary("tenant-b").env_steps == 1
    meter.close()
    store.dispose()


# -- Training Queue: a tenant's partitions in bulk ---------------------------------------------
@pytest.mark.parametrize("wrap", [False, True], ids=["queue", "client"])
def test_training_queue_clears_by_prefix_and_by_tenant(wrap):
    queue = TrainingQueue()
    q = service_handle(TrainingQueue, queue) if wrap else queue
    ids = [
        "api/acme/p1",
        "api/acme/p2",
        "api/acme-2/p1",
        partition_id_for("job-1", "vla", "acme", "sft"),
        partition_id_for("job-2", "vla", "other", "rl"),
        "loose",
    ]
    for pid in ids:
        q.put(pid, {"x": np.zeros((2, 1), np.float32)})
    assert q.clear_prefix("api/acme/") == 2
    assert q.clear_prefix("api/acme/") == 0
    assert q.partitions() == sorted(ids[2:])
    for pid in ("api/acme/p3", "api/acme/p4"):
        q.put(pid, {"x": np.zeros((1, 1), np.float32)})
    assert q.clear_tenant("acme") == 3  # both API partitions and the job partition, not "acme-2"
    assert q.partitions() == sorted(["api/acme-2/p1", "vla/other/rl/job-2", "loose"])
    with pytest.raises(TrainingQueueError):
        q.clear_prefix("")
    with pytest.raises(TrainingQueueError):
        q.clear_tenant("a/b")


# -- UsageLedger storage bytes -----------------------------------------------------------------
def test_ledger_asks_the_checkpoint_store_for_storage_bytes(tmp_path):
    class Checkpoints:
        def tenant_bytes(self, tenant_id: str) -> int:
            return {"acme": 1234}.get(tenant_id, 0)

    store = ControlPlaneStore(f"sqlite:///{tmp_path / 'control.db'}")
    assert UsageLedger(store, checkpoints=Checkpoints()).summary("acme").storage_bytes == 1234
    assert UsageLedger(store, checkpoints=Checkpoints()).storage_bytes("other") == 0

    folder = tmp_path / "ckpt" / "tenants" / "acme"  # the deprecated local-folder path still works
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"x" * 10)
    with pytest.warns(DeprecationWarning):
        ledger = UsageLedger(store, checkpoint_root=tmp_path / "ckpt")
    assert ledger.storage_bytes("acme") == 10
    store.dispose()
