"""The policy server under load: N simulated robots at a fixed control rate through a real uvicorn
server, with the Inference Queue's group batching (default B / T) vs one request per forward.

  .venv/bin/python benchmarks/policy_server.py [--robots 1 8 32] [--seconds 5] [--hz 30] [--tenants 4]

The server (in-process services, the tiny backbone, several tenants of two schemas: camera sets,
image sizes, action dims and module kinds differ) runs in this process; the robots run in a
separate process (so they do not share the server's interpreter lock), each a
`joynexus.robot_client.RobotPolicyClient` on its own websocket, its tenant chosen round-robin.
A control thread ticks every robot at `--hz` and executes `next_action()`; each client requests its
next chunk when `--threshold` actions or fewer are left (LeRobot-style asynchronous inference).

Per point (robots x mode), over the measurement window after a warm-up:
- control rate: actions executed per robot per second (the target is --hz; a starved tick executes
  nothing),
- p50 / p99 latency: request round trip seen by the robot (observation sent -> chunk received),
- mean physical batch: samples per shared backbone forward, from the Inference Model Service's
  stats() (and requests per forward),
- gc max: the longest garbage-collector pause in the server's process (and in the robots' one)
  during the window: a full collection stalls the event loop and every thread at once, so it lands
  in the latency of every request in flight (issue 17: the server freezes its startup heap, see
  `joynexus.core.heap`; JOYNEXUS_GC_FREEZE=0 turns that off to compare).
"grouped" is the service's default (max batch B, max wait T); "ungrouped" sets max batch 1, so
every request gets its own backbone forward. Ratios grouped / ungrouped are printed side by side.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import multiprocessing
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ADMIN_KEY = "benchmark-admin-key-0123456789abcdef"
TINY_MODEL_ID = "joynexus/tiny-smolvlm"
SCHEMAS = [
    dict(cameras=["front", "wrist"], image_size=[32, 32], state_dim=8, action_dim=7, module="oft_mlp"),
    dict(cameras=["top"], image_size=[24, 40], state_dim=4, action_dim=2, module="flow_matching"),
]


def tenant_spec(name: str, schema: dict[str, Any], chunk: int) -> dict[str, Any]:
    """An evaluation tenant (no dataset needed) of one schema."""
    return {
        "tenant": name,
        "base_model": TINY_MODEL_ID,
        "task": "eval",
        "action_module": {"kind": schema["module"], "size": "tiny"},
        "observation": {
            "cameras": schema["cameras"],
            "image_size": schema["image_size"],
            "state_dim": schema["state_dim"],
            "action_dim": schema["action_dim"],
            "action_chunk": chunk,
            "instruction": "push the cube",
        },
    }


class GcPauses:
    """Garbage-collector pauses of this process, timestamped (gc.callbacks), to cut out a window."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []  # (wall time at the end, seconds, generation)
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((time.time(), time.perf_counter() - self._started, info["generation"]))

    def window(self, t0: float, t1: float) -> dict[str, float]:
        inside = [(seconds, generation) for at, seconds, generation in self.pauses if t0 <= at <= t1]
        return {
            "gc_max_ms": max((seconds for seconds, _ in inside), default=0.0) * 1000.0,
            "gc_full": sum(1 for _, generation in inside if generation == 2),
        }

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)


# -- the robots' process -------------------------------------------------------------------------
def run_robots(
    url: str, robots: list[dict[str, Any]], hz: float, threshold: int, warmup_s: float, seconds: float
) -> dict[str, Any]:
    """Runs in a child process: N robot clients, one control thread; returns the measurements."""
    from joynexus.robot_client import RobotPolicyClient

    def observer(schema: dict[str, Any], seed: int):
        rng = np.random.default_rng(seed)
        height, width = schema["image_size"]
        images = rng.integers(0, 256, (len(schema["cameras"]), 3, height, width), dtype=np.uint8)
        state = rng.standard_normal(schema["state_dim"]).astype(np.float32)
        return lambda: {"images": images, "state": state, "instruction": "push the cube"}

    clients = [
        RobotPolicyClient(url, r["api_key"], observer(r["schema"], i), control_hz=hz, request_threshold=threshold)
        for i, r in enumerate(robots)
    ]
    for client in clients:
        client.start(wait_s=60)
    pauses = GcPauses()
    executed = [0] * len(clients)
    ticks = 0
    period = 1.0 / hz
    window: dict[str, float] = {}
    snapshots: dict[str, list[dict[str, Any]]] = {}
    start = time.monotonic()
    next_tick = start
    measuring = False
    while True:
        now = time.monotonic()
        if not measuring and now - start >= warmup_s:
            measuring = True
            window["t0"] = time.time()
            snapshots["before"] = [c.stats() for c in clients]
            executed, ticks = [0] * len(clients), 0
        if measuring and now - start >= warmup_s + seconds:
            window["t1"] = time.time()
            snapshots["after"] = [c.stats() for c in clients]
            break
        for i, client in enumerate(clients):
            if client.next_action(timeout=0.0) is not None:
                executed[i] += 1
        ticks += 1
        next_tick += period
        delay = next_tick - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_tick = time.monotonic()  # behind: tick again at once, no burst
    for client in clients:
        client.close()
    pauses.stop()
    elapsed = window["t1"] - window["t0"]
    latencies: list[float] = []
    requests = errors = 0
    for before, after in zip(snapshots["before"], snapshots["after"], strict=True):
        latencies += after["latencies_ms"][len(before["latencies_ms"]) :]
        requests += after["requests"] - before["requests"]
        errors += after["errors"] - before["errors"] + after["timeouts"] - before["timeouts"]
    return {
        **window,
        "control_hz": float(np.mean(executed)) / elapsed,
        "min_control_hz": float(np.min(executed)) / elapsed,
        "tick_hz": ticks / elapsed,
        "p50_ms": float(np.percentile(latencies, 50)) if latencies else float("nan"),
        "p99_ms": float(np.percentile(latencies, 99)) if latencies else float("nan"),
        "requests_per_s": requests / elapsed,
        "errors": errors,
        "robots_gc_max_ms": pauses.window(window["t0"], window["t1"])["gc_max_ms"],
    }


# -- the server's process ------------------------------------------------------------------------
class StatsPoller:
    """Timestamped snapshots of the Inference Model Service's counters, to cut out a window."""

    def __init__(self, service: Any, every_s: float = 0.02):
        self.service, self.every_s = service, every_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            stats = self.service._stats
            self.samples.append((time.time(), {k: stats[k] for k in ("batches", "requests", "samples")}))
            time.sleep(self.every_s)

    def window(self, t0: float, t1: float) -> dict[str, int]:
        def at(t: float) -> dict[str, int]:
            return min(self.samples, key=lambda s: abs(s[0] - t))[1]

        a, b = at(t0), at(t1)
        return {k: b[k] - a[k] for k in a}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def start_server(data_dir: Path) -> tuple[Any, Any, str, Any]:
    import uvicorn

    from joynexus.api.app import ApiSettings, create_app
    from joynexus.connect import in_process
    from joynexus.settings import Settings

    cluster = in_process(Settings(data_dir=data_dir))
    app = create_app(cluster, ApiSettings(), admin_key=ADMIN_KEY)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return cluster, server, f"http://127.0.0.1:{port}", thread


def create_tenants(url: str, count: int, chunk: int) -> list[dict[str, Any]]:
    import httpx

    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    tenants = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for i in range(count):
            schema = SCHEMAS[i % len(SCHEMAS)]
            created = http.post("/v1/admin/tenants", json=tenant_spec(f"robot-fleet-{i}", schema, chunk), headers=admin)
            created.raise_for_status()
            key = created.json()["key"]["api_key"]
            loaded = http.post("/v1/weights/load", json={}, headers={"Authorization": f"Bearer {key}"})
            loaded.raise_for_status()
            tenants.append({"api_key": key, "schema": schema})
    return tenants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--robots", type=int, nargs="+", default=[1, 8, 32], help="robot counts to run")
    parser.add_argument("--seconds", type=float, default=5.0, help="measurement window per point")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds before each window")
    parser.add_argument("--hz", type=float, default=30.0, help="control rate of every robot")
    parser.add_argument("--tenants", type=int, default=4, help="tenants (two schemas alternate)")
    parser.add_argument("--chunk", type=int, default=8, help="action chunk length of every tenant")
    parser.add_argument("--threshold", type=int, default=4, help="request the next chunk at this many actions left")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 and 4 robots, 1 s windows")
    args = parser.parse_args()
    if args.quick:
        args.robots, args.seconds, args.warmup, args.tenants = [1, 4], 1.0, 0.5, 2

    from joynexus.actors import handle_of

    with tempfile.TemporaryDirectory(prefix="joynexus-policy-server-") as tmp:
        cluster, server, url, thread = start_server(Path(tmp))
        service = handle_of(cluster.inference).target
        grouped_batch, grouped_wait_ms = service.max_batch_size, service.max_wait_s * 1000
        tenants = create_tenants(url, args.tenants, args.chunk)
        poller = StatsPoller(service)
        pauses = GcPauses()
        results: list[dict[str, Any]] = []
        context = multiprocessing.get_context("spawn")
        print(
            f"policy server {url}: {args.tenants} tenants, chunk {args.chunk}, request at <= {args.threshold} left, "
            f"{args.hz:g} Hz, {args.seconds:g} s per point; grouped = B {grouped_batch} / T {grouped_wait_ms:g} ms, "
            "ungrouped = B 1"
        )
        try:
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
                for n in args.robots:
                    robots = [tenants[i % len(tenants)] for i in range(n)]
                    for mode, batch in (("grouped", grouped_batch), ("ungrouped", 1)):
                        service.max_batch_size = batch
                        measured = pool.submit(
                            run_robots, url, robots, args.hz, args.threshold, args.warmup, args.seconds
                        ).result()
                        counts = poller.window(measured["t0"], measured["t1"])
                        row = {
                            "robots": n,
                            "mode": mode,
                            **measured,
                            **pauses.window(measured["t0"], measured["t1"]),
                            "mean_batch_samples": counts["samples"] / max(counts["batches"], 1),
                            "requests_per_batch": counts["requests"] / max(counts["batches"], 1),
                            "forwards_per_s": counts["batches"] / (measured["t1"] - measured["t0"]),
                        }
                        results.append(row)
                        print(
                            f"  {n:3d} robots {mode:9s}: {row['control_hz']:5.1f} Hz "
                            f"(min {row['min_control_hz']:4.1f}), "
                            f"p50 {row['p50_ms']:7.1f} ms, p99 {row['p99_ms']:7.1f} ms, "
                            f"batch {row['mean_batch_samples']:5.2f} samples, {row['requests_per_s']:6.1f} req/s, "
                            f"errors {row['errors']}, gc max {row['gc_max_ms']:.0f} ms "
                            f"({row['gc_full']} full; robots {row['robots_gc_max_ms']:.0f} ms)",
                            flush=True,
                        )
        finally:
            service.max_batch_size = grouped_batch
            poller.stop()
            pauses.stop()
            server.should_exit = True
            thread.join(timeout=30)
            cluster.close()

    print("\ngrouped vs ungrouped, side by side (ratio = grouped / ungrouped; latency ratio < 1 is better)")
    header = (
        f"{'robots':>6} | {'control Hz g / u':>17} {'ratio':>6} | {'p50 ms g / u':>17} {'ratio':>6} | "
        f"{'p99 ms g / u':>19} {'ratio':>6} | {'batch g / u':>13} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for n in args.robots:
        g = next(r for r in results if r["robots"] == n and r["mode"] == "grouped")
        u = next(r for r in results if r["robots"] == n and r["mode"] == "ungrouped")
        print(
            f"{n:>6} | {g['control_hz']:7.1f} / {u['control_hz']:7.1f} {g['control_hz'] / u['control_hz']:6.2f} | "
            f"{g['p50_ms']:7.1f} / {u['p50_ms']:7.1f} {g['p50_ms'] / u['p50_ms']:6.2f} | "
            f"{g['p99_ms']:8.1f} / {u['p99_ms']:8.1f} {g['p99_ms'] / u['p99_ms']:6.2f} | "
            f"{g['mean_batch_samples']:5.2f} / {u['mean_batch_samples']:5.2f} "
            f"{g['mean_batch_samples'] / u['mean_batch_samples']:6.2f}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"results: {args.json}")


if __name__ == "__main__":
    main()
