"""Inference Scheduler: largest FIFO-compatible prefix, target size B, max wait T, no starvation."""

from __future__ import annotations

import threading
import time

import pytest

from joynexus.scheduling.inference_queue import (
    InferenceQueue,
    InferenceQueueClosed,
    InferenceRequest,
    Observation,
)

OBS = Observation(images=(), state=())


def req(key="m1", n=1, tenant="t"):
    return InferenceRequest(tenant_id=tenant, schema_signature="s", prefix_key=(key,), observations=[OBS] * n)


def drain(q, b, t):
    batches = []
    while q.depth():
        batches.append([r.request_id for r in q.collect_prefix(b, t)])
    return batches


def test_batches_reach_target_size_in_fifo_order():
    q = InferenceQueue()
    reqs = [req(tenant=f"t{i % 3}") for i in range(10)]  # three tenants, one interface
    for r in reqs:
        q.enqueue(r)
    ids = [r.request_id for r in reqs]
    assert drain(q, 4, 0.01) == [ids[0:4], ids[4:8], ids[8:10]]


def test_the_head_waits_at_most_t_for_a_partial_batch():
    q = InferenceQueue()
    q.enqueue(req())
    started = time.monotonic()
    batch = q.collect_prefix(max_batch_size=8, timeout_s=0.2)
    assert len(batch) == 1
    assert time.monotonic() - started >= 0.15  # it did wait for company, up to T


def test_a_full_batch_dispatches_without_waiting_for_t():
    q = InferenceQueue()
    got = []
    worker = threading.Thread(target=lambda: got.append(q.collect_prefix(3, timeout_s=30.0)))
    worker.start()
    for _ in range(3):
        q.enqueue(req())
    worker.join(timeout=10)
    assert not worker.is_alive() and len(got[0]) == 3  # B reached long before T = 30 s


def test_batches_never_mix_prefix_keys_and_incompatible_requests_are_not_starved():
    q = InferenceQueue()
    a1, b1, a2, a3, b2 = req("A"), req("B"), req("A"), req("A"), req("B")
    for r in (a1, b1, a2, a3, b2):
        q.enqueue(r)
    batches = drain(q, 8, 1.0)  # dispatch happens because the prefix is blocked, well before T
    assert batches == [[a1.request_id], [b1.request_id], [a2.request_id, a3.request_id], [b2.request_id]]


def test_different_tenants_with_the_same_prefix_share_a_batch():
    q = InferenceQueue()
    for tenant in ("arm", "gripper", "humanoid"):
        q.enqueue(req(tenant=tenant))
    batch = q.collect_prefix(3, 1.0)
    assert {r.tenant_id for r in batch} == {"arm", "gripper", "humanoid"}


def test_sample_counts_bound_the_batch_and_an_oversize_request_still_runs():
    q = InferenceQueue()
    big, small1, small2 = req(n=5), req(n=2), req(n=2)
    for r in (big, small1, small2):
        q.enqueue(r)
    assert [r.request_id for r in q.collect_prefix(4, 0.01)] == [big.request_id]
    assert [r.request_id for r in q.collect_prefix(4, 0.01)] == [small1.request_id, small2.request_id]


def test_idle_poll_returns_empty_and_close_fails_pending_requests():
    q = InferenceQueue()
    assert q.collect_prefix(4, 1.0, poll_s=0.05) == []
    pending = q.enqueue(req())
    q.close()
    with pytest.raises(InferenceQueueClosed):
        pending.result(timeout=1)
    with pytest.raises(InferenceQueueClosed):
        q.enqueue(req())
    with pytest.raises(ValueError, match="at least one observation"):
        InferenceQueue().enqueue(InferenceRequest("t", "s", ("m",), observations=[]))
