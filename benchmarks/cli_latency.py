"""How long the everyday commands take, before -> after, side by side in one run (issue 30).

  .venv/bin/python benchmarks/cli_latency.py --before ../main-checkout [--after .] [--no-flow] [--repeat 2]

For each source tree (`--before`: a checkout of the code to compare against, e.g. a worktree at main;
`--after`: this one) the same sequence runs on a fresh data dir with its own free ports, the tree on
PYTHONPATH and the same interpreter:

* `status` with nothing up (exit 1: every service down) -- the command a person types most;
* `up` (Ray head, resident services, Prefect and MLflow servers) until it returns;
* `status` against that deployment;
* `serve` over Ray: from spawning `joynexus serve` until `GET /v1/health` answers 200;
* the lifecycle flow's overhead: from spawning `python -m flows.tenant_lifecycle` (with the env `up`
  wrote) until Prefect begins the flow run (its first task starts next); the run is then stopped;
* `down` until it returns.

Printed: one row per command with before / after seconds (median of `--repeat` for the cheap
status-without-deployment) and the ratio before / after. Trees run one after the other, before
first, on the same host in the same run, so both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
RAY_BLOCK = 10  # JOYNEXUS_RAY_PORT and the 9 ports above it (joynexus/ops/ray_ports.py)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((HOST, port)) == 0


def ray_port() -> int:
    """A base port whose whole Ray block is free and outside Ray's worker range (10002-19999)."""
    while True:
        base = free_port()
        if base > 20000 and base + RAY_BLOCK < 65535 and not any(_listening(base + i) for i in range(RAY_BLOCK)):
            return base


class Tree:
    """One source tree's commands, each on the same interpreter with the tree first on PYTHONPATH."""

    def __init__(self, root: Path, work: Path):
        self.root, self.data_dir = root, work / "data"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("JOYNEXUS_", "PREFECT_", "MLFLOW_"))}
        self.env.update(
            PYTHONPATH=str(root),
            JOYNEXUS_DATA_DIR=str(self.data_dir),
            JOYNEXUS_RAY_PORT=str(ray_port()),
            JOYNEXUS_PREFECT_PORT=str(free_port()),
            JOYNEXUS_MLFLOW_PORT=str(free_port()),
            JOYNEXUS_TORCH_THREADS="1",
            RAY_USAGE_STATS_ENABLED="0",
        )

    def cli(self, *args: str, timeout: float = 900) -> tuple[float, subprocess.CompletedProcess]:
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "joynexus.cli", *args], cwd=self.root, env=self.env,
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        return time.perf_counter() - start, done

    def deployment_env(self) -> dict[str, str]:
        """The env a shell gets from `source <data dir>/run/env.sh`."""
        env = dict(self.env)
        for line in (self.data_dir / "run" / "env.sh").read_text().splitlines():
            if line.startswith("export "):
                key, value = line.removeprefix("export ").split("=", 1)
                env[key] = json.loads(value)
        return env


def time_until(argv: list[str], env: dict[str, str], cwd: Path, ready, timeout: float = 600) -> float:
    """Seconds from spawning `argv` until `ready(output_so_far)` is true; the process is then stopped."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while time.perf_counter() - start < timeout:
            if ready(Path(log.name).read_text(errors="replace")):
                return time.perf_counter() - start
            if process.poll() is not None:
                raise RuntimeError(f"{argv[:4]} exited {process.returncode}:\n{Path(log.name).read_text()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{argv[:4]} not ready after {timeout} s")
    finally:
        os.killpg(process.pid, 15)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
        Path(log.name).unlink(missing_ok=True)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except Exception:
        return False


def measure(tree: Tree, repeat: int, flow: bool) -> dict[str, float]:
    times: dict[str, float] = {}
    times["status (nothing up)"] = statistics.median(tree.cli("status")[0] for _ in range(repeat))
    elapsed, up = tree.cli("up", "--timeout", "900")
    if up.returncode != 0:
        raise RuntimeError(f"up failed in {tree.root}:\n{up.stdout[-2000:]}{up.stderr[-2000:]}")
    times["up"] = elapsed
    try:
        times["status (deployment up)"] = tree.cli("status")[0]
        port = free_port()
        times["serve over Ray -> healthy"] = time_until(
            [sys.executable, "-m", "joynexus.cli", "serve", "--port", str(port)], tree.env, tree.root,
            lambda _: _healthy(f"http://{HOST}:{port}/v1/health"),
        )  # fmt: skip
        if flow:
            sys.path.insert(0, str(ROOT))
            from tests.helpers import sft_spec, write_dataset_for

            spec = sft_spec("latency", tree.data_dir.parent / "dataset", jobs=1, samples_per_job=8)
            write_dataset_for(spec, episodes=2, length=8)
            spec_file = tree.data_dir.parent / "spec.json"
            spec_file.write_text(json.dumps(spec))
            times["lifecycle flow -> run begins"] = time_until(
                [sys.executable, "-m", "flows.tenant_lifecycle", str(spec_file), "--jobs", "1"],
                tree.deployment_env(), tree.root, lambda out: "Beginning flow run" in out,
            )  # fmt: skip
    finally:
        elapsed, down = tree.cli("down")
        times["down"] = elapsed
        if down.returncode != 0:
            print(f"down failed in {tree.root}: {down.stderr[-1000:]}", file=sys.stderr)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, default=None, help="source tree to compare against (required)")
    parser.add_argument("--after", type=Path, default=ROOT, help="source tree measured second (default: this one)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the cheap status-without-deployment")
    parser.add_argument("--no-flow", action="store_true", help="skip the lifecycle flow's overhead")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: one status, no flow; --before defaults to this tree"
    )
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.no_flow, args.before = 1, True, args.before or ROOT
    if args.before is None:
        parser.error("--before is required (a source tree to compare against)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="jnx-latency-") as work:
        for label, root in (("before", args.before.resolve()), ("after", args.after.resolve())):
            print(f"measuring {label}: {root}", file=sys.stderr, flush=True)
            results[label] = measure(Tree(root, Path(work) / label), args.repeat, not args.no_flow)
    print(f"{'command':32s} {'before s':>9s} {'after s':>9s} {'before/after':>13s}")
    for command, before in results["before"].items():
        after = results["after"].get(command, float("nan"))
        print(f"{command:32s} {before:9.2f} {after:9.2f} {before / after:12.1f}x")


if __name__ == "__main__":
    main()
