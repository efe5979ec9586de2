"""Warm environment workers: a tenant's sessions opened one after another (as each RL workload and
each evaluation does) on fresh worker processes vs on the warm worker its last session left,
side by side in one run.

  .venv/bin/python benchmarks/environment_warm_workers.py [--cycles 3] [--repeats 2] [--envs 8]
      [--rl-rounds 3] [--rl-jobs 2]

1. Sessions alone: each cycle opens the session (a spawn, the simulator's import and its scenes built, or the warm
worker renewed), resets every environment without a seed and closes it. Printed per mode: wall
seconds per open (the first open of a service is cold in both), CPU seconds per cycle (this
process and its worker processes), the ratio, the warm worker's resident memory, and whether the
unseeded resets on a renewed worker gave the same states as on fresh ones (they must).

2. Through the service: one RL tenant of the tuned PushCube spec on an in-process deployment
(Master's WorkloadManager, Training Queue, Training / Inference Model Services, Environment
Service), rounds of an RL workload of `--rl-jobs` jobs then an evaluation of 8 episodes (what
benchmarks/rl_maniskill.py and the main job do), with JOYNEXUS_ENVIRONMENT_WARM_WORKERS 0 and 8;
CPU seconds per round (this process and its simulator workers) after the first round.

Task: ManiSkill PushCube-v1 state-only, 8 environments in one worker (the tuned spec's rollout
session, examples/specs/tuned/pushcube_state.yaml); gym-pusht with --task pusht (part 1 only).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rl_maniskill import cpu_seconds, cube_spec, probe  # noqa: E402
from joynexus.master.deployment import Deployment  # noqa: E402
from joynexus.master.workloads.manager import WorkloadManager  # noqa: E402
from joynexus.services.environment.sessions import EnvironmentService  # noqa: E402
from joynexus.settings import Settings  # noqa: E402

TASKS = {
    "maniskill": {
        "simulator": "maniskill",
        "task": "PushCube-v1",
        "control_mode": "pd_ee_delta_pos",
        "reward_mode": "normalized_dense",
        "max_episode_steps": 50,
    },
    "pusht": {"simulator": "pusht", "task": "PushT-v0"},
}


def run(sim: dict, warm_workers: int, cycles: int) -> dict:
    """`cycles` sessions of one tenant and config, one after another, on one service."""
    opens, states, rss = [], [], 0
    started_cpu = cpu_seconds()
    with EnvironmentService(warm_workers=warm_workers) as service:
        for cycle in range(cycles):
            started = time.perf_counter()
            sid = service.open_session("bench", f"cycle-{cycle}", sim)
            opens.append(time.perf_counter() - started)
            n = int(service.spec("bench", sid).get("num_envs", 1))
            ids = [sid] if n == 1 else [f"{sid}#{slot}" for slot in range(n)]
            states.append(np.stack([service.reset("bench", one)["state"] for one in ids]))
            pid = service.sessions("bench")[0]["pid"]
            rss = max(rss, psutil.Process(pid).memory_info().rss)
            service.close("bench", sid)
    # close_all (the context's exit) stopped and reaped every worker: cpu_seconds counts them as children
    return {"opens": opens, "cpu_per_cycle": (cpu_seconds() - started_cpu) / cycles, "states": states, "rss": rss}


def rl_rounds(warm_workers: int, rounds: int, jobs: int, state_dim: int, action_dim: int) -> list[float]:
    """CPU seconds of each round (an RL workload of `jobs` jobs, then an evaluation) of one tenant."""
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), torch_threads=1, environment_warm_workers=warm_workers)
        dep = Deployment.in_process(settings)
        manager = WorkloadManager(dep).start()
        try:
            tenant = dep.creator.create(cube_spec("warm-bench", "PushCube-v1", state_dim, action_dim)).tenant_id
            per_round = []
            for _ in range(rounds):
                started = cpu_seconds()
                for status in manager.wait_all([manager.submit(tenant, jobs=jobs).workload_id], 3600):
                    assert status.state == "completed", (status.state, status.error)
                for status in manager.wait_all([manager.evaluate(tenant, episodes=8).workload_id], 3600):
                    assert status.state == "completed", (status.state, status.error)
                per_round.append(cpu_seconds() - started)
            return per_round
        finally:
            manager.stop()
            dep.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), default="maniskill")
    parser.add_argument("--cycles", type=int, default=3, help="sessions opened one after another per service")
    parser.add_argument("--repeats", type=int, default=2, help="cold / warm pairs, interleaved")
    parser.add_argument("--envs", type=int, default=8, help="environments in the session's one worker")
    parser.add_argument("--rl-rounds", type=int, default=3, help="rounds of part 2 (0: skip it)")
    parser.add_argument("--rl-jobs", type=int, default=2, help="RL jobs per round in part 2")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: gym-pusht, 2 sessions of 2 envs, one pair, no part 2"
    )
    args = parser.parse_args()
    if args.quick:
        args.task, args.cycles, args.repeats, args.envs, args.rl_rounds = "pusht", 2, 1, 2, 0
    sim = {**TASKS[args.task], "num_envs": args.envs}
    results: dict[str, list[dict]] = {"fresh workers": [], "warm worker": []}
    for _ in range(args.repeats):
        results["fresh workers"].append(run(sim, 0, args.cycles))
        results["warm worker"].append(run(sim, 2, args.cycles))

    print(f"{args.task} {sim['task']}, {args.envs} envs in one worker, {args.cycles} sessions per service, "
          f"{args.repeats} services per mode (interleaved)")  # fmt: skip
    print(f"{'mode':<14} {'first open s':>12} {'later opens s':>14} {'CPU s / session':>16} {'worker RSS MiB':>15}")
    summary = {}
    for mode, runs in results.items():
        first = np.mean([r["opens"][0] for r in runs])
        later = np.mean([o for r in runs for o in r["opens"][1:]])
        cpu = np.mean([r["cpu_per_cycle"] for r in runs])
        rss = max(r["rss"] for r in runs) / 2**20
        summary[mode] = (later, cpu)
        print(f"{mode:<14} {first:>12.2f} {later:>14.3f} {cpu:>16.2f} {rss:>15.0f}")
    (cold_open, cold_cpu), (warm_open, warm_cpu) = summary["fresh workers"], summary["warm worker"]
    print(f"later opens: {cold_open * 1e3:.0f} ms fresh, {warm_open * 1e3:.1f} ms warm; "
          f"CPU per session: fresh / warm = {cold_cpu / warm_cpu:.2f}x")  # fmt: skip
    reference = results["fresh workers"][0]["states"][0]
    same = all(np.array_equal(s, reference) for runs in results.values() for r in runs for s in r["states"])
    print(f"unseeded resets equal on fresh and renewed workers: {same}")
    if not same:
        raise SystemExit("a renewed worker's unseeded reset differs from a fresh worker's")
    if args.task != "maniskill" or args.rl_rounds < 2:
        return

    state_dim, action_dim = probe("PushCube-v1")
    rounds = {mode: rl_rounds(warm, args.rl_rounds, args.rl_jobs, state_dim, action_dim)
              for mode, warm in (("fresh workers", 0), ("warm workers", 8))}  # fmt: skip
    print(f"\nRL tenant (tuned PushCube spec): rounds of {args.rl_jobs} RL jobs + an 8-episode evaluation")
    for mode, cpu in rounds.items():
        print(f"{mode:<14} CPU s per round: {' '.join(f'{c:.1f}' for c in cpu)}")
    fresh, warm = (np.mean(rounds[mode][1:]) for mode in ("fresh workers", "warm workers"))
    print(f"rounds after the first: {fresh:.1f} CPU s fresh, {warm:.1f} warm; fresh / warm = {fresh / warm:.2f}x")


if __name__ == "__main__":
    main()
