"""A sweep's N variants trained side by side vs one after another, in one run (issue 28.5).

  PYTHONPATH=. .venv/bin/python benchmarks/sweep.py [--variants 8] [--jobs 2] [--mode inprocess|ray]
                                                    [--repeats 1] [--out var/benchmarks]

What runs: one deployment (tiny backbone; `inprocess`: every service a local object, `ray`: the
services and the Master as Ray actors) and one SFT source tenant on a generated dataset. Each
setting forks the source's version 0 into N variants with N learning rates
(`joynexus.master.sweeps`, the library the `sweep` flow is thin over), then trains them:

- side by side: every variant's training workload submitted at once (`train_side_by_side`), so the
  actor loop leases their jobs together and trains them grouped, one shared backbone forward per
  round (what the sweep flow does);
- sequential: the same N variants (forked afresh) trained one workload at a time, each waited for
  before the next is submitted (N separate runs).

Figures: the training wall time of each setting (submit to the last workload's end; the forks are
timed apart), the ratio sequential / side by side, and the per-variant mean. Every workload must
complete (checked). `--repeats R` alternates which setting goes first and reports medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SAMPLES_PER_JOB = 32
MICROBATCH = 8
TINY_MODEL_ID = "joynexus/tiny-smolvlm"  # the resident tiny backbone's id (the default backbone)
LEARNING_RATES = [1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 1e-1, 2e-1, 5e-1]


def source_spec(dataset_root: Path, jobs: int, base_model: str, microbatch: int = MICROBATCH) -> dict[str, Any]:
    return {
        "tenant": "sweep-source",
        "base_model": base_model,
        "task": "sft",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {
            "cameras": ["top"],
            "image_size": [32, 32],
            "state_dim": 4,
            "action_dim": 2,
            "action_chunk": 1,
            "instruction": "move the arm to the target",
        },  # fmt: skip
        "dataset": {"root": str(dataset_root), "repo_id": "bench/sweep-demos"},
        "scheduling": {"max_in_flight_jobs": jobs, "completion_target": jobs},
        "training": {"samples_per_job": SAMPLES_PER_JOB, "microbatch_size": microbatch, "learning_rate": 1e-3},
    }


@contextlib.contextmanager
def deployment(mode: str, data_dir: Path) -> Iterator[Any]:
    from joynexus.settings import Settings

    settings = Settings(data_dir=data_dir, torch_threads=1, ray_namespace=f"sweep-{uuid.uuid4().hex[:8]}")
    if mode == "inprocess":
        from joynexus.connect import in_process

        cluster = in_process(settings)
        try:
            yield cluster
        finally:
            cluster.close()
        return
    from joynexus.connect import ray_cluster
    from joynexus.ops.supervisor import remove_service_actors

    try:
        yield ray_cluster(settings)
    finally:
        remove_service_actors(settings.ray_namespace)


def fork_variants(cluster: Any, label: str, n: int) -> tuple[list[str], float]:
    from joynexus.master import sweeps

    variants = sweeps.expand_variants({"learning_rate": LEARNING_RATES[:n]})
    sweep_id = f"{label}{uuid.uuid4().hex[:4]}"
    started = time.perf_counter()
    ids = []
    for index, variant in enumerate(variants):
        tenant_id = sweeps.variant_tenant_id("sweep-source", sweep_id, index)
        ids.append(sweeps.create_variant(cluster.master, "sweep-source", 0, variant, tenant_id)["tenant_id"])
    return ids, time.perf_counter() - started


def step_totals() -> dict[str, float]:
    """This process's Training Model Service rounds so far (in-process mode): count and seconds of
    `serial` rounds (one tenant's step) and `grouped` rounds (one shared forward for several)."""
    from joynexus.core.service_metrics import service_metrics

    totals: dict[str, float] = {}
    for metric in service_metrics().training_step_seconds.collect():
        for sample in metric.samples:
            kind = sample.name.rsplit("_", 1)[-1]
            if kind in ("count", "sum"):
                totals[f"{sample.labels['mode']}_{kind}"] = sample.value
    return totals


def train(cluster: Any, tenant_ids: list[str], jobs: int, side_by_side: bool, timeout_s: float) -> float:
    from joynexus.master.sweeps import train_side_by_side

    started = time.perf_counter()
    groups = [tenant_ids] if side_by_side else [[t] for t in tenant_ids]
    finals = [f for group in groups for f in train_side_by_side(cluster.master, cluster.wait_workload, group, jobs,
                                                                 timeout_s)]  # fmt: skip
    wall = time.perf_counter() - started
    bad = [(f.tenant_id, f.state, f.error) for f in finals if f.state != "completed"]
    if bad:
        raise RuntimeError(f"workloads did not complete: {bad}")
    return wall


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=2, help="training jobs per variant")
    parser.add_argument("--mode", choices=("inprocess", "ray"), default="inprocess")
    parser.add_argument("--microbatch", type=int, default=MICROBATCH, help="the tenants' microbatch size")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 variants x 1 job")
    args = parser.parse_args(argv)
    if args.quick:
        args.variants, args.jobs = 2, 1
    if not 1 <= args.variants <= len(LEARNING_RATES):
        parser.error(f"--variants must be in [1, {len(LEARNING_RATES)}]")

    from joynexus.data.lerobot_dataset import write_synthetic_dataset

    walls: dict[str, list[float]] = {"side_by_side": [], "sequential": []}
    rounds: dict[str, dict[str, float]] = {"side_by_side": {}, "sequential": {}}  # in-process only
    forks: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp,
        deployment(args.mode, Path(tmp) / "data") as cluster,
    ):
        root = Path(tmp) / "demos"
        write_synthetic_dataset(
            root,
            "bench/sweep-demos",
            cameras=["top"],
            image_size=(32, 32),
            state_dim=4,
            action_dim=2,
            num_episodes=4,
            episode_length=40,
            task="move the arm to the target",
        )
        cluster.master.create_tenant(source_spec(root, args.jobs, TINY_MODEL_ID, args.microbatch))
        cluster.training.save(["sweep-source"])  # version 0, the one every variant forks
        for repeat in range(args.repeats):
            order = ("side_by_side", "sequential") if repeat % 2 == 0 else ("sequential", "side_by_side")
            for setting in order:
                ids, fork_s = fork_variants(cluster, setting[:3], args.variants)
                forks.append(fork_s / args.variants)
                before = step_totals()
                walls[setting].append(train(cluster, ids, args.jobs, setting == "side_by_side", args.timeout))
                after = step_totals()
                for key, value in after.items():
                    rounds[setting][key] = rounds[setting].get(key, 0.0) + value - before.get(key, 0.0)
                print(f"repeat {repeat + 1}: {setting:12s} {args.variants} variants x {args.jobs} jobs: "
                      f"{walls[setting][-1]:.2f} s", flush=True)  # fmt: skip
    side, seq = statistics.median(walls["side_by_side"]), statistics.median(walls["sequential"])
    result = {
        "mode": args.mode, "variants": args.variants, "jobs_per_variant": args.jobs,
        "samples_per_job": SAMPLES_PER_JOB, "microbatch": args.microbatch, "side_by_side_s": side, "sequential_s": seq,
        "ratio_sequential_over_side_by_side": seq / side, "fork_s_per_variant": statistics.median(forks),
        "walls": walls, "training_rounds": rounds if args.mode == "inprocess" else None,
    }  # fmt: skip
    print(
        f"\n{args.variants} variants x {args.jobs} jobs, microbatch {args.microbatch} ({args.mode}): "
        f"side by side {side:.2f} s ({side / args.variants:.2f} s/variant), "
        f"sequential {seq:.2f} s ({seq / args.variants:.2f} s/variant); "
        f"sequential / side by side = {seq / side:.2f}x; a fork takes {result['fork_s_per_variant']:.2f} s"
    )
    if args.mode == "inprocess":  # where the time went: the service's optimizer rounds vs everything else
        for setting, totals in rounds.items():
            seconds = totals.get("serial_sum", 0.0) + totals.get("grouped_sum", 0.0)
            print(
                f"  {setting}: {totals.get('grouped_count', 0):.0f} grouped + {totals.get('serial_count', 0):.0f} "
                f"serial optimizer rounds, {seconds:.2f} s in them over {args.repeats} repeat(s) "
                f"(the rest: data, checkpoints, exports, registration, scheduling)"
            )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"sweep-{args.mode}-mb{args.microbatch}.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
