"""`joynexus` command line (typer + rich)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

# show_default: `--help` shows every option's default (joynexus.api.cli.HELP_SETTINGS).
app = typer.Typer(
    help="JoyNexus: multi-tenant post-training for robot VLA policies on one shared backbone.",
    context_settings={"show_default": True},
)
# Logs and CI capture are not terminals; rich would wrap the tables at 80 columns there.
console = Console(width=None if sys.stdout.isatty() else 140)


@app.callback()
def _main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: never try the network for models or data
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Help text is rich markup, where a literal "[default: ...]" would vanish: defaults go in show_default.
_DATA_DIR_HELP = "Data dir of the deployment."
_DATA_DIR_DEFAULT = "$JOYNEXUS_DATA_DIR or ./var"


def _deploy_settings(data_dir: Path | None):  # type: ignore[no-untyped-def]
    from joynexus.settings import Settings

    return Settings(data_dir=data_dir.resolve()) if data_dir is not None else Settings()


@app.command()
def up(
    data_dir: Path | None = typer.Option(None, help=_DATA_DIR_HELP, show_default=_DATA_DIR_DEFAULT),
    timeout: float = typer.Option(300.0, min=1, help="Seconds each service may take to come up."),
) -> None:
    """Start a Ray head, the resident services (detached actors), a Prefect server and an MLflow server.

    Services the environment already points at (JOYNEXUS_RAY_ADDRESS, PREFECT_API_URL,
    JOYNEXUS_MLFLOW_TRACKING_URI) are used, not started. `joynexus down` stops what this started."""
    from joynexus.ops.backbone_check import backbone_directory_problem
    from joynexus.ops.supervisor import DeployError
    from joynexus.ops.supervisor import up as deploy_up

    settings = _deploy_settings(data_dir)
    problem = backbone_directory_problem(settings)
    if problem is not None:
        typer.echo(problem, err=True)
        raise typer.Exit(code=2)
    try:
        state = deploy_up(settings, timeout_s=timeout, on_stage=console.log)
    except DeployError as error:
        console.print(f"[red]up failed: {error}")
        raise typer.Exit(code=1) from error
    console.print(f"Ray: {state.ray_address}   (namespace {state.namespace})")
    console.print(f"Prefect UI: {state.prefect_api_url.removesuffix('/api')}")
    console.print(f"MLflow UI: {state.mlflow_tracking_uri}")
    console.print(f"use it from a shell:  source {settings.data_dir / 'run' / 'env.sh'}")


@app.command()
def down(
    data_dir: Path | None = typer.Option(None, help=_DATA_DIR_HELP, show_default=_DATA_DIR_DEFAULT),
) -> None:
    """Remove the resident service actors and stop exactly the processes `joynexus up` started."""
    from joynexus.ops.supervisor import down as deploy_down

    deploy_down(_deploy_settings(data_dir), on_stage=console.log)


@app.command()
def status(
    data_dir: Path | None = typer.Option(None, help=_DATA_DIR_HELP, show_default=_DATA_DIR_DEFAULT),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Health of each service, the Training Queue depth and the Inference Queue depth."""
    import json

    from joynexus.ops.supervisor import status as deploy_status

    report = deploy_status(_deploy_settings(data_dir))
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        table = Table(title="JoyNexus services")
        for column in ("service", "health", "where", "detail"):
            table.add_column(column)
        for name, entry in report.items():
            health = "[green]healthy" if entry["healthy"] else "[red]down"
            table.add_row(name, health, str(entry["where"]), str(entry.get("detail", "")))
        console.print(table)
    if not all(entry["healthy"] for entry in report.values()):
        raise typer.Exit(code=1)


# The tenant API's commands: serve, tenant, workload, versions, export, usage (joynexus/api/cli.py).
from joynexus.api.cli import register as _register_api_commands  # noqa: E402

_register_api_commands(app)


if __name__ == "__main__":
    app()
