"""`joynexus up` notices a Ray head that dies while the deployment starts (a raylet or GCS server
that crashed: `ray start --block` then stops the rest and exits) and fails at once naming the logs,
instead of waiting out its timeout (issue 30); the services driver's stages reach `up`'s output."""

from __future__ import annotations

import sys
import time

import pytest

from joynexus.ops import services_driver
from joynexus.ops import supervisor as deploy
from joynexus.settings import Settings

# Stands in for `ray start --head --block`: its GCS port answers, then a Ray subprocess "crashes".
FAKE_RAY = """#!{python}
import socket, sys, time
port = int(next(a for a in sys.argv if a.startswith("--port=")).split("=")[1])
gcs = socket.socket()
gcs.bind(("127.0.0.1", port))
gcs.listen()
print("Ray runtime started.", flush=True)
time.sleep(1.5)
print("Some Ray subprocesses exited unexpectedly: raylet [exit code=1]", flush=True)
sys.exit(1)
"""


def _free_ray_block() -> int:
    while True:
        base = deploy.free_port()
        if 20000 < base < 65000 and not any(deploy._port_open("127.0.0.1", base + i) for i in range(8)):
            return base


def test_up_fails_fast_naming_the_logs_when_the_ray_head_dies_at_start(tmp_path, monkeypatch):
    fake = tmp_path / "ray"
    fake.write_text(FAKE_RAY.format(python=sys.executable))
    fake.chmod(0o755)
    real_executable = deploy._executable
    monkeypatch.setattr(deploy, "_executable", lambda name: str(fake) if name == "ray" else real_executable(name))
    monkeypatch.setenv("RAY_TMPDIR", "/tmp")
    monkeypatch.delenv("JOYNEXUS_RAY_ADDRESS", raising=False)
    settings = Settings(
        data_dir=tmp_path / "data",
        ray_port=_free_ray_block(),
        mlflow_tracking_uri="http://127.0.0.1:9",  # given, so `up` starts no server: only the head and driver
        prefect_api_url="http://127.0.0.1:9/api",
    )
    stages: list[str] = []
    begun = time.monotonic()
    with pytest.raises(deploy.DeployError) as caught:
        deploy.up(settings, timeout_s=300, on_stage=stages.append)
    elapsed = time.monotonic() - begun
    message = str(caught.value)
    assert elapsed < 30, f"up waited {elapsed:.0f} s for a Ray head that had exited"
    assert str(settings.data_dir / "run" / "ray.log") in message
    assert str(deploy._ray_temp_dir(settings) / "session_latest" / "logs") in message and "raylet.out" in message
    assert "raylet [exit code=1]" in message  # the head's own last words
    assert any(stage.startswith("creating the resident services") for stage in stages)
    assert deploy.read_state(settings) is None
    driver_log = (settings.data_dir / "run" / services_driver.DRIVER_LOG).read_text()
    assert "stage: importing the service classes" in driver_log  # the driver ran, and was stopped


def test_the_drivers_stage_lines_are_relayed_once_and_whole(tmp_path):
    log = tmp_path / services_driver.DRIVER_LOG
    log.write_text("stage: importing (driver +0.0 s)\nsome warning\nstage: waiting for the Ray")
    relayed: list[str] = []
    offset = services_driver._relay(log, 0, relayed.append)
    assert relayed == ["importing (driver +0.0 s)"]
    with open(log, "a") as more:
        more.write(" head (driver +3.1 s)\n")
    services_driver._relay(log, offset, relayed.append)
    assert relayed == ["importing (driver +0.0 s)", "waiting for the Ray head (driver +3.1 s)"]


def test_up_refuses_at_once_an_inherited_ray_address_nothing_answers_at(tmp_path):
    """Issue 41.15: after `down`, a shell that sourced env.sh keeps JOYNEXUS_RAY_ADDRESS; `up` started
    nothing, waited 300 s and failed without naming it."""
    stale = f"127.0.0.1:{_free_ray_block()}"
    settings = Settings(data_dir=tmp_path, ray_address=stale)
    started = time.monotonic()
    with pytest.raises(deploy.DeployError) as refused:
        deploy.up(settings, timeout_s=300)
    assert time.monotonic() - started < 10
    assert "JOYNEXUS_RAY_ADDRESS" in str(refused.value) and stale in str(refused.value)
    assert deploy.read_state(settings) is None  # nothing was started or recorded
