"""What one Master sustains (issue 43.9): N tenants' SFT workloads running at once in one Master.

  .venv/bin/python benchmarks/master_capacity.py [--workloads 8 32] [--jobs 4] [--out var/benchmarks]

In process (the services beside the Master, tiny backbone, `oft_mlp` tiny, 32x32 images, one torch
thread), a fresh deployment per N: N tenants, one workload of --jobs jobs each, all admitted at once
(max_running = N). Measured while they run: the Master's threads per running workload, the CPU time
per completed job of the SFT producers (the data loops that read the dataset and build every job:
in a cluster too they run in the Master's process) and of the actor loop (in process it runs the
training step itself; in a cluster it only waits on the remote Training Model Service), and the jobs completed
per second. Training runs in this process too, so jobs/s is a property of this host; the producers' CPU
per job is what carries over: one Master's data loops sustain about 1 / (that figure) jobs per second
per CPU core the Master gets.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import psutil

from joynexus.master.deployment import Deployment
from joynexus.master.workloads.manager import WorkloadManager
from joynexus.settings import Settings
from tests.helpers import sft_spec, write_dataset_for


def thread_cpu_by_name() -> dict[str, float]:
    """name of each live Python thread -> its CPU seconds (user + system), through its native id."""
    native = {t.native_id: t.name for t in threading.enumerate()}
    return {native[t.id]: t.user_time + t.system_time for t in psutil.Process().threads() if t.id in native}


def run(n: int, jobs: int, base: Path) -> dict[str, float]:
    dataset = base / "ds"
    if not dataset.exists():
        write_dataset_for(sft_spec("t0", dataset, jobs=jobs), episodes=4, length=40)
    dep = Deployment.in_process(Settings(data_dir=base / f"data-{n}", torch_threads=1))
    try:
        tenants = [f"t{i}" for i in range(n)]
        for tenant in tenants:
            dep.creator.create(sft_spec(tenant, dataset, jobs=jobs))
        before = threading.active_count()
        manager = WorkloadManager(dep, max_running=n).start()
        started = time.monotonic()
        ids = [manager.submit(t, jobs=jobs).workload_id for t in tenants]
        peak_threads, master_cpu = 0, {}
        while True:
            states = [manager.get(w).state for w in ids]
            peak_threads = max(peak_threads, threading.active_count() - before)
            for name, cpu in thread_cpu_by_name().items():
                # the producer replica's threads (issue 40: its data loops, `{kind}-{tenant}`, and advantage stage)
                # and the Master's own (actor loop, admission)
                if name.split("-")[0] in PRODUCER_THREADS or name in ("actor_loop", "admission"):
                    master_cpu[name] = max(master_cpu.get(name, 0.0), cpu)
            if all(s in ("completed", "failed", "cancelled") for s in states):
                break
            time.sleep(0.2)
        wall = time.monotonic() - started
        done = [manager.get(w) for w in ids]
        manager.stop()
        completed = sum(s.completed_jobs for s in done)
        return {
            "workloads": n,
            "completed": sum(s.state == "completed" for s in done),
            "jobs": completed,
            "wall_s": wall,
            "jobs_per_s": completed / wall,
            "threads_per_workload": peak_threads / n,
            # the data loops: in process the producer replica's threads; in a cluster its own actors
            "producer_cpu_ms_per_job": 1000
            * sum(v for k, v in master_cpu.items() if k.split("-")[0] in PRODUCER_THREADS)
            / max(completed, 1),
            # in process the actor loop runs the training step itself; in a cluster it waits on the remote service
            "actor_loop_cpu_ms_per_job": 1000 * master_cpu.get("actor_loop", 0.0) / max(completed, 1),
        }
    finally:
        dep.shutdown()


PRODUCER_THREADS = ("sft", "rl", "eval", "advantages")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--jobs", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.workloads:
            r = run(n, args.jobs, Path(tmp))
            print(
                f"workloads={r['workloads']} completed={r['completed']} jobs={r['jobs']} wall={r['wall_s']:.1f}s "
                f"jobs/s={r['jobs_per_s']:.2f} threads/workload={r['threads_per_workload']:.2f} "
                f"producer_cpu/job={r['producer_cpu_ms_per_job']:.1f}ms "
                f"actor_loop_cpu/job(incl. training in process)={r['actor_loop_cpu_ms_per_job']:.1f}ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
