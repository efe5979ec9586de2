"""The main job's backbone options (`./scripts/run-main --backbone NAME | --backbone-path DIR`): parsed
and checked against the backbone registry before anything starts, handed to the services it starts
as settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from recipes.main_job import job_settings, main


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(main)
    return app


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_a_preset_name_becomes_the_backbone_setting(preset: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("JOYNEXUS_BACKBONE_PATH", str(tmp_path))  # the option wins over the environment
    settings = job_settings(tmp_path, backbone=preset)
    assert settings.backbone_preset == preset and settings.backbone_path is None
    assert settings.data_dir == tmp_path.resolve()


def test_without_options_the_environment_decides(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("JOYNEXUS_BACKBONE_PRESET", "small")
    monkeypatch.delenv("JOYNEXUS_BACKBONE_PATH", raising=False)
    assert job_settings(tmp_path).backbone_preset == "small"


def test_a_checkpoint_directory_becomes_the_backbone_path(tmp_path: Path) -> None:
    settings = job_settings(None, backbone_path=tmp_path)
    assert settings.backbone_path == str(tmp_path.resolve())
    with pytest.raises(typer.BadParameter, match="not a directory"):
        job_settings(None, backbone_path=tmp_path / "missing")
    with pytest.raises(typer.BadParameter, match="not both"):
        job_settings(None, backbone="tiny", backbone_path=tmp_path)


def test_an_unknown_preset_is_refused_with_the_presets_before_anything_runs(tmp_path: Path) -> None:
    result = CliRunner().invoke(_app(), ["--data-dir", str(tmp_path), "--backbone", "gpt-9"])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())  # rich wraps the error box
    assert "unknown backbone preset 'gpt-9'" in output
    assert "'small'" in output and "'tiny'" in output  # the allowed presets are listed
    assert not (tmp_path / "datasets").exists()  # refused while parsing: nothing was written


def test_the_options_are_documented() -> None:
    result = CliRunner().invoke(_app(), ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--backbone" in result.output and "--backbone-path" in result.output
    assert "smolvlm-256m" in result.output


def test_the_mlflow_ui_hint_names_the_running_server_or_the_local_store(tmp_path: Path, monkeypatch) -> None:
    from joynexus.ops.deployment_state import DeploymentState, write_state
    from joynexus.settings import Settings
    from recipes.main_job import mlflow_ui_hint

    monkeypatch.delenv("JOYNEXUS_MLFLOW_TRACKING_URI", raising=False)
    settings = Settings(data_dir=tmp_path)
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path.resolve()}/mlflow/mlflow.db" in mlflow_ui_hint(settings)
    # over `joynexus up`'s deployment (recorded in the data dir): its MLflow server already serves the UI
    (tmp_path / "run").mkdir()
    state = DeploymentState(str(tmp_path), "127.0.0.1:6379", "http://127.0.0.1:4200/api", "http://127.0.0.1:5123",
                            "joynexus", [], 0.0)  # fmt: skip
    write_state(settings, state)
    hint = mlflow_ui_hint(settings)
    assert "open http://127.0.0.1:5123" in hint and "mlflow ui" not in hint
