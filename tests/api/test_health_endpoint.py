"""`GET /v1/health` tells the truth per role: the Master, its own threads and every service, from
the Health Manager's heartbeats (a role restarted in place shows its restarts and why)."""

from __future__ import annotations

import time

ROLES = {
    "master", "training_queue", "training_service", "inference_service", "environment_service",
    "actor_loop", "producer_follower", "admission", "producers",
}  # fmt: skip


def test_health_reports_every_role(api):
    body = api.client.get("/v1/health").json()
    assert body["status"] == "ok" and set(body["roles"]) == ROLES
    for role, entry in body["roles"].items():
        assert entry["healthy"] and entry["restarts"] >= 0, (role, entry)
    assert body["roles"]["training_service"]["incarnation"]


def test_a_dead_role_shows_until_it_is_restarted_in_place(api):
    master = api.cluster.master
    manager = master.workloads
    health = master.health_manager
    health.stop()  # hold the next round so the report can be read while the role is down
    try:
        role = manager.roles.role("producer_follower")
        before = role.restarts
        role.stop.set()
        role.thread.join(timeout=10)
        health.check()
        # check() restarted it at once; the report says so, with the reason.
        body = api.client.get("/v1/health").json()
        entry = body["roles"]["producer_follower"]
        assert entry["restarts"] == before + 1 and entry["detail"].startswith("died")
    finally:
        health.start()
    deadline = time.monotonic() + 10
    while api.client.get("/v1/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
