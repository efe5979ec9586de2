"""Learning curves of state-only ManiSkill RL through the services: success (with its 95% Wilson
interval) vs environment steps and wall time, per seed.

  .venv/bin/python benchmarks/rl_maniskill.py [--task PushCube-v1] [--seeds 0 1 2] [--rounds 10]
      [--jobs-per-round 4] [--eval-episodes 20] [--head oft_mlp|flow_matching] [--envs-per-worker 1]

Each seed is one tenant on an in-process deployment (the Master's WorkloadManager, Training Queue,
Training / Inference Model Services, Environment Service workers): every round submits an RL
workload of `jobs-per-round` jobs (PPO with GAE, state-only observations) and then an evaluation
of the served version on the same seeded episodes (`evaluate`: deterministic actions); printed:
round, jobs, environment steps so far, wall seconds so far, success rate [95% interval], mean return.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from joynexus.master.deployment import Deployment  # noqa: E402
from joynexus.master.workloads.manager import WorkloadManager  # noqa: E402
from joynexus.services.environment.sessions import EnvironmentService  # noqa: E402
from joynexus.settings import Settings  # noqa: E402


def tenant_spec(args: argparse.Namespace, seed: int, state_dim: int, action_dim: int) -> dict:
    return {
        "tenant": f"ms-{args.task.lower().replace('-', '')}-s{seed}",
        "base_model": "joynexus/tiny-smolvlm",
        "task": "rl",
        "action_module": {"kind": args.head, "size": "tiny"},
        "observation": {"cameras": [], "state_dim": state_dim, "action_dim": action_dim, "action_chunk": 1},
        "environment": {
            "simulator": "maniskill", "task": args.task, "control_mode": "pd_ee_delta_pos",
            "reward_mode": "normalized_dense", "num_envs": args.envs, "horizon": args.horizon,
            "max_episode_steps": 50, "seed": seed, "envs_per_worker": args.envs_per_worker,
        },
        "rl": {"advantage": "gae", "ppo_epochs": 4, "gamma": 0.9, "entropy_coef": 0.0},
        "scheduling": {"max_in_flight_jobs": 2, "max_policy_staleness": 1},
        "training": {"samples_per_job": args.envs * args.horizon, "microbatch_size": args.envs * args.horizon // 2,
                     "learning_rate": 3e-4, "seed": seed},
        "promotion": {"eval_episodes": 1},
    }  # fmt: skip


def probe(task: str) -> tuple[int, int]:
    service = EnvironmentService(max_sessions=1, reset_timeout_s=900)
    try:
        sid = service.open_session("probe", "probe", {"simulator": "maniskill", "task": task,
                                                      "control_mode": "pd_ee_delta_pos"})  # fmt: skip
        spec = service.spec("probe", sid)
        return int(spec["state_dim"]), int(spec["action_dim"])
    finally:
        service.close_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="PushCube-v1")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--jobs-per-round", type=int, default=4)
    parser.add_argument("--eval-episodes", type=int, default=20)
    parser.add_argument("--envs", type=int, default=4)
    parser.add_argument("--horizon", type=int, default=32)
    parser.add_argument("--envs-per-worker", type=int, default=1)
    parser.add_argument("--head", default="oft_mlp", choices=["oft_mlp", "flow_matching"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    state_dim, action_dim = probe(args.task)
    print(f"maniskill {args.task} state-only (state {state_dim}, action {action_dim}), head {args.head}, "
          f"{args.envs} envs x horizon {args.horizon} per job")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        dep = Deployment.in_process(Settings(data_dir=Path(tmp), torch_threads=1))
        manager = WorkloadManager(dep).start()
        try:
            for seed in args.seeds:
                tenant = dep.creator.create(tenant_spec(args, seed, state_dim, action_dim)).tenant_id
                started, jobs = time.perf_counter(), 0
                print(f"seed {seed}: round  jobs  env_steps  wall_s  success [95% CI]  mean_return")
                for round_ in range(args.rounds + 1):
                    if round_:
                        status = manager.wait(manager.submit(tenant, jobs=args.jobs_per_round).workload_id, 36000)
                        if status.state != "completed":
                            raise RuntimeError(f"workload {status.state}: {status.error}")
                        jobs += args.jobs_per_round
                    ev = manager.wait(manager.evaluate(tenant, episodes=args.eval_episodes).workload_id, 36000)
                    r = ev.result or {}
                    print(f"seed {seed}: {round_:5d} {jobs:5d} {jobs * args.envs * args.horizon:10d} "
                          f"{time.perf_counter() - started:7.0f}  {r.get('success_rate', float('nan')):5.0%} "
                          f"[{r.get('success_ci_low', 0):.0%}-{r.get('success_ci_high', 1):.0%}]  "
                          f"{r.get('mean_return', float('nan')):8.3f}", flush=True)  # fmt: skip
        finally:
            manager.stop()
            dep.shutdown()


if __name__ == "__main__":
    main()
