"""Inference Model Service fairness (issue 11): a large predict is split into chunks at submission,
batches take chunks round-robin across tenants, and the caller gets the chunks' results back in
order, identical to an unsplit run. Fairness is checked on the batch compositions the service
records (never on timings). Also the service's heartbeat."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.inference_queue import InferenceQueueClosed, Observation
from joynexus.services.inference.service import InferenceModelService
from joynexus.services.training.service import TrainingModelService
from tests.helpers import compiled_config

SHAPES = {
    "arm": dict(cameras=("front", "wrist"), image_size=(32, 32), state_dim=4, action_dim=7, action_chunk=2),
    "gripper": dict(
        cameras=("top",), image_size=(24, 40), state_dim=2, action_dim=2, action_chunk=4, module="flow_matching"
    ),
    "rl": dict(cameras=("top",), image_size=(32, 32), state_dim=3, action_dim=2, action_chunk=2),
}


@pytest.fixture(scope="module")
def payloads(tmp_path_factory):
    """Real payloads exported by a Training Model Service; "rl" is a stochastic policy with a critic."""
    torch.set_num_threads(1)
    trainer = TrainingModelService(BackboneSource(preset="tiny"), tmp_path_factory.mktemp("ckpt"))
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        cfg = compiled_config(name, trainer.capabilities(), **shape).model_copy(update={"seed": i})
        if name == "rl":
            module = {**cfg.action_module, "stochastic": True, "value_head": True}
            cfg = cfg.model_copy(update={"action_module": module})
        trainer.add_tenant(cfg)
        out[name] = trainer.export_params(name)
    return out


def make_service(payloads, **kwargs) -> InferenceModelService:
    svc = InferenceModelService(BackboneSource(preset="tiny"), start_worker=kwargs.pop("start_worker", False), **kwargs)
    for payload in payloads.values():
        svc.load_weights(payload)
    return svc


@pytest.fixture
def service(payloads):
    svc = make_service(payloads, max_batch_size=4)
    yield svc
    svc.close()


def observations(name: str, n: int, seed: int) -> list[Observation]:
    shape, rng = SHAPES[name], np.random.default_rng(seed)
    h, w = shape["image_size"]
    return [
        Observation(
            images=tuple(rng.random((3, h, w), dtype=np.float32) for _ in shape["cameras"]),
            state=rng.standard_normal(shape["state_dim"]).astype(np.float32),
            instruction="pick",
        )
        for _ in range(n)
    ]


def serve_one_batch(svc: InferenceModelService) -> None:
    """Form and run one backbone batch by hand (the worker thread is off)."""
    svc.execute(svc.queue.collect_prefix(svc.max_batch_size, 0.0))


def parts(batch: dict) -> list[tuple[str, int | None, int]]:
    return [(p["tenant_id"], p["chunk"], p["samples"]) for p in batch["parts"]]


# -- splitting and reassembly -------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, sample",
    [("arm", False), ("gripper", False), ("rl", True)],
    ids=["oft_mlp", "flow_matching", "stochastic"],
)
def test_a_split_request_returns_exactly_what_its_chunks_return_as_separate_requests(service, name, sample):
    obs, seeds = observations(name, 10, seed=1), list(range(500, 510))
    # Reference: the same rows as three separate requests, each alone in its forward, no splitting.
    service.max_chunk_samples = None
    reference = []
    for start, stop in ((0, 4), (4, 8), (8, 10)):
        future = service.submit(name, obs[start:stop], seeds=seeds[start:stop], sample=sample)
        serve_one_batch(service)
        reference.append(future.result(timeout=5))
    service.max_chunk_samples = 4  # B = 4: chunks of 4, 4, 2, one per forward
    future = service.submit(name, obs, seeds=seeds, sample=sample)
    assert service.queue.depth() == 3
    for _ in range(3):
        assert not future.done()  # the caller's future waits for every chunk
        serve_one_batch(service)
    result = future.result(timeout=5)
    for key in ("actions", "values", "log_probs"):
        parts_ = [r[key] for r in reference]
        if parts_[0] is None:
            assert result[key] is None
        else:
            np.testing.assert_array_equal(result[key], np.concatenate(parts_))  # exactly, not approximately
    assert result["actions"].shape == (10, SHAPES[name]["action_chunk"], SHAPES[name]["action_dim"])
    assert result["device_seconds"] > 0 and result["batch_samples"] == 4
    stats = service.stats()
    assert stats["split_requests"] == 1 and stats["chunks"] == 3 and stats["requests"] == 4
    last = stats["recent_batches"][-3:]
    assert [parts(b) for b in last] == [[(name, 0, 4)], [(name, 1, 4)], [(name, 2, 2)]]
    assert len({b["parts"][0]["request_id"] for b in last}) == 1  # one caller request


def test_a_split_request_matches_one_unsplit_forward(payloads):
    """Split (B = 8) against the same request in one forward (splitting off): only batch
    composition differs, so equal within float tolerance."""
    obs, seeds = observations("gripper", 19, seed=2), list(range(19))
    split_svc = make_service(payloads, max_batch_size=8, start_worker=True, max_wait_ms=1)
    whole_svc = make_service(payloads, max_batch_size=8, max_chunk_samples=None)
    try:
        split = split_svc.predict("gripper", obs, seeds=seeds, timeout_s=60)  # through the worker thread
        future = whole_svc.submit("gripper", obs, seeds=seeds)
        serve_one_batch(whole_svc)
        whole = future.result(timeout=5)
        assert whole["batch_samples"] == 19 and split["batch_samples"] <= 8
        np.testing.assert_allclose(split["actions"], whole["actions"], atol=1e-5, rtol=1e-4)
        assert split_svc.stats()["chunks"] == 3 and split_svc.stats()["max_batch_samples"] <= 8
    finally:
        split_svc.close()
        whole_svc.close()


# -- fairness -----------------------------------------------------------------------------------
A8 = [("arm", k, 8) for k in range(128)]


@pytest.mark.parametrize(
    "chunk, first, second",
    [
        # Chunks of B: the large request's first chunk fills the first forward, the small one is next.
        (32, [("arm", 0, 32)], [("gripper", None, 1)]),
        # The default, smaller chunks: the small request rides in the first forward, between chunks.
        (None, [A8[0], ("gripper", None, 1), A8[1], A8[2]], A8[3:7]),
    ],
    ids=["chunks-of-B", "default-chunks"],
)
def test_a_small_request_of_another_tenant_is_not_starved_by_a_large_one(payloads, chunk, first, second):
    svc = make_service(payloads, max_batch_size=32, **({} if chunk is None else {"max_chunk_samples": chunk}))
    try:
        size = svc.chunk_samples()
        assert size == (chunk or 8)
        big = svc.submit("arm", observations("arm", 1024, seed=3))
        small = svc.submit("gripper", observations("gripper", 1, seed=4))
        assert svc.queue.depth() == 1024 // size + 1  # the large request's chunks, then the small request
        serve_one_batch(svc)
        serve_one_batch(svc)
        batches = svc.stats()["recent_batches"]
        assert [parts(b) for b in batches] == [first, second]
        assert small.result(timeout=5)["actions"].shape == (1, 4, 2)
        served = sum(len(b["parts"]) for b in batches) - 1
        assert not big.done() and svc.queue.depth() == 1024 // size - served
    finally:
        svc.close()
    with pytest.raises(InferenceQueueClosed):  # closing fails what is left, so no caller hangs
        big.result(timeout=5)


def test_without_splitting_the_large_request_fills_the_first_forward(payloads):
    """What splitting changes: unsplit, the 1,024 samples are one forward ahead of the small one."""
    svc = make_service(payloads, max_batch_size=32, max_chunk_samples=None)
    try:
        svc.submit("arm", observations("arm", 1024, seed=3))
        svc.submit("gripper", observations("gripper", 1, seed=4))
        batch = svc.queue.collect_prefix(32, 0.0)  # formed, not run: its forward is the slow part
        assert [(r.tenant_id, r.size) for r in batch] == [("arm", 1024)]
    finally:
        svc.close()


def test_batches_take_tenants_round_robin_and_fill_with_what_fits(payloads):
    svc = make_service(payloads, max_batch_size=8)
    try:
        svc.submit("arm", observations("arm", 24, seed=5))  # 3 chunks of 8
        svc.submit("rl", observations("rl", 12, seed=6))  # chunks of 8 and 4
        for seed in (7, 8):
            svc.submit("gripper", observations("gripper", 2, seed=seed))
        while svc.queue.depth():
            serve_one_batch(svc)
        assert [parts(b) for b in svc.stats()["recent_batches"]] == [
            [("arm", 0, 8)],
            [("rl", 0, 8)],  # the least recently served tenant goes first
            # One entry per tenant per round: arm's next 8 does not fit and sits this one out.
            [("gripper", None, 2), ("rl", 1, 4), ("gripper", None, 2)],
            [("arm", 1, 8)],
            [("arm", 2, 8)],
        ]
    finally:
        svc.close()


def test_a_failing_chunk_fails_the_request_once_and_its_other_chunks_are_not_run(service, monkeypatch):
    module = service._resolve("arm", None).module

    def explode(*args, **kwargs):
        raise RuntimeError("arm head is broken")

    monkeypatch.setattr(module, "predict", explode)
    future = service.submit("arm", observations("arm", 12, seed=9))  # chunks of 4
    ok = service.submit("gripper", observations("gripper", 1, seed=10))
    serve_one_batch(service)  # arm chunk 0 fails the whole request
    with pytest.raises(RuntimeError, match="arm head is broken"):
        future.result(timeout=5)
    serve_one_batch(service)  # the cancelled chunks 1 and 2 are dropped: only gripper runs
    assert ok.result(timeout=5)["actions"].shape == (1, 4, 2)
    assert service.queue.depth() == 0
    stats = service.stats()
    assert stats["failed_requests"] == 1 and stats["batches"] == 2 and stats["samples"] == 5


def test_a_caller_cancelling_a_split_request_cancels_its_chunks(service):
    future = service.submit("arm", observations("arm", 9, seed=11))
    assert service.queue.depth() == 3
    assert future.cancel()
    assert service.queue.collect_prefix(4, 0.0, poll_s=0.01) == []
    assert service.queue.depth() == 0


def test_max_chunk_samples_is_checked(payloads):
    with pytest.raises(ValueError, match="max_chunk_samples must be >= 1 or None"):
        InferenceModelService(BackboneSource(preset="tiny"), start_worker=False, max_chunk_samples=0)


# -- heartbeat ----------------------------------------------------------------------------------
def test_heartbeat_answers_while_a_batch_runs_and_a_new_instance_has_a_new_incarnation(payloads, monkeypatch):
    svc = make_service(payloads)
    other = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False)
    try:
        beat = svc.heartbeat()
        assert beat["role"] == "inference" and beat["tenants"] == sorted(SHAPES)
        assert len(beat["incarnation"]) == 12 and beat["started_at"] > 0 and beat["queue_depth"] == 0
        assert beat["pid"] == os.getpid()
        assert other.heartbeat()["incarnation"] != beat["incarnation"] and other.heartbeat()["tenants"] == []

        # A batch that cannot finish until we say so: the heartbeat still answers meanwhile.
        module = svc._resolve("arm", None).module
        inside, release = threading.Event(), threading.Event()
        real_predict = module.predict

        def held(*args, **kwargs):
            inside.set()
            assert release.wait(timeout=30)
            return real_predict(*args, **kwargs)

        monkeypatch.setattr(module, "predict", held)
        future = svc.submit("arm", observations("arm", 1, seed=12))
        svc.submit("gripper", observations("gripper", 1, seed=13))
        worker = threading.Thread(target=lambda: svc.execute(svc.queue.collect_prefix(1, 0.0)))
        worker.start()
        assert inside.wait(timeout=30)
        answered: list[dict] = []
        probe = threading.Thread(target=lambda: answered.append(svc.heartbeat()))
        probe.start()
        probe.join(timeout=10)
        release.set()
        worker.join(timeout=30)
        assert answered and answered[0]["incarnation"] == beat["incarnation"] and answered[0]["queue_depth"] == 1
        assert future.result(timeout=5)["actions"].shape == (1, 2, 7)
    finally:
        svc.close()
        other.close()
