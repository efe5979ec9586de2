"""`joynexus serve` as a real process: binds 127.0.0.1, prints a generated admin key only at its
first start (only the hash is kept), and that key still works after a restart."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.api.conftest import free_port

pytestmark = pytest.mark.slow


def start(data_dir, port: int) -> tuple[subprocess.Popen, list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("JOYNEXUS_ADMIN_KEY", "JOYNEXUS_API_KEY")}
    command = [sys.executable, "-m", "joynexus.cli", "serve", "--services", "in-process", "--port", str(port),
               "--data-dir", str(data_dir)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            raise AssertionError("server exited:\n" + "".join(lines))
        lines.append(line)
        if "Uvicorn running on" in line:
            return process, lines
    process.kill()
    raise AssertionError("server did not start:\n" + "".join(lines))


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_serve_generates_the_admin_key_once_and_binds_loopback(tmp_path):
    port = free_port()
    process, lines = start(tmp_path / "data", port)
    try:
        output = "".join(lines)
        key = re.search(r"admin key \(shown once[^:]*:\s*(jnx_[0-9a-f]{16}_[A-Za-z0-9_-]{43})", output).group(1)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/health").json()["status"] == "ok"
        assert httpx.get(f"{url}/v1/admin/tenants", headers={"Authorization": f"Bearer {key}"}).json() == []
        assert f"Uvicorn running on http://127.0.0.1:{port}" in output
    finally:
        stop(process)
    process, lines = start(tmp_path / "data", port)
    try:
        assert "admin key (shown once" not in "".join(lines)
        listed = httpx.get(f"http://127.0.0.1:{port}/v1/admin/tenants", headers={"Authorization": f"Bearer {key}"})
        assert listed.status_code == 200
    finally:
        stop(process)
