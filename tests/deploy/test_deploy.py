"""`joynexus up / down / status` (joynexus/deploy.py): processes tracked by session and stopped by
PID, the recorded state and the settings it completes, and (slow) the real thing end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from joynexus.ops import supervisor as deploy
from joynexus.ops.deployment_state import DeploymentState, ManagedProcess, write_state
from joynexus.ops.supervisor import spawn_process, stop_process
from joynexus.settings import Settings


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # exited, not yet reaped by its parent
    except psutil.NoSuchProcess:
        return True


def test_a_spawned_session_is_tracked_and_stopped_with_its_children(tmp_path):
    # A leader and children that ignore SIGTERM, the children in process groups of their own (job
    # control): the session still finds them all, and SIGKILL follows when SIGTERM is not enough.
    script = "trap '' TERM; set -m; sleep 300 & sleep 300 & wait"
    process = spawn_process("tree", ["bash", "-c", script], dict(os.environ), tmp_path)
    deadline = time.monotonic() + 10
    while len(process.session_pids()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    members = process.session_pids()
    assert process.pid in members and len(members) == 3  # bash and its two sleeps
    assert len({os.getpgid(pid) for pid in members}) == 3
    stopped = stop_process(process, grace_s=0.5)
    assert set(stopped) == set(members)
    assert all(_gone(pid) for pid in members) and not process.alive()
    assert stop_process(process) == []  # idempotent


def test_a_reused_pid_is_not_ours(tmp_path):
    process = spawn_process("short", ["sleep", "300"], dict(os.environ), tmp_path)
    try:
        stale = ManagedProcess(**{**process.__dict__, "create_time": process.create_time + 3600})
        assert stale.session_pids() == []  # recorded as started after the process that holds the PID now
        assert stop_process(stale) == [] and process.alive()
    finally:
        stop_process(process)


def test_state_round_trip_and_settings_completed_from_it(tmp_path, monkeypatch):
    for name in ("JOYNEXUS_RAY_ADDRESS", "JOYNEXUS_MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings(data_dir=tmp_path)
    assert deploy.read_state(settings) is None and deploy.effective_settings(settings) == settings
    assert deploy.down(settings) == {}  # nothing recorded: nothing to stop

    exited = subprocess.run(["bash", "-c", "echo $$"], capture_output=True, text=True)  # a PID that is gone
    dead = int(exited.stdout)
    state = DeploymentState(
        data_dir=str(tmp_path), ray_address="127.0.0.1:6390", prefect_api_url="http://127.0.0.1:4299/api",
        mlflow_tracking_uri="http://127.0.0.1:5099", namespace="joynexus",
        processes=[ManagedProcess("ray", dead, time.time(), ["ray"], "ray.log", members=[dead])], started_at=0.0,
    )  # fmt: skip
    (tmp_path / "run").mkdir()
    write_state(settings, state)
    assert deploy.read_state(settings) == state
    env_sh = (tmp_path / "run" / "env.sh").read_text()
    assert 'export JOYNEXUS_RAY_ADDRESS="127.0.0.1:6390"' in env_sh and "RAY_AUTH_MODE" in env_sh

    completed = deploy.effective_settings(settings)
    assert completed.ray_address == "127.0.0.1:6390" and completed.mlflow_tracking_uri == "http://127.0.0.1:5099"
    assert completed.prefect_api_url == "http://127.0.0.1:4299/api"
    explicit = Settings(data_dir=tmp_path, ray_address="ray-head:6379")
    assert deploy.effective_settings(explicit).ray_address == "ray-head:6379"  # the environment wins

    with pytest.raises(deploy.DeployError, match="partly down"):  # the recorded Ray head is gone
        deploy.up(settings)


def test_up_refuses_a_busy_port_before_starting_anything(tmp_path, monkeypatch):
    import socket

    for name in ("JOYNEXUS_RAY_ADDRESS", "JOYNEXUS_MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        settings = Settings(data_dir=tmp_path, mlflow_port=deploy.free_port(), prefect_port=busy.getsockname()[1])
        with pytest.raises(deploy.DeployError, match="JOYNEXUS_PREFECT_PORT"):
            deploy.up(settings)
    assert deploy.read_state(settings) is None and list((tmp_path / "run").iterdir()) == []


def test_status_without_a_deployment_reports_every_service_down(tmp_path, monkeypatch):
    for name in ("JOYNEXUS_RAY_ADDRESS", "JOYNEXUS_MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        monkeypatch.delenv(name, raising=False)
    report = deploy.status(Settings(data_dir=tmp_path))
    assert set(report) == {"ray", "mlflow", "prefect"}
    assert not report["ray"]["healthy"] and not report["prefect"]["healthy"]


@pytest.mark.slow
def test_up_status_down_leaves_no_stray_processes(tmp_path):
    """The CLI end to end on free ports: a Ray head, the resident services as detached actors, a
    Prefect server and an MLflow server come up healthy; down stops every recorded PID."""
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOYNEXUS_", "PREFECT_", "MLFLOW_"))}
    env.update(
        JOYNEXUS_RAY_PORT=str(deploy.free_port()),
        JOYNEXUS_PREFECT_PORT=str(deploy.free_port()),
        JOYNEXUS_MLFLOW_PORT=str(deploy.free_port()),
        JOYNEXUS_TORCH_THREADS="1",
    )
    cli = [str(Path(sys.executable).parent / "joynexus")]

    def joynexus(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, *args, "--data-dir", str(data_dir)], env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip

    recorded: list[int] = []
    try:
        up = joynexus("up")
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((data_dir / "run" / "services.json").read_text())
        assert {p["name"] for p in state["processes"]} == {"ray", "prefect", "mlflow"}
        recorded = sorted({pid for p in state["processes"] for pid in [p["pid"], *p["members"]]})
        assert all(not _gone(pid) for pid in recorded)

        status = joynexus("status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert all(entry["healthy"] for entry in report.values()), report
        assert report["joynexus.training_queue"]["depth"] == 0  # Training Queue: partitions
        assert report["joynexus.inference_service"]["depth"] == 0  # Inference Queue: requests waiting
        assert "Training Queue depth: 0 partitions" in report["joynexus.training_queue"]["detail"]

        # A flow run on this host finds the deployment through the recorded env (Ray, MLflow and
        # Prefect servers) and trains on the resident actors.
        from tests.helpers import sft_spec, write_dataset_for

        spec = sft_spec("via-ray", tmp_path / "dataset", jobs=1, samples_per_job=8)
        write_dataset_for(spec, episodes=2, length=8)
        (tmp_path / "spec.yaml").write_text(json.dumps(spec))
        flow_env = {k: v for k, v in env.items() if not k.startswith("JOYNEXUS_")}
        for line in (data_dir / "run" / "env.sh").read_text().splitlines():
            if line.startswith("export "):
                key, value = line.removeprefix("export ").split("=", 1)
                flow_env[key] = json.loads(value)
        flow = subprocess.run(
            [sys.executable, "-m", "flows.tenant_lifecycle", str(tmp_path / "spec.yaml"), "--jobs", "1"],
            cwd=Path(__file__).resolve().parents[2], env=flow_env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert flow.returncode == 0, flow.stdout[-3000:] + flow.stderr[-3000:]
        # The spec declares no promotion metric (no environment, no validation episodes): the newest moves.
        assert "| champion | v1 (moved: no promotion metric declared" in flow.stdout
        after = json.loads(joynexus("status", "--json").stdout)
        assert after["joynexus.training_service"]["detail"] == "1 tenant slots"  # trained on the resident actor

        again = joynexus("up")  # idempotent: reports the running deployment, starts nothing
        assert again.returncode == 0 and "already up" in again.stdout
        assert json.loads((data_dir / "run" / "services.json").read_text()) == state
    finally:
        down = joynexus("down")
        assert down.returncode == 0, down.stdout + down.stderr
    time.sleep(1)
    assert [pid for pid in recorded if not _gone(pid)] == []
    for process in state["processes"]:  # nothing else in the sessions up started either
        assert ManagedProcess(**process).session_pids() == []
    assert not (data_dir / "run" / "services.json").exists()
    assert joynexus("status").returncode == 1
