"""A client outside the Ray cluster (what a Kubernetes pod runs): connects through the Ray Client
server (`JOYNEXUS_RAY_ADDRESS=ray://head:port`), creates the services (detached, as the services
Job does), then runs a mixed SFT + RL workload through the Master Service and predicts; prints one
JSON line with what it saw.

    python -m tests.cluster.client_workload '<json: data_dir, namespace, sft_spec, rl_spec>'
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def main(args: dict) -> dict:
    import ray

    from joynexus.connect import connect
    from joynexus.scheduling.inference_queue import Observation
    from joynexus.settings import Settings

    settings = Settings(data_dir=Path(args["data_dir"]), ray_namespace=args["namespace"], torch_threads=1)
    assert settings.ray_address and settings.ray_address.startswith("ray://"), settings.ray_address
    started = time.monotonic()
    cluster = connect(settings, mode="ray", detached=True)
    through_client = ray.util.client.ray.is_connected()  # a Ray Client session, not a driver on a node
    master = cluster.master
    sft = master.create_tenant(args["sft_spec"])
    rl = master.create_tenant(args["rl_spec"])
    workloads = {
        "sft": master.submit_workload(sft.tenant_id, jobs=args.get("jobs", 1)).workload_id,
        "rl": master.submit_workload(rl.tenant_id, jobs=args.get("jobs", 1)).workload_id,
    }
    states = {}
    for name, workload_id in workloads.items():
        status = cluster.wait_workload(workload_id, timeout_s=900)
        states[name] = {"state": status.state, "error": getattr(status, "error", None)}
    obs_spec = args["sft_spec"]["observation"]
    h, w = obs_spec["image_size"]
    rng = np.random.default_rng(0)
    observations = [
        Observation(
            images=tuple(rng.random((3, h, w), dtype=np.float32) for _ in obs_spec["cameras"]),
            state=rng.standard_normal(obs_spec["state_dim"]).astype(np.float32),
            instruction=obs_spec["instruction"],
        )
        for _ in range(4)
    ]
    predictions = [cluster.inference.predict(sft.tenant_id, observations[i : i + 1]) for i in range(4)]
    stats = cluster.inference.stats()
    health = master.health()
    return {
        "through_ray_client": through_client,
        "workloads": states,
        "predicted_versions": [int(p["policy_version"]) for p in predictions],
        "served_versions": cluster.inference.versions(sft.tenant_id),
        "replicas": stats.get("replicas"),
        "health": {role: {"healthy": e["healthy"], "detail": e["detail"]} for role, e in health.items()},
        "environment_beat": master.role_beat("environment_service"),
        "seconds": time.monotonic() - started,
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result, default=str))
