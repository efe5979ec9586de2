"""Learning curves of state-only ManiSkill RL through the services: success (with its 95% Wilson
interval) vs environment steps, wall time and CPU time, per seed.

  .venv/bin/python benchmarks/rl_maniskill.py [--task PushCube-v1] [--seeds 0 1 2] [--rounds 8]
      [--jobs-per-round 10] [--eval-episodes 16] [--head oft_mlp|flow_matching] [--csv PATH] [--together]
      [--no-initial-eval] [--eval-every N] [--head-size tiny|small|base] [--off-policy-correction none|decoupled] ...

Each seed is one tenant on an in-process deployment (the Master's WorkloadManager, Training Queue,
Training / Inference Model Services, Environment Service workers): every round submits an RL
workload of `jobs-per-round` jobs (PPO with GAE, state-only observations, the spec below) and then
an evaluation of the served version on the same seeded episodes (`evaluate`: deterministic actions);
printed per round: jobs, environment steps so far, wall seconds so far, CPU seconds so far (this
process and its simulator workers, user + system), success rate [95% interval], mean return;
at the end per seed: jobs trained and dropped as stale, and the PPO updates' approx KL / clip fraction.
The spec is examples/specs/tuned/pushcube_state.yaml (the main job's ManiSkill tenant uses it too).
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from joynexus.actors import handle_of  # noqa: E402
from joynexus.master.deployment import Deployment  # noqa: E402
from joynexus.master.workloads.manager import WorkloadManager  # noqa: E402
from joynexus.services.environment.sessions import EnvironmentService  # noqa: E402
from joynexus.settings import Settings  # noqa: E402

# The tuned spec (examples/specs/tuned/pushcube_state.yaml); the knobs below override its fields.
CUBE_SPEC = Path(__file__).resolve().parents[1] / "examples" / "specs" / "tuned" / "pushcube_state.yaml"


def cube_defaults() -> dict[str, Any]:
    """The tuned spec's knobs, by the names of this script's options."""
    spec = yaml.safe_load(CUBE_SPEC.read_text())
    env, rl, training = spec["environment"], spec["rl"], spec["training"]
    return {
        "envs": env["num_envs"], "horizon": env["horizon"], "max_episode_steps": env["max_episode_steps"],
        "ppo_epochs": rl["ppo_epochs"], "microbatch": training["microbatch_size"], "gamma": rl["gamma"],
        "gae_lambda": rl["gae_lambda"], "lr": training["learning_rate"],
        "max_in_flight": spec["scheduling"]["max_in_flight_jobs"],
        # 0: a constant learning rate (training.lr_decay_jobs None)
        "lr_decay_jobs": training.get("lr_decay_jobs") or 0,
        "lr_final_fraction": training.get("lr_final_fraction", 0.1),
        "off_policy_correction": rl.get("off_policy_correction", "none"),
        "head_size": spec["action_module"]["size"],
    }  # fmt: skip


def cube_spec(
    tenant: str, task: str, state_dim: int, action_dim: int, *, seed: int = 0, head: str = "oft_mlp",
    base_model: str = "joynexus/tiny-smolvlm", instruction: str | None = None, **overrides: Any,
) -> dict[str, Any]:  # fmt: skip
    """The tuned spec for `task` as tenant `tenant`, with any of `cube_defaults()`'s knobs overridden."""
    k = {**cube_defaults(), **overrides}
    spec = yaml.safe_load(CUBE_SPEC.read_text())
    spec.update(tenant=tenant, base_model=base_model)
    spec["action_module"].update(kind=head, size=k["head_size"])
    obs = spec["observation"]
    obs.update(state_dim=state_dim, action_dim=action_dim)
    if instruction is not None:
        obs["instruction"] = instruction
    spec["environment"].update(
        task=task, seed=seed, num_envs=k["envs"], envs_per_worker=k["envs"], horizon=k["horizon"],
        max_episode_steps=k["max_episode_steps"],
    )  # fmt: skip
    spec["rl"].update(
        ppo_epochs=k["ppo_epochs"], gamma=k["gamma"], gae_lambda=k["gae_lambda"],
        off_policy_correction=k["off_policy_correction"],
    )  # fmt: skip
    spec["scheduling"]["max_in_flight_jobs"] = k["max_in_flight"]
    spec["training"].update(
        samples_per_job=k["envs"] * k["horizon"], microbatch_size=k["microbatch"], learning_rate=k["lr"], seed=seed,
        lr_decay_jobs=k["lr_decay_jobs"] or None, lr_final_fraction=k["lr_final_fraction"],
    )
    return spec


def probe(task: str) -> tuple[int, int]:
    service = EnvironmentService(max_sessions=1, reset_timeout_s=1800, startup_timeout_s=1800)
    try:
        sid = service.open_session("probe", "probe", {"simulator": "maniskill", "task": task,
                                                      "control_mode": "pd_ee_delta_pos"})  # fmt: skip
        spec = service.spec("probe", sid)
        return int(spec["state_dim"]), int(spec["action_dim"])
    finally:
        service.close_all()


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, its finished children and its live ones."""
    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="PushCube-v1")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=8)  # 80 jobs: the stated budget
    parser.add_argument("--jobs-per-round", type=int, default=10)
    parser.add_argument("--eval-episodes", type=int, default=16)
    parser.add_argument("--head", default="oft_mlp", choices=["oft_mlp", "flow_matching"])
    parser.add_argument("--csv", type=Path, default=None, help="append one row per round here")
    parser.add_argument("--together", action="store_true", help="all seeds as tenants of one deployment at once")
    parser.add_argument("--no-initial-eval", action="store_true", help="no evaluation before the first round")
    parser.add_argument("--eval-every", type=int, default=1, help="evaluate after every N rounds (and the last)")
    defaults = cube_defaults()
    for name, value in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 seed, 1 round of 1 job, 2 envs, 2 evaluation episodes"
    )
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.rounds, args.jobs_per_round, args.eval_episodes, args.envs = [0], 1, 1, 2, 2
    torch.set_num_threads(1)
    knobs = {name: getattr(args, name) for name in defaults}
    state_dim, action_dim = probe(args.task)
    print(f"maniskill {args.task} state-only (state {state_dim}, action {action_dim}), head {args.head}, {knobs}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        dep = Deployment.in_process(Settings(data_dir=Path(tmp), torch_threads=1))
        # On a loaded host a worker importing ManiSkill and building 8 scenes can take minutes.
        env_service = handle_of(dep.environment_service).target
        env_service.reset_timeout_s, env_service.step_timeout_s = 1800.0, 600.0
        env_service.startup_timeout_s = 1800.0
        manager = WorkloadManager(dep).start()
        try:
            # --together: every seed is a tenant of the one deployment at once (the service's
            # multi-tenant case; wall and CPU are then the group's, shared by its tenants).
            groups = [args.seeds] if args.together else [[seed] for seed in args.seeds]
            for seeds in groups:
                rows += run_group(manager, dep, args, knobs, seeds, state_dim, action_dim)
        finally:
            manager.stop()
            dep.shutdown()


def run_group(
    manager: WorkloadManager, dep: Deployment, args: argparse.Namespace, knobs: dict[str, Any], seeds: list[int],
    state_dim: int, action_dim: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Rounds of training + evaluation for one tenant per seed in `seeds`, all at once; a row per
    tenant and round (printed, and appended to --csv)."""
    tenants = {}
    for seed in seeds:
        name = f"ms-{args.task.lower().replace('-', '')}-s{seed}"
        spec = cube_spec(name, args.task, state_dim, action_dim, seed=seed, head=args.head, **knobs)
        tenants[seed] = dep.creator.create(spec).tenant_id
    started, cpu0, jobs, rows = time.perf_counter(), cpu_seconds(), 0, []
    print(f"seeds {seeds} (tenants at once: {len(seeds)}): seed round  jobs  env_steps  wall_s  cpu_s  "
          "success [95% CI]  mean_return")  # fmt: skip
    for round_ in range(args.rounds + 1):
        if round_:
            submitted = [manager.submit(t, jobs=args.jobs_per_round).workload_id for t in tenants.values()]
            for status in manager.wait_all(submitted, 36000):
                if status.state != "completed":
                    raise RuntimeError(f"workload of {status.tenant_id} {status.state}: {status.error}")
            jobs += args.jobs_per_round
        if (round_ == 0 and args.no_initial_eval) or (round_ % args.eval_every and round_ != args.rounds):
            continue
        evaluations = [manager.evaluate(t, episodes=args.eval_episodes).workload_id for t in tenants.values()]
        results = {s.tenant_id: s.result or {} for s in manager.wait_all(evaluations, 36000)}
        wall, cpu = round(time.perf_counter() - started), round(cpu_seconds() - cpu0)
        for seed, tenant in tenants.items():
            r = results[tenant]
            row = {
                "task": args.task, "seed": seed, "round": round_, "jobs": jobs,
                "env_steps": jobs * args.envs * args.horizon, "wall_s": wall, "cpu_s": cpu,
                "tenants_at_once": len(tenants), "success_rate": r.get("success_rate"),
                "success_ci_low": r.get("success_ci_low"), "success_ci_high": r.get("success_ci_high"),
                "mean_return": r.get("mean_return"), "episodes": args.eval_episodes,
            }  # fmt: skip
            rows.append(row)
            print(f"seed {seed}: {round_:5d} {jobs:5d} {row['env_steps']:10d} {wall:7d} {cpu:6d}  "
                  f"{r.get('success_rate', float('nan')):5.0%} "
                  f"[{r.get('success_ci_low', 0):.0%}-{r.get('success_ci_high', 1):.0%}]  "
                  f"{r.get('mean_return', float('nan')):8.3f}", flush=True)  # fmt: skip
            if args.csv is not None:
                new = not args.csv.exists()
                args.csv.parent.mkdir(parents=True, exist_ok=True)
                with args.csv.open("a", newline="") as fh:
                    writer = csv.DictWriter(fh, fieldnames=list(row))
                    if new:
                        writer.writeheader()
                    writer.writerow(row)
    for seed, tenant in tenants.items():
        print(f"seed {seed}: {job_summary(dep, tenant)}")
    return rows


def job_summary(dep: Deployment, tenant_id: str) -> str:
    """The tenant's RL jobs: how many trained and were dropped as stale, how far behind the learner
    the trained rollouts were, and the PPO updates' mean approx KL and clip fraction."""
    jobs = dep.scheduler.jobs(tenant_id=tenant_id)
    trained = [j for j in jobs if j.state == "completed" and j.result]
    lags = [j.result["version"] - 1 - j.behavior_policy_version for j in trained]
    stats = [j.result.get("rl_stats", {}) for j in trained]
    kl = sum(s.get("rl/approx_kl", 0.0) for s in stats) / max(1, len(stats))
    clip = sum(s.get("rl/clip_fraction", 0.0) for s in stats) / max(1, len(stats))
    dropped = sum(1 for j in jobs if j.state == "dropped")
    behind = sum(1 for lag in lags if lag > 0)
    return (f"{len(trained)} jobs trained ({behind} on a rollout one version behind), {dropped} dropped as stale, "
            f"approx KL {kl:.3f}, clip fraction {clip:.2f}")


if __name__ == "__main__":
    main()
