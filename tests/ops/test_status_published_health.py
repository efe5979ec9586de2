"""`joynexus status` without a Ray driver (issue 30): the deployment's Master publishes its health
after every Health Manager round (`master/health_snapshot.py`) and status reads it while it is
fresh. A missing, stale or foreign record is never reported: status then asks the actors."""

from __future__ import annotations

import json
import socket
import time

import pytest

from joynexus.master.health import HealthOptions
from joynexus.master.health_snapshot import health_snapshot_path, read_health_snapshot, write_health_snapshot
from joynexus.ops import supervisor
from joynexus.ops.health_report import published_health
from joynexus.settings import Settings
from tests.helpers import wait_for

SERVICE_ROWS = (
    "joynexus.master",
    "joynexus.training_queue",
    "joynexus.training_service",
    "joynexus.inference_service",
    "joynexus.environment_service",
)
ROLE_ROWS = {f"role {r}" for r in ("training_queue", "training_service", "inference_service", "environment_service")}


def _role(healthy: bool = True, detail: str = "ok", incarnation: str | None = "inc1") -> dict:
    return {"healthy": healthy, "incarnation": incarnation, "last_beat_s": 0.1, "restarts": 0, "detail": detail}


def _snapshot(namespace: str = "joynexus", **overrides) -> dict:
    health = {
        "master": _role(detail="up 5 s"),
        "training_queue": _role(),
        "training_service": _role(),
        "inference_service": _role(),
        "environment_service": _role(),
        "actor_loop": _role(incarnation=None),
    }
    health.update(overrides)
    return {
        "namespace": namespace,
        "ping": {"incarnation": "m1", "tenants": 3, "unhealthy_tenants": {"bad": "corrupt"}, "running_workloads": 2},
        "health": health,
        "beats": {
            "training_queue": {"partitions": 4},
            "training_service": {"tenants": ["a", "b"]},
            "inference_service": {"tenants": ["a"], "queue_depth": 7, "replicas": [{"state": "active"}]},
            "environment_service": {},
        },
    }


def _settings(tmp_path, **fields) -> Settings:
    return Settings(data_dir=tmp_path, **fields)


def test_fresh_published_health_gives_the_rows_the_actors_would(tmp_path):
    settings = _settings(tmp_path)
    write_health_snapshot(health_snapshot_path(tmp_path, "joynexus"), _snapshot())
    rows = published_health(settings)
    assert rows is not None and set(SERVICE_ROWS) <= set(rows) and {"role actor_loop", *ROLE_ROWS} <= set(rows)
    assert rows["joynexus.master"]["detail"].startswith("Master Service m1: 3 tenants (1 unhealthy), 2 workloads")
    assert rows["joynexus.training_queue"] == {
        "healthy": True, "where": "joynexus/joynexus.training_queue", "detail": "Training Queue depth: 4 partitions",
        "depth": 4,
    }  # fmt: skip
    assert rows["joynexus.training_service"]["detail"] == "2 tenant slots"
    inference = rows["joynexus.inference_service"]
    assert inference["depth"] == 7 and inference["detail"].endswith("1 tenants served; replicas: 1 active")
    assert rows["role actor_loop"]["where"] == "joynexus.master"


def test_a_role_the_health_manager_sees_restarting_is_reported_down_with_why(tmp_path):
    write_health_snapshot(
        health_snapshot_path(tmp_path, "joynexus"), _snapshot(inference_service=_role(False, "restoring"))
    )
    rows = published_health(_settings(tmp_path))
    assert rows["joynexus.inference_service"]["healthy"] is False
    assert rows["joynexus.inference_service"]["detail"].startswith("restoring")
    role = rows["role inference_service"]
    assert role["healthy"] is False and "restoring" in role["detail"]
    assert rows["joynexus.training_service"]["healthy"] is True


def test_a_stale_foreign_or_torn_record_is_never_reported(tmp_path):
    path = health_snapshot_path(tmp_path, "joynexus")
    assert published_health(_settings(tmp_path)) is None  # none written
    write_health_snapshot(path, _snapshot(namespace="other"))
    assert published_health(_settings(tmp_path)) is None  # a record that names another namespace
    stale = {**_snapshot(), "written_at": time.time() - 60}
    path.write_text(json.dumps(stale))
    assert read_health_snapshot(path) is None and published_health(_settings(tmp_path)) is None
    path.write_text('{"namespace": "joynexus", "ping"')  # a torn write (never by write_health_snapshot)
    assert published_health(_settings(tmp_path)) is None


@pytest.fixture
def ray_port():
    """Something listening where the Ray head would (status first checks the port is open)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_status_reads_fresh_published_health_and_asks_the_actors_otherwise(tmp_path, monkeypatch, ray_port):
    asked = []

    def probe(settings, address, timeout_s):  # the Ray driver path: a subprocess that asks each actor
        asked.append(address)
        return {name: {"healthy": False, "where": address, "detail": "asked the actors"} for name in SERVICE_ROWS}

    monkeypatch.setattr(supervisor, "_actor_health", probe)
    settings = _settings(tmp_path, ray_address=f"127.0.0.1:{ray_port}")
    write_health_snapshot(health_snapshot_path(tmp_path, "joynexus"), _snapshot())
    report = supervisor.status(settings)
    assert asked == [] and report["ray"]["healthy"] and report["joynexus.training_queue"]["depth"] == 4

    path = health_snapshot_path(tmp_path, "joynexus")
    path.write_text(json.dumps({**_snapshot(), "written_at": time.time() - 30}))  # the Master stopped writing
    report = supervisor.status(settings)
    assert asked == [f"127.0.0.1:{ray_port}"] and report["joynexus.master"]["detail"] == "asked the actors"


def test_the_deployments_master_publishes_what_its_health_says(tmp_path):
    """A Master with `publish_health` (the detached one `joynexus up` creates) writes after every round."""
    from joynexus.master.deployment import Deployment
    from joynexus.master.service import MasterOptions, MasterService

    settings = Settings(data_dir=tmp_path / "data", torch_threads=1)
    options = MasterOptions(health=HealthOptions(interval_s=0.1))
    master = MasterService(deployment=Deployment.in_process(settings), options=options, publish_health=True)
    try:
        rows = wait_for(lambda: published_health(settings), "the published health")
        health = master.health()
        for role in ("training_queue", "training_service", "inference_service", "environment_service"):
            assert rows[f"role {role}"]["healthy"] == health[role]["healthy"] is True
            assert rows[f"role {role}"]["where"] == f"incarnation {health[role]['incarnation']}"
        assert rows["joynexus.master"]["detail"].startswith(f"Master Service {master.incarnation}: 0 tenants")
    finally:
        master.close()
    path = health_snapshot_path(settings.data_dir, settings.ray_namespace)
    assert json.loads(path.read_text())["namespace"] == settings.ray_namespace
