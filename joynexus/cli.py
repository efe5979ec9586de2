"""`joynexus` command line (typer + rich)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(help="JoyNexus: multi-tenant post-training for robot VLA policies on one shared backbone.")
# Logs and CI capture are not terminals; rich would wrap the tables at 80 columns there.
console = Console(width=None if sys.stdout.isatty() else 140)


@app.callback()
def _main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: never try the network for models or data
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@app.command()
def demo(
    data_dir: Path = typer.Option(Path("var"), help="Where the store, datasets, checkpoints and MLflow live."),
    jobs: int = typer.Option(12, min=1, help="Training jobs per tenant in this run."),
    samples_per_job: int = typer.Option(64, min=1, help="Demonstration samples per training job."),
    simulators: bool = typer.Option(
        True, help="Include the simulator tenants (RL, SFT on recorded demos, evaluation)."
    ),
    rl_jobs: int = typer.Option(30, min=1, help="PPO updates of the PushT-reach RL tenant."),
) -> None:
    """Run the main job: SFT, RL and evaluation side by side on one resident backbone per service."""
    from joynexus.demo import run_demo
    from joynexus.runtime import Settings

    settings = Settings(data_dir=data_dir.resolve())
    progress = Progress(
        TextColumn("[bold]{task.fields[tenant]:<16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("jobs  loss {task.fields[loss]}  v{task.fields[version]}"),
        TimeElapsedColumn(),
        console=console,
    )
    bars: dict[str, int] = {}
    workload_tenant: dict[str, str] = {}

    def on_event(event: dict) -> None:
        tenant = workload_tenant.get(event["workload_id"])
        if tenant is None or tenant not in bars:
            return
        if event["kind"] == "step":
            progress.update(bars[tenant], loss=f"{event['loss']:.4f}")
        elif event["kind"] == "job_completed":
            progress.update(bars[tenant], completed=event["completed_jobs"], version=event["version"])

    def on_stage(message: str) -> None:
        progress.console.log(message)
        if message.startswith("workload "):  # "workload <id> of <tenant>: <n> <TASK> jobs"
            words = message.split()
            tenant = words[3].rstrip(":")
            workload_tenant[words[1]] = tenant
            bars[tenant] = progress.add_task("", total=int(words[4]), tenant=tenant, loss="   -   ", version=0)

    with progress:
        result = run_demo(
            settings,
            jobs_per_tenant=jobs,
            samples_per_job=samples_per_job,
            simulators=simulators,
            rl_jobs=rl_jobs,
            on_event=on_event,
            on_stage=on_stage,
        )

    table = Table(
        title=f"main job: {len(result.tenants)} tenants, {result.seconds:.1f} s, one backbone per model service"
    )
    for column in ("tenant", "task", "module", "schema", "workload", "jobs", "steps", "first loss", "last loss",
                   "version", "MLflow model"):  # fmt: skip
        table.add_column(column)
    failed = False
    for tenant in result.tenants:
        status = result.statuses[tenant.tenant_id]
        losses = result.losses[tenant.tenant_id]
        failed |= status.state != "completed"
        first = sum(losses[:3]) / max(1, len(losses[:3]))
        last = sum(losses[-3:]) / max(1, len(losses[-3:]))
        table.add_row(
            tenant.tenant_id,
            tenant.spec.task.value,
            tenant.backend_config.action_module["kind"],
            tenant.schema_signature[:16],
            status.workload_id,
            f"{status.completed_jobs}/{status.target_jobs}",
            str(status.optimizer_steps),
            f"{first:.4f}" if losses else "-",
            f"{last:.4f}" if losses else "-",
            str(status.version),
            f"v{status.registered_version}" if status.registered_version else "-",
        )
        if status.error:
            console.print(f"[red]{tenant.tenant_id}: {status.state}: {status.error}")
    console.print(table)
    if result.evaluations:
        evals = Table(title="evaluation in the simulator (deterministic policy, one version per run)")
        for column in ("tenant", "simulator / task", "before: version", "return", "success", "after: version",
                       "return", "success"):  # fmt: skip
            evals.add_column(column)
        for tenant_id, pair in result.evaluations.items():
            cells = [tenant_id]
            for when in ("before", "after"):
                r = pair[when].result
                if when == "before":
                    cells.append(f"{r['simulator']}/{r['task']}" if r else "-")
                cells += [f"v{r['policy_version']}", f"{r['mean_return']:.2f}", f"{r['success_rate']:.0%}"] if r else [
                    pair[when].state, "-", "-"]  # fmt: skip
            evals.add_row(*cells)
        console.print(evals)
    info = result.backbone
    console.print(
        f"backbone [bold]{info['model_id']}[/]: {info['parameter_count']:,} frozen parameters, "
        f"{info['instances_created']} instance(s) in the Training Model Service (pid {info['pid']}) "
        f"for {len(result.tenants)} tenants"
    )
    s = result.settings
    console.print(f"control-plane store: {s.resolved_database_url()}")
    console.print(f"checkpoints: {s.checkpoint_root}")
    console.print(
        "MLflow UI (runs, loss curves, registered tenant models):\n"
        f"  .venv/bin/mlflow ui --backend-store-uri {s.resolved_mlflow_uri()} --port 5000\n"
        "  then open http://127.0.0.1:5000"
    )
    if failed:
        raise typer.Exit(code=1)


_DATA_DIR_HELP = "Data dir of the deployment [default: $JOYNEXUS_DATA_DIR or ./var]."


def _deploy_settings(data_dir: Path | None):  # type: ignore[no-untyped-def]
    from joynexus.runtime import Settings

    return Settings(data_dir=data_dir.resolve()) if data_dir is not None else Settings()


@app.command()
def up(
    data_dir: Path | None = typer.Option(None, help=_DATA_DIR_HELP),
    timeout: float = typer.Option(300.0, min=1, help="Seconds each service may take to come up."),
) -> None:
    """Start a Ray head, the resident services (detached actors), a Prefect server and an MLflow server.

    Services the environment already points at (JOYNEXUS_RAY_ADDRESS, PREFECT_API_URL,
    JOYNEXUS_MLFLOW_TRACKING_URI) are used, not started. `joynexus down` stops what this started."""
    from joynexus.ops.supervisor import DeployError
    from joynexus.ops.supervisor import up as deploy_up

    settings = _deploy_settings(data_dir)
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
    data_dir: Path | None = typer.Option(None, help=_DATA_DIR_HELP),
) -> None:
    """Remove the resident service actors and stop exactly the processes `joynexus up` started."""
    from joynexus.ops.supervisor import down as deploy_down

    deploy_down(_deploy_settings(data_dir), on_stage=console.log)


@app.command()
def status(
    data_dir: Path | None = typer.Option(None, help=_DATA_DIR_HELP),
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
