"""Issue 26 item 1: nobody without a valid key can evict a tenant's idempotency entries.

Before the fix the cache was keyed on the raw Authorization header before authentication and
tracked at most 1,024 callers: 1,100 POSTs with made-up keys (answered 404) pushed a tenant's kept
answer out, and its retried train step was applied twice. Now the key is verified first and answers
are kept per authenticated tenant."""

from __future__ import annotations

import time

import httpx

from tests.security.conftest import serving_tenant, wire

FLOOD = 1100  # more made-up callers than the old cache tracked (1,024)


def test_an_unauthenticated_flood_does_not_evict_a_tenants_idempotent_step(api, live_server):
    t = serving_tenant(api, "idem-victim")
    batch = wire(t.batch(2, seed=3))
    keyed = {**t.headers, "Idempotency-Key": "victim-step-1"}
    with httpx.Client(base_url=live_server, timeout=60) as client:
        first = client.post("/v1/train_batch", json=batch, headers=keyed)
        assert first.status_code == 200, first.text
        steps = first.json()["optimizer_steps"]
        started = time.perf_counter()
        for i in range(FLOOD):  # made-up keys, each its own "caller", to a path with no route
            flood = client.post(
                f"/v1/no-such-route-{i}",
                content=b"{}",
                headers={"Authorization": f"Bearer made-up-{i}", "Idempotency-Key": f"k-{i}"},
            )
            assert flood.status_code in (401, 404), flood.text
        flood_s = time.perf_counter() - started
        retried = client.post("/v1/train_batch", json=batch, headers=keyed)  # the client's retry
        assert retried.status_code == 200, retried.text
        assert retried.headers.get("idempotent-replayed") == "true", f"the step ran again after a {flood_s:.1f} s flood"
        assert retried.json() == first.json()
        versions = client.get("/v1/versions", headers=t.headers).json()
    assert versions["optimizer_steps"] == steps  # applied once
