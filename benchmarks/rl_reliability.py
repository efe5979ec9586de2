"""Does the main job's RL tenant learn, reliably? PushT-reach (recipes/main_job.py `reach_rl_spec`)
trained alone, for several seeds, evaluated before and after on the SAME episodes.

  .venv/bin/python benchmarks/rl_reliability.py [--seeds 0 1 2] [--jobs 30] [--episodes 12]

Each seed is a fresh in-process deployment (joynexus.connect.in_process on a temporary data dir)
with the tenant's training seed and environment seed both set from it; the tenant is evaluated
(deterministic actions, `--episodes` episodes, episode j seeded environment.seed + 10_000 + j),
trained for `--jobs` PPO updates through the real path (rollouts through the Inference Queue,
the advantage stage, the actor loop), then evaluated again on the same episodes. Printed per seed:
success rate and mean return before and after; at the end, how many seeds improved (success
rate up, or equal success and mean return up). Exit status 1 when not every seed improved.
`--set rl.ppo_epochs=8` style overrides try other hyper-parameters without editing the recipe.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from joynexus.connect import in_process  # noqa: E402
from joynexus.settings import Settings
from recipes.main_job import reach_rl_spec  # noqa: E402


def apply_overrides(spec: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    for item in overrides:
        path, _, raw = item.partition("=")
        *parents, leaf = path.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = json.loads(raw) if raw not in ("", None) else None
    return spec


def run_seed(seed: int, jobs: int, episodes: int, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"rl-reliability-{seed}-") as tmp:
        cluster = in_process(Settings(data_dir=Path(tmp), torch_threads=1))
        try:
            master = cluster.master
            model = cluster.training.backbone_info()["model_id"]
            spec = reach_rl_spec(model, jobs)
            spec = apply_overrides(spec, overrides)
            spec["training"] = {**spec["training"], "seed": seed}
            spec["environment"] = {**spec["environment"], "seed": 1000 * seed}
            tenant = master.create_tenant(spec)
            started = time.perf_counter()
            before = cluster.wait_workload(master.evaluate(tenant.tenant_id, episodes=episodes).workload_id, timeout_s)
            workload = master.submit_workload(tenant.tenant_id, jobs=jobs)
            trained = cluster.wait_workload(workload.workload_id, timeout_s)
            after = cluster.wait_workload(master.evaluate(tenant.tenant_id, episodes=episodes).workload_id, timeout_s)
            for status in (before, trained, after):
                if status.state != "completed":
                    raise RuntimeError(f"seed {seed}: workload {status.workload_id} ({status.task}) {status.state}: "
                                       f"{status.error}")  # fmt: skip
            b, a = before.result, after.result
            improved = a["success_rate"] > b["success_rate"] or (
                a["success_rate"] == b["success_rate"] and a["mean_return"] > b["mean_return"]
            )
            return {
                "seed": seed,
                "before": b,
                "after": a,
                "improved": improved,
                "versions": (b["policy_version"], a["policy_version"]),
                "seconds": time.perf_counter() - started,
            }
        finally:
            cluster.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=30, help="PPO updates (the main job's default: 30)")
    parser.add_argument("--episodes", type=int, default=12, help="evaluation episodes before and after")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=JSON",
        help="override a spec field, e.g. rl.ppo_epochs=8 or training.learning_rate=1e-4",
    )
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 seed, 1 PPO update, 1 episode")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.jobs, args.episodes = [0], 1, 1

    print(f"PushT-reach RL tenant (recipes/main_job.py reach_rl_spec), {args.jobs} PPO updates, "
          f"{args.episodes} evaluation episodes, overrides {args.overrides or 'none'}", flush=True)  # fmt: skip
    rows = []
    for seed in args.seeds:
        row = run_seed(seed, args.jobs, args.episodes, args.overrides, args.timeout)
        rows.append(row)
        b, a = row["before"], row["after"]
        print(
            f"seed {seed}: v{row['versions'][0]} success {b['success_rate']:.0%} return {b['mean_return']:.3f}  ->  "
            f"v{row['versions'][1]} success {a['success_rate']:.0%} return {a['mean_return']:.3f}  "
            f"{'improved' if row['improved'] else 'NOT improved'}  ({row['seconds']:.0f} s)",
            flush=True,
        )
    count = sum(r["improved"] for r in rows)
    print(f"improved in {count} of {len(rows)} seeds")
    if args.quick:  # one update says nothing about learning: the smoke run's status is only "it ran"
        print("(--quick: a smoke run, the exit status is not the verdict)")
        return 0
    return 0 if count == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
