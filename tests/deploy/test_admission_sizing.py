"""The admission limits are settings of the deployment (issue 43.9): JOYNEXUS_MAX_RUNNING_WORKLOADS, read
where the Master's options are made, and JOYNEXUS_PRODUCER_CONCURRENT_ROLLOUTS, each producer
replica's (issue 40 moved the rollouts out of the Master) (`joynexus up`, the
services Job, whose pod gets deployments/config.yaml), sized in config.yaml against the deployment's
other bounds, and overridable by infra/scripts/render-deployment. With the deployment's value a ninth
tenant's workload runs instead of waiting behind eight."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from joynexus.master.deployment import Deployment
from joynexus.master.options import MasterOptions
from joynexus.master.workloads.manager import WorkloadManager
from joynexus.settings import Settings
from tests.deploy.render import DEPLOYMENTS, REPO, by_key, rendered
from tests.helpers import sft_spec, write_dataset_for

RENDER = REPO / "infra" / "scripts" / "render-deployment"


def config() -> dict[str, str]:
    return by_key(rendered(DEPLOYMENTS))[("ConfigMap", "joynexus-config")]["data"]


def test_the_limits_are_settings_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("JOYNEXUS_MAX_RUNNING_WORKLOADS", raising=False)
    monkeypatch.delenv("JOYNEXUS_PRODUCER_CONCURRENT_ROLLOUTS", raising=False)
    assert (MasterOptions().max_running_workloads, Settings().producer_concurrent_rollouts) == (8, 4)  # a laptop
    monkeypatch.setenv("JOYNEXUS_MAX_RUNNING_WORKLOADS", "40")
    monkeypatch.setenv("JOYNEXUS_PRODUCER_CONCURRENT_ROLLOUTS", "12")
    assert (MasterOptions().max_running_workloads, Settings().producer_concurrent_rollouts) == (40, 12)
    monkeypatch.setenv("JOYNEXUS_MAX_RUNNING_WORKLOADS", "0")
    with pytest.raises(ValueError):
        MasterOptions()
    monkeypatch.setenv("JOYNEXUS_MAX_RUNNING_WORKLOADS", "many")
    with pytest.raises(ValueError, match="JOYNEXUS_MAX_RUNNING_WORKLOADS"):
        MasterOptions()


def test_the_deployment_sizes_them_against_its_other_bounds():
    data = config()
    running = int(data["JOYNEXUS_MAX_RUNNING_WORKLOADS"])
    rollouts = int(data["JOYNEXUS_PRODUCER_CONCURRENT_ROLLOUTS"])
    group = int(data.get("JOYNEXUS_TRAINING_GROUP_MAX", "8"))
    active = int(data.get("JOYNEXUS_MAX_ACTIVE_TENANTS", "64"))
    # a full training group can form, and every running tenant keeps a live training slot (no paging
    # of running tenants' slots on every step)
    assert group <= running <= active, (group, running, active)
    assert 1 <= rollouts <= running
    assert running > 8  # more than the laptop default (8): a cluster's tenant 9 does not wait
    # the services Job (where `joynexus up` makes the Master's options) reads this ConfigMap
    job = by_key(rendered(DEPLOYMENTS))[("Job", "joynexus-services")]
    env_from = job["spec"]["template"]["spec"]["containers"][0]["envFrom"]
    assert {"configMapRef": {"name": "joynexus-config"}} in env_from


def test_render_deployment_takes_an_operators_limits():
    args = [str(RENDER), "--registry", "r.example/x", "--image-tag", "0.2.0", "--cluster", "prod", "--bucket", "b",
            "--region", "eu-west-1", "--gcs-redis", "rediss://r:6379", "--db-secret", "arn:x",
            "--max-running-workloads", "48", "--max-concurrent-rollouts", "16"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(done.stdout) if d}
    data = docs[("ConfigMap", "joynexus-config")]["data"]
    assert (data["JOYNEXUS_MAX_RUNNING_WORKLOADS"], data["JOYNEXUS_PRODUCER_CONCURRENT_ROLLOUTS"]) == ("48", "16")
    default = subprocess.run(args[:-4], capture_output=True, text=True, timeout=120)
    data = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(default.stdout) if d}
    assert (
        data[("ConfigMap", "joynexus-config")]["data"]["JOYNEXUS_MAX_RUNNING_WORKLOADS"]
        == config()["JOYNEXUS_MAX_RUNNING_WORKLOADS"]
    )


def test_a_ninth_tenant_runs_under_the_deployments_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("JOYNEXUS_MAX_RUNNING_WORKLOADS", config()["JOYNEXUS_MAX_RUNNING_WORKLOADS"])
    options = MasterOptions()
    dataset = tmp_path / "ds"
    write_dataset_for(sft_spec("t0", dataset, jobs=1))
    dep = Deployment.in_process(Settings(data_dir=tmp_path / "data", torch_threads=1))
    try:
        tenants = [f"t{i}" for i in range(9)]
        for tenant in tenants:
            dep.creator.create(sft_spec(tenant, dataset, jobs=1))
        # actor loop not started: admitted workloads stay running, the rest would wait with a position
        manager = WorkloadManager(dep, max_running=options.max_running_workloads)
        states = [manager.get(manager.submit(t, jobs=1).workload_id) for t in tenants]
        assert [s.state for s in states] == ["running"] * 9, [(s.state, s.position) for s in states]
        manager.stop()
    finally:
        dep.shutdown()
