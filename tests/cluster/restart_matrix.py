"""The restart matrix (issue 26.6, 26.7, 26.9): a `joynexus up` deployment with a `joynexus serve`
in front, three tenants, clients calling all the time; then each restart path in turn: the API
server killed, the Master, the Inference Model Service and the Training Model Service SIGKILLed,
the whole Ray killed (then down + up), and a plain down + up. Checked per path: no call answers a
5xx other than 503 with Retry-After, every tenant's served and pinned versions are the same after,
and the workload running through it ends as it would have (completed, every job).

  .venv/bin/python tests/cluster/restart_matrix.py   # prints the table and the wall time

Tenants: `mx-a` trained by a workload (serves its newest version), `mx-b` serving v0 explicitly
while its training slot moved on (the pinned case), `mx-c` running a workload through each fault.
Only a Ray head is started (MLflow on the data dir's SQLite, no Prefect server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from joynexus.ops.supervisor import free_port  # noqa: E402
from joynexus.protocol.wire import tensor  # noqa: E402
from joynexus.settings import local_tracking_uri  # noqa: E402
from tests.helpers import sft_spec, write_dataset_for  # noqa: E402

ADMIN_KEY = "jnx-admin-restart-matrix-key-0123456789"
PATHS = ("api_server", "master", "inference_service", "training_service", "whole_ray", "down_up")
ACTOR_CLASS = {"master": "MasterService", "inference_service": "InferenceModelService",
               "training_service": "TrainingModelService"}  # fmt: skip


@dataclass
class PathResult:
    path: str
    seconds_away: float = 0.0
    statuses: Counter = field(default_factory=Counter)
    bad: list[str] = field(default_factory=list)  # 5xx that are not 503 + Retry-After
    connection_errors: int = 0
    serving_before: dict[str, Any] = field(default_factory=dict)
    serving_after: dict[str, Any] = field(default_factory=dict)
    workload: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        workload_ok = self.workload.get("state") == "completed" and self.workload.get("completed_jobs") == 2
        return not self.bad and self.serving_before == self.serving_after and workload_ok


def _wire(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: tensor(v).model_dump(mode="json") if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def _batch(spec: dict[str, Any], n: int, seed: int) -> dict[str, np.ndarray]:
    obs = spec["observation"]
    rng = np.random.default_rng(seed)
    h, w = obs["image_size"]
    return {
        "images": rng.random((n, len(obs["cameras"]), 3, h, w), dtype=np.float32),
        "state": rng.standard_normal((n, obs["state_dim"])).astype(np.float32),
        "action": np.tanh(rng.standard_normal((n, obs["action_chunk"], obs["action_dim"]))).astype(np.float32),
    }


class Deployment:
    """`joynexus up` / `down` / `serve` as subprocesses on free ports under one data dir."""

    def __init__(self, work: Path):
        self.work = work
        self.data_dir = work / "data"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("JOYNEXUS_", "PREFECT_", "MLFLOW_"))}
        self.env.update(
            JOYNEXUS_RAY_PORT=str(free_port()), JOYNEXUS_TORCH_THREADS="1", JOYNEXUS_ADMIN_KEY=ADMIN_KEY,
            JOYNEXUS_MLFLOW_TRACKING_URI=local_tracking_uri(self.data_dir), PREFECT_API_URL="http://127.0.0.1:9/api",
            PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MLFLOW_DISABLE_TELEMETRY="true",
        )  # fmt: skip
        self.serve_process: subprocess.Popen | None = None

    def cli(self, *args: str, timeout: float = 900) -> None:
        command = [str(Path(sys.executable).parent / "joynexus"), *args, "--data-dir", str(self.data_dir)]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"joynexus {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")

    def up(self) -> None:
        self.cli("up")

    def down(self) -> None:
        self.cli("down")

    def serve(self) -> None:
        command = [str(Path(sys.executable).parent / "joynexus"), "serve", "--port", str(self.port),
                   "--data-dir", str(self.data_dir)]  # fmt: skip
        log = open(self.work / "serve.log", "ab")  # noqa: SIM115 - the process keeps it
        self.serve_process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=5).status_code in (200, 503):
                    return
            except httpx.HTTPError:
                pass
            assert self.serve_process.poll() is None, "serve exited; see serve.log"
            time.sleep(0.5)
        raise RuntimeError("serve did not answer within 300 s")

    def kill_serve(self) -> None:
        if self.serve_process is not None and self.serve_process.poll() is None:
            self.serve_process.kill()
            self.serve_process.wait()

    def ray_session(self) -> int:
        state = json.loads((self.data_dir / "run" / "services.json").read_text())
        return next(p["pid"] for p in state["processes"] if p["name"] == "ray")

    def actor_pid(self, role: str) -> int:
        """The worker process of a role's actor in this deployment's Ray session (by its title)."""
        session = self.ray_session()
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if os.getsid(proc.pid) == session and (proc.info["cmdline"] or [""])[0].startswith(
                    f"ray::{ACTOR_CLASS[role]}"
                ):
                    return proc.pid
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        raise LookupError(f"no process of {role} in Ray session {session}")

    def kill_ray(self) -> None:
        session = self.ray_session()
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getsid(proc.pid) == session:
                    os.kill(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue


class Clients:
    """Tenants' calls all the time (health, versions, predict), every answer counted."""

    def __init__(self, url: str, tenants: dict[str, dict[str, Any]]):
        self.url, self.tenants = url, tenants
        self.result: PathResult | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Clients:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        b = self.tenants["mx-b"]
        predict = {"observations": _wire({k: v for k, v in _batch(b["spec"], 1, 0).items() if k != "action"})}
        calls = [
            ("GET", "/v1/health", None, {}),
            ("GET", "/v1/versions", None, self.tenants["mx-a"]["headers"]),
            ("POST", "/v1/predict", predict, b["headers"]),
        ]
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self._stop.is_set():
                for method, path, body, headers in calls:
                    result = self.result
                    try:
                        response = client.request(method, path, json=body, headers=headers)
                    except httpx.HTTPError:
                        if result is not None:
                            result.connection_errors += 1
                        time.sleep(0.2)
                        continue
                    if result is None:
                        continue
                    result.statuses[response.status_code] += 1
                    if response.status_code >= 500 and not (
                        response.status_code == 503 and response.headers.get("retry-after")
                    ):
                        result.bad.append(f"{method} {path} -> {response.status_code} {response.text[:160]}")
                time.sleep(0.05)


def _call(client: httpx.Client, method: str, path: str, headers: dict[str, str], body: Any = None) -> Any:
    """A call that must succeed; 503 + Retry-After is waited out (a role is away)."""
    deadline = time.monotonic() + 300
    while True:
        try:
            response = client.request(method, path, json=body, headers=headers)
        except httpx.HTTPError:
            response = None
        if response is not None and response.status_code < 300:
            return response.json()
        if response is not None and response.status_code != 503:
            raise AssertionError(f"{method} {path} -> {response.status_code} {response.text[:300]}")
        assert time.monotonic() < deadline, f"{method} {path} kept failing"
        time.sleep(1.0)


def setup_tenants(client: httpx.Client, work: Path) -> dict[str, dict[str, Any]]:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    tenants = {}
    for name in ("mx-a", "mx-b", "mx-c"):
        spec = sft_spec(name, work / name, jobs=None, samples_per_job=8, microbatch_size=8, max_in_flight=1)
        write_dataset_for(spec, episodes=2, length=8)
        created = _call(client, "POST", "/v1/admin/tenants", admin, spec)
        tenants[name] = {"spec": spec, "headers": {"Authorization": f"Bearer {created['key']['api_key']}"}}
    a, b = tenants["mx-a"], tenants["mx-b"]
    run_workload(client, a, jobs=2)  # mx-a serves v2 (published by its workload)
    _call(client, "POST", "/v1/save", b["headers"], {})  # checkpoint v0, serve it, then train on
    _call(client, "POST", "/v1/weights/load", b["headers"], {"version": 0})
    _call(client, "POST", "/v1/train_batch", b["headers"], _wire(_batch(b["spec"], 4, 1)))
    return tenants


def run_workload(client: httpx.Client, tenant: dict[str, Any], jobs: int, wait: bool = True) -> str:
    workload_id = _call(client, "POST", "/v1/workloads", tenant["headers"], {"jobs": jobs})["workload_id"]
    if wait:
        wait_workload(client, tenant, workload_id)
    return workload_id


def wait_workload(client: httpx.Client, tenant: dict[str, Any], workload_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 600
    while True:
        info = _call(client, "GET", f"/v1/workloads/{workload_id}", tenant["headers"])
        if info["state"] in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
            return info
        time.sleep(1.0)


def serving(client: httpx.Client, tenants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per tenant (a and b): served versions and the version a predict without one gets."""
    seen = {}
    for name in ("mx-a", "mx-b"):
        tenant = tenants[name]
        versions = _call(client, "GET", "/v1/versions", tenant["headers"])["serving_versions"]
        obs = {k: v for k, v in _batch(tenant["spec"], 1, 0).items() if k != "action"}
        pinned = _call(client, "POST", "/v1/predict", tenant["headers"], {"observations": _wire(obs)})
        seen[name] = {"served": versions, "pinned": pinned["policy_version"]}
    return seen


def fault(deployment: Deployment, path: str) -> None:
    if path == "api_server":
        deployment.kill_serve()
        deployment.serve()
    elif path in ACTOR_CLASS:
        os.kill(deployment.actor_pid(path), signal.SIGKILL)
    elif path == "whole_ray":
        deployment.kill_ray()
        time.sleep(2)
        deployment.down()  # clears the record of the dead deployment
        deployment.up()
    elif path == "down_up":
        deployment.down()
        deployment.up()


def wait_healthy(client: httpx.Client, timeout_s: float = 600) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if client.get("/v1/health").status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not healthy within {timeout_s:.0f} s")


def run(work: Path, paths: tuple[str, ...] = PATHS) -> list[PathResult]:
    deployment = Deployment(work)
    results: list[PathResult] = []
    deployment.up()
    try:
        deployment.serve()
        with httpx.Client(base_url=deployment.url, timeout=300) as client:
            tenants = setup_tenants(client, work)
            clients = Clients(deployment.url, tenants).start()
            try:
                for path in paths:
                    result = PathResult(path, serving_before=serving(client, tenants))
                    c = tenants["mx-c"]
                    workload_id = run_workload(client, c, jobs=2, wait=False)
                    clients.result = result
                    time.sleep(1.0)  # the workload is under way when the fault hits
                    started = time.monotonic()
                    fault(deployment, path)
                    wait_healthy(client)
                    result.seconds_away = time.monotonic() - started
                    result.workload = wait_workload(client, c, workload_id)
                    time.sleep(2.0)
                    clients.result = None
                    result.serving_after = serving(client, tenants)
                    results.append(result)
                    print(report_line(result), flush=True)
            finally:
                clients.stop()
    finally:
        deployment.kill_serve()
        try:
            deployment.down()
        except Exception as error:  # noqa: BLE001 - report, never leave the caller's Ray behind silently
            print(f"down failed: {error}", flush=True)
    return results


def report_line(r: PathResult) -> str:
    statuses = ", ".join(f"{code}: {n}" for code, n in sorted(r.statuses.items()))
    return (
        f"{r.path:18} {'ok ' if r.ok else 'BAD'} away {r.seconds_away:6.1f} s | {statuses} | conn errors "
        f"{r.connection_errors} | bad 5xx {len(r.bad)} {r.bad[:2]} | serving {r.serving_before} -> "
        f"{r.serving_after} | workload {r.workload.get('state')} {r.workload.get('completed_jobs')} "
        f"{r.workload.get('error') or ''}"
    )


if __name__ == "__main__":
    import tempfile

    chosen = tuple(sys.argv[1:]) or PATHS
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="joynexus-matrix-") as tmp:
        outcome = run(Path(tmp), chosen)
    print(f"restart matrix: {sum(r.ok for r in outcome)}/{len(outcome)} paths ok in {time.monotonic() - started:.0f} s")
    sys.exit(0 if all(r.ok for r in outcome) and len(outcome) == len(chosen) else 1)
