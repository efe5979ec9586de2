"""Issue 29 item 6, on a real MLflow server: the MLflow container's own shell script from the rendered
manifest (basic-auth app, config written at start, admin from MLFLOW_AUTH_ADMIN_*), run here on a
SQLite store and a free port. Without credentials the tracking API answers 401; an MLflow client with
MLFLOW_TRACKING_USERNAME / _PASSWORD (what every JoyNexus MLflow client gets) logs a run; a wrong
password is refused. /health stays open for the probes."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.deploy.render import by_key, rendered

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, auth: tuple[str, str] | None = None, body: dict | None = None) -> int:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode())
    request.add_header("Content-Type", "application/json")
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=90) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):  # not listening yet
        return 0


def test_mlflow_behind_basic_auth_as_the_manifest_starts_it(tmp_path):
    pytest.importorskip("flask_wtf", reason="mlflow[auth] is not installed here yet: run scripts/bootstrap")
    container = by_key(rendered())[("Deployment", "joynexus-mlflow")]["spec"]["template"]["spec"]["containers"][0]
    port = free_port()
    script = container["args"][0].replace("--port 5000", f"--port {port}").replace("--host 0.0.0.0", "--host 127.0.0.1")
    assert container["command"] == ["/bin/sh", "-c"] and f"--port {port}" in script
    user, password = "joynexus", "an-admin-password-from-secrets-manager"
    env = dict(
        os.environ,
        PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        MLFLOW_BACKEND_STORE_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
        MLFLOW_AUTH_CONFIG_PATH=str(tmp_path / "basic_auth.ini"),
        MLFLOW_AUTH_ADMIN_USERNAME=user,
        MLFLOW_AUTH_ADMIN_PASSWORD=password,
        MLFLOW_FLASK_SERVER_SECRET_KEY="a-flask-secret-key-from-secrets-manager",
        JOYNEXUS_S3_BUCKET="unused-bucket",
        HOME=str(tmp_path),
    )
    server = subprocess.Popen(["/bin/sh", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # a loaded 2-core machine took > 240 s
        while call(f"{base}/health") != 200:
            assert server.poll() is None, server.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "MLflow did not answer /health"
            time.sleep(1)
        search = f"{base}/api/2.0/mlflow/experiments/search"
        assert call(search, body={"max_results": 1}) == 401
        assert call(search, auth=(user, "wrong"), body={"max_results": 1}) == 401
        assert call(search, auth=(user, password), body={"max_results": 1}) == 200
        client = subprocess.run(
            [sys.executable, "-c", "import mlflow\nwith mlflow.start_run() as r:\n    mlflow.log_metric('m', 1.0)\n"
             "print(r.info.run_id)"],
            env={**env, "MLFLOW_TRACKING_URI": base, "MLFLOW_TRACKING_USERNAME": user,
                 "MLFLOW_TRACKING_PASSWORD": password},
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert client.returncode == 0, client.stderr[-3000:]
        refused = subprocess.run(
            [sys.executable, "-c", "import mlflow\nmlflow.search_experiments()"],
            env={**env, "MLFLOW_TRACKING_URI": base, "MLFLOW_TRACKING_USERNAME": user,
                 "MLFLOW_TRACKING_PASSWORD": "not-it"},
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert refused.returncode != 0 and "401" in refused.stderr + refused.stdout
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 15)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
                server.wait(timeout=30)
