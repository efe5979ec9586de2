"""Why state-only GRPO in gym-pusht (PushT-v0) regresses: what one rollout's groups carry.

  .venv/bin/python benchmarks/grpo_pusht_groups.py [--groups 12] [--group-size 4] [--horizon 32]
      [--std 0.61] [--csv PATH]

For each group (one initial-state seed, as the rollout producer's `_group_seed` gives), G attempts
of `horizon` steps with the initial policy's noise (a Gaussian of std `--std` in the unit action
range around the field's centre: an untrained head's mean is near 0 and its log-std starts at
-0.5, i.e. 0.61), the discounted attempt returns and the advantages `algorithms.rl.grpo_advantages`
gives them. Printed per group: returns, mean, spread (std), spread / |mean|, how far the block
moved in each attempt, and the largest |advantage|; then the summary the regression comes from.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from joynexus.algorithms.rl import grpo_advantages  # noqa: E402
from joynexus.envs.base import SimulatorConfig, build_simulator, unit_to_bounds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--horizon", type=int, default=32)
    parser.add_argument("--std", type=float, default=float(np.exp(-0.5)))
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 groups of 2 attempts, horizon 8")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.group_size, args.horizon = 2, 2, 8
    rng = np.random.default_rng(0)
    sim = build_simulator(SimulatorConfig(simulator="pusht", task="PushT-v0"))
    low, high = np.asarray(sim.spec.action_low, np.float32), np.asarray(sim.spec.action_high, np.float32)
    rows = []
    print("group  returns                          mean    spread  spread/|mean|  block moved (px)      max|adv|")
    for g in range(args.groups):
        rewards = np.zeros((args.horizon, args.group_size), np.float32)
        moved = []
        for a in range(args.group_size):
            obs = sim.reset(1000 + g)
            block0 = obs.state[2:4].copy()
            for t in range(args.horizon):
                action = np.clip(rng.normal(0.0, args.std, size=2), -1, 1).astype(np.float32)
                result = sim.step(unit_to_bounds(action, low, high))
                rewards[t, a] = result.reward
            moved.append(float(np.linalg.norm(result.observation.state[2:4] - block0)))
        dones = np.zeros_like(rewards, dtype=bool)
        adv, ret = grpo_advantages(rewards, dones, np.zeros_like(rewards, dtype=np.int64), gamma=args.gamma)
        returns = ret[0]
        mean, spread = float(returns.mean()), float(returns.std())
        rel = spread / abs(mean) if mean else 0.0
        row = {"group": g, "returns": " ".join(f"{r:.3f}" for r in returns), "mean": round(mean, 4),
               "spread": round(spread, 4), "relative_spread": round(rel, 3),
               "block_moved_px": " ".join(f"{m:.0f}" for m in moved),
               "max_abs_advantage": round(float(np.abs(adv).max()), 3)}  # fmt: skip
        rows.append(row)
        print(f"{g:5d}  {row['returns']:<32} {mean:6.3f}  {spread:7.3f}  {rel:13.2f}  {row['block_moved_px']:<20}  "
              f"{row['max_abs_advantage']:7.2f}")  # fmt: skip
    silent = sum(1 for r in rows if r["spread"] == 0.0)
    loud = [r for r in rows if r["spread"] > 0.0]
    print(f"\n{silent}/{len(rows)} groups carry no signal (every attempt the same return: advantage 0);")
    if loud:
        rels = [r["relative_spread"] for r in loud]
        top = max(r["max_abs_advantage"] for r in loud)
        print(
            f"the other {len(loud)} get advantages of |A| up to {top:.2f} whatever their spread: "
            f"relative spreads {min(rels):.2f} .. {max(rels):.2f} weigh the same."
        )
    if args.csv is not None:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
