"""A driver of the scale-out test (tests/cluster/test_scale_out.py), in its own process: connects to
the two-node cluster (`JOYNEXUS_RAY_ADDRESS`), creates the services (detached, as the services Job
does: 4 Training Model Service shards, 3 tenant-affine Inference Model Service replicas, producer
replicas), creates the tenants and submits one workload each; once a share of the jobs completed it
kills one training shard and one inference replica for good, then waits for every workload and
prints one JSON line with what it saw.

    python -m tests.cluster.scale_out_workload '<json: data_dir, namespace, specs, jobs, kill_after>'
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def main(args: dict[str, Any]) -> dict[str, Any]:
    import ray

    from joynexus.artifacts.checkpoints import checkpoint_store
    from joynexus.connect import connect
    from joynexus.core.store import ControlPlaneStore
    from joynexus.scheduling.training_scheduler import TrainingScheduler
    from joynexus.services.training.shard_router import TrainingShardRouter, shard_actor_name
    from joynexus.settings import Settings

    settings = Settings(data_dir=Path(args["data_dir"]), ray_namespace=args["namespace"], torch_threads=1)
    started = time.monotonic()
    cluster = connect(settings, mode="ray", detached=True)
    master = cluster.master
    store = ControlPlaneStore(settings.resolved_database_url())
    scheduler = TrainingScheduler(store)

    def completed() -> list[Any]:
        return scheduler.jobs(states=["completed"])

    killed: dict[str, Any] = {}

    def kill_one_shard_and_one_replica() -> None:
        """For good: the shard and the inference replica whose tenants have the most work left."""
        done = completed()
        killed["jobs_completed_before"] = len(done)
        left = {t for t in workloads if sum(j.tenant_id == t for j in done) < args["jobs"]}
        held_by = {
            i: sorted(ray.get(ray.get_actor(shard_actor_name(i), namespace=settings.ray_namespace).tenants.remote()))
            for i in range(args["shards"])
        }
        index = max(held_by, key=lambda i: (len(left & set(held_by[i])), -i))
        killed["shard"], killed["shard_tenants"] = index, held_by[index]
        killed["shard_tenants_with_work_left"] = sorted(left & set(held_by[index]))
        ray.kill(ray.get_actor(shard_actor_name(index), namespace=settings.ray_namespace), no_restart=True)
        table = cluster.inference.assignment()
        held = {name: [t for t, holders in table["tenants"].items() if name in holders] for name in table["replicas"]}
        victim = max(held, key=lambda name: (len(left & set(held[name])), len(held[name])))
        killed["replica"], killed["replica_tenants"] = victim, sorted(held[victim])
        ray.kill(ray.get_actor(victim, namespace=settings.ray_namespace), no_restart=True)

    workloads = {}
    for spec in args["specs"]:
        master.create_tenant(spec)
        workloads[spec["tenant"]] = master.submit_workload(spec["tenant"], jobs=args["jobs"]).workload_id
    deadline = time.monotonic() + 900
    while not killed and len(completed()) < args["kill_after"] and time.monotonic() < deadline:
        time.sleep(0.2)
    if not killed:
        kill_one_shard_and_one_replica()

    states: dict[str, dict[str, Any]] = {}
    for tenant_id, workload_id in workloads.items():
        status = cluster.wait_workload(workload_id, timeout_s=max(1.0, deadline - time.monotonic()))
        states[tenant_id] = {"state": status.state, "error": status.error, "jobs": status.completed_jobs}
    versions: dict[str, list[int]] = {}
    for job in completed():
        versions.setdefault(job.tenant_id, []).append(int(job.result["version"]))
    checkpoints = checkpoint_store(settings)
    checkpointed = {t: checkpoints.versions(t) for t in workloads}
    live = [i for i in range(args["shards"]) if i != killed["shard"]]
    shards = [ray.get_actor(shard_actor_name(i), namespace=settings.ray_namespace) for i in live]
    router = TrainingShardRouter(shards)  # the live shards, as a producer replica reaches them
    slots = {t: int(router.policy_version(t)) for t in workloads}
    store.dispose()
    return {
        "workloads": states,
        "versions": {t: sorted(v) for t, v in versions.items()},
        "slots": slots,
        "checkpointed": checkpointed,
        "killed": killed,
        "replicas_after": cluster.inference.assignment()["replicas"],
        "seconds": time.monotonic() - started,
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result, default=str))
