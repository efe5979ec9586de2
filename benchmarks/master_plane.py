"""The Master as a control plane (issue 40): what the Master's process spends per job, how fast a
control call answers while every tenant's loops run, and what a second producer replica buys.

One local Ray; per configuration a fresh deployment in its own namespace (tiny backbone): `--tenants`
SFT tenants and `--rl-tenants` RL tenants (gym-pusht reach) each run one workload of `--jobs` jobs at
once. Measured per configuration:

* the Master process's CPU seconds (user + system, read with psutil from its pid) per completed job;
* p50 / p99 of `get_workload` (what `GET /v1/workloads/{id}` asks the Master) called in a loop from
  the driver while the workloads run;
* SFT jobs/s and RL rollout env steps/s over the run's wall time.

`--replicas 1,2` compares producer replica counts side by side in one run. Run against another tree
(e.g. an export of main, whose Master runs the loops as its own threads) with that tree first on
PYTHONPATH: where `Settings` has no `producer_replicas`, the configuration is labelled `master threads`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # appended: a tree put first on PYTHONPATH is the one measured

from joynexus.actors import init_ray  # noqa: E402
from joynexus.connect import connect  # noqa: E402
from joynexus.ops.supervisor import remove_service_actors  # noqa: E402
from joynexus.settings import Settings  # noqa: E402
from tests.helpers import TINY_MODEL_ID, sft_spec, write_dataset_for  # noqa: E402

FINAL = ("completed", "failed", "cancelled")


def rl_spec(tenant: str) -> dict[str, Any]:
    return {
        "tenant": tenant, "base_model": TINY_MODEL_ID, "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": ["top"], "image_size": [32, 32], "state_dim": 4, "action_dim": 2,
                        "action_chunk": 1, "instruction": "move the pusher to the T-shaped block"},
        "environment": {"simulator": "pusht", "task": "PushT-reach-v0", "num_envs": 2, "horizon": 4,
                        "max_episode_steps": 6},
        "rl": {"advantage": "gae", "ppo_epochs": 1, "gamma": 0.95},
        "scheduling": {"max_in_flight_jobs": 1, "max_policy_staleness": 1},
        "training": {"samples_per_job": 8, "microbatch_size": 8, "learning_rate": 5e-5},
    }  # fmt: skip


def master_cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system + times.children_user + times.children_system)


def run_config(replicas: int | None, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    namespace = f"bench-plane-{uuid.uuid4().hex[:6]}"
    data_dir = workdir / namespace
    fields: dict[str, Any] = {"data_dir": data_dir, "ray_namespace": namespace, "torch_threads": 1}
    if replicas is not None:
        fields["producer_replicas"] = replicas
    cluster = connect(Settings(**fields), mode="ray")
    try:
        master = cluster.master
        tenants: list[tuple[str, str]] = []
        for i in range(args.tenants):
            spec = sft_spec(f"s{i}", data_dir / "datasets" / f"s{i}", jobs=None, samples_per_job=8, max_in_flight=1)
            write_dataset_for(spec, episodes=2, length=8, seed=i)
            master.create_tenant(spec)
            tenants.append((f"s{i}", "sft"))
        for i in range(args.rl_tenants):
            master.create_tenant(rl_spec(f"r{i}"))
            tenants.append((f"r{i}", "rl"))
        pid = int(master.ping()["pid"])
        cpu_before = master_cpu_s(pid)
        started = time.perf_counter()
        workloads = {master.submit_workload(t, jobs=args.jobs).workload_id: kind for t, kind in tenants}
        latencies: list[float] = []
        done = threading.Event()

        def control_calls() -> None:
            ids = list(workloads)
            n = 0
            while not done.is_set():
                t0 = time.perf_counter()
                master.get_workload(ids[n % len(ids)])
                latencies.append(time.perf_counter() - t0)
                n += 1
                time.sleep(0.02)

        caller = threading.Thread(target=control_calls, daemon=True)
        caller.start()
        infos = {}
        while len(infos) < len(workloads):
            for workload_id in workloads:
                if workload_id not in infos:
                    info = master.get_workload(workload_id)
                    if info.state in FINAL:
                        infos[workload_id] = info
            time.sleep(0.2)
        wall = time.perf_counter() - started
        done.set()
        caller.join(timeout=10)
        cpu = master_cpu_s(pid) - cpu_before
        jobs = sum(info.completed_jobs for info in infos.values())
        sft_jobs = sum(info.completed_jobs for w, info in infos.items() if workloads[w] == "sft")
        rl_jobs = jobs - sft_jobs
        states = sorted({info.state for info in infos.values()})
        ordered = sorted(latencies)
        return {
            "config": "master threads" if replicas is None else f"{replicas} replica(s)",
            "states": states, "jobs": jobs, "wall_s": wall, "cpu_per_job": cpu / max(jobs, 1),
            "sft_jobs_s": sft_jobs / wall, "rl_steps_s": rl_jobs * 2 * 4 / wall,
            "p50_ms": 1e3 * statistics.median(ordered) if ordered else float("nan"),
            "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan"),
            "calls": len(ordered),
        }  # fmt: skip
    finally:
        cluster.close()
        remove_service_actors(namespace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, default=8, help="SFT tenants")
    parser.add_argument("--rl-tenants", type=int, default=2, help="RL tenants (each 2 simulator workers)")
    parser.add_argument("--jobs", type=int, default=4, help="jobs per workload")
    parser.add_argument("--replicas", default="1,2", help="producer replica counts to compare")
    parser.add_argument("--quick", action="store_true", help="2 SFT + 1 RL tenants, 2 jobs each")
    args = parser.parse_args()
    if args.quick:
        args.tenants, args.rl_tenants, args.jobs = 2, 1, 2
    has_replicas = "producer_replicas" in Settings.model_fields
    counts: list[int | None] = [int(c) for c in args.replicas.split(",")] if has_replicas else [None]
    init_ray()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-plane-") as tmp:
        for replicas in counts:
            rows.append(run_config(replicas, args, Path(tmp)))
            print(f"done: {rows[-1]['config']}", flush=True)
    print(f"\n{args.tenants} SFT + {args.rl_tenants} RL tenants, {args.jobs} jobs each (tiny backbone, local Ray)")
    print(f"{'config':<16} {'states':<12} {'jobs':>5} {'wall s':>7} {'Master CPU s/job':>17} "
          f"{'SFT jobs/s':>11} {'RL steps/s':>11} {'control p50 ms':>15} {'p99 ms':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['config']:<16} {','.join(r['states']):<12} {r['jobs']:>5} {r['wall_s']:>7.1f} "
              f"{r['cpu_per_job']:>17.3f} {r['sft_jobs_s']:>11.2f} {r['rl_steps_s']:>11.1f} "
              f"{r['p50_ms']:>15.1f} {r['p99_ms']:>8.1f}")  # fmt: skip
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print(f"{last['config']} / {first['config']}: SFT jobs/s {last['sft_jobs_s'] / first['sft_jobs_s']:.2f}x, "
              f"RL steps/s {last['rl_steps_s'] / max(first['rl_steps_s'], 1e-9):.2f}x")  # fmt: skip
    print(f"master CPU per job: {rows[0]['cpu_per_job']:.3f} s; control p99 {rows[0]['p99_ms']:.1f} ms")


if __name__ == "__main__":
    main()
