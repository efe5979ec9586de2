"""GET /metrics: control, learning and system signals of an in-process deployment after one SFT job
and one predict, parsed with prometheus_client's own parser; the Grafana dashboard only uses
metric names the endpoint exposes."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import sft_spec, write_dataset_for

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deployments" / "grafana" / "joynexus-dashboard.json"
ADMIN_KEY = "metrics-admin-key-0123456789abcdef"
OPERATOR = {"Authorization": f"Bearer {ADMIN_KEY}"}  # /metrics needs the operator (admin) key (issue 26)
TENANT = "metrics-arm"
SHAPE = dict(cameras=("front",), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2)
# starlette's TestClient warns that it will move to httpx2; nothing to act on here.
pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Any:
    from fastapi.testclient import TestClient

    from joynexus.api.app import create_app
    from joynexus.connect import in_process
    from joynexus.settings import Settings

    data_dir = tmp_path_factory.mktemp("metrics")
    cluster = in_process(Settings(data_dir=data_dir))
    app = create_app(cluster, admin_key=ADMIN_KEY)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield app, client, cluster, data_dir
    cluster.close()


@pytest.fixture(scope="module")
def trained(world) -> dict[str, Any]:
    """A tenant that ran a 1-job SFT workload and served one predict."""
    from joynexus.protocol.wire import tensor

    _app, client, _cluster, data_dir = world
    spec = sft_spec(TENANT, data_dir / "datasets" / TENANT, jobs=1, **SHAPE)
    write_dataset_for(spec, episodes=2, length=12)
    created = client.post("/v1/admin/tenants", json=spec, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert created.status_code == 201, created.text
    headers = {"Authorization": f"Bearer {created.json()['key']['api_key']}"}
    submitted = client.post("/v1/workloads", json={"jobs": 1}, headers=headers)
    assert submitted.status_code == 202, submitted.text
    workload_id = submitted.json()["workload_id"]
    deadline = time.monotonic() + 60
    while True:
        status = client.get(f"/v1/workloads/{workload_id}", headers=headers).json()
        if status["state"] in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status["state"] == "completed", status
    rng = np.random.default_rng(0)
    body = {
        "observations": {
            "images": tensor(rng.random((1, 1, 3, 32, 32), dtype=np.float32)).model_dump(mode="json"),
            "state": tensor(rng.standard_normal((1, 4)).astype(np.float32)).model_dump(mode="json"),
        }
    }
    predicted = client.post("/v1/predict", json=body, headers=headers)
    assert predicted.status_code == 200, predicted.text
    return {"headers": headers, "workload_id": workload_id}


def scrape(client: Any) -> dict[str, Any]:
    """One fresh scrape: scrapes within the collector's `min_interval_s` share one answer (by design,
    so a burst of scrapers makes one round of calls), so wait that window out since the last one."""
    from prometheus_client.parser import text_string_to_metric_families

    collector = client.app.state.metrics.collector
    if collector._last is not None:
        time.sleep(max(0.0, collector._last[0] + collector.min_interval_s + 0.05 - time.monotonic()))
    response = client.get("/metrics", headers=OPERATOR)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def value(families: dict[str, Any], name: str, sample: str | None = None, **labels: str) -> float | None:
    for s in families[name].samples:
        if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def test_metrics_after_an_sft_job_and_a_predict(world, trained):
    _app, client, _cluster, _ = world
    families = scrape(client)
    # control
    assert value(families, "joynexus_training_jobs", tenant=TENANT, state="completed") == 1
    assert value(families, "joynexus_workloads", tenant=TENANT, task="sft", state="completed") == 1
    assert value(families, "joynexus_inference_queue_depth") >= 0
    assert "joynexus_training_leases_held" in families and "joynexus_training_queue_partitions" in families
    assert "joynexus_admission_oldest_wait_seconds" in families
    assert value(families, "joynexus_tenants", status="active") >= 1
    # learning
    loss = value(families, "joynexus_train_loss", tenant=TENANT)
    assert loss is not None and math.isfinite(loss)
    assert value(families, "joynexus_policy_version", tenant=TENANT) >= 1
    assert value(families, "joynexus_train_optimizer_steps", tenant=TENANT) >= 1
    # system
    assert value(families, "joynexus_inference_batches", "joynexus_inference_batches_total") >= 1
    assert value(families, "joynexus_inference_mean_batch_samples") >= 1
    latency_count = value(
        families, "joynexus_inference_request_latency_seconds", "joynexus_inference_request_latency_seconds_count"
    )
    assert latency_count >= 1
    assert value(families, "joynexus_device_busy_seconds", service="training") > 0
    assert value(families, "joynexus_device_busy_seconds", service="inference") > 0
    assert value(families, "joynexus_device_seconds", tenant=TENANT, category="training") > 0
    assert value(families, "joynexus_process_resident_memory_bytes", role="api") > 0
    assert value(families, "joynexus_scrape_errors", source="master") == 0


def test_learning_signals_of_the_master(world, trained):
    _app, _client, cluster, _ = world
    signals = cluster.master.learning_signals()[TENANT]
    assert math.isfinite(signals["loss"]) and signals["policy_version"] >= 1
    assert signals["updated_at"] > 0


def test_a_failing_source_is_counted_not_fatal(world, trained):
    app, client, _cluster, _ = world
    collector = app.state.metrics.collector
    calls = collector._calls

    def broken() -> dict[str, Any]:
        found = calls()
        found["inference"] = lambda: (_ for _ in ()).throw(RuntimeError("inference down"))
        return found

    collector._calls, collector._last = broken, None
    try:
        families = scrape(client)
    finally:
        collector._calls, collector._last = calls, None
    assert value(families, "joynexus_scrape_errors", source="inference") >= 1
    assert "joynexus_inference_queue_depth" not in families
    assert value(families, "joynexus_training_jobs", tenant=TENANT, state="completed") == 1


def test_metrics_need_the_operator_key(world, trained):
    """Issue 26: /metrics lists every tenant's series, so by default only the operator (admin) key
    reads it: no key 401, a tenant's key 403 (its own figures are on /v1/usage), the operator 200."""
    from fastapi.testclient import TestClient

    from joynexus.api.app import ApiSettings, create_app

    _app, client, cluster, _ = world
    assert client.get("/metrics").status_code == 401
    made_up = {"Authorization": "Bearer jnx_0000000000000000_" + "x" * 43}
    assert client.get("/metrics", headers=made_up).status_code == 401
    refused = client.get("/metrics", headers=trained["headers"])
    assert refused.status_code == 403 and TENANT not in refused.text
    response = client.get("/metrics", headers=OPERATOR)
    assert response.status_code == 200 and "joynexus_training_jobs" in response.text
    usage = client.get("/v1/usage", headers=trained["headers"])  # the tenant's own figures
    assert usage.status_code == 200 and usage.json()["tenant_id"] == TENANT
    # An operator who wants it open says so.
    public = create_app(cluster, ApiSettings(metrics_public=True), admin_key=ADMIN_KEY)
    with TestClient(public, raise_server_exceptions=False) as open_client:
        assert open_client.get("/metrics").status_code == 200


def _promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are neither functions, keywords nor
    label names (inside {...}, by (...), without (...))."""
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r'"[^"]*"', "", expr)  # strings
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {n for n in names if n.startswith(("joynexus_", "process_"))}


def test_the_dashboard_uses_exposed_metrics(world, trained):
    _app, client, _cluster, _ = world
    families = scrape(client)
    exposed = {s.name for family in families.values() for s in family.samples} | set(families)
    # Families with no sample this scrape (no RL tenant here, no CUDA) still have a TYPE line.
    response = client.get("/metrics", headers=OPERATOR).text
    exposed |= set(re.findall(r"^# TYPE (\S+)", response, flags=re.M))
    exposed |= {f"{name}_total" for name in re.findall(r"^# TYPE (\S+) counter", response, flags=re.M)}
    for suffix in ("_bucket", "_sum", "_count"):
        exposed |= {f"{name}{suffix}" for name in re.findall(r"^# TYPE (\S+) histogram", response, flags=re.M)}

    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "tenant" in variables
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    assert len(panels) >= 12
    used: set[str] = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            used |= _promql_metric_names(target["expr"])
    used |= _promql_metric_names(variables["tenant"]["query"]["query"])
    assert used, "no metric names found in the dashboard"
    # The "Service signals" row reads each service's own endpoint (core.service_metrics), not /metrics.
    from joynexus.core.service_metrics import SERVICE_METRIC_NAMES

    exposed |= {f"{name}{suffix}" for name in SERVICE_METRIC_NAMES for suffix in ("", "_bucket", "_sum", "_count")}
    assert used <= exposed, sorted(used - exposed)


def test_an_evaluation_is_a_learning_signal_and_a_metric(world):
    """An evaluation's success rate and return reach learning_signals and /metrics."""
    _app, client, cluster, _ = world
    from tests.api.test_ray_services import rl_spec

    spec = rl_spec("metrics-eval")
    created = client.post("/v1/admin/tenants", json=spec, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert created.status_code == 201, created.text
    headers = {"Authorization": f"Bearer {created.json()['key']['api_key']}"}
    submitted = client.post("/v1/workloads", json={"task": "eval", "episodes": 2}, headers=headers)
    assert submitted.status_code == 202, submitted.text
    workload_id = submitted.json()["workload_id"]
    deadline = time.monotonic() + 120
    while (status := client.get(f"/v1/workloads/{workload_id}", headers=headers).json())["state"] not in (
        "completed", "failed", "cancelled",
    ):  # fmt: skip
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    assert status["state"] == "completed", status
    result = status["result"]
    signals = cluster.master.learning_signals()["metrics-eval"]
    assert signals["eval_success_rate"] == result["success_rate"]
    assert signals["eval_mean_return"] == pytest.approx(result["mean_return"])
    assert signals["eval_policy_version"] == result["policy_version"]
    families = scrape(client)
    assert value(families, "joynexus_eval_success_rate", tenant="metrics-eval") == result["success_rate"]
    assert value(families, "joynexus_eval_mean_return", tenant="metrics-eval") == pytest.approx(result["mean_return"])
