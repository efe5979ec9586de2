"""Issue 41.14: the Ray head `joynexus up` starts has token authentication on and listens on
127.0.0.1 unless JOYNEXUS_RAY_BIND names an address to expose. Fast: the token file, the head's
command line and environment, what env.sh and our own processes get. Slow: a real head refuses a
client without the token, takes one with it, and listens on loopback only. Each fails on the main
of 2026-12-07 (checked: `RAY_AUTH_MODE=disabled` on both sides, no token, Ray on every interface)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from joynexus.ops import supervisor
from joynexus.ops.deployment_state import DeployError, DeploymentState, ManagedProcess, ray_access, write_state
from joynexus.ops.ray_access import TOKEN_FILE, ensure_ray_token, ray_access_env
from joynexus.settings import Settings


def test_the_token_is_made_once_per_data_dir_readable_by_its_user_only(tmp_path):
    first = ensure_ray_token(tmp_path / "a" / "run")
    assert first.name == TOKEN_FILE and stat.S_IMODE(first.stat().st_mode) == 0o600
    token = first.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert ensure_ray_token(tmp_path / "a" / "run").read_text() == token  # the next `up` reuses it
    assert ensure_ray_token(tmp_path / "b" / "run").read_text() != token  # another data dir, another token
    os.chmod(first, 0o644)
    ensure_ray_token(tmp_path / "a" / "run")
    assert stat.S_IMODE(first.stat().st_mode) == 0o600


def _settings(tmp_path, **extra) -> Settings:
    return Settings(data_dir=tmp_path, ray_address=None, ray_port=46500, ray_worker_ports="47000-47100", **extra)


def test_the_head_starts_with_token_auth_on_loopback_and_the_token_stays_off_its_command_line(tmp_path):
    settings = _settings(tmp_path)
    token = ensure_ray_token(tmp_path / "run")
    argv, env = supervisor.ray_head_command(settings, ray_access_env(token, "127.0.0.1"))
    assert "--node-ip-address=127.0.0.1" in argv and "--include-dashboard=false" in argv
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # Ray's single-host mode: binds 127.0.0.1
    assert token.read_text() not in " ".join(argv) and "RAY_AUTH_TOKEN" not in env
    with pytest.raises(DeployError, match="needs its token"):
        supervisor.ray_head_command(settings, {})


def test_an_exposed_address_is_an_explicit_setting_and_a_wildcard_is_refused(tmp_path):
    exposed = _settings(tmp_path, ray_bind="10.1.2.3")
    token = ensure_ray_token(tmp_path / "run")
    argv, env = supervisor.ray_head_command(exposed, ray_access_env(token, "10.1.2.3"))
    assert "--node-ip-address=10.1.2.3" in argv and env["RAY_AUTH_MODE"] == "token"
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env or env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] != "0"
    for bad, reason in (("0.0.0.0", "no address others reach"), ("ray-head", "expected an IP address")):
        with pytest.raises(DeployError, match=f"JOYNEXUS_RAY_BIND.*{reason}"):
            supervisor.up(_settings(tmp_path / bad, ray_bind=bad))
        assert not (tmp_path / bad / "run" / "services.json").exists()


def test_env_sh_and_our_processes_reach_the_recorded_head_with_its_token(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # inherited from an older env.sh: the record wins
    settings = _settings(tmp_path)
    token = ensure_ray_token(tmp_path / "run")
    state = DeploymentState(
        data_dir=str(tmp_path), ray_address="127.0.0.1:46500", prefect_api_url="http://127.0.0.1:4299/api",
        mlflow_tracking_uri="http://127.0.0.1:5099", namespace="joynexus",
        processes=[ManagedProcess("ray", os.getpid(), time.time(), ["ray"], "ray.log", members=[os.getpid()])],
        started_at=0.0, ray_auth_token_path=str(token), ray_bind="127.0.0.1",
    )  # fmt: skip
    write_state(settings, state)
    exports = {}
    for line in (tmp_path / "run" / "env.sh").read_text().splitlines():
        if line.startswith("export "):
            key, value = line.removeprefix("export ").split("=", 1)
            exports[key] = json.loads(value)
    assert exports["RAY_AUTH_MODE"] == "token" and exports["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert exports["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert token.read_text() not in (tmp_path / "run" / "env.sh").read_text()  # the file, never the token
    assert ray_access(settings)["RAY_AUTH_MODE"] == "token"
    assert supervisor._child_env(settings)["RAY_AUTH_TOKEN_PATH"] == str(token)  # status, down's actor removal
    other = Settings(data_dir=tmp_path, ray_address="ray-head:6379")
    assert ray_access(other) == {} and supervisor._child_env(other)["RAY_AUTH_MODE"] == "disabled"


_CLIENT = """
import os, sys, ray
from joynexus.actors import init_ray
os.environ.update({access})  # after `import ray`: as joynexus.connect sets it
try:
    init_ray({address!r})
except Exception as error:
    print("REFUSED", type(error).__name__, error)
    sys.exit(3)
print("ANSWER", ray.get(ray.remote(lambda: 41 + 1).remote()))
"""


def _client(address: str, access: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    script = _CLIENT.format(access=access, address=address)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_real_head_refuses_a_client_without_the_token_and_listens_on_loopback_only(tmp_path):
    from joynexus.ops.deployment_state import port_answers

    settings = Settings(
        data_dir=tmp_path, ray_address=None, ray_port=supervisor.free_port(), ray_worker_ports="47200-47300"
    )
    access = ray_access_env(ensure_ray_token(tmp_path / "run"), "127.0.0.1")
    argv, env = supervisor.ray_head_command(settings, access)
    head = supervisor.spawn_process("ray", argv, env, tmp_path / "run")
    address = f"127.0.0.1:{settings.ray_port}"
    try:
        deadline = time.monotonic() + 120
        while not port_answers("127.0.0.1", settings.ray_port):
            assert time.monotonic() < deadline and head.alive(), "the Ray head did not start"
            time.sleep(0.5)
        single_host = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        without = _client(address, {**single_host, "RAY_AUTH_MODE": "disabled"})
        assert without.returncode == 3 and "REFUSED" in without.stdout, without.stdout + without.stderr[-2000:]
        wrong = _client(address, {**single_host, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64})
        assert wrong.returncode == 3, wrong.stdout + wrong.stderr[-2000:]
        with_token = _client(address, access)
        assert with_token.returncode == 0 and "ANSWER 42" in with_token.stdout, with_token.stderr[-3000:]
        listening = set()
        for pid in head.session_pids():
            try:
                connections = psutil.Process(pid).net_connections(kind="inet")
            except psutil.Error:
                continue
            listening |= {c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN}
        assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
    finally:
        supervisor.stop_process(head)
    assert not Path(tmp_path / "run" / "services.json").exists()
