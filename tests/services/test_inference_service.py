"""Inference Model Service: grouped = serial within tolerance for mixed schemas, versions pinned,
clear errors for unknown versions, a failing tenant module fails only its own requests."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from joynexus.models.backbone import BackboneSource, ResidentBackbone
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.inference.service import InferenceModelService, UnknownPolicyVersion
from joynexus.services.training.service import TrainingModelService
from tests.helpers import compiled_config

SHAPES = {
    "arm": dict(cameras=("front", "wrist"), image_size=(32, 32), state_dim=4, action_dim=7, action_chunk=2),
    "gripper": dict(
        cameras=("top",), image_size=(24, 40), state_dim=2, action_dim=2, action_chunk=4, module="flow_matching"
    ),
    "biarm": dict(cameras=("l", "r", "c"), image_size=(48, 48), state_dim=14, action_dim=14, action_chunk=1),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Real payloads: tenants built and exported by a Training Model Service."""
    torch.set_num_threads(1)
    trainer = TrainingModelService(BackboneSource(preset="tiny"), tmp_path_factory.mktemp("ckpt"))
    payloads = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        cfg = compiled_config(name, trainer.capabilities(), **shape).model_copy(update={"seed": i})
        trainer.add_tenant(cfg)
        payloads[name] = trainer.export_params(name)
    return trainer, payloads


@pytest.fixture
def service(exported):
    svc = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False)
    for payload in exported[1].values():
        svc.load_weights(payload)
    yield svc
    svc.close()


def observation(name: str, rng: np.random.Generator, instruction: str = "pick") -> Observation:
    shape = SHAPES[name]
    h, w = shape["image_size"]
    images = tuple(rng.random((3, h, w), dtype=np.float32) for _ in shape["cameras"])
    return Observation(
        images=images, state=rng.standard_normal(shape["state_dim"]).astype(np.float32), instruction=instruction
    )


def serve_now(svc: InferenceModelService) -> None:
    """Run the scheduler + one execute by hand (the worker thread is off in these tests)."""
    batch = svc.queue.collect_prefix(svc.max_batch_size, 0.0)
    svc.execute(batch)


def test_grouped_predictions_equal_serial_predictions_for_mixed_schemas(service):
    rng = np.random.default_rng(0)
    plan = [("arm", 2), ("gripper", 1), ("biarm", 3), ("gripper", 2), ("arm", 1)]
    requests = []
    for k, (name, n) in enumerate(plan):
        obs = [observation(name, rng, instruction="x" * (3 + 5 * k)) for _ in range(n)]  # varied text lengths
        requests.append((name, obs, [100 * k + i for i in range(n)]))
    serial = []
    for name, obs, seeds in requests:
        future = service.submit(name, obs, seeds=seeds)
        serve_now(service)  # each request alone in its batch
        serial.append(future.result())
        assert serial[-1]["batch_samples"] == len(obs)
    futures = [service.submit(name, obs, seeds=seeds) for name, obs, seeds in requests]
    serve_now(service)  # all of them in ONE shared forward
    grouped = [f.result() for f in futures]
    assert grouped[0]["batch_samples"] == sum(n for _, n in plan)
    for (name, obs, _), one, many in zip(requests, serial, grouped, strict=True):
        assert many["actions"].shape == (len(obs), SHAPES[name]["action_chunk"], SHAPES[name]["action_dim"])
        np.testing.assert_allclose(many["actions"], one["actions"], atol=1e-5, rtol=1e-4)


def test_loaded_payload_predicts_like_the_training_slot(exported, service):
    trainer, _ = exported
    obs = observation("arm", np.random.default_rng(1))
    future = service.submit("arm", [obs])
    serve_now(service)
    served = future.result()["actions"]
    features = trainer.encode([[torch.as_tensor(i) for i in obs.images]], [obs.instruction])
    expected = trainer._slot("arm").module.predict(features, torch.as_tensor(obs.state)[None])
    np.testing.assert_allclose(served, expected.numpy(), atol=1e-5)


def test_a_new_version_serves_new_requests_while_pinned_old_ones_still_resolve(exported, service):
    trainer, _ = exported
    obs = observation("arm", np.random.default_rng(2))
    old = service.submit("arm", [obs])  # pinned to v0 at submission
    slot = trainer._slot("arm")
    with torch.no_grad():
        for p in slot.module.parameters():
            p.add_(0.5)
    slot.version += 1
    assert service.load_weights(trainer.export_params("arm"))["version"] == 1
    new = service.submit("arm", [obs])
    explicit_old = service.submit("arm", [obs], policy_version=0)
    serve_now(service)
    assert old.result()["policy_version"] == 0 and explicit_old.result()["policy_version"] == 0
    assert new.result()["policy_version"] == 1
    np.testing.assert_allclose(old.result()["actions"], explicit_old.result()["actions"], atol=1e-6)
    assert not np.allclose(old.result()["actions"], new.result()["actions"])
    slot.version -= 1
    with torch.no_grad():
        for p in slot.module.parameters():
            p.sub_(0.5)


def test_unknown_versions_and_bad_observations_are_clear_errors(service):
    rng = np.random.default_rng(3)
    with pytest.raises(UnknownPolicyVersion, match=r"no version 7 \(loaded: \[0\]\)"):
        service.submit("arm", [observation("arm", rng)], policy_version=7)
    with pytest.raises(UnknownPolicyVersion, match="no serving state"):
        service.submit("nobody", [observation("arm", rng)])
    with pytest.raises(ValueError, match=r"observations\[0\].state: expected shape \(4,\)"):
        service.submit("arm", [observation("gripper", rng)])


def test_a_failing_tenant_module_fails_only_its_own_requests(service, monkeypatch):
    rng = np.random.default_rng(4)
    broken = service._resolve("gripper", None).module

    def explode(*args, **kwargs):
        raise RuntimeError("gripper head is broken")

    monkeypatch.setattr(broken, "predict", explode)
    ok1 = service.submit("arm", [observation("arm", rng)])
    bad = service.submit("gripper", [observation("gripper", rng)])
    ok2 = service.submit("biarm", [observation("biarm", rng)])
    serve_now(service)
    assert ok1.result()["actions"].shape == (1, 2, 7) and ok2.result()["actions"].shape == (1, 1, 14)
    with pytest.raises(RuntimeError, match="gripper head is broken"):
        bad.result()
    assert service.stats()["failed_requests"] == 1


def test_versions_are_bounded_per_tenant_and_the_latest_is_kept(exported):
    trainer, payloads = exported
    svc = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False, max_versions_per_tenant=2)
    slot = trainer._slot("biarm")
    base = slot.version
    for v in range(4):
        slot.version = base + v
        svc.load_weights(trainer.export_params("biarm"))
    slot.version = base
    assert svc.versions("biarm") == [base + 2, base + 3]
    svc.close()


def test_the_worker_groups_concurrent_callers_of_different_tenants(exported):
    _, payloads = exported
    before = ResidentBackbone.instances_created
    svc = InferenceModelService(BackboneSource(preset="tiny"), max_batch_size=6, max_wait_ms=300)
    assert ResidentBackbone.instances_created == before + 1
    for payload in payloads.values():
        svc.load_weights(payload)
    rng = np.random.default_rng(5)
    names = ["arm", "gripper", "biarm"] * 2
    obs = [observation(n, rng) for n in names]
    results = [None] * len(names)
    barrier = threading.Barrier(len(names))

    def call(i):
        barrier.wait()
        results[i] = svc.predict(names[i], [obs[i]])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None for r in results)
    assert svc.stats()["max_batch_samples"] > 1  # callers of different tenants shared a forward
    svc.close()
