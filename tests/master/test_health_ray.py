"""Restart in place on the real deployment (Ray): a service actor process is SIGKILLed mid-workload,
Ray restarts it with the same arguments, the Master's Health Manager sees the new incarnation and
restores what the old life held (tenant slots from their last checkpoints, served weights, jobs
whose data was lost), the workloads complete, and the health report tells the truth per role.
"""

from __future__ import annotations

import os
import signal
import uuid
from typing import Any

import numpy as np
import pytest

from joynexus.connect import Cluster, ray_cluster
from joynexus.master.health import HealthOptions
from joynexus.master.service import MasterOptions
from joynexus.ops.supervisor import remove_service_actors
from joynexus.scheduling.inference_queue import Observation
from joynexus.settings import Settings
from tests.helpers import sft_spec, wait_for, write_dataset_for

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    started_ray = not ray.is_initialized()
    namespace = f"test-health-{uuid.uuid4().hex[:8]}"
    settings = Settings(data_dir=tmp_path_factory.mktemp("health-ray"), ray_namespace=namespace, torch_threads=1)
    options = MasterOptions(health=HealthOptions(interval_s=0.2, probe_timeout_s=5))
    cluster = None
    try:
        cluster = ray_cluster(settings, options=options)
        yield cluster
    finally:
        if cluster is not None:
            cluster.close()
        if ray.is_initialized():
            remove_service_actors(namespace)
            if started_ray:
                ray.shutdown()


def sigkill(cluster: Cluster, role: str) -> int:
    """Kill the role's actor process the hard way; returns the pid it had."""
    pid = cluster.master.role_beat(role)["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def restarted(cluster: Cluster, role: str, restarts: int) -> dict[str, Any] | None:
    report = cluster.master.health()
    entry = report[role]
    return report if entry["restarts"] >= restarts and entry["healthy"] else None


# ~50 s with its cluster on a 2-core host: on demand (`-m slow`); the restart matrix
# (tests/cluster/restart_matrix.py) and the chaos soak cover the same in-place restarts at length.
@pytest.mark.slow
def test_killed_services_restart_in_place_and_workloads_complete(cluster: Cluster, tmp_path):
    spec = sft_spec("alpha", tmp_path / "alpha", jobs=None, samples_per_job=8, microbatch_size=8, max_in_flight=1)
    write_dataset_for(spec, episodes=2, length=8, seed=0)
    cluster.master.create_tenant(spec)
    report = wait_for(
        lambda: (r := cluster.master.health()) and all(e["healthy"] for e in r.values()) and r, "all healthy", 120
    )
    assert report["training_service"]["restarts"] == 0

    # 1. The Training Model Service dies in the middle of a workload.
    first = cluster.master.submit_workload("alpha", jobs=8).workload_id
    wait_for(lambda: cluster.master.get_workload(first).completed_jobs >= 2, "two jobs done", 120)
    checkpoints = cluster.checkpoints
    acknowledged = {v: checkpoints.read_manifest("alpha", v).digest for v in checkpoints.versions("alpha")}
    old_pid = sigkill(cluster, "training_service")
    report = wait_for(lambda: restarted(cluster, "training_service", 1), "the training service back", 120)
    assert cluster.master.role_beat("training_service")["pid"] != old_pid
    assert "restored" in report["training_service"]["detail"]
    final = wait_for(lambda: (w := cluster.master.get_workload(first)).state != "running" and w, "first done", 240)
    assert final.state == "completed" and final.completed_jobs == 8, final
    # The slot came back from its last checkpoint and numbering went on after every issued version.
    assert "alpha" in cluster.training.tenants()
    assert cluster.training.policy_version("alpha") == checkpoints.issued_version("alpha")
    for version, digest in acknowledged.items():  # nothing acknowledged before the crash was lost
        if version in checkpoints.versions("alpha"):
            assert checkpoints.read_manifest("alpha", version).digest == digest

    # 2. The Training Queue dies (every partition with it) while the next workload runs.
    second = cluster.master.submit_workload("alpha", jobs=6).workload_id
    wait_for(lambda: cluster.master.get_workload(second).completed_jobs >= 1, "a job of the second workload", 120)
    sigkill(cluster, "training_queue")
    report = wait_for(lambda: restarted(cluster, "training_queue", 1), "the training queue back", 120)
    final = wait_for(lambda: (w := cluster.master.get_workload(second)).state != "running" and w, "second done", 240)
    assert final.state == "completed" and final.completed_jobs == 6, final

    # 3. The Inference Model Service dies: the tenant it served is served again.
    served = cluster.inference.versions("alpha")
    assert served
    sigkill(cluster, "inference_service")
    report = wait_for(lambda: restarted(cluster, "inference_service", 1), "the inference service back", 120)
    assert "restored the serving sets of 1 tenants" in report["inference_service"]["detail"]  # from the store
    observation = Observation(images=(np.zeros((3, 32, 32), dtype=np.float32),), state=np.zeros(4, dtype=np.float32))
    result = cluster.inference.predict("alpha", [observation])
    assert np.asarray(result["actions"]).shape == (1, 2, 3)

    # Every other role never restarted; the report names them all.
    for role, entry in cluster.master.health().items():
        if role == "producers":  # counts the waits of producers for a restarting service
            continue
        expected = 1 if role in ("training_service", "training_queue", "inference_service") else 0
        assert entry["restarts"] == expected, (role, entry)
