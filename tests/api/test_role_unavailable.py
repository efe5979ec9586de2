"""A role that is away (the Master or a service restarting in place, a deployment being replaced)
answers 503 with `Retry-After`, never 500 `internal`, and the keep-alive connection stays open
(issue 26.6): the handlers by class in `api/errors.py`, behind a real uvicorn server."""

from __future__ import annotations

import http.client
import threading
import time

import pytest
from fastapi import FastAPI

from joynexus.actors import RoleUnavailable
from joynexus.api.errors import install_exception_handlers
from joynexus.services.training.slots import UnknownTenant
from tests.api.conftest import free_port

ray_exceptions = pytest.importorskip("ray.exceptions")


@pytest.fixture(scope="module")
def server():
    import uvicorn

    app = FastAPI()
    install_exception_handlers(app)
    errors = {
        "died": lambda: ray_exceptions.ActorDiedError(),
        "unavailable": lambda: ray_exceptions.ActorUnavailableError("restarting", None),
        "role": lambda: RoleUnavailable("master", "a new deployment is coming up", retry_after_s=5),
        "slot": lambda: UnknownTenant("t1"),  # a restarted Training Model Service before its restore
        "bug": lambda: ZeroDivisionError("a real bug"),
    }

    @app.get("/fail/{kind}")
    def fail(kind: str) -> dict:
        raise errors[kind]()

    @app.get("/ok")
    def ok() -> dict:
        return {"ok": True}

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield app, port
    uv.should_exit = True
    thread.join(timeout=30)


@pytest.mark.parametrize("kind, retry_after", [("died", "2"), ("unavailable", "2"), ("role", "5"), ("slot", "2")])
def test_a_role_away_is_a_503_with_retry_after_on_a_kept_connection(server, kind, retry_after):
    app, port = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", f"/fail/{kind}")
    response = conn.getresponse()
    body = response.read()
    assert response.status == 503, body
    assert response.getheader("Retry-After") == retry_after
    assert b'"code":"unavailable"' in body and response.getheader("Connection") != "close"
    sock = conn.sock
    conn.request("GET", "/ok")  # the same connection serves the next call
    again = conn.getresponse()
    assert again.status == 200 and again.read() == b'{"ok":true}'
    assert conn.sock is sock
    conn.close()


def test_a_real_bug_is_still_a_500_internal(server):
    _, port = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/fail/bug")
    response = conn.getresponse()
    assert response.status == 500 and b'"code":"internal"' in response.read()
    conn.close()
