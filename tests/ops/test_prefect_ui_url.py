"""The Prefect server `joynexus up` starts on JOYNEXUS_PREFECT_PORT tells its UI to call that port's
API: Prefect derives the UI's API URL from PREFECT_SERVER_API_PORT (4200), not from `--port`, so a
server on another port served a UI that could not connect, or showed the deployment on 4200 (found
by tests/ui/test_browser_uis.py in a real browser)."""

from __future__ import annotations

from joynexus.ops import supervisor
from joynexus.settings import Settings


def test_the_prefect_ui_calls_the_api_of_its_own_port(tmp_path, monkeypatch):
    spawned = []
    monkeypatch.setenv("PREFECT_API_URL", "http://elsewhere:4200/api")  # a client setting: not the server's
    monkeypatch.setattr(supervisor, "spawn_process", lambda name, argv, env, folder, url: spawned.append((argv, env)))
    url = supervisor._start_prefect(Settings(data_dir=tmp_path, prefect_port=14321), tmp_path, [], lambda m: None)
    assert url == "http://127.0.0.1:14321/api"
    ((argv, env),) = spawned
    assert argv[-2:] == ["--port", "14321"]
    assert env["PREFECT_UI_API_URL"] == url and "PREFECT_API_URL" not in env
