"""`joynexus` commands of the tenant API (typer + rich): serve, tenants, workloads, datasets,
versions, export, usage. Registered on the main `joynexus` app by `joynexus.cli`.

Where to reach the server and with which key: `--url` / env JOYNEXUS_URL (default
http://127.0.0.1:8765), `--api-key` / env JOYNEXUS_API_KEY (a tenant key), `--admin-key` / env
JOYNEXUS_ADMIN_KEY (tenant and quota administration).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console(width=None if sys.stdout.isatty() else 140)
# `--help` shows every option's default; defaults that are not a value say what happens instead
# (show_default="..."): help text itself is rich markup, where "[default: ...]" would vanish.
HELP_SETTINGS = {"show_default": True}
tenant_app = typer.Typer(
    help="Tenants, API keys and quotas (admin key).", no_args_is_help=True, context_settings=HELP_SETTINGS
)
workload_app = typer.Typer(
    help="Workloads of your tenant: submit, watch, list, cancel.", no_args_is_help=True, context_settings=HELP_SETTINGS
)
dataset_app = typer.Typer(
    help="Datasets your tenant uploaded: upload, list, delete.", no_args_is_help=True, context_settings=HELP_SETTINGS
)
spec_app = typer.Typer(
    help="Workload specs: write one from a LeRobot dataset.", no_args_is_help=True, context_settings=HELP_SETTINGS
)

URL = typer.Option(None, "--url", envvar="JOYNEXUS_URL", help="API base URL.", show_default="http://127.0.0.1:8765")
API_KEY = typer.Option(None, "--api-key", envvar="JOYNEXUS_API_KEY", help="Your tenant's API key.")
ADMIN_KEY = typer.Option(None, "--admin-key", envvar="JOYNEXUS_ADMIN_KEY", help="The server's admin key.")


def _client(url: str | None, key: str | None, what: str) -> Any:
    from joynexus.client import JoyNexusClient

    if not key:
        console.print(f"[red]no {what}: pass --{what.replace(' ', '-')} or set its environment variable")
        raise typer.Exit(code=2)
    return _run(lambda: JoyNexusClient(url, key))


def _fail(error: Exception) -> typer.Exit:
    """Print an error without a traceback and return the exit to raise: 2 for what was wrong on
    this side (a spec file that does not parse, an invalid argument), 1 for everything else.

    An API error prints its status, code and message, then every problem as `field: reason` (a
    refused spec lists each field it refused). Texts are printed as they are, never as markup."""
    from joynexus.client import InvalidArgument, JoyNexusError, SpecFileError

    if isinstance(error, SpecFileError):  # one line: file:line:column: reason
        console.print(f"[red]error[/]: {escape(error.message)}", soft_wrap=True)
        return typer.Exit(code=2)
    if isinstance(error, JoyNexusError):
        head = error.code if error.status_code is None else f"{error.status_code} {error.code}"
        # A problem that only repeats the message (a quota refusal) is folded into it: said once.
        same = [p for p in error.problems if p.reason == error.message]
        message = error.message
        if same and not message.startswith(f"{same[0].field}:"):
            message = f"{same[0].field}: {message}"
        console.print(f"[red]{escape(head)}[/]: {escape(message)}", soft_wrap=True)
        for problem in error.problems:
            line = f"{problem.field}: {problem.reason}"
            if problem.reason != error.message and line != error.message:  # a single problem is often the message
                console.print(f"  {escape(line)}", soft_wrap=True)
        return typer.Exit(code=2 if isinstance(error, InvalidArgument) else 1)
    console.print(f"[red]{escape(type(error).__name__)}[/]: {escape(str(error))}", soft_wrap=True)
    return typer.Exit(code=1)


def _run(fn: Any) -> Any:
    from joynexus.client import JoyNexusError

    try:
        return fn()
    except (JoyNexusError, OSError, ValueError) as error:  # OSError: local files (export -o)
        raise _fail(error) from None


# -- serve --------------------------------------------------------------------------------------


def serve(
    host: str = typer.Option("127.0.0.1", help="Interface to bind; 127.0.0.1 keeps the API on this machine."),
    port: int = typer.Option(8765, min=0, max=65535),
    data_dir: Path | None = typer.Option(
        None,
        envvar="JOYNEXUS_DATA_DIR",
        help="Where the store, checkpoints and MLflow live.",
        show_default="./var",
    ),
    services: str = typer.Option(
        "ray",
        help="'ray': the deployment's resident services and Master Service (the one `joynexus up` started, "
        "else a local Ray started here); 'in-process': everything in this process.",
    ),
    max_body_mb: int = typer.Option(64, min=1, help="Largest request body accepted (MiB)."),
) -> None:
    """Run the tenant API server (FastAPI + uvicorn). Prints a generated admin key at first start."""
    import uvicorn

    from joynexus.api.app import ApiSettings, create_app
    from joynexus.connect import connect, in_process
    from joynexus.settings import Settings

    if services not in ("ray", "in-process"):
        console.print(f"[red]--services: {services!r} is not one of ['ray', 'in-process']")
        raise typer.Exit(code=2)
    settings = Settings(data_dir=data_dir.resolve()) if data_dir is not None else Settings()
    _refuse_an_unservable_backbone(settings)
    console.log(f"connecting to the services ({services}) of {settings.data_dir}")
    from joynexus.ops.role_follower import outlive_ray_restarts

    outlive_ray_restarts()  # this server reconnects to a new deployment (down + up) instead of exiting
    cluster = connect(settings, mode="ray") if services == "ray" else in_process(settings)
    app = create_app(cluster, ApiSettings(host=host, port=port, max_body_bytes=max_body_mb << 20))
    if app.state.generated_admin_key:
        console.print(
            "[bold yellow]admin key (shown once, only its hash is stored):[/] "
            f"{app.state.generated_admin_key}\n  export JOYNEXUS_ADMIN_KEY=<it> to administer tenants"
        )
    if host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]binding to {host}: the API is reachable from other machines; use TLS in front of it")
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        cluster.close()


def _refuse_an_unservable_backbone(settings: Any) -> None:
    """Exit 2 with one line when JOYNEXUS_BACKBONE_PATH names a model_type no family serves."""
    from joynexus.ops.backbone_check import backbone_directory_problem

    problem = backbone_directory_problem(settings)
    if problem is not None:
        typer.echo(problem, err=True)
        raise typer.Exit(code=2)


# -- tenants (admin) ------------------------------------------------------------------------------


@tenant_app.command("create")
def tenant_create(
    spec: Path = typer.Argument(..., exists=True, dir_okay=False, help="Workload spec (YAML or JSON)."),
    issue_key: bool = typer.Option(True, help="Also issue the tenant's first API key."),
    url: str | None = URL,
    admin_key: str | None = ADMIN_KEY,
) -> None:
    """Create a tenant from a workload spec and print its first API key (shown once)."""
    with _client(url, admin_key, "admin key") as client:
        created = _run(lambda: client.create_tenant(spec, issue_key=issue_key))
    info = created.tenant
    console.print(f"tenant [bold]{info.tenant_id}[/] ({info.task}), schema {info.schema_signature}")
    if created.key is not None:
        console.print(f"API key (shown once): [bold]{created.key.api_key}[/]\n  export JOYNEXUS_API_KEY=<it>")


@tenant_app.command("list")
def tenant_list(url: str | None = URL, admin_key: str | None = ADMIN_KEY) -> None:
    with _client(url, admin_key, "admin key") as client:
        tenants = _run(client.tenants)
    table = Table(title="tenants")
    for column in ("tenant", "task", "module", "cameras", "image", "state", "action", "chunk", "schema"):
        table.add_column(column)
    for t in tenants:
        table.add_row(
            t.tenant_id,
            t.task,
            str(t.action_module.get("kind")),
            ",".join(t.cameras),
            "x".join(map(str, t.image_size)) if t.cameras else "-",  # a state-only tenant has no image
            str(t.state_dim),
            str(t.action_dim),
            str(t.action_chunk),
            t.schema_signature[:16],
        )
    console.print(table)


@tenant_app.command("key")
def tenant_key(
    tenant_id: str = typer.Argument(...),
    label: str = typer.Option("", help="A note to recognize the key by."),
    url: str | None = URL,
    admin_key: str | None = ADMIN_KEY,
) -> None:
    """Issue another API key for a tenant (shown once)."""
    with _client(url, admin_key, "admin key") as client:
        issued = _run(lambda: client.issue_key(tenant_id, label))
    console.print(f"key {issued.key_id} for {tenant_id} (shown once): [bold]{issued.api_key}[/]")


@tenant_app.command("revoke")
def tenant_revoke(key_id: str = typer.Argument(...), url: str | None = URL, admin_key: str | None = ADMIN_KEY) -> None:
    with _client(url, admin_key, "admin key") as client:
        info = _run(lambda: client.revoke_key(key_id))
    console.print(f"key {info.key_id} of {info.tenant_id} revoked at {info.revoked_at}")


@tenant_app.command("delete")
def tenant_delete(
    tenant_id: str = typer.Argument(...),
    delete_artifacts: bool = typer.Option(False, help="Also delete its checkpoints and registered model."),
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
    url: str | None = URL,
    admin_key: str | None = ADMIN_KEY,
) -> None:
    """Delete a tenant: cancel its workloads, remove its keys, slots and queue data. Without
    --delete-artifacts its id stays retired until `joynexus tenant purge`."""
    if not yes:
        typer.confirm(f"delete tenant {tenant_id!r}{' and its artifacts' if delete_artifacts else ''}?", abort=True)
    with _client(url, admin_key, "admin key") as client:
        deleted = _run(lambda: client.delete_tenant(tenant_id, delete_artifacts=delete_artifacts))
    console.print(f"tenant {deleted.tenant_id} deleted: {deleted.removed}")


@tenant_app.command("purge")
def tenant_purge(
    tenant_id: str = typer.Argument(...),
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
    url: str | None = URL,
    admin_key: str | None = ADMIN_KEY,
) -> None:
    """Delete the checkpoints and registered model a deleted tenant left; frees its id for reuse."""
    if not yes:
        typer.confirm(f"delete every artifact of deleted tenant {tenant_id!r}?", abort=True)
    with _client(url, admin_key, "admin key") as client:
        purged = _run(lambda: client.purge_tenant_artifacts(tenant_id))
    console.print(f"tenant {purged.tenant_id} purged: {purged.removed}")


@tenant_app.command("quota")
def tenant_quota(
    tenant_id: str = typer.Argument(...),
    max_device_seconds: float | None = typer.Option(
        None, min=0, help="Spend cap (device-seconds).", show_default="the server's default"
    ),
    max_queued_workloads: int | None = typer.Option(
        None, min=0, help="Waiting workloads.", show_default="the server's default"
    ),
    max_storage_bytes: int | None = typer.Option(
        None, min=0, help="Checkpoint bytes.", show_default="the server's default"
    ),
    url: str | None = URL,
    admin_key: str | None = ADMIN_KEY,
) -> None:
    """Set a tenant's quotas."""
    with _client(url, admin_key, "admin key") as client:
        quota = _run(
            lambda: client.set_quota(
                tenant_id,
                max_device_seconds=max_device_seconds,
                max_queued_workloads=max_queued_workloads,
                max_storage_bytes=max_storage_bytes,
            )
        )
    console.print(f"{tenant_id}: {quota.model_dump()}")


# -- workloads ------------------------------------------------------------------------------------


@workload_app.command("submit")
def workload_submit(
    spec: Path | None = typer.Argument(None, exists=True, dir_okay=False, help="Your tenant's spec (optional)."),
    jobs: int | None = typer.Option(
        None, min=1, help="Training jobs.", show_default="the spec's scheduling.completion_target"
    ),
    watch: bool = typer.Option(False, "--watch", help="Follow it with a live progress bar."),
    url: str | None = URL,
    api_key: str | None = API_KEY,
) -> None:
    """Submit a training workload of your tenant's task."""
    with _client(url, api_key, "api key") as client:
        handle = _run(lambda: client.submit(spec, jobs=jobs))
        status = handle.submitted
        where = f", position {status.position} in the queue" if status.position else ""
        console.print(f"workload [bold]{status.workload_id}[/]: {status.state}{where}")
        if watch:
            _watch(client, status.workload_id)


@workload_app.command("eval")
def workload_eval(
    version: int | None = typer.Option(None, min=0, help="Policy version.", show_default="the latest served"),
    episodes: int = typer.Option(4, min=1),
    watch: bool = typer.Option(False, "--watch"),
    url: str | None = URL,
    api_key: str | None = API_KEY,
) -> None:
    """Evaluate a policy version of your tenant in its environment."""
    with _client(url, api_key, "api key") as client:
        handle = _run(lambda: client.evaluate(version=version, episodes=episodes))
        console.print(f"evaluation [bold]{handle.workload_id}[/]: {handle.submitted.state}")
        if watch:
            _watch(client, handle.workload_id)


@workload_app.command("watch")
def workload_watch(
    workload_id: str = typer.Argument(...), url: str | None = URL, api_key: str | None = API_KEY
) -> None:
    """Follow a workload with a live progress bar until it ends."""
    with _client(url, api_key, "api key") as client:
        _watch(client, workload_id)


def _follow(client: Any, workload_id: str, progress: Progress, bar: Any) -> None:
    """Update the bar from the workload's Server-Sent Events until it ends (the client reconnects
    across a server restart and resumes after the last event). Training counts jobs (with the loss;
    RL adds the environment steps its rollouts took), an evaluation counts episodes (with its running
    success rate)."""
    env_steps = 0
    for event in client.stream(workload_id):
        data = event.model_dump()
        if event.kind == "started" and data.get("episodes"):  # an evaluation
            progress.update(bar, total=data["episodes"], unit="episodes", state="running")
        elif event.kind == "episode":
            rate = data.get("success_rate") or 0.0
            progress.update(bar, completed=data.get("done"), total=data.get("total"), detail=f"success {rate:.0%}")
        elif event.kind == "step" and data.get("loss") is not None:
            detail = f"loss {data['loss']:.4f}" + (f"  {env_steps:,} env steps" if env_steps else "")
            progress.update(bar, detail=detail, state="running")
        elif event.kind == "rl_update":
            env_steps = max(env_steps, int(data.get("rollout/env_steps") or 0))  # the rollouts' steps so far
        elif event.kind == "job_completed":
            progress.update(bar, completed=data.get("completed_jobs"), version=data.get("version"))
        else:
            progress.update(bar, state=event.kind)


def _watch(client: Any, workload_id: str) -> None:
    status = _run(lambda: client.workload(workload_id))
    progress = Progress(
        TextColumn("[bold]{task.fields[workload]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[unit]}  {task.fields[state]}  {task.fields[detail]}  v{task.fields[version]}"),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        bar = progress.add_task(
            "",
            total=status.target_jobs or None,
            completed=status.completed_jobs,
            workload=workload_id,
            unit="episodes" if status.task == "eval" else "jobs",
            state=status.state,
            detail="loss    -   " if status.task != "eval" else "",
            version=status.version,
        )
        _run(lambda: _follow(client, workload_id, progress, bar))
    final = _run(lambda: client.workload(workload_id))
    color = "green" if final.state == "completed" else "red"
    console.print(f"workload {workload_id}: [{color}]{final.state}[/] v{final.version}")
    if final.error:
        console.print(f"  {final.error}")
    if final.result:
        console.print(f"  result: {final.result}")
    if final.state != "completed":
        raise typer.Exit(code=1)


@workload_app.command("list")
def workload_list(url: str | None = URL, api_key: str | None = API_KEY) -> None:
    with _client(url, api_key, "api key") as client:
        workloads = _run(client.workloads)
    table = Table(title="workloads")
    for column in ("workload", "task", "state", "queue", "jobs", "version", "last loss", "created"):
        table.add_column(column)
    for w in workloads:
        table.add_row(
            w.workload_id,
            w.task,
            w.state,
            str(w.position or "-"),
            f"{w.completed_jobs}/{w.target_jobs}",
            str(w.version),
            f"{w.last_loss:.4f}" if w.last_loss is not None else "-",
            (w.created_at or "")[:19],
        )
    console.print(table)


@workload_app.command("cancel")
def workload_cancel(
    workload_id: str = typer.Argument(...), url: str | None = URL, api_key: str | None = API_KEY
) -> None:
    with _client(url, api_key, "api key") as client:
        status = _run(lambda: client.cancel(workload_id))
    console.print(f"workload {workload_id}: {status.state}")


# -- datasets ------------------------------------------------------------------------------------


@dataset_app.command("upload")
def dataset_upload(
    path: Path = typer.Argument(..., help="A LeRobot dataset folder, or a .tar / .tar.gz / .tgz / .zip of one."),
    repo_id: str | None = typer.Option(None, help="The dataset's LeRobot repo id.", show_default="local/<name>"),
    url: str | None = URL,
    api_key: str | None = API_KEY,
) -> None:
    """Upload a dataset (validated against your tenant's interface); prints the id a spec names."""
    with _client(url, api_key, "api key") as client:
        info = _run(lambda: client.upload_dataset(path, repo_id=repo_id))
    console.print(f"dataset {info.dataset_id} ({info.repo_id}, {info.bytes:,} B)", markup=False)
    console.print(f"train on it: a workload spec with  dataset: {{id: {info.dataset_id}, repo_id: {info.repo_id}}}")


@dataset_app.command("list")
def dataset_list(url: str | None = URL, api_key: str | None = API_KEY) -> None:
    with _client(url, api_key, "api key") as client:
        rows = _run(client.datasets)
    table = Table(title="datasets")
    for column in ("dataset id", "repo id", "bytes"):
        table.add_column(column)
    for d in rows:
        table.add_row(d.dataset_id, d.repo_id or "-", f"{d.bytes:,}")
    console.print(table)


@dataset_app.command("delete")
def dataset_delete(
    dataset_id: str = typer.Argument(..., help="As `joynexus dataset list` shows it."),
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
    url: str | None = URL,
    api_key: str | None = API_KEY,
) -> None:
    """Delete an upload to free its storage (not while a workload trains on it)."""
    if not yes:
        typer.confirm(f"delete dataset {dataset_id}?", abort=True)
    with _client(url, api_key, "api key") as client:
        deleted = _run(lambda: client.delete_dataset(dataset_id))
    freed, stored = f"{deleted.bytes:,}", f"{deleted.storage_bytes:,}"
    console.print(f"deleted dataset {deleted.dataset_id}: freed {freed} B, {stored} B stored")


# -- versions, export, usage ----------------------------------------------------------------------


def versions(
    after: int | None = typer.Option(
        None, min=0, help="Only checkpoints with a version above this.", show_default="all"
    ),
    limit: int | None = typer.Option(None, min=1, max=1000, help="At most this many checkpoints.", show_default="all"),
    url: str | None = URL,
    api_key: str | None = API_KEY,
) -> None:
    """Your tenant's policy versions: training, checkpointed, served."""
    with _client(url, api_key, "api key") as client:
        # Without --limit the client pages through every checkpoint (the server answers pages).
        info = _run(lambda: client.versions(after=after, limit=limit))
    console.print(
        f"training version [bold]{info.training_version}[/] ({info.optimizer_steps} optimizer steps); "
        f"served: {info.serving_versions or '-'}"
    )
    table = Table(title="checkpoints")
    for column in ("version", "created", "bytes", "digest (exports, MLflow)"):
        table.add_column(column)
    for c in info.checkpoints:
        table.add_row(str(c.version), c.created_at[:19], f"{c.size_bytes:,}", c.digest[:16])
    console.print(table)
    if info.next_after is not None:
        console.print(f"more checkpoints follow: --after {info.next_after}")


def export(
    version: int | None = typer.Option(
        None, min=0, help="Policy version to export.", show_default="the current training parameters"
    ),
    output: Path | None = typer.Option(
        None, "-o", "--output", help="File to write.", show_default="<tenant>-v<N>.safetensors"
    ),
    directory: Path | None = typer.Option(
        None,
        "--dir",
        help="Also write the version as files stock tools load: action_module/ (config.json + "
        "model.safetensors) and, for a LoRA tenant, a PEFT adapter/ directory. Must not exist or be empty.",
    ),
    url: str | None = URL,
    api_key: str | None = API_KEY,
) -> None:
    """Export a policy version as a tenant payload (safetensors; manifest in its metadata)."""
    from joynexus.artifacts import decode_tenant_payload

    with _client(url, api_key, "api key") as client:
        payload = _run(lambda: client.export(version))
    _, manifest = decode_tenant_payload(payload)
    if directory is not None:
        from joynexus.artifacts.exports import export_directory

        try:
            export_directory(payload, directory)
        except FileExistsError as error:
            console.print(f"error: --dir: {error}", markup=False)
            raise typer.Exit(code=2) from None
        console.print(f"wrote {directory}/ (files stock tools load)", markup=False)
    path = output or Path(f"{manifest.tenant_id}-v{manifest.policy_version}.safetensors")
    path.write_bytes(payload)
    console.print(f"wrote {path} ({len(payload):,} bytes): {manifest.tenant_id} v{manifest.policy_version}")


def delete_version(
    version: int = typer.Argument(..., min=0, help="The checkpointed version to delete."),
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
    url: str | None = URL,
    api_key: str | None = API_KEY,
) -> None:
    """Delete one checkpointed version to free storage (allowed at or over the storage quota)."""
    if not yes:
        typer.confirm(f"delete checkpoint version {version}?", abort=True)
    with _client(url, api_key, "api key") as client:
        deleted = _run(lambda: client.delete_version(version))
    freed, stored = f"{deleted.freed_bytes:,}", f"{deleted.storage_bytes:,}"
    console.print(f"deleted version {deleted.version}: freed {freed} B, {stored} B stored")


def usage(
    all_tenants: bool = typer.Option(False, "--all", help="Every tenant (admin key)."),
    url: str | None = URL,
    api_key: str | None = API_KEY,
    admin_key: str | None = ADMIN_KEY,
) -> None:
    """Device-seconds, samples, env steps, storage and quota."""
    if all_tenants:
        with _client(url, admin_key, "admin key") as client:
            rows = _run(client.all_usage)
    else:
        with _client(url, api_key, "api key") as client:
            rows = [_run(client.usage)]
    table = Table(title="usage")
    columns = ("tenant", "train s", "infer s", "total s", "cap s", "samples", "predicted", "env steps", "storage")
    for column in (*columns, "datasets"):
        table.add_column(column)
    for u in rows:
        cap = u.quota.max_device_seconds
        table.add_row(
            u.tenant_id,
            f"{u.device_seconds.training:.2f}",
            f"{u.device_seconds.inference:.2f}",
            f"{u.device_seconds.total:.2f}",
            "-" if cap is None else f"{cap:.2f}",
            f"{u.samples_trained:,}",
            f"{u.samples_predicted:,}",
            f"{u.env_steps:,}",
            f"{u.storage_bytes:,} B",
            f"{u.dataset_bytes:,} B",
        )
    console.print(table)


# -- state control (issue 28.3) --------------------------------------------------------------------


def load_state(
    version: int = typer.Argument(..., min=0, help="A kept checkpoint version (see `joynexus versions`)."),
    url: str | None = URL,
    api_key: str | None = API_KEY,
) -> None:
    """Roll your training slot (module, adapter, optimizer) back to a kept checkpoint version."""
    with _client(url, api_key, "api key") as client:
        result = _run(lambda: client.load_state(version))
    optimizer = "restored" if result.optimizer_restored else "fresh (the checkpoint had no optimizer state)"
    console.print(
        f"training slot at version [bold]{result.version}[/] (was {result.previous_version}); optimizer "
        f"{optimizer}; {result.discarded_microbatches} pending microbatch(es) discarded"
    )


def fork(
    new_tenant: str = typer.Argument(..., help="The new tenant's id."),
    version: int | None = typer.Option(None, min=0, help="A kept version to fork.", show_default="the current one"),
    learning_rate: float | None = typer.Option(None, "--lr", help="The new tenant's learning rate."),
    seed: int | None = typer.Option(None, min=0, help="The new tenant's training seed."),
    url: str | None = URL,
    api_key: str | None = API_KEY,
) -> None:
    """A new tenant from one of your versions with another learning rate / seed; prints its API key (once)."""
    with _client(url, api_key, "api key") as client:
        forked = _run(lambda: client.fork(new_tenant, version=version, learning_rate=learning_rate, seed=seed))
    console.print(
        f"tenant [bold]{forked.tenant.tenant_id}[/] forked from {forked.forked_from.tenant_id} "
        f"v{forked.forked_from.version}"
    )
    if forked.key is not None:
        console.print(f"API key (shown once): {forked.key.api_key}", markup=False)


@spec_app.command("from-dataset")
def spec_from_dataset_command(
    root: Path = typer.Argument(..., help="A LeRobot dataset folder (with meta/info.json)."),
    tenant: str = typer.Option("my-tenant", help="The tenant id the spec names."),
    base_model: str = typer.Option("joynexus/tiny-smolvlm", help="The server's base model (GET /v1/base_model)."),
    action_chunk: int = typer.Option(4, min=1, help="Actions predicted per step."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write here.", show_default="stdout"),
) -> None:
    """Write the SFT spec a LeRobot dataset needs: its cameras, image size, state and action dims.
    Then `joynexus tenant create` it (or create the tenant first and `joynexus dataset upload` the
    folder: the upload is checked against the same observation block)."""
    import yaml

    from joynexus.data.dataset_spec import DatasetSpecError, spec_from_dataset
    from joynexus.data.lerobot_dataset import NotALeRobotDatasetError

    try:
        spec = spec_from_dataset(root, tenant=tenant, base_model=base_model, action_chunk=action_chunk)
    except (DatasetSpecError, NotALeRobotDatasetError) as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(code=2) from None
    text = yaml.safe_dump(spec, sort_keys=False)
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
        console.print(f"wrote {output}")


def register(app: typer.Typer) -> None:
    """Add the tenant-API commands to the main `joynexus` app."""
    app.command("serve", context_settings=HELP_SETTINGS)(serve)
    app.add_typer(tenant_app, name="tenant")
    app.add_typer(workload_app, name="workload")
    app.add_typer(dataset_app, name="dataset")
    app.add_typer(spec_app, name="spec")
    app.command("versions", context_settings=HELP_SETTINGS)(versions)
    app.command("export", context_settings=HELP_SETTINGS)(export)
    app.command("delete-version", context_settings=HELP_SETTINGS)(delete_version)
    app.command("usage", context_settings=HELP_SETTINGS)(usage)
    app.command("load-state", context_settings=HELP_SETTINGS)(load_state)
    app.command("fork", context_settings=HELP_SETTINGS)(fork)
