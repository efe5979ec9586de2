"""More than one machine (issue 12): a 2-node Ray cluster on this host (`ray start --head` with
{"joynexus_head": 1}, a worker node with {"joynexus_worker": 1}), roles placed by the resource
configuration (JOYNEXUS_RESOURCES_JSON): the Training Model Service, Training Queue and Master on
the head, two Inference Model Service replicas and a pool of two Environment Service workers on
the worker node. A client outside the cluster (a subprocess connected through the Ray Client
server, `ray://`, as a Kubernetes pod does) runs a mixed SFT + RL workload; the test then checks
through Ray's state API where every role really ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.api.test_ray_services import rl_spec
from tests.cluster.two_nodes import ray_env, start_two_nodes
from tests.helpers import sft_spec, write_dataset_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ON_HEAD = {"resources": {"joynexus_head": 0.1}}
ON_WORKER = {"resources": {"joynexus_worker": 0.1}}
PLACEMENT = {
    "master": ON_HEAD,
    "training_queue": ON_HEAD,
    "training_service": {"num_cpus": 1, **ON_HEAD},
    "inference_router": ON_WORKER,
    "inference_service": {"num_cpus": 1, **ON_WORKER},
    "environment_service": ON_WORKER,
    "environment_worker": ON_WORKER,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_two_nodes(tmp_path_factory.mktemp("ray-logs"), head_cpus=2, worker_cpus=3)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_mixed_sft_and_rl_workload_from_a_ray_client_with_roles_on_two_nodes(cluster, tmp_path):
    namespace = f"two-nodes-{uuid.uuid4().hex[:6]}"
    spec = sft_spec("twonode-sft", tmp_path / "datasets" / "twonode-sft", jobs=1, samples_per_job=16)
    write_dataset_for(spec, episodes=2, length=12)
    args = {
        "data_dir": str(tmp_path / "data"),
        "namespace": namespace,
        "sft_spec": spec,
        "rl_spec": rl_spec("twonode-rl"),
    }
    env = ray_env(
        JOYNEXUS_RAY_ADDRESS=cluster.client_address,
        JOYNEXUS_RESOURCES_JSON=json.dumps(PLACEMENT),
        JOYNEXUS_INFERENCE_SCALING_JSON=json.dumps({"min_replicas": 2, "max_replicas": 2}),
        JOYNEXUS_ENVIRONMENT_WORKERS="2",
        JOYNEXUS_TORCH_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("JOYNEXUS_DATA_DIR", None)
    run = subprocess.run(
        [sys.executable, "-m", "tests.cluster.client_workload", json.dumps(args)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, f"client failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))

    assert result["through_ray_client"] is True
    assert result["workloads"] == {
        "sft": {"state": "completed", "error": None},
        "rl": {"state": "completed", "error": None},
    }, result["workloads"]
    assert result["predicted_versions"] == [1] * 4 and result["served_versions"][-1] == 1
    assert [r["state"] for r in result["replicas"]] == ["active", "active"]
    assert all(r["served"] > 0 for r in result["replicas"]) or sum(r["served"] for r in result["replicas"]) >= 4
    assert result["health"]["inference_service"]["healthy"], result["health"]
    assert "replicas: 2 active" in result["health"]["inference_service"]["detail"]
    assert "2 workers" in result["health"]["environment_service"]["detail"]

    # Where each role ran, from Ray's own state API (the dashboard), not from our code.
    nodes = cluster.node_ids()
    assert nodes["head"] != nodes["worker"]
    placed: dict[str, set[str]] = {}
    for actor in cluster.actors():
        name = actor["name"] or ""
        role = name.split(".")[1] if name.startswith("joynexus.") else actor["class_name"]
        placed.setdefault(role, set()).add(actor["node_id"])
    assert placed["training_service"] == {nodes["head"]}
    assert placed["training_queue"] == {nodes["head"]} and placed["master"] == {nodes["head"]}
    assert placed["inference_service"] == {nodes["worker"]}  # the replica set's front
    assert placed["inference_replica"] == {nodes["worker"]}
    assert placed["environment_service"] == {nodes["worker"]} and placed["environment_worker"] == {nodes["worker"]}
    replicas = [a for a in cluster.actors() if (a["name"] or "").startswith("joynexus.inference_replica.")]
    workers = [a for a in cluster.actors() if (a["name"] or "").startswith("joynexus.environment_worker.")]
    assert len(replicas) == 2 and len(workers) == 2
