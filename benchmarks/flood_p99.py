"""A victim tenant's predict p99 when a noisy tenant floods the API 10x, with and without the
per-tenant rate limits (issues 26.3, 28.6), side by side in one run.

  .venv/bin/python benchmarks/flood_p99.py [--seconds 6] [--flood-factor 10] [--victim-callers 2]
      [--noisy-requests-per-s 20] [--rounds 2] [--json out.json]

One in-process deployment (`joynexus.connect.in_process`: tiny backbone, SQLite store), two API
servers over it (uvicorn, real sockets), each with two tenants that trained one step and serve it:
  limits off   `rate_limits.enabled = False`: nothing is refused (each tenant's calls still run
               in worker threads of its own);
  limits on    the service defaults, and the noisy tenant's own override (`rate_limits.tenants`):
               --noisy-requests-per-s requests/s.
For each server the victim's --victim-callers closed-loop callers send 1-sample predicts, first
alone (idle), then while the noisy tenant's flood-factor x as many closed-loop callers send the
same predicts (a 429 waits its Retry-After, as a client should). Callers run in processes of
their own, so their CPU is not the server's. --rounds rounds per server, in alternating order, are
pooled (a loaded machine's drift then hits both servers alike). Printed: the victim's p50 / p99 idle and flooded,
the ratio flooded p99 / idle p99 per server, and what the flood got (answers by status).

  python benchmarks/flood_p99.py callers <json>    one caller process (used by the above and by
                                                   tests/api/test_flood_isolation.py)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ADMIN_KEY = "flood-benchmark-admin-key-0123456789"
SHAPE = dict(cameras=["front"], image_size=[32, 32], state_dim=4, action_dim=3, action_chunk=2)


# -- one caller process ---------------------------------------------------------------------------
async def _callers(args: dict[str, Any]) -> dict[str, Any]:
    import httpx

    body = Path(args["body_file"]).read_bytes()
    headers = {"Authorization": f"Bearer {args['api_key']}", "Content-Type": "application/json"}
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    deadline = time.monotonic() + args["seconds"]

    async def caller(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                response = await client.post(args["path"], content=body, headers=headers)
            except httpx.HTTPError as error:
                statuses[type(error).__name__] = statuses.get(type(error).__name__, 0) + 1
                continue
            statuses[str(response.status_code)] = statuses.get(str(response.status_code), 0) + 1
            if response.status_code == 200:
                latencies.append(time.perf_counter() - started)
            elif response.status_code == 429:
                await asyncio.sleep(min(2.0, float(response.headers.get("retry-after", "1"))))

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args["url"], timeout=120, limits=limits) as client:
        await asyncio.gather(*[caller(client) for _ in range(args["callers"])])
    return {"statuses": statuses, "latencies": latencies}


def start_callers(url: str, api_key: str, body_file: Path, callers: int, seconds: float) -> subprocess.Popen:
    """A caller process: `callers` closed-loop POSTs of the body to /v1/predict for `seconds`; its
    stdout's last line is JSON {statuses, latencies}."""
    args = dict(url=url, api_key=api_key, body_file=str(body_file), callers=callers, seconds=seconds)
    args["path"] = "/v1/predict"
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "callers", json.dumps(args)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def result_of(process: subprocess.Popen, timeout_s: float = 300) -> dict[str, Any]:
    out, _ = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, f"caller process exited {process.returncode}: {out[-2000:]}"
    return json.loads(out.strip().splitlines()[-1])


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# -- the benchmark --------------------------------------------------------------------------------
@contextlib.contextmanager
def api_server(cluster: Any, settings: Any) -> Iterator[str]:
    """`create_app` over `cluster` behind uvicorn on a free port of 127.0.0.1; yields the URL."""
    import socket

    import uvicorn

    from joynexus.api.app import create_app

    app = create_app(cluster, settings, admin_key=ADMIN_KEY)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def serving_tenant(url: str, tenant_id: str, data_dir: Path) -> tuple[str, bytes]:
    """A tenant created through the admin API, one train_batch step, its weights served; returns
    (its key, the JSON body of a 1-sample predict)."""
    import httpx

    from joynexus.data.lerobot_dataset import write_synthetic_dataset
    from joynexus.protocol.wire import tensor

    root = data_dir / "datasets" / tenant_id
    write_synthetic_dataset(root, f"bench/{tenant_id}", num_episodes=1, episode_length=8, task="pick",
                            **{k: (tuple(v) if k == "image_size" else v) for k, v in SHAPE.items()
                               if k != "action_chunk"})  # fmt: skip
    spec = {
        "tenant": tenant_id,
        "base_model": "joynexus/tiny-smolvlm",
        "task": "sft",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {**SHAPE, "instruction": "pick"},
        "dataset": {"root": str(root), "repo_id": f"bench/{tenant_id}"},
    }
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=url, timeout=120) as client:
        created = client.post("/v1/admin/tenants", json=spec, headers=admin)
        assert created.status_code == 201, created.text
        key = created.json()["key"]["api_key"]
        headers = {"Authorization": f"Bearer {key}"}
        rng = np.random.default_rng(0)
        images = rng.random((2, 1, 3, 32, 32), dtype=np.float32)
        state = rng.standard_normal((2, 4)).astype(np.float32)
        action = rng.standard_normal((2, 2, 3)).astype(np.float32)
        arrays = dict(images=images, state=state, action=action)
        batch = {k: tensor(v).model_dump(mode="json") for k, v in arrays.items()}
        assert client.post("/v1/train_batch", json=batch, headers=headers).status_code == 200
        assert client.post("/v1/weights/load", json={}, headers=headers).status_code == 200
    observations = {k: tensor(v[:1]).model_dump(mode="json") for k, v in dict(images=images, state=state).items()}
    return key, json.dumps({"observations": observations}).encode()


def measure(url: str, victim: tuple[str, Path], noisy: tuple[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    """One round on one server: the victim alone, then under the flood."""
    idle = result_of(start_callers(url, victim[0], victim[1], args.victim_callers, args.seconds))
    flood = start_callers(url, noisy[0], noisy[1], args.victim_callers * args.flood_factor, args.seconds + 2)
    time.sleep(1.0)  # the flood is on before the victim measures
    flooded = result_of(start_callers(url, victim[0], victim[1], args.victim_callers, args.seconds))
    return {"idle": idle["latencies"], "flooded": flooded["latencies"], "noisy": result_of(flood)["statuses"]}


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one server pooled: p50 / p99 idle and flooded, their p99 ratio."""
    idle = [x for r in rounds for x in r["idle"]]
    flooded = [x for r in rounds for x in r["flooded"]]
    noisy: dict[str, int] = {}
    for r in rounds:
        for status, count in r["noisy"].items():
            noisy[status] = noisy.get(status, 0) + count
    return {
        "victim_idle_p50_ms": percentile(idle, 50) * 1e3,
        "victim_idle_p99_ms": percentile(idle, 99) * 1e3,
        "victim_flooded_p50_ms": percentile(flooded, 50) * 1e3,
        "victim_flooded_p99_ms": percentile(flooded, 99) * 1e3,
        "p99_ratio": percentile(flooded, 99) / percentile(idle, 99),
        "noisy_statuses": noisy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--flood-factor", type=int, default=10)
    parser.add_argument("--victim-callers", type=int, default=2)
    parser.add_argument("--noisy-requests-per-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per server, alternating, pooled")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: one 1 s round per server")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.rounds = 1.0, 1

    import torch

    from joynexus.api.app import ApiSettings
    from joynexus.api.rate_limits import RateLimitSettings, TenantRateLimits
    from joynexus.connect import in_process
    from joynexus.settings import Settings

    torch.set_num_threads(1)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        cluster = in_process(Settings(data_dir=data_dir))
        try:
            noisy_limits = {"noisy": TenantRateLimits(requests_per_s=args.noisy_requests_per_s)}
            servers = {
                "limits off": ApiSettings(rate_limits=RateLimitSettings(enabled=False)),
                "limits on": ApiSettings(rate_limits=RateLimitSettings(tenants=noisy_limits)),
            }
            with contextlib.ExitStack() as stack:
                urls = {name: stack.enter_context(api_server(cluster, settings)) for name, settings in servers.items()}
                first = next(iter(urls.values()))
                bodies = {}
                for who in ("victim", "noisy"):
                    key, body = serving_tenant(first, who, data_dir)
                    (data_dir / f"{who}.json").write_bytes(body)
                    bodies[who] = (key, data_dir / f"{who}.json")
                rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
                for round_ in range(args.rounds):  # alternating order: drift of the machine hits both
                    for name in list(urls)[:: 1 if round_ % 2 == 0 else -1]:
                        rounds[name].append(measure(urls[name], bodies["victim"], bodies["noisy"], args))
                for name, measured in rounds.items():
                    results[name] = summary(measured)
        finally:
            cluster.close()
    print(f"victim p99 of 1-sample predicts, {args.victim_callers} callers; noisy tenant: "
          f"{args.flood_factor}x as many callers ({args.noisy_requests_per_s:g} req/s when limited)")  # fmt: skip
    print(f"{'server':<12} {'idle p50':>9} {'idle p99':>9} {'flood p50':>10} {'flood p99':>10} {'ratio':>6}  flood got")
    for name in ("limits off", "limits on"):
        r = results[name]
        print(
            f"{name:<12} {r['victim_idle_p50_ms']:8.1f}ms {r['victim_idle_p99_ms']:8.1f}ms "
            f"{r['victim_flooded_p50_ms']:9.1f}ms {r['victim_flooded_p99_ms']:9.1f}ms {r['p99_ratio']:6.2f}  "
            f"{r['noisy_statuses']}"
        )
    off, on = results["limits off"]["p99_ratio"], results["limits on"]["p99_ratio"]
    print(f"flooded/idle p99: {off:.2f}x without limits, {on:.2f}x with limits")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "callers":
        print(json.dumps(asyncio.run(_callers(json.loads(sys.argv[2])))))
    else:
        main()
