"""Inference Scheduler (`TenantFairQueue`): FIFO-compatible batches of target size B within max
wait T, an incompatible head waits at most one batch, a closed queue fails what is pending; and
fairness across tenants: batches interleave tenants least recently served first, each tenant's own
order is kept, cancelled entries never run, and no tenant with pending work is starved."""

from __future__ import annotations

import threading
import time

import pytest

from joynexus.scheduling.inference_queue import (
    InferenceQueueClosed,
    InferenceRequest,
    Observation,
    TenantFairQueue,
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
    q = TenantFairQueue()
    reqs = [req(tenant=f"t{i % 3}") for i in range(10)]  # three tenants, one interface
    for r in reqs:
        q.enqueue(r)
    ids = [r.request_id for r in reqs]
    assert drain(q, 4, 0.01) == [ids[0:4], ids[4:8], ids[8:10]]


def test_the_head_waits_at_most_t_for_a_partial_batch():
    q = TenantFairQueue()
    q.enqueue(req())
    started = time.monotonic()
    batch = q.collect_prefix(max_batch_size=8, timeout_s=0.2)
    assert len(batch) == 1
    assert time.monotonic() - started >= 0.15  # it did wait for company, up to T


def test_a_full_batch_dispatches_without_waiting_for_t():
    q = TenantFairQueue()
    got = []
    worker = threading.Thread(target=lambda: got.append(q.collect_prefix(3, timeout_s=30.0)))
    worker.start()
    for _ in range(3):
        q.enqueue(req())
    worker.join(timeout=10)
    assert not worker.is_alive() and len(got[0]) == 3  # B reached long before T = 30 s


def test_batches_never_mix_prefix_keys_and_incompatible_requests_are_not_starved():
    q = TenantFairQueue()
    a1, b1, a2, a3, b2 = req("A"), req("B"), req("A"), req("A"), req("B")
    for r in (a1, b1, a2, a3, b2):
        q.enqueue(r)
    batches = drain(q, 8, 1.0)  # dispatch happens because the prefix is blocked, well before T
    assert batches == [[a1.request_id], [b1.request_id], [a2.request_id, a3.request_id], [b2.request_id]]


def test_different_tenants_with_the_same_prefix_share_a_batch():
    q = TenantFairQueue()
    for tenant in ("arm", "gripper", "humanoid"):
        q.enqueue(req(tenant=tenant))
    batch = q.collect_prefix(3, 1.0)
    assert {r.tenant_id for r in batch} == {"arm", "gripper", "humanoid"}


def test_sample_counts_bound_the_batch_and_an_oversize_request_still_runs():
    q = TenantFairQueue()
    big, small1, small2 = req(n=5), req(n=2), req(n=2)
    for r in (big, small1, small2):
        q.enqueue(r)
    assert [r.request_id for r in q.collect_prefix(4, 0.01)] == [big.request_id]
    assert [r.request_id for r in q.collect_prefix(4, 0.01)] == [small1.request_id, small2.request_id]


def test_idle_poll_returns_empty_and_close_fails_pending_requests():
    q = TenantFairQueue()
    assert q.collect_prefix(4, 1.0, poll_s=0.05) == []
    pending = q.enqueue(req())
    q.close()
    with pytest.raises(InferenceQueueClosed):
        pending.result(timeout=1)
    with pytest.raises(InferenceQueueClosed):
        q.enqueue(req())
    with pytest.raises(ValueError, match="at least one observation"):
        TenantFairQueue().enqueue(InferenceRequest("t", "s", ("m",), observations=[]))
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        TenantFairQueue().collect_prefix(0, 1.0)


# -- fairness across tenants ----------------------------------------------------------------------
def test_the_fair_queue_interleaves_tenants_keeps_each_tenants_order_and_drops_cancelled_entries():
    q = TenantFairQueue()
    a = [req(tenant="a") for _ in range(4)]
    b = [req(tenant="b") for _ in range(2)]
    c = req("other", tenant="c")  # another prefix key: never in a batch with the others
    for r in [*a, *b, c]:
        q.enqueue(r)
    a[1].future.cancel()  # its caller gave up: dropped, never run
    batch = q.collect_prefix(4, 60.0)  # due at once: the other prefix key cannot join
    assert batch == [a[0], b[0], a[2], b[1]]
    assert q.collect_prefix(4, 60.0) == [c]  # c never got a turn before, so it goes before a
    assert q.collect_prefix(4, 0.0) == [a[3]]
    assert q.depth() == 0 and q.collect_prefix(4, 60.0, poll_s=0.01) == []
    q.enqueue(late := req(tenant="a"))
    q.close()
    with pytest.raises(InferenceQueueClosed):
        late.future.result(timeout=1)
    with pytest.raises(InferenceQueueClosed):
        q.enqueue(req(tenant="a"))


def test_a_backlogged_tenant_does_not_delay_a_newcomer_beyond_one_batch():
    q = TenantFairQueue()
    bulk = [req(tenant="bulk") for _ in range(20)]
    for r in bulk:
        q.enqueue(r)
    assert q.collect_prefix(4, 0.0) == bulk[0:4]  # alone: a FIFO prefix of B
    newcomer = req(tenant="newcomer")
    q.enqueue(newcomer)
    # The newcomer was never served, the bulk tenant just was: it goes first, then bulk fills B.
    assert q.collect_prefix(4, 0.0) == [newcomer, *bulk[4:7]]
    assert q.collect_prefix(4, 0.0) == bulk[7:11]


def test_an_incompatible_tenant_waits_at_most_one_batch_and_then_leads():
    q = TenantFairQueue()
    a = [req("A", tenant="a") for _ in range(6)]
    b = req("B", tenant="b")
    q.enqueue(a[0])
    q.enqueue(b)
    for r in a[1:]:
        q.enqueue(r)
    started = time.monotonic()
    assert q.collect_prefix(8, 60.0) == a  # b's key differs: it sits this batch out, a's whole FIFO runs
    assert time.monotonic() - started < 30.0  # due at once: waiting could not grow the batch
    assert q.collect_prefix(8, 0.0) == [b]


def test_every_tenant_with_pending_work_is_served_within_as_many_batches_as_tenants():
    q = TenantFairQueue()
    tenants = [f"t{i}" for i in range(5)]
    for _ in range(3):
        for tenant in tenants:
            q.enqueue(req(n=4, tenant=tenant))  # each entry fills B: one tenant per batch
    served = [q.collect_prefix(4, 0.0)[0].tenant_id for _ in range(15)]
    for start in range(0, 15, 5):
        assert sorted(served[start : start + 5]) == tenants  # a full round before anyone goes twice
    assert q.depth() == 0


def test_enqueue_many_is_all_or_nothing_and_depth_counts_entries():
    q = TenantFairQueue()
    chunks = [req(tenant="a", n=2) for _ in range(3)]
    q.enqueue_many(chunks)
    assert q.depth() == 3
    q.close()
    with pytest.raises(InferenceQueueClosed):
        q.enqueue_many([req(tenant="a"), req(tenant="b")])
    assert q.depth() == 0
    with pytest.raises(ValueError, match="at least one observation"):  # checked before any is enqueued
        TenantFairQueue().enqueue_many([req(), InferenceRequest("t", "s", ("m",), observations=[])])
