"""`workload watch` (the client's event stream) survives a restart of the API server: it reconnects
and resumes after the last event it received, so no event is lost or repeated (issue 30)."""

from __future__ import annotations

import threading
import time

import uvicorn

from joynexus.client import JoyNexusClient, RetryPolicy
from tests.api.conftest import free_port


def _server(app, port: int) -> tuple[uvicorn.Server, threading.Thread]:
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    return server, thread


def test_the_event_stream_resumes_after_a_server_restart(api):
    t = api.tenant("rewatch")
    port = free_port()
    first, first_thread = _server(api.app, port)
    servers = [first]

    def restart() -> None:
        first.should_exit = first.force_exit = True
        first_thread.join(timeout=30)
        time.sleep(1.0)  # a moment with nothing listening: connections are refused
        servers.append(_server(api.app, port)[0])

    retry = RetryPolicy(attempts=3, backoff_s=0.05, max_backoff_s=0.3)
    try:
        with JoyNexusClient(f"http://127.0.0.1:{port}", t.api_key, retry=retry) as client:
            workload_id = client.submit(jobs=6).workload_id
            seqs, kinds = [], []
            for event in client.stream(workload_id, reconnect_s=60):
                seqs.append(event.seq)
                kinds.append(event.kind)
                if len(seqs) == 1:
                    # At once, while the stream waits on its first event: on a quick host a restart
                    # in the background came after the whole workload had streamed.
                    restart()
            # The stream went on through the new server (its only request before the next call).
            assert len(servers) == 2 and servers[1].server_state.total_requests >= 1
            everything = client.events(workload_id).events
    finally:
        for server in servers:
            server.should_exit = server.force_exit = True
    assert kinds[-1] == "completed", kinds
    assert seqs == [e.seq for e in everything]  # none lost, none repeated
