"""Beyond one device on a multi-node Ray cluster (issue 45.4): a head and a worker node started by
the test on this host, with GPUs declared to Ray's scheduler (CPU processes: placement is real,
devices are not), 4 Training Model Service shards (one declared GPU each, one placement group
over both nodes), 3 tenant-affine Inference Model Service replicas (half a GPU each), producer
replicas, and 32 tenants of mixed SFT and RL (PushT), two jobs each. Mid-run one shard and one
inference replica are killed for good. Every workload completes; each tenant's completed jobs
issued distinct, increasing versions, each one checkpointed (none lost), and its slot is at the last.

Slow: two Ray nodes, a dozen actor processes and 64 jobs on a small host."""

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
SFT_TENANTS, RL_TENANTS, JOBS = 24, 8, 2
PLACEMENT = {
    "master": {"num_cpus": 0.1},
    "training_queue": {"num_cpus": 0.1},
    "training_service": {"num_cpus": 0.25, "num_gpus": 1},
    "inference_router": {"num_cpus": 0.1},
    "inference_service": {"num_cpus": 0.25, "num_gpus": 0.5},
    "environment_service": {"num_cpus": 0.25},
    "call_futures": {"num_cpus": 0.05},
    "producers": {"num_cpus": 0.25},
}


def _specs(root: Path) -> list[dict]:
    specs = []
    for i in range(SFT_TENANTS):
        spec = sft_spec(f"so-sft-{i}", root / f"sft-{i}", module="oft_mlp" if i % 2 else "flow_matching",
                        jobs=None, samples_per_job=8, microbatch_size=8, max_in_flight=1)  # fmt: skip
        write_dataset_for(spec, episodes=1, length=8, seed=i)
        specs.append(spec)
    for i in range(RL_TENANTS):
        spec = rl_spec(f"so-rl-{i}")
        spec["scheduling"]["completion_target"] = None
        specs.append(spec)
    for spec in specs:  # every version durable: a lost shard's tenants resume at their last one
        spec.setdefault("training", {})["checkpoint_every_jobs"] = 1
    return specs


def test_four_shards_three_replicas_32_tenants_survive_a_killed_shard_and_replica(tmp_path):
    cluster = start_two_nodes(tmp_path / "ray-logs", head_cpus=4, worker_cpus=6, head_gpus=2, worker_gpus=4)
    try:
        args = {
            "data_dir": str(tmp_path / "data"),
            "namespace": f"scale-out-{uuid.uuid4().hex[:6]}",
            "specs": _specs(tmp_path / "datasets"),
            "jobs": JOBS,
            "kill_after": 8,
            "shards": 4,
        }
        env = ray_env(
            JOYNEXUS_RAY_ADDRESS=cluster.gcs_address,
            JOYNEXUS_RESOURCES_JSON=json.dumps(PLACEMENT),
            JOYNEXUS_TRAINING_SHARDS="4",
            JOYNEXUS_INFERENCE_SCALING_JSON=json.dumps(
                {"min_replicas": 3, "max_replicas": 3, "max_tenants_per_replica": 24}
            ),
            JOYNEXUS_PRODUCER_REPLICAS="2",
            JOYNEXUS_DEVICE="cpu",
            JOYNEXUS_TORCH_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        )
        env.pop("JOYNEXUS_DATA_DIR", None)
        run = subprocess.run(
            [sys.executable, "-m", "tests.cluster.scale_out_workload", json.dumps(args)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
    finally:
        cluster.stop()
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, f"driver failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    print({k: result[k] for k in ("killed", "replicas_after", "seconds")})

    killed = result["killed"]
    assert killed["shard_tenants_with_work_left"] and killed["replica_tenants"], killed  # killed mid-run
    bad = {t: s for t, s in result["workloads"].items() if s["state"] != "completed" or s["jobs"] != JOBS}
    assert not bad, bad
    assert len(result["workloads"]) == SFT_TENANTS + RL_TENANTS
    for tenant, versions in result["versions"].items():
        assert len(versions) == JOBS and versions == sorted(set(versions)), (tenant, versions)  # none reissued
        assert set(versions) <= set(result["checkpointed"][tenant]), (tenant, versions)  # none lost
        assert result["slots"][tenant] == versions[-1], (tenant, result["slots"][tenant], versions)
    assert result["killed"]["replica"] not in result["replicas_after"]
