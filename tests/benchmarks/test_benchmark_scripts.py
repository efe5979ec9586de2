"""Every script in benchmarks/ runs at its smallest options, exits 0 and prints its table (issue 42,
item 1): a refactor that breaks a benchmark fails a test instead of rotting until someone reruns it.

Each script runs as a reader would run it, in its own process from the command line, in a scratch
working directory (their default output folders are relative to it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS_DIR = ROOT / "benchmarks"
# Generous for a loaded CI host: each smoke run takes a minute or two on a quiet 2-core machine.
TIMEOUT_S = 900

# script -> (its smallest options, a line of the table it prints last: a regex, multiline).
SMOKE_RUNS: dict[str, tuple[list[str], str]] = {
    "abuse.py": (["--quick"], r"^victim under +robots hanging up: p99 +\d+ ms = +[\d.]+x idle"),
    "capacity.py": (["--quick"], r"^first jobs/s bottleneck: "),
    "chaos_soak.py": (["--quick"], r"^acknowledged versions: \d+; lost or changed: 0"),
    "cli_latency.py": (["--quick"], r"^down +[\d.]+ +[\d.]+ +[\d.]+x$"),
    "control_plane.py": (["--quick"], r"^correctness: every job leased once and completed exactly once"),
    "density.py": (["--quick"], r"^first predict paged-out / resident, T=0 ms: [\d.]+x median"),
    "env_vectorized.py": (["--quick"], r"maniskill PushCube-v1 \(state\)  rollout through the services:.*ratio"),
    "environment_warm_workers.py": (["--quick"], r"^unseeded resets equal on fresh and renewed workers: True"),
    "flood_p99.py": (["--quick"], r"^flooded/idle p99: [\d.]+x without limits, [\d.]+x with limits"),
    # Its own smallest options (the script is extended for the first GPU run; no --quick of its own).
    "gpu_check.py": (["--preset", "tiny", "--steps", "1", "--repeats", "1"], r"^== checkpoint round trip =="),
    "group_batching.py": (["--quick"], r"flow_matching +throughput [\d.]+x with group batching"),
    "grpo_pusht_groups.py": (["--quick"], r"^\d+/\d+ groups carry no signal"),
    "master_capacity.py": (["--workloads", "2", "--jobs", "1"], r"^workloads=2 completed=2 jobs=2 "),
    "master_plane.py": (["--quick", "--replicas", "1"], r"^master CPU per job: [\d.]+ s; control p99 [\d.]+ ms"),
    "lora_vs_peft.py": (["--quick"], r"^heads off: speed-up ours [\d.]+x vs stock [\d.]+x"),
    "mixed_workload.py": (
        ["--quick", "--rl-jobs", "2", "--sft-jobs", "2", "--sim-jobs", "10"],
        r"^goal >= 1\.5x: measured [\d.]+x",
    ),
    "normalization.py": (["--quick"], r"^  action\[1\]: normalized [\d.]+ +raw [\d.]+ +raw / normalized"),
    "openpi_latency.py": (["--quick"], r"^ +1 +[\d.]+ms +[\d.]+ms +[\d.]+ "),
    "pipelined_loop.py": (["--quick"], r"client work 0 ms: blocking [\d.]+ steps/s, pipelined [\d.]+ steps/s, ratio"),
    "policy_server.py": (["--quick"], r"^ +4 \| +[\d.]+ / +[\d.]+ +[\d.]+ \|"),
    "predict_fairness.py": (["--quick"], r"^B's p50 under load, split off / split on: [\d.]+x"),
    "real_size.py": (
        ["--preset", "tiny", "--image-size", "48", "--quick", "--grid", "--grid-tenants", "2", "--grid-batches", "1,2"],
        r"^== table \(issue 23\)",
    ),
    "replicas.py": (["--quick"], r"^throughput 3 replicas / 1 replica: [\d.]+x"),
    "rl_maniskill.py": (["--quick"], r"^seed 0: .*trained"),
    "rl_reliability.py": (["--quick"], r"^improved in [01] of 1 seeds"),
    "rollout_throughput.py": (["--quick"], r"^  2 tenant\(s\): grouped .* -> [\d.]+x"),
    "state_only_features.py": (["--quick"], r"^tiny +[\d,]+ +[\d.]+ +[\d.]+ +\d+x"),
    "smolvla_grouped.py": (["--quick"], r"whole policies [\d.]+ GiB \([\d.]+x\)"),
    "sweep.py": (["--quick"], r"sequential / side by side = [\d.]+x"),
    "training_throughput.py": (["--quick"], r"^ +2 +[\d.]+ +[\d.]+ +[\d.]+x +[\d.]+$"),
    "vla_peer.py": (
        ["--quick"],
        r"^2 tenants: joynexus in-process / lerobot requests/s [\d.]+x, PSS [\d.]+x, requests/s per GiB [\d.]+x",
    ),
}


def test_every_benchmark_script_has_a_smoke_run() -> None:
    # A new benchmark without an entry here would escape the slow suite.
    scripts = {p.name for p in BENCHMARKS_DIR.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(SMOKE_RUNS), {"missing": scripts - set(SMOKE_RUNS), "gone": set(SMOKE_RUNS) - scripts}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE_RUNS))
def test_benchmark_runs_at_its_smallest_options(script: str, tmp_path: Path) -> None:
    options, table_line = SMOKE_RUNS[script]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JOYNEXUS_DATA_DIR": str(tmp_path / "var")}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS_DIR / script), *options],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    tail = f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, f"{script} {' '.join(options)} exited {done.returncode}\n{tail}"
    assert re.search(table_line, done.stdout, re.MULTILINE), f"{script}: no line matching {table_line!r}\n{tail}"
