"""Promotion on every path (issue 25 item 2): a workload submitted through the API, the main job on
Ray and the tenant-lifecycle flow all register a version, move `candidate`, and move `champion` by
the Master's ONE rule: the tenant's declared metric (here the held-out loss of a dataset-only
tenant, `dataset.validation_episodes`), logged on the registered version."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from joynexus.registry import CANDIDATE_ALIAS, CHAMPION_ALIAS
from tests.flows.conftest import prefect_api  # noqa: F401  (the flow path's Prefect API fixture)
from tests.helpers import sft_spec, write_dataset_for

ADMIN_KEY = "test-admin-key-promotion-0123456789"
HELDOUT = "eval/heldout_loss"


def heldout_spec(tenant: str, root: Any, **promotion: Any) -> dict[str, Any]:
    """A dataset-only SFT tenant whose last episode is held out for its promotion metric."""
    spec = sft_spec(tenant, root, jobs=1, samples_per_job=16, microbatch_size=8, lr=1e-2)
    spec["dataset"]["validation_episodes"] = 1
    spec["promotion"] = promotion
    return spec


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from fastapi.testclient import TestClient

    from joynexus.api.app import create_app
    from joynexus.connect import in_process, use_cluster
    from joynexus.settings import Settings

    root = tmp_path_factory.mktemp("promotion")
    cluster = in_process(Settings(data_dir=root / "data", torch_threads=1))
    dataset = root / "ds"
    write_dataset_for(heldout_spec("shape", dataset), episodes=3, length=12)
    from flows.tasks import shared_tracker

    previous = use_cluster(cluster)  # the flows' `shared()` is this deployment
    shared_tracker.cache_clear()  # and their MLflow client its tracking store (an earlier test's is cached)
    try:
        with TestClient(create_app(cluster, admin_key=ADMIN_KEY), raise_server_exceptions=False) as client:
            yield cluster, client, dataset
    finally:
        use_cluster(previous)
        shared_tracker.cache_clear()
        cluster.close()


def _api_train(client: Any, key: str, jobs: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    response = client.post("/v1/workloads", json={"jobs": jobs}, headers=headers)
    assert response.status_code == 202, response.text
    workload_id = response.json()["workload_id"]
    deadline = time.monotonic() + 120
    while True:
        status = client.get(f"/v1/workloads/{workload_id}", headers=headers).json()
        if status["state"] in ("completed", "failed", "cancelled"):
            assert status["state"] == "completed", status
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


def _aliases(tracker: Any, tenant: str) -> tuple[int | None, int | None]:
    return tracker.alias_version(tenant, CANDIDATE_ALIAS), tracker.alias_version(tenant, CHAMPION_ALIAS)


def _create(client: Any, spec: dict[str, Any]) -> str:
    response = client.post("/v1/admin/tenants", json=spec, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 201, response.text
    return response.json()["key"]["api_key"]


def test_api_path_sets_candidate_and_moves_champion_only_when_heldout_loss_improves(world):
    cluster, client, dataset = world
    tracker = cluster.master.deployment.tracker
    key = _create(client, heldout_spec("api-heldout", dataset))
    first = _api_train(client, key, jobs=1)
    assert first["registered_version"] == 1
    assert (
        tracker.alias_version("api-heldout", CANDIDATE_ALIAS)
        == tracker.alias_version("api-heldout", CHAMPION_ALIAS)
        == 1
    )
    v1 = tracker.evaluation_metric("api-heldout", 1, HELDOUT)
    assert v1 is not None and v1 > 0
    tags = tracker.model_version_tags("api-heldout", 1)  # the metrics are on the version ...
    assert float(tags[HELDOUT]) == v1 and float(tags["eval/heldout_frames"]) == 12
    run = tracker.client.get_run(cluster.master.get_workload(first["workload_id"]).run_id)
    assert run.data.metrics[HELDOUT] == v1  # ... and on the run that registered it

    second = _api_train(client, key, jobs=6)  # more training: a lower held-out loss
    assert second["registered_version"] == 2
    v2 = tracker.evaluation_metric("api-heldout", 2, HELDOUT)
    decision = cluster.master.get_workload(second["workload_id"]).result["promotion"]
    assert decision["metric"] == HELDOUT and decision["value"] == v2 and decision["champion_value"] == v1
    assert tracker.alias_version("api-heldout", CANDIDATE_ALIAS) == 2
    assert decision["promoted"] == (v2 < v1)
    assert tracker.alias_version("api-heldout", CHAMPION_ALIAS) == (2 if v2 < v1 else 1)
    assert v2 < v1, (v1, v2)  # six jobs at lr 1e-2 fit the synthetic task far better than one
    print(f"held-out loss: v1 (1 job) {v1:.4f}, v2 (+6 jobs) {v2:.4f}")


def test_champion_stays_when_the_new_version_does_not_win_by_the_declared_margin(world):
    cluster, client, dataset = world
    tracker = cluster.master.deployment.tracker
    key = _create(client, heldout_spec("api-margin", dataset, min_improvement=1e6))
    _api_train(client, key, jobs=1)
    second = _api_train(client, key, jobs=2)
    assert tracker.alias_version("api-margin", CANDIDATE_ALIAS) == 2
    assert tracker.alias_version("api-margin", CHAMPION_ALIAS) == 1
    decision = cluster.master.get_workload(second["workload_id"]).result["promotion"]
    assert not decision["promoted"] and "does not beat champion v1" in decision["reason"]
    assert tracker.evaluation_metric("api-margin", 2, HELDOUT) is not None  # measured all the same


def test_a_tenant_without_a_measurable_metric_has_its_champion_follow_every_version(world):
    cluster, client, dataset = world
    tracker = cluster.master.deployment.tracker
    spec = heldout_spec("api-plain", dataset)
    spec["dataset"]["validation_episodes"] = 0
    key = _create(client, spec)
    _api_train(client, key, jobs=1)
    _api_train(client, key, jobs=1)
    assert (
        tracker.alias_version("api-plain", CANDIDATE_ALIAS) == tracker.alias_version("api-plain", CHAMPION_ALIAS) == 2
    )


def test_a_metric_the_tenant_cannot_measure_is_refused_naming_the_field(world):
    cluster, client, dataset = world
    from joynexus.spec import SpecError, parse_workload_spec

    spec = heldout_spec("bad-metric", dataset, metric="heldout_loss")
    spec["dataset"]["validation_episodes"] = 0
    with pytest.raises(SpecError, match=r"promotion.*validation_episodes"):
        parse_workload_spec(spec)
    spec = heldout_spec("bad-metric", dataset, metric="success_rate")
    with pytest.raises(SpecError, match=r"promotion.*environment"):
        parse_workload_spec(spec)


def test_flow_path_calls_the_masters_rule_and_periodic_evaluation_covers_dataset_only_tenants(world, prefect_api):  # noqa: F811
    from flows.periodic_evaluation import periodic_evaluation
    from flows.tenant_lifecycle import tenant_lifecycle

    cluster, _, dataset = world
    tracker = cluster.master.deployment.tracker
    result = tenant_lifecycle(heldout_spec("flow-heldout", dataset))
    decision = result["promotion"]
    assert decision["version"] == 1 and decision["promoted"] and decision["metric"] == HELDOUT
    assert result["evaluation"]["value"] == tracker.evaluation_metric("flow-heldout", 1, HELDOUT)
    assert (
        tracker.alias_version("flow-heldout", CANDIDATE_ALIAS)
        == tracker.alias_version("flow-heldout", CHAMPION_ALIAS)
        == 1
    )

    swept = periodic_evaluation(tenants=["flow-heldout", "api-heldout", "api-plain"])
    assert swept["flow-heldout"]["status"] == "evaluated" and HELDOUT in swept["flow-heldout"]["metrics"]
    assert swept["api-heldout"]["status"] == "evaluated"  # trained through the API: covered too
    assert swept["api-plain"]["status"] == "skipped"  # nothing to measure it by
    history = swept["flow-heldout"]["history_run"]
    assert tracker.metric_history(history, "registry_version") == [(0, 1.0)]


@pytest.fixture
def local_ray():
    import ray

    from joynexus.actors import init_ray

    init_ray(num_cpus=2)
    yield
    ray.shutdown()


# Slow (about 70 s: a Ray deployment of its own); the main job on Ray stays in the default suite
# (tests/test_main_job.py), and the promotion rule in the in-process tests above.
@pytest.mark.slow
def test_main_job_path_on_ray_registers_both_aliases_with_the_heldout_loss(local_ray, tmp_path):
    from joynexus.registry import ExperimentTracker
    from joynexus.settings import Settings
    from recipes.main_job import DEMO_TENANTS, run_demo

    settings = Settings(data_dir=tmp_path, ray_namespace=f"test-{uuid.uuid4().hex[:8]}", torch_threads=1)
    result = run_demo(settings, tenants=DEMO_TENANTS[:1], simulators=False, jobs_per_tenant=1, samples_per_job=16)
    tenant = DEMO_TENANTS[0].tenant
    status = result.statuses[tenant]
    assert status.state == "completed" and status.registered_version == 1, status
    assert status.result["promotion"]["metric"] == HELDOUT and status.result["promotion"]["promoted"]
    tracker = ExperimentTracker(settings.resolved_mlflow_uri())
    assert _aliases(tracker, tenant) == (1, 1)
    assert tracker.evaluation_metric(tenant, 1, HELDOUT) == status.result["promotion"]["value"]
