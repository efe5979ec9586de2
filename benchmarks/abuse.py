"""Abuse figures (issue 26), side by side in one run: what an unauthenticated caller, or one tenant,
does to the service and to another tenant.

  .venv/bin/python benchmarks/abuse.py [--seconds 4] [--abandoned 100] [--samples 512] [--json out.json]

One API server (uvicorn, in-process services, tiny backbone, default settings) in this process; the
victim tenant's 1-sample predicts run here, every flood runs in a separate process (its own
interpreter lock), so the figures are the server's, not the flooder's. Printed:

- idempotency: a tenant's train step sent with an Idempotency-Key, then `--flood` POSTs with
  made-up keys, then the tenant's retry: replayed (the step applied once) or run again;
- abandoned predicts: `--abandoned` predicts of `--samples` observations with timeout_s=0.001, then
  the Inference Queue's depth (entries, i.e. chunks of 8 samples) right after and 1 s later; the
  same for robots that send their in-flight limit of large frames on /v1/stream and hang up;
- /metrics: the status without a key, with a tenant key, with the operator (admin) key;
- the victim's p99 latency idle and under each flood (unauthenticated POSTs, the attacker's large
  predicts, the same abandoned at once, robots hanging up), as ratios to idle.

Run it on main and on a fix branch for before / after (the script uses only what both have).
"""

from __future__ import annotations

import argparse
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

ADMIN_KEY = "abuse-benchmark-admin-key-0123456789"
TINY_MODEL_ID = "joynexus/tiny-smolvlm"
VICTIM = dict(cameras=["front", "wrist"], image_size=[32, 32], state_dim=8, action_dim=7, module="oft_mlp")
ATTACKER = dict(cameras=["top"], image_size=[24, 40], state_dim=4, action_dim=2, module="flow_matching")


def tenant_spec(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "tenant": name,
        "base_model": TINY_MODEL_ID,
        "task": "eval",
        "action_module": {"kind": schema["module"], "size": "tiny"},
        "observation": {k: schema[k] for k in ("cameras", "image_size", "state_dim", "action_dim")},
    }


def observations(schema: dict[str, Any], n: int, seed: int) -> dict[str, Any]:
    from joynexus.protocol.wire import tensor

    rng = np.random.default_rng(seed)
    h, w = schema["image_size"]
    images = rng.integers(0, 255, (n, len(schema["cameras"]), 3, h, w), dtype=np.uint8)
    state = rng.standard_normal((n, schema["state_dim"])).astype(np.float32)
    return {"images": tensor(images).model_dump(mode="json"), "state": tensor(state).model_dump(mode="json")}


# -- floods (each in its own process) -------------------------------------------------------------
def flood(kind: str, url: str, key: str, seconds: float, samples: int, sent: Any, ready: Any) -> None:
    import httpx  # noqa: F401 (imported before the clock starts)
    from websockets.sync.client import connect  # noqa: F401

    body = {"observations": observations(ATTACKER, samples, 1)}
    ready.set()
    stop = time.monotonic() + seconds
    if kind == "robots hanging up":
        return _robots(url, key, stop, samples, sent)
    if kind == "abandoned predicts":
        body["timeout_s"] = 0.001
    elif kind == "predicts":
        body["timeout_s"] = 5.0
    threads = [threading.Thread(target=_post_loop, args=(kind, url, key, stop, body, sent)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _post_loop(kind: str, url: str, key: str, stop: float, body: dict[str, Any], sent: Any) -> None:
    import httpx

    i = 0
    with httpx.Client(base_url=url, timeout=60) as client:
        while time.monotonic() < stop:
            i += 1
            if kind == "unauthenticated":
                headers = {"Authorization": f"Bearer made-up-{i}", "Idempotency-Key": f"k-{i}"}
                client.post(f"/v1/no-such-route-{i}", content=b"{}", headers=headers)
                client.get("/metrics")
            else:
                client.post("/v1/predict", json=body, headers={"Authorization": f"Bearer {key}"})
            with sent.get_lock():
                sent.value += 1


def _robots(url: str, key: str, stop: float, samples: int, sent: Any) -> None:
    from websockets.sync.client import connect

    from joynexus.protocol.wire import msgpack_dumps, msgpack_loads, tensor

    rng = np.random.default_rng(2)
    h, w = ATTACKER["image_size"]
    frame = {
        "type": "obs",
        "observations": {
            "images": tensor(rng.integers(0, 255, (samples, 1, 3, h, w), dtype=np.uint8)).model_dump(),
            "state": tensor(rng.standard_normal((samples, ATTACKER["state_dim"])).astype(np.float32)).model_dump(),
        },
    }
    ws_url = url.replace("http://", "ws://") + "/v1/stream"
    while True:  # at least one robot
        with connect(ws_url, additional_headers={"Authorization": f"Bearer {key}"}, max_size=None) as ws:
            limit = msgpack_loads(ws.recv(timeout=60))["limits"]["max_in_flight"]
            for seq in range(limit):
                ws.send(msgpack_dumps({**frame, "seq": seq}))
        with sent.get_lock():
            sent.value += 1
        if time.monotonic() >= stop:
            return


def run_flood(kind: str, url: str, key: str, seconds: float, samples: int) -> tuple[Any, Any]:
    """Start a flood process; returns once it is under way (its imports done, its clock started)."""
    context = multiprocessing.get_context("spawn")
    sent, ready = context.Value("i", 0), context.Event()
    process = context.Process(target=flood, args=(kind, url, key, seconds, samples, sent, ready), daemon=True)
    process.start()
    if not ready.wait(timeout=120):
        raise RuntimeError(f"the {kind} flood did not start")
    return process, sent


# -- the server and the victim --------------------------------------------------------------------
def start_server(data_dir: Path) -> tuple[Any, Any, str]:
    import uvicorn

    from joynexus.api.app import ApiSettings, create_app
    from joynexus.connect import in_process
    from joynexus.settings import Settings

    cluster = in_process(Settings(data_dir=data_dir))
    app = create_app(cluster, ApiSettings(), admin_key=ADMIN_KEY)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    threading.Thread(target=server.run, name="uvicorn", daemon=True).start()
    deadline = time.monotonic() + 120
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return cluster, server, f"http://127.0.0.1:{port}"


def create_tenant(http: Any, name: str, schema: dict[str, Any]) -> str:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    created = http.post("/v1/admin/tenants", json=tenant_spec(name, schema), headers=admin)
    created.raise_for_status()
    key = created.json()["key"]["api_key"]
    http.post("/v1/weights/load", json={}, headers={"Authorization": f"Bearer {key}"}).raise_for_status()
    return key


def victim_p99(http: Any, key: str, seconds: float) -> dict[str, float]:
    body = {"observations": observations(VICTIM, 1, 7)}
    latencies = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop or len(latencies) < 10:
        started = time.perf_counter()
        response = http.post("/v1/predict", json=body, headers={"Authorization": f"Bearer {key}"})
        latencies.append(time.perf_counter() - started)
        response.raise_for_status()
    return {
        "n": len(latencies),
        "p50_s": float(np.percentile(latencies, 50)),
        "p99_s": float(np.percentile(latencies, 99)),
    }


def idempotency(http: Any, key: str, flood_n: int) -> dict[str, Any]:
    from joynexus.protocol.wire import tensor

    rng = np.random.default_rng(0)
    n = 2
    batch = {
        **observations(VICTIM, n, 0),
        "action": tensor(np.tanh(rng.standard_normal((n, 1, VICTIM["action_dim"]))).astype(np.float32)).model_dump(
            mode="json"
        ),
    }
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "victim-step"}
    first = http.post("/v1/train_batch", json=batch, headers=headers)
    first.raise_for_status()
    started = time.perf_counter()
    for i in range(flood_n):
        fake = {"Authorization": f"Bearer made-up-{i}", "Idempotency-Key": f"k-{i}"}
        http.post(f"/v1/no-such-route-{i}", content=b"{}", headers=fake)
    flood_s = time.perf_counter() - started
    retried = http.post("/v1/train_batch", json=batch, headers=headers)
    return {
        "flood_requests": flood_n,
        "flood_s": round(flood_s, 2),
        "retry_replayed": retried.headers.get("idempotent-replayed") == "true",
        "optimizer_steps_before": first.json()["optimizer_steps"],
        "optimizer_steps_after_retry": retried.json()["optimizer_steps"],
    }


def abandoned(http: Any, cluster: Any, url: str, key: str, count: int, samples: int) -> dict[str, Any]:
    queue = cluster.inference.queue
    body = {"observations": observations(ATTACKER, samples, 3), "timeout_s": 0.001}
    statuses: dict[int, int] = {}
    for _ in range(count):
        code = http.post("/v1/predict", json=body, headers={"Authorization": f"Bearer {key}"}).status_code
        statuses[code] = statuses.get(code, 0) + 1
    right_after = queue.depth()
    time.sleep(1.0)
    out = {"requests": count, "samples_each": samples, "statuses": statuses, "queued_chunks_after": right_after}
    out["queued_chunks_1s_later"] = queue.depth()
    drain_started = time.monotonic()
    while queue.depth() and time.monotonic() - drain_started < 600:
        time.sleep(0.2)
    out["seconds_to_drain"] = round(time.monotonic() - drain_started, 1)
    # Robots that send their in-flight limit of large frames and hang up.
    process, sent = run_flood("robots hanging up", url, key, 0.1, 2048)
    process.join()
    out["robots"] = {"connections": sent.value, "samples_each_frame": 2048}
    time.sleep(1.0)
    out["robots"]["queued_chunks_1s_after_hangup"] = queue.depth()
    drain_started = time.monotonic()
    while queue.depth() and time.monotonic() - drain_started < 600:
        time.sleep(0.2)
    return out


def main() -> None:
    import httpx

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0, help="victim measurement per flood")
    parser.add_argument("--flood", type=int, default=1100, help="made-up-key POSTs against the idempotency cache")
    parser.add_argument("--abandoned", type=int, default=100)
    parser.add_argument("--samples", type=int, default=512, help="observations per abandoned predict")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 s windows, small floods")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.flood, args.abandoned, args.samples = 1.0, 50, 5, 64

    with tempfile.TemporaryDirectory(prefix="joynexus-abuse-") as tmp:
        cluster, server, url = start_server(Path(tmp))
        results: dict[str, Any] = {}
        with httpx.Client(base_url=url, timeout=120) as http:
            victim = create_tenant(http, "victim", VICTIM)
            attacker = create_tenant(http, "attacker", ATTACKER)
            results["idempotency"] = idempotency(http, victim, args.flood)
            print("idempotency:", json.dumps(results["idempotency"]), flush=True)
            results["abandoned"] = abandoned(http, cluster, url, attacker, args.abandoned, args.samples)
            print("abandoned:", json.dumps(results["abandoned"]), flush=True)
            results["metrics"] = {
                who: http.get("/metrics", headers=headers).status_code
                for who, headers in (
                    ("no key", {}),
                    ("tenant key", {"Authorization": f"Bearer {victim}"}),
                    ("operator key", {"Authorization": f"Bearer {ADMIN_KEY}"}),
                )
            }
            print("/metrics:", json.dumps(results["metrics"]), flush=True)
            victim_p99(http, victim, 1.0)  # warm
            idle = victim_p99(http, victim, args.seconds)
            results["victim"] = {"idle": idle}
            print(f"victim idle: p50 {idle['p50_s'] * 1e3:.0f} ms, p99 {idle['p99_s'] * 1e3:.0f} ms", flush=True)
            for kind in ("unauthenticated", "predicts", "abandoned predicts", "robots hanging up"):
                process, sent = run_flood(kind, url, attacker, args.seconds + 1.0, 256)
                time.sleep(0.5)  # the flood is under way
                loaded = victim_p99(http, victim, args.seconds)
                process.join()
                cluster_depth = cluster.inference.queue.depth()
                ratio = loaded["p99_s"] / idle["p99_s"]
                results["victim"][kind] = {**loaded, "p99_ratio": ratio, "flood_sent": sent.value}
                print(
                    f"victim under {kind:>18}: p99 {loaded['p99_s'] * 1e3:6.0f} ms = {ratio:5.1f}x idle "
                    f"(flood sent {sent.value}; queue depth after {cluster_depth})",
                    flush=True,
                )
                while cluster.inference.queue.depth():
                    time.sleep(0.2)
        server.should_exit = True
        cluster.close()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
