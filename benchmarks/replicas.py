"""Predict throughput with 1 vs 3 Inference Model Service replicas, and 1 vs 2 Ray nodes (issue 12),
side by side in one run.

  .venv/bin/python benchmarks/replicas.py [--seconds 5] [--callers 12] [--rounds 2] [--json out.json]

replicas   a local Ray (--cpus logical CPUs); one `InferenceReplicaSet` in this driver fronting
           Ray actor replicas (tiny backbone, 1 torch thread each); --callers threads predict one
           observation at a time, back to back, for --seconds; the set is scaled 1 -> 3 -> 1 -> 3
           (--rounds pairs) so both sizes see the same machine state. Ratio: 3 replicas / 1.
nodes      a 2-node Ray cluster on this host (tests/cluster/two_nodes.py: `ray start --head` and a
           worker node, stopped by PID); two replicas placed on the head only ("1 node") or spread
           over both nodes ("2 nodes", Ray's SPREAD), the same load. Ratio: 2 nodes / 1 node.

On one host the "nodes" share the same cores, so the node ratio shows the cost of the second
node's plumbing, not extra hardware; with few cores the replica ratio is bounded by the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.inference_queue import Observation  # noqa: E402
from joynexus.services.inference.replicas import InferenceReplicaSet, RayReplicas  # noqa: E402
from joynexus.services.training.service import TrainingModelService
from joynexus.settings import RoleResources, ScalingPolicy

SHAPE = dict(cameras=("front",), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2)


def payload(workdir: Path) -> bytes:
    from tests.helpers import compiled_config

    trainer = TrainingModelService(BackboneSource(preset="tiny"), workdir / "ckpt")
    trainer.add_tenant(compiled_config("bench", trainer.capabilities(), **SHAPE))
    return trainer.export_params("bench")


def drive(replicas: InferenceReplicaSet, seconds: float, callers: int) -> dict[str, Any]:
    """Requests/s and p50 / p99 latency of `callers` threads predicting back to back."""
    stop = threading.Event()
    latencies: list[list[float]] = [[] for _ in range(callers)]
    errors: list[str] = []

    def loop(k: int) -> None:
        rng = np.random.default_rng(k)
        h, w = SHAPE["image_size"]
        obs = [Observation(images=(rng.random((3, h, w), dtype=np.float32),), state=np.zeros(4, np.float32),
                           instruction="pick")]  # fmt: skip
        while not stop.is_set():
            started = time.perf_counter()
            try:
                replicas.predict("bench", obs, timeout_s=120)
            except Exception as error:  # counted, reported
                errors.append(f"{type(error).__name__}: {error}")
                continue
            latencies[k].append(time.perf_counter() - started)

    threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(callers)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # warm-up: not counted
    for each in latencies:
        each.clear()
    started = time.perf_counter()
    time.sleep(seconds)
    done = [list(each) for each in latencies]
    elapsed = time.perf_counter() - started
    stop.set()
    for t in threads:
        t.join(timeout=120)
    flat = [x for each in done for x in each]
    return {
        "rps": len(flat) / elapsed,
        "p50_ms": 1000 * float(np.percentile(flat, 50)) if flat else None,
        "p99_ms": 1000 * float(np.percentile(flat, 99)) if flat else None,
        "errors": len(errors),
    }


def replicas_part(args: argparse.Namespace, blob: bytes) -> dict[str, Any]:
    import ray

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        factory = RayReplicas(BackboneSource(preset="tiny"), service_kwargs={"num_threads": 1})
        replicas = InferenceReplicaSet(factory, policy=ScalingPolicy(min_replicas=1, max_replicas=3, interval_s=60))
        replicas.load_weights(blob)
        runs: dict[int, list[dict[str, Any]]] = {1: [], 3: []}
        for _ in range(args.rounds):
            for n in (1, 3):
                replicas.scale_to(n)
                runs[n].append(drive(replicas, args.seconds, args.callers))
                print(f"  {n} replica(s): {runs[n][-1]}", flush=True)
        replicas.close()
        return runs
    finally:
        ray.shutdown()


def nodes_part(args: argparse.Namespace, blob: bytes) -> dict[str, Any]:
    import ray

    from tests.cluster.two_nodes import start_two_nodes

    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    cluster = start_two_nodes(Path(tempfile.mkdtemp(prefix="bench-2n-")), head_cpus=3, worker_cpus=3)
    runs: dict[str, list[dict[str, Any]]] = {"1 node": [], "2 nodes": []}
    try:
        ray.init(address=cluster.gcs_address, log_to_driver=False, configure_logging=False)
        source, kwargs = BackboneSource(preset="tiny"), {"num_threads": 1}
        on_head = RoleResources(resources={"joynexus_head": 0.1})
        layouts = {
            "1 node": RayReplicas(source, resources=on_head, service_kwargs=kwargs),
            "2 nodes": RayReplicas(source, service_kwargs=kwargs, scheduling_strategy="SPREAD"),
        }
        sets = {}
        for name, factory in layouts.items():
            sets[name] = InferenceReplicaSet(
                factory, policy=ScalingPolicy(min_replicas=2, max_replicas=2, interval_s=60)
            )
            sets[name].load_weights(blob)
        placement = {}
        nodes = cluster.node_ids()
        by_node = {v: k for k, v in nodes.items()}
        for actor in cluster.actors():
            for name, replica_set in sets.items():
                if (actor["name"] or "").startswith(f"joynexus.inference_replica.{replica_set.incarnation}."):
                    placement.setdefault(name, []).append(by_node.get(actor["node_id"], actor["node_id"]))
        print(f"  replica placement: {placement}", flush=True)
        for _ in range(args.rounds):
            for name, replica_set in sets.items():
                runs[name].append(drive(replica_set, args.seconds, args.callers))
                print(f"  {name}: {runs[name][-1]}", flush=True)
        for replica_set in sets.values():
            replica_set.close()
        runs["placement"] = placement  # type: ignore[assignment]
        return runs
    finally:
        ray.shutdown()
        cluster.stop()


def mean(runs: list[dict[str, Any]], key: str) -> float:
    return float(np.mean([r[key] for r in runs if r[key] is not None]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--callers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=4, help="logical CPUs of the local Ray (replicas part)")
    parser.add_argument("--skip-nodes", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 s, 4 callers, 1 round, no 2-node part")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.callers, args.rounds, args.skip_nodes = 1.0, 4, 1, True
    torch.set_num_threads(1)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    print(f"host: {os.cpu_count()} cores; {args.callers} callers, {args.seconds:g} s per run, {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        blob = payload(Path(tmp))
    print("replicas (local Ray):", flush=True)
    replica_runs = replicas_part(args, blob)
    node_runs = (
        None if args.skip_nodes else (print("nodes (2-node Ray cluster):", flush=True), nodes_part(args, blob))[1]
    )

    print("\nside by side")
    print(f"{'':>12} | {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")

    def row(label: str, runs: list[dict[str, Any]]) -> None:
        errors = sum(r["errors"] for r in runs)
        cells = f"{mean(runs, 'rps'):8.1f} {mean(runs, 'p50_ms'):8.1f} {mean(runs, 'p99_ms'):8.1f} {errors:6d}"
        print(f"{label:>12} | {cells}")

    row("1 replica", replica_runs[1])
    row("3 replicas", replica_runs[3])
    ratio = mean(replica_runs[3], "rps") / mean(replica_runs[1], "rps")
    print(f"throughput 3 replicas / 1 replica: {ratio:.2f}x")
    if node_runs is not None:
        row("1 node", node_runs["1 node"])
        row("2 nodes", node_runs["2 nodes"])
        ratio = mean(node_runs["2 nodes"], "rps") / mean(node_runs["1 node"], "rps")
        print(f"throughput 2 nodes / 1 node (2 replicas each): {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"replicas": replica_runs, "nodes": node_runs}, indent=2, default=str))
        print(f"results: {args.json}")


if __name__ == "__main__":
    main()
