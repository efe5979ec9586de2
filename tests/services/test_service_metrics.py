"""Each service's own signals (issue 25.4), without the API server: training step latency and
throughput and policy staleness from the Training Model Service, weight-sync time from the
Inference Model Service, environment step latency from the Environment Service; the per-process
HTTP endpoint (JOYNEXUS_METRICS_PORT) and the Grafana row that shows them."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from joynexus.core.service_metrics import (
    METRICS_PORT_SPAN,
    SERVICE_METRIC_NAMES,
    ServiceMetrics,
    metrics_port_from_env,
    service_metrics,
)
from joynexus.scheduling.training_jobs import TrainingJob

DASHBOARD = Path(__file__).resolve().parents[2] / "deployments" / "grafana" / "joynexus-dashboard.json"
ROW_TITLE = "Service signals (each service's own endpoint)"


def _value(name: str, labels: dict[str, str] | None = None) -> float:
    return service_metrics().registry.get_sample_value(name, labels or {}) or 0.0


def test_training_service_reports_steps_jobs_and_samples(world):
    """`world` (tests/services/conftest.py): one Training Model Service with tenants alpha, beta."""
    from joynexus.master.loops.actor_loop import ActorLoop
    from tests.services.test_training_service import producer

    jobs_before = _value("joynexus_training_jobs_total", {"tenant": "alpha"})
    samples_before = _value("joynexus_training_samples_total", {"tenant": "alpha"})
    steps_before = _value("joynexus_training_step_seconds_count", {"mode": "serial"})
    producer(world, "alpha").produce_once()  # 16 samples, microbatch 8: two steps
    assert ActorLoop(world["scheduler"], world["service"]).step().state == "completed"
    assert _value("joynexus_training_jobs_total", {"tenant": "alpha"}) == jobs_before + 1
    assert _value("joynexus_training_samples_total", {"tenant": "alpha"}) == samples_before + 16
    assert _value("joynexus_training_step_seconds_count", {"mode": "serial"}) == steps_before + 2
    assert _value("joynexus_training_step_seconds_sum", {"mode": "serial"}) > 0

    grouped_before = _value("joynexus_training_step_seconds_count", {"mode": "grouped"})
    producer(world, "alpha").produce_once()
    producer(world, "beta").produce_once()
    outcomes = ActorLoop(world["scheduler"], world["service"], group_max=2).step_all()
    assert [o.state for o in outcomes] == ["completed", "completed"]
    assert _value("joynexus_training_step_seconds_count", {"mode": "grouped"}) > grouped_before


def test_policy_staleness_is_the_version_gap_of_the_last_rl_job():
    metrics = ServiceMetrics()
    job = TrainingJob(
        job_id="j", policy_key="rl-t:rl", tenant_id="rl-t", task_type="rl", partition_id="p", sample_count=4,
        domain="vla", metadata={}, priority=0, created_seq=1, ready_seq=1, behavior_policy_version=3,
        max_policy_staleness=2, producer_role="rollout", consumer_role="actor", state="leased",
        lease_owner="a", terminal_reason=None,
    )  # fmt: skip
    metrics.observe_job(job, {"tenant_id": "rl-t", "samples": 4, "version": 6}, start_version=5)
    assert metrics.registry.get_sample_value("joynexus_policy_staleness", {"tenant": "rl-t"}) == 2
    assert metrics.registry.get_sample_value("joynexus_training_samples_total", {"tenant": "rl-t"}) == 4


def test_inference_weight_sync_and_environment_step_latency(world):
    from joynexus.models.backbone import BackboneSource
    from joynexus.services.environment.service import EnvironmentService
    from joynexus.services.inference.service import InferenceModelService

    payload = world["service"].export_params("alpha")
    inference = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False, num_threads=1)
    before = _value("joynexus_weight_sync_seconds_count")
    inference.load_weights(payload)
    assert _value("joynexus_weight_sync_seconds_count") == before + 1

    env = EnvironmentService(max_sessions=1)
    try:
        session_id = env.open_session("t-env", "rollout-0", {"simulator": "pusht", "task": "PushT-v0"})
        env.reset("t-env", session_id, seed=0)
        steps_before = _value("joynexus_env_step_seconds_count")
        env.step("t-env", session_id, [0.0, 0.0])
        env.batch_step("t-env", {session_id: [0.0, 0.0]})
        assert _value("joynexus_env_step_seconds_count") == steps_before + 2
    finally:
        env.close_all()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_process_registry_serves_over_http_on_the_first_free_port(monkeypatch):
    port = _free_port()
    first, second = ServiceMetrics(), ServiceMetrics()
    first.training_step_seconds.labels("grouped").observe(0.02)
    assert first.serve(port) == port and first.serve(port) == port  # idempotent
    assert second.serve(port) == port + 1  # a second service process on the node takes the next
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"joynexus_training_step_seconds", "joynexus_weight_sync_seconds", "joynexus_env_step_seconds"} <= set(
        families
    )
    count = [s for s in families["joynexus_training_step_seconds"].samples if s.name.endswith("_count")]
    assert count[0].labels == {"mode": "grouped"} and count[0].value == 1

    monkeypatch.setenv("JOYNEXUS_METRICS_PORT", "0")
    assert metrics_port_from_env() == 0
    monkeypatch.setenv("JOYNEXUS_METRICS_PORT", "x")
    with pytest.raises(ValueError, match="JOYNEXUS_METRICS_PORT must be a port number"):
        metrics_port_from_env()
    monkeypatch.setenv("JOYNEXUS_METRICS_PORT", str(65535 - METRICS_PORT_SPAN + 1))
    with pytest.raises(ValueError, match="JOYNEXUS_METRICS_PORT must be in"):
        metrics_port_from_env()


def test_the_dashboard_row_shows_every_service_signal():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    row = next(i for i, p in enumerate(panels) if p.get("type") == "row" and p["title"] == ROW_TITLE)
    row_panels = []
    for panel in panels[row + 1 :]:
        if panel.get("type") == "row":
            break
        row_panels.append(panel)
    used: set[str] = set()
    for panel in row_panels:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            used |= {
                re.sub(r"_(bucket|sum|count)$", "", name)
                for name in re.findall(r"\b(joynexus_[a-z_]+)\b", target["expr"])
            }
    assert used == set(SERVICE_METRIC_NAMES)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
