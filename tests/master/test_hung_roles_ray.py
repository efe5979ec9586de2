"""Hung roles on Ray (issue 25 item 3): each service of a `joynexus up`-style deployment (detached
named actors created by a driver that exits at once) is hung through the debug hook, killed by the
Health Manager and restarted in place by Ray, from handles got by name; the recovery time per role
is measured and printed (`-s` shows it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.slow

ROLES = {
    "training_queue": "joynexus.training_queue",
    "training_service": "joynexus.training_service",
    "inference_service": "joynexus.inference_service",
    "environment_service": "joynexus.environment_service",
}

# The `joynexus up` driver: create the detached services (waiting until each answers), then exit.
UP_DRIVER = """
import sys, ray
from joynexus.master.deployment import create_service_actors
from joynexus.settings import Settings
settings = Settings(data_dir=sys.argv[1], ray_namespace=sys.argv[2], ray_address=sys.argv[3], torch_threads=1)
actors = create_service_actors(settings, detached=True)
ray.get([a.heartbeat.remote() for a in actors], timeout=300)
print("up", flush=True)
"""


@pytest.fixture
def deployment(tmp_path):
    import ray

    from joynexus.actors import init_ray

    init_ray(num_cpus=4)
    namespace = f"hung-{uuid.uuid4().hex[:8]}"
    address = ray.get_runtime_context().gcs_address
    driver = subprocess.run(
        [sys.executable, "-c", UP_DRIVER, str(tmp_path), namespace, address],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert driver.returncode == 0 and "up" in driver.stdout, driver.stderr[-3000:]
    handles = {role: ray.get_actor(name, namespace=namespace) for role, name in ROLES.items()}  # by name
    try:
        yield handles
    finally:
        for handle in handles.values():
            ray.kill(handle, no_restart=True)
        ray.shutdown()


def test_each_hung_service_is_restarted_in_place_after_its_driver_exited(deployment):
    from joynexus.master.health import HealthManager, HealthOptions
    from joynexus.master.hung_roles import HungRoleOptions, hang_heartbeat

    restored: list[str] = []
    options = HealthOptions(
        interval_s=0.25,
        probe_timeout_s=1.0,
        hung=HungRoleOptions(hung_after_s=3.0, restart_budget=3, restart_window_s=600, backoff_s=5.0),
    )
    health = HealthManager(
        deployment,
        check_roles=lambda stale: {},
        on_restart=lambda role, previous, beat: restored.append(role) or "restored",
        options=options,
    ).start()
    recovery: dict[str, float] = {}
    try:
        for role, actor in deployment.items():
            before = health.report()[role]
            assert before["healthy"], before
            pid = health.last_beat(role)["pid"]
            hang_heartbeat(actor, 3600)  # never answers again in this life
            hung_at = time.monotonic()
            deadline = hung_at + 240
            while True:
                entry = health.report()[role]
                if entry["healthy"] and entry["incarnation"] != before["incarnation"]:
                    break
                assert time.monotonic() < deadline, entry
                time.sleep(0.1)
            recovery[role] = round(time.monotonic() - hung_at, 2)
            assert entry["hung_restarts"] == 1 and entry["restarts"] == 1
            assert health.last_beat(role)["pid"] != pid  # a new process, the same named actor
        assert sorted(restored) == sorted(ROLES)
        assert health.escalated() == {}
    finally:
        health.stop()
    print("hung-role recovery seconds (hung_after_s 3, probe every 0.25 s):", json.dumps(recovery))
