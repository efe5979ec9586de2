"""Round-trip latency of the stock openpi client on /v1/openpi beside /v1/stream, side by side.

  .venv/bin/python benchmarks/openpi_latency.py [--robots 1 4] [--requests 100] [--json out.json]

One real uvicorn server over in-process services (the tiny backbone; `policy_server.py`'s setup),
two tenants of two schemas. Per point, N robots in threads, each on its own websocket, send one
observation and wait for its chunk, `--requests` times (a closed loop: the round trip is the
whole cost, nothing overlaps within a robot), in `--rounds` rounds alternating the protocols:
- ``openpi``: `openpi_client.websocket_client_policy.WebsocketClientPolicy.infer` (msgpack-numpy,
  HWC uint8 images per camera, the state as a flat array);
- ``stream``: a raw `/v1/stream` obs frame (`joynexus.protocol.wire` tensors) on a websocket.
Both reach the same gateway predict and the same Inference Queue; the difference is the protocol
and its conversions. p50 / p90 round trip per point and the ratio openpi / stream.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.policy_server import create_tenants, start_server  # noqa: E402


def observation(schema: dict[str, Any], rng: np.random.Generator) -> tuple[dict, dict]:
    """One observation in both protocols: (openpi dict, /v1/stream observations)."""
    from joynexus.protocol.wire import tensor

    height, width = schema["image_size"]
    images = rng.integers(0, 256, (len(schema["cameras"]), 3, height, width), dtype=np.uint8)
    state = rng.standard_normal(schema["state_dim"]).astype(np.float32)
    openpi = {"images": {c: images[i].transpose(1, 2, 0) for i, c in enumerate(schema["cameras"])}, "state": state}
    stream = {"images": tensor(images[None]).model_dump(), "state": tensor(state[None]).model_dump()}
    return openpi, stream


def openpi_robot(url: str, tenant: dict[str, Any], requests: int, out: list[float]) -> None:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    policy = WebsocketClientPolicy(url.replace("http://", "ws://") + "/v1/openpi", api_key=tenant["api_key"])
    rng = np.random.default_rng(0)
    obs = [observation(tenant["schema"], rng)[0] for _ in range(8)]
    policy.infer(obs[0])  # warm-up
    for i in range(requests):
        started = time.perf_counter()
        policy.infer(obs[i % len(obs)])
        out.append((time.perf_counter() - started) * 1000.0)


def stream_robot(url: str, tenant: dict[str, Any], requests: int, out: list[float]) -> None:
    from websockets.sync.client import connect

    from joynexus.protocol.wire import msgpack_dumps, msgpack_loads

    headers = {"Authorization": f"Bearer {tenant['api_key']}"}
    rng = np.random.default_rng(0)
    obs = [observation(tenant["schema"], rng)[1] for _ in range(8)]
    with connect(url.replace("http://", "ws://") + "/v1/stream", additional_headers=headers, max_size=None) as ws:
        msgpack_loads(ws.recv())  # ready
        for i in range(-1, requests):  # -1: warm-up
            started = time.perf_counter()
            ws.send(msgpack_dumps({"type": "obs", "seq": i + 1, "observations": obs[i % len(obs)]}))
            answer = msgpack_loads(ws.recv())
            if answer["type"] != "actions":
                raise RuntimeError(answer)
            if i >= 0:
                out.append((time.perf_counter() - started) * 1000.0)


def point(url: str, tenants: list[dict[str, Any]], robots: int, requests: int, mode: str) -> list[float]:
    target = openpi_robot if mode == "openpi" else stream_robot
    results: list[list[float]] = [[] for _ in range(robots)]
    threads = [
        threading.Thread(target=target, args=(url, tenants[i % len(tenants)], requests, results[i]))
        for i in range(robots)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies = [x for r in results for x in r]
    if len(latencies) != robots * requests:
        raise RuntimeError(f"{mode}: {len(latencies)} of {robots * requests} requests answered")
    return latencies


def summary(latencies: list[float]) -> dict[str, float]:
    return {"p50_ms": float(np.percentile(latencies, 50)), "p90_ms": float(np.percentile(latencies, 90))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--robots", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=100, help="round trips per robot per point")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two protocols per point")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 robot, 10 round trips, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.robots, args.requests, args.rounds = [1], 10, 1
    with tempfile.TemporaryDirectory(prefix="joynexus-openpi-bench-") as tmp:
        cluster, server, url, thread = start_server(Path(tmp))
        try:
            tenants = create_tenants(url, 2, chunk=8)
            rows = []
            heads = ("stream p50", "openpi p50", "ratio", "stream p90", "openpi p90")
            print(f"{'robots':>6} " + " ".join(f"{h:>11}" if h != "ratio" else f"{h:>6}" for h in heads))
            for robots in args.robots:
                # Rounds alternate the two protocols, so drift of a shared machine's load hits both.
                pooled: dict[str, list[float]] = {"stream": [], "openpi": []}
                for _ in range(args.rounds):
                    for mode in ("stream", "openpi"):
                        pooled[mode] += point(url, tenants, robots, args.requests, mode)
                stream, openpi = summary(pooled["stream"]), summary(pooled["openpi"])
                ratio = openpi["p50_ms"] / stream["p50_ms"]
                rows.append({"robots": robots, "stream": stream, "openpi": openpi, "openpi_over_stream_p50": ratio})
                print(
                    f"{robots:>6} {stream['p50_ms']:>9.2f}ms {openpi['p50_ms']:>9.2f}ms {ratio:>6.2f} "
                    f"{stream['p90_ms']:>9.2f}ms {openpi['p90_ms']:>9.2f}ms"
                )
            if args.json is not None:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(
                    json.dumps({"requests": args.requests, "rounds": args.rounds, "points": rows}, indent=2)
                )
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            cluster.close()


if __name__ == "__main__":
    main()
