"""Control-plane throughput: full Training Scheduler cycles per second on SQLite and PostgreSQL.

  .venv/bin/python benchmarks/control_plane.py [--cycles 400] [--workers 1 8] [--modes threads processes]

One cycle is what a producer and an actor do with one job: `reserve` (for the worker's tenant),
`mark(ready)`, `lease_next`, `complete`. Every worker has its OWN tenant policy (tenant `bench-<i>`,
an in-flight bound above what it can reach) and all workers share ONE ready queue (consumer role
`actor`, domain `vla`), as several actors draining every tenant's jobs would: a worker's
`lease_next` may take another worker's job, and then it completes that one. A `lease_next` that
finds the queue empty (another worker took the only ready job) still counts its reserve and mark;
the throughput is completed jobs per second of the timed phase.

Configurations: backend (SQLite file in a temporary directory, with the store's own settings: WAL,
BEGIN IMMEDIATE; PostgreSQL: a fresh database `joynexus_bench_<uuid>` created and dropped on the
server at 127.0.0.1:5432) x 1 worker and N workers, the N workers as threads of one process and as
processes (multiprocessing spawn: N independent drivers, each with its own engine). Every
configuration gets a fresh database. Workers warm up (a few cycles, untimed), wait on a barrier,
then run `--cycles` cycles each; the time is from the barrier to the last worker's end. Jobs still
ready at the end are drained untimed. Also printed: the client CPU time per cycle (the workers'
thread CPU time), which tells a CPU-starved machine from a slow database.

Correctness, checked per configuration (exit status 1 if any fails): no job was leased twice,
every reserved job was completed exactly once (by exactly one complete call), and the store agrees
(every job `completed`, as many as were reserved, each with the result its completer wrote).

Goals (issue 14): >= 1,000 cycles/s on SQLite, >= 300 cycles/s on PostgreSQL.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import create_engine, text  # noqa: E402

from joynexus.core.store import ControlPlaneStore  # noqa: E402
from joynexus.scheduling.training_scheduler import COMPLETED, TrainingScheduler  # noqa: E402

POSTGRES_ADMIN_URL = os.environ.get("JOYNEXUS_BENCH_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
GOALS = {"sqlite": 1000.0, "postgresql": 300.0}
WARMUP_CYCLES = 5


# -- one worker -----------------------------------------------------------------------------------
def _cycle(sched: TrainingScheduler, tenant: str, owner: str, log: dict[str, list[str]]) -> None:
    job = sched.reserve(tenant_id=tenant, task_type="sft", sample_count=1, metadata={"schema_signature": "bench"})
    if job is None:
        raise RuntimeError(f"{tenant}: reserve refused (in-flight bound or target reached)")
    log["reserved"].append(job.job_id)
    sched.mark(job.job_id, "ready")
    leased = sched.lease_next(owner=owner)
    if leased is None:
        return  # another worker took the only ready job (ours); it completes it
    log["leased"].append(leased.job_id)
    sched.complete(leased.job_id, {"by": owner}, owner=owner)
    log["completed"].append(leased.job_id)


def _run_worker(sched: TrainingScheduler, index: int, cycles: int, barrier: Any, shared_policy: bool) -> dict[str, Any]:
    tenant = "bench-shared" if shared_policy else f"bench-{index}"
    owner = f"worker-{index}"
    log: dict[str, list[str]] = {"reserved": [], "leased": [], "completed": []}
    for _ in range(WARMUP_CYCLES):
        _cycle(sched, tenant, owner, log)
    barrier.wait()
    start, cpu = time.perf_counter(), time.thread_time()
    for _ in range(cycles):
        _cycle(sched, tenant, owner, log)
    end, cpu = time.perf_counter(), time.thread_time() - cpu
    return {"owner": owner, "start": start, "end": end, "cpu": cpu, **log}


def _process_worker(url: str, index: int, cycles: int, barrier: Any, shared_policy: bool, out: Any) -> None:
    store = ControlPlaneStore(url)
    try:
        out.put(_run_worker(TrainingScheduler(store), index, cycles, barrier, shared_policy))
    except BaseException as error:  # report instead of hanging the parent on out.get()
        out.put({"owner": f"worker-{index}", "error": repr(error)})
        barrier.abort()
        raise
    finally:
        store.dispose()


# -- databases ------------------------------------------------------------------------------------
class Database:
    """A fresh, empty control-plane database for one configuration."""

    def __init__(self, backend: str):
        self.backend = backend
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._pg_name: str | None = None
        if backend == "sqlite":
            self._tmp = tempfile.TemporaryDirectory(prefix="joynexus-bench-")
            self.url = f"sqlite:///{Path(self._tmp.name) / 'control.db'}"
        else:
            self._pg_name = f"joynexus_bench_{uuid.uuid4().hex[:12]}"
            admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
            try:
                with admin.connect() as conn:
                    conn.execute(text(f'CREATE DATABASE "{self._pg_name}"'))
            finally:
                admin.dispose()
            self.url = POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{self._pg_name}"

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
        if self._pg_name is not None:
            admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{self._pg_name}" WITH (FORCE)'))
            admin.dispose()


def postgres_reachable() -> bool:
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except Exception:
        return False
    finally:
        admin.dispose()


# -- one configuration ----------------------------------------------------------------------------
def run_config(backend: str, workers: int, mode: str, cycles: int, shared_policy: bool) -> dict[str, Any]:
    db = Database(backend)
    try:
        store = ControlPlaneStore(db.url)
        sched = TrainingScheduler(store)
        tenants = ["bench-shared"] if shared_policy else [f"bench-{i}" for i in range(workers)]
        for tenant in tenants:
            sched.register_policy(tenant, "sft", max_in_flight=10 * workers + 10)
        if mode == "processes":
            ctx = mp.get_context("spawn")
            barrier = ctx.Barrier(workers)
            out = ctx.Queue()
            procs = [
                ctx.Process(target=_process_worker, args=(db.url, i, cycles, barrier, shared_policy, out))
                for i in range(workers)
            ]
            for p in procs:
                p.start()
            results = [out.get(timeout=600) for _ in procs]
            for p in procs:
                p.join(timeout=60)
        else:
            barrier = threading.Barrier(workers)
            results = [None] * workers

            def target(i: int) -> None:
                try:
                    results[i] = _run_worker(sched, i, cycles, barrier, shared_policy)
                except BaseException as error:
                    results[i] = {"owner": f"worker-{i}", "error": repr(error)}
                    barrier.abort()

            threads = [threading.Thread(target=target, args=(i,)) for i in range(workers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise RuntimeError(f"{backend} {workers} {mode}: worker failed: {errors[0]}")
        elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
        timed = workers * cycles
        # Drain what is still ready (untimed), then check.
        drained: list[str] = []
        while (job := sched.lease_next(owner="drain")) is not None:
            sched.complete(job.job_id, {"by": "drain"}, owner="drain")
            drained.append(job.job_id)
        problems = check(sched, results, drained)
        store.dispose()
        return {
            "backend": backend,
            "workers": workers,
            "mode": mode,
            "cycles": timed,
            "elapsed_s": elapsed,
            "rate": timed / elapsed,
            "cpu_ms": 1e3 * sum(r["cpu"] for r in results) / timed,
            "drained": len(drained),
            "problems": problems,
        }
    finally:
        db.close()


def check(sched: TrainingScheduler, results: list[dict[str, Any]], drained: list[str]) -> list[str]:
    problems: list[str] = []
    reserved = [j for r in results for j in r["reserved"]]
    leased = [j for r in results for j in r["leased"]] + drained
    completed = [j for r in results for j in r["completed"]] + drained
    completer = {j: r["owner"] for r in results for j in r["completed"]} | dict.fromkeys(drained, "drain")
    if len(set(reserved)) != len(reserved):
        problems.append("a job id was reserved twice")
    if len(set(leased)) != len(leased):
        problems.append(f"{len(leased) - len(set(leased))} job(s) leased twice")
    if len(set(completed)) != len(completed):
        problems.append(f"{len(completed) - len(set(completed))} job(s) completed twice")
    if set(completed) != set(reserved):
        problems.append(f"reserved {len(set(reserved))} jobs, completed {len(set(completed))}: sets differ")
    jobs = sched.jobs()
    if len(jobs) != len(reserved):
        problems.append(f"store holds {len(jobs)} jobs, {len(reserved)} were reserved")
    not_done = [j for j in jobs if j.state != COMPLETED]
    if not_done:
        problems.append(f"{len(not_done)} job(s) not completed in the store, e.g. {not_done[0].state}")
    wrong = [j for j in jobs if (j.result or {}).get("by") != completer.get(j.job_id) or j.lease_owner is None]
    if wrong:
        problems.append(f"{len(wrong)} job(s) whose stored completer differs from the worker that completed it")
    return problems


# -- report ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=400, help="timed cycles per worker")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--modes", nargs="+", default=["threads", "processes"], choices=["threads", "processes"])
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    parser.add_argument("--shared-policy", action="store_true", help="all workers reserve for ONE tenant policy")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 40 cycles per worker, 1 and 2 workers")
    args = parser.parse_args(argv)
    if args.quick:
        args.cycles, args.workers = 40, [1, 2]

    backends = list(args.backends)
    if "postgresql" in backends and not postgres_reachable():
        print(f"PostgreSQL at {POSTGRES_ADMIN_URL} is not reachable: skipped", file=sys.stderr)
        backends.remove("postgresql")
    configs: list[tuple[int, str]] = []
    for n in args.workers:
        for mode in ["threads"] if n == 1 else args.modes:
            configs.append((n, mode))
    policy = "one shared tenant policy" if args.shared_policy else "one tenant policy per worker"
    print(
        f"cycle = reserve -> mark(ready) -> lease_next -> complete; {policy}, one shared ready queue; "
        f"{args.cycles} timed cycles per worker; {os.cpu_count()} CPUs"
    )
    rows: dict[tuple[str, int, str], dict[str, Any]] = {}
    for backend in backends:
        for n, mode in configs:
            row = run_config(backend, n, mode, args.cycles, args.shared_policy)
            rows[(backend, n, mode)] = row
            status = "ok" if not row["problems"] else "FAILED: " + "; ".join(row["problems"])
            print(
                f"  {backend:<10} {n:>2} {mode:<9} {row['rate']:8.0f} cycles/s "
                f"({row['cycles']} in {row['elapsed_s']:.2f} s, client CPU {row['cpu_ms']:.2f} ms/cycle, "
                f"{row['drained']} drained)  check {status}",
                flush=True,
            )

    # Side by side: one column per backend, ratios where they compare.
    print()
    header = f"{'workers':<14}" + "".join(f"{b + ' cycles/s':>20}" for b in backends)
    if len(backends) == 2:
        header += f"{'sqlite/postgresql':>20}"
    print(header)
    for n, mode in configs:
        label = f"{n} {mode}" if n > 1 else "1"
        line = f"{label:<14}" + "".join(f"{rows[(b, n, mode)]['rate']:>20.0f}" for b in backends)
        if len(backends) == 2:
            line += f"{rows[('sqlite', n, mode)]['rate'] / rows[('postgresql', n, mode)]['rate']:>20.2f}"
        print(line)
    for n, mode in configs:
        if n == 1:
            continue
        ratios = ", ".join(
            f"{b} {rows[(b, n, mode)]['rate'] / rows[(b, 1, 'threads')]['rate']:.2f}x"
            for b in backends
            if (b, 1, "threads") in rows
        )
        print(f"scaling {n} {mode} / 1 worker: {ratios}")
    print()
    ok = True
    for b in backends:
        worst = min(r["rate"] for (rb, _, _), r in rows.items() if rb == b)
        met = worst >= GOALS[b]
        print(
            f"goal {b}: >= {GOALS[b]:.0f} cycles/s in every configuration: {'met' if met else 'NOT met'} "
            f"(lowest {worst:.0f})"
        )
    failed = [k for k, r in rows.items() if r["problems"]]
    if failed:
        ok = False
        print(f"correctness check FAILED in {len(failed)} configuration(s)")
    else:
        print("correctness: every job leased once and completed exactly once, in every configuration")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
