"""Pipelined vs blocking steps/s of `examples/pipelined_loop.py`, side by side (issue 28).

  .venv/bin/python benchmarks/pipelined_loop.py [--services in-process|ray] [--rounds 3]
      [--iterations 20] [--batch 8] [--n 4] [--client-work-ms 0 20] [--json out.json]

`joynexus serve` in a process of its own over the deployment's services (the tiny backbone): in
process, or on Ray as it runs by default (a local Ray it starts, its own namespace; the futures then
go through the shared `joynexus.call_futures` actor). Two RL tenants, one per loop. Per client-work setting,
`--rounds` rounds alternate the order (blocking first, then pipelined first, ...), each loop
`--iterations` steps after a warm-up call; prints median steps/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ADMIN_KEY = "bench-admin-key-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[1]


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("example_pipelined_loop", ROOT / "examples" / "pipelined_loop.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def start_server(services: str, data_dir: Path, port: int) -> subprocess.Popen:
    """`joynexus serve` in its own process (the client's loop must not share the server's GIL)."""
    import httpx

    env = {**os.environ, "JOYNEXUS_ADMIN_KEY": ADMIN_KEY, "JOYNEXUS_RAY_NAMESPACE": f"bench-{uuid.uuid4().hex[:8]}"}
    command = [sys.executable, "-m", "joynexus.cli", "serve", "--services", services, "--port", str(port),
               "--data-dir", str(data_dir)]  # fmt: skip
    log = open(data_dir / "serve.log", "wb")  # noqa: SIM115 - the server's whole life
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"joynexus serve exited ({server.returncode}); see {data_dir / 'serve.log'}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("joynexus serve did not answer within 300 s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(example: Any, url: str, keys: tuple[str, str], args: argparse.Namespace, work_ms: float) -> dict:
    from joynexus.client import JoyNexusClient

    loops = {"blocking": example.blocking_loop, "pipelined": example.pipelined_loop}
    rates: dict[str, list[float]] = {name: [] for name in loops}
    for round_index in range(args.rounds):
        order = list(loops) if round_index % 2 == 0 else list(reversed(loops))
        for name in order:
            with JoyNexusClient(url, keys[0] if name == "blocking" else keys[1]) as client:
                batches = example.Batches(client.tenant(), args.batch)
                client.sample(*batches(0), n=1, seed=0)  # warm-up, the futures path too (on Ray its
                client.sample_async(*batches(0), n=1, seed=0).result(timeout=300)  # actor starts on first use)
                started = time.perf_counter()
                loops[name](client, batches, args.iterations, args.n, work_ms / 1000.0)
                rates[name].append(args.iterations / (time.perf_counter() - started))
    blocking, pipelined = statistics.median(rates["blocking"]), statistics.median(rates["pipelined"])
    return {"client_work_ms": work_ms, "blocking_steps_per_s": blocking, "pipelined_steps_per_s": pipelined,
            "ratio": pipelined / blocking, "rounds": rates}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--services", choices=["in-process", "ray"], default="in-process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--client-work-ms", type=float, nargs="+", default=[0.0, 20.0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 2 iterations, no client work")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.iterations, args.client_work_ms = 1, 2, [0.0]

    from joynexus.client import JoyNexusClient

    example = load_example()
    data_dir = Path(tempfile.mkdtemp(prefix="pipelined-bench-"))
    port = free_port()
    server = start_server(args.services, data_dir, port)
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        with JoyNexusClient(url, ADMIN_KEY) as admin:
            keys = tuple(admin.create_tenant(example.rl_spec(f"bench-{i}")).key.api_key for i in range(2))
        for work_ms in args.client_work_ms:
            result = measure(example, url, keys, args, work_ms)
            results.append(result)
            line = (
                f"{args.services}, batch {args.batch} x n {args.n}, client work {work_ms:g} ms: blocking "
                f"{result['blocking_steps_per_s']:.2f} steps/s, pipelined {result['pipelined_steps_per_s']:.2f} "
                f"steps/s, ratio {result['ratio']:.2f}x"
            )
            print(line, flush=True)
    finally:
        server.send_signal(signal.SIGINT)  # uvicorn's graceful stop: the services (and a local Ray) close
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    if args.json:
        args.json.write_text(json.dumps({"services": args.services, "results": results}, indent=2))


if __name__ == "__main__":
    main()
