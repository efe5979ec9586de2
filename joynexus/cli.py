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
) -> None:
    """Run the main job: three SFT tenants with different schemas on one resident backbone."""
    from joynexus.demo import DEMO_TENANTS, run_demo
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
    bars = {
        t.tenant: progress.add_task("", total=jobs, tenant=t.tenant, loss="   -   ", version=0) for t in DEMO_TENANTS
    }

    def on_progress(state) -> None:  # type: ignore[no-untyped-def]
        loss = f"{state.losses[-1]:.4f}" if state.losses else "   -   "
        progress.update(bars[state.tenant_id], completed=state.completed_jobs, loss=loss, version=state.version)

    with progress:
        result = run_demo(
            settings,
            jobs_per_tenant=jobs,
            samples_per_job=samples_per_job,
            on_progress=on_progress,
            on_stage=lambda message: progress.console.log(message),
        )

    table = Table(title=f"workload {result.workload_id}: {result.seconds:.1f} s on one backbone")
    for column in ("tenant", "module", "schema", "jobs", "steps", "first loss", "last loss", "version", "MLflow model"):
        table.add_column(column)
    failed = False
    for tenant in result.tenants:
        state = result.progress[tenant.tenant_id]
        failed |= bool(state.failures) or not state.done
        first = sum(state.losses[:3]) / max(1, len(state.losses[:3]))
        last = sum(state.losses[-3:]) / max(1, len(state.losses[-3:]))
        table.add_row(
            tenant.tenant_id,
            tenant.backend_config.action_module["kind"],
            tenant.schema_signature[:14],
            f"{state.completed_jobs}/{state.target_jobs}",
            str(state.optimizer_steps),
            f"{first:.4f}" if state.losses else "-",
            f"{last:.4f}" if state.losses else "-",
            str(state.version),
            f"v{state.registered_version}" if state.registered_version else "-",
        )
        for failure in state.failures:
            console.print(f"[red]{tenant.tenant_id}: {failure}")
    console.print(table)
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


if __name__ == "__main__":
    app()
