"""Issue 26: abandoned inference work leaves the queue, and a tenant's queued samples are bounded.

Real services with the worker off (nothing is served unless the test runs a batch), so what the
queue holds is exact: a predict that times out, a request cancelled by its key (also a cancel that
arrives before its request), a split request's chunks, and the same through a replica set."""

from __future__ import annotations

import pickle

import pytest

from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.inference_queue import TenantQueueFull
from joynexus.services.inference.replicas import InferenceReplicaSet, LocalReplicas
from joynexus.settings import ScalingPolicy
from tests.services.test_inference_fairness import make_service, observations, payloads  # noqa: F401


@pytest.fixture
def service(payloads):  # noqa: F811
    svc = make_service(payloads, max_batch_size=8, max_chunk_samples=4, max_queued_samples_per_tenant=64)
    yield svc
    svc.close()


def test_a_predict_that_times_out_leaves_none_of_its_chunks_queued(service):
    with pytest.raises(TimeoutError):
        service.predict("arm", observations("arm", 40, 0), timeout_s=0.01)  # 10 chunks, never served
    assert service.queue.depth("arm") == 0 and service.queue.queued_samples("arm") == 0
    assert service.stats()["queue_depth"] == 0 and service.stats()["queued_samples"] == 0


def test_a_request_cancelled_by_its_key_leaves_the_queue_also_when_the_cancel_comes_first(service):
    kept = service.submit("gripper", observations("gripper", 3, 1))  # another tenant's: untouched
    future = service.submit("arm", observations("arm", 12, 2), request_key="robot-7")
    assert service.queue.depth("arm") == 3 and service.queue.queued_samples("arm") == 12
    assert service.cancel("arm", "robot-7") is True and future.cancelled()
    assert service.queue.depth("arm") == 0 and service.queue.queued_samples("arm") == 0
    assert service.cancel("gripper", "robot-7") is False  # a tenant cancels only its own keys
    early = service.cancel("arm", "late-1")  # the cancel overtook its request
    late = service.submit("arm", observations("arm", 5, 3), request_key="late-1")
    assert early is False and late.cancelled() and service.queue.depth("arm") == 0
    assert service.queue.depth("gripper") == 1 and not kept.done()
    with pytest.raises(ValueError, match="request_key"):
        service.submit("arm", observations("arm", 1, 4), request_key="")
    assert service.queue.depth("arm") == 0


def test_a_tenants_queued_samples_are_bounded_and_the_refusal_names_the_setting(service):
    first = service.submit("arm", observations("arm", 60, 5))
    with pytest.raises(TenantQueueFull) as refused:
        service.submit("arm", observations("arm", 5, 6))
    message = str(refused.value)
    assert "limit of 64 queued samples per tenant" in message and "JOYNEXUS_MAX_QUEUED_SAMPLES_PER_TENANT" in message
    assert service.queue.queued_samples("arm") == 60  # nothing of the refused request was queued
    assert service.submit("gripper", observations("gripper", 64, 7)) is not None  # another tenant's own bound
    first.cancel()  # the tenant's own backlog gone: it may send again
    assert service.submit("arm", observations("arm", 5, 8)) is not None
    again = pickle.loads(pickle.dumps(refused.value))  # crosses Ray as itself
    assert isinstance(again, TenantQueueFull) and str(again) == message


def test_a_replica_set_cancels_on_the_replica(payloads):  # noqa: F811
    factory = LocalReplicas(BackboneSource(preset="tiny"), {"num_threads": 1, "start_worker": False})
    replicas = InferenceReplicaSet(factory, policy=ScalingPolicy(min_replicas=1, max_replicas=1))
    try:
        for payload in payloads.values():
            replicas.load_weights(payload)
        (replica,) = replicas._active()
        queue = replica.handle.target.queue
        with pytest.raises(TimeoutError):
            replicas.predict("arm", observations("arm", 20, 0), timeout_s=0.01)
        assert queue.depth() == 0
        future = replicas.submit("arm", observations("arm", 20, 1), request_key="k")
        assert queue.depth("arm") > 0
        assert replicas.cancel("arm", "k") is True and future.cancelled()
        assert queue.depth() == 0
        assert replicas.stats()["failed_requests"] == 0  # given up on, not failed
    finally:
        replicas.close()
