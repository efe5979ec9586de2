"""JOYNEXUS_DATA_DIR is honoured by every command that has a data dir: `joynexus serve`,
`joynexus up / down / status`, `python -m recipes.main_job`, and what `up` hands its child
processes. Each command is run through typer's CliRunner with the work it would start replaced by
a recorder of the Settings it got (nothing starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from joynexus.settings import Settings


class Captured(Exception):
    """Raised by a recorder once it has the settings: the command stops there."""


@pytest.fixture
def env_dir(tmp_path, monkeypatch) -> Path:
    """A data dir named only by JOYNEXUS_DATA_DIR; the working directory is elsewhere, so a
    command falling back to ./var would land in a different folder."""
    data_dir = tmp_path / "from-env"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("JOYNEXUS_DATA_DIR", str(data_dir))
    monkeypatch.delenv("JOYNEXUS_RAY_ADDRESS", raising=False)
    return data_dir


def _recorder(seen: list[Settings]) -> Any:
    def record(settings: Settings | None = None, *args: Any, **kwargs: Any) -> Any:
        seen.append(settings if settings is not None else Settings())
        raise Captured

    return record


def _invoke(app: typer.Typer, args: list[str]) -> Any:
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, Captured), (result.exception, result.output)
    return result


def test_settings_default_to_the_variable_and_else_to_var(env_dir, monkeypatch):
    assert Settings().data_dir == env_dir.resolve()
    monkeypatch.delenv("JOYNEXUS_DATA_DIR")
    assert Settings().data_dir == (Path.cwd() / "var").resolve()


@pytest.mark.parametrize("mode", ["ray", "in-process"])
def test_serve_uses_the_variable(env_dir, monkeypatch, mode):
    import joynexus.connect
    from joynexus.cli import app

    seen: list[Settings] = []
    monkeypatch.setattr(joynexus.connect, "connect" if mode == "ray" else "in_process", _recorder(seen))
    _invoke(app, ["serve"] if mode == "ray" else ["serve", "--services", mode])  # 'ray' is the default
    assert [s.data_dir for s in seen] == [env_dir.resolve()]


def test_serve_data_dir_option_overrides_the_variable(env_dir, tmp_path, monkeypatch):
    import joynexus.connect
    from joynexus.cli import app

    seen: list[Settings] = []
    monkeypatch.setattr(joynexus.connect, "connect", _recorder(seen))
    _invoke(app, ["serve", "--data-dir", str(tmp_path / "given")])
    assert [s.data_dir for s in seen] == [(tmp_path / "given").resolve()]


@pytest.mark.parametrize("command", ["up", "down", "status"])
def test_up_down_status_use_the_variable(env_dir, monkeypatch, command):
    import joynexus.ops.supervisor as supervisor
    from joynexus.cli import app

    seen: list[Settings] = []
    monkeypatch.setattr(supervisor, command, _recorder(seen))
    _invoke(app, [command])
    assert [s.data_dir for s in seen] == [env_dir.resolve()]


def test_the_main_job_uses_the_variable(env_dir, monkeypatch):
    import recipes.main_job as main_job

    seen: list[Settings] = []
    monkeypatch.setattr(main_job, "run_demo", _recorder(seen))
    app = typer.Typer()
    app.command()(main_job.main)  # what `python -m recipes.main_job` runs (typer.run(main))
    _invoke(app, ["--jobs", "1"])
    assert [s.data_dir for s in seen] == [env_dir.resolve()]


def test_up_hands_its_data_dir_to_the_processes_it_starts(env_dir, tmp_path, monkeypatch):
    """`up` starts the Ray head, servers and the driver that creates the actors with the data dir
    in their environment (the actors and `_create-services` build Settings() from it), and
    `status` / the flows find the recorded deployment of $JOYNEXUS_DATA_DIR."""
    from joynexus.ops.deployment_state import DeploymentState, effective_settings, write_state
    from joynexus.ops.supervisor import _child_env

    given = Settings(data_dir=tmp_path / "given")
    env = _child_env(given)
    assert env["JOYNEXUS_DATA_DIR"] == str(given.data_dir)
    monkeypatch.setenv("JOYNEXUS_DATA_DIR", env["JOYNEXUS_DATA_DIR"])
    assert Settings().data_dir == given.data_dir  # what the children build

    settings = Settings()  # from the variable
    (settings.data_dir / "run").mkdir(parents=True)
    state = DeploymentState(
        data_dir=str(settings.data_dir),
        ray_address="127.0.0.1:1",
        prefect_api_url="http://127.0.0.1:2/api",
        mlflow_tracking_uri="http://127.0.0.1:3",
        namespace=settings.ray_namespace,
        processes=[],
        started_at=0.0,
    )
    write_state(settings, state)
    found = effective_settings()
    assert found.data_dir == given.data_dir and found.ray_address == "127.0.0.1:1"
