"""The main job: SFT, RL and evaluation side by side on ONE resident backbone per model service,
on the embedded defaults (local Ray, SQLite, local MLflow).

- three SFT tenants with different schemas and action modules, on generated LeRobot datasets;
- an SFT tenant on demonstrations recorded from a scripted policy in gym-pusht (PushT-reach);
- a LeRobot SmolVLA tenant on the same demonstrations: a lab's SmolVLA checkpoint (written by
  LeRobot's own `SmolVLAPolicy.save_pretrained`, small dimensions, over this deployment's VLM) comes in,
  its action expert fine-tuned over the shared prefix (`action_module.kind: smolvla`);
- two RL tenants on different simulators: PushT-reach (GAE + PPO, learns within the run) and
  ManiSkill3 PushCube, state-only (GAE + PPO with the tuned spec examples/specs/tuned/pushcube_state.yaml:
  50 jobs of 400 environment steps: 20k steps, where the tuned spec succeeds in 40-75% of episodes);
- evaluations of the simulator tenants before and after training.

A thin recipe over the library: write or record each tenant's data, create the tenants through the
Master Service, submit every workload at once, and report.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from joynexus.connect import Cluster, connect
from joynexus.core.tenants import Tenant
from joynexus.protocol.schemas import WorkloadInfo
from joynexus.settings import Settings


@dataclass(frozen=True)
class DemoTenant:
    tenant: str
    cameras: tuple[str, ...]
    image_size: tuple[int, int]
    state_dim: int
    action_dim: int
    action_chunk: int
    module: str
    task: str
    priority: int = 0


# Three embodiments: different camera sets, image sizes, action dims, chunk lengths and module kinds.
DEMO_TENANTS = (
    DemoTenant("arm7-oft", ("front", "wrist"), (32, 32), 8, 7, 4, "oft_mlp", "pick up the red cube"),
    DemoTenant("gripper2-flow", ("front",), (40, 48), 4, 2, 8, "flow_matching", "push the block to the goal"),
    DemoTenant("biarm14-oft", ("left", "right", "top"), (24, 32), 14, 14, 2, "oft_mlp", "fold the towel", 1),
)


# The simulator tenants. Observations use small images: the backbone resizes them anyway.
REACH_OBSERVATION = {
    "cameras": ["top"],
    "image_size": [32, 32],
    "state_dim": 4,
    "action_dim": 2,
    "action_chunk": 1,
    "instruction": "move the pusher to the T-shaped block",
}
REACH_ENVIRONMENT = {"simulator": "pusht", "task": "PushT-reach-v0", "num_envs": 4, "horizon": 32}


def reach_rl_spec(base_model: str, jobs: int) -> dict[str, Any]:
    return {
        "tenant": "reacher-rl",
        "base_model": base_model,
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": REACH_OBSERVATION,
        "environment": REACH_ENVIRONMENT,
        "rl": {"advantage": "gae", "ppo_epochs": 4, "gamma": 0.95},
        "scheduling": {"max_in_flight_jobs": 1, "completion_target": jobs, "max_policy_staleness": 1},
        # PPO on Adam needs a small step here: larger ones moved the policy mean so far in one step
        # that the clipped ratio lost its meaning (approx KL > 1 per job at 3e-4, ~0.02 at 5e-5).
        "training": {"samples_per_job": 128, "microbatch_size": 32, "learning_rate": 5e-5},
    }


# The ManiSkill tenant: state-only PushCube with the spec tuned to learn on a CPU (PPO + GAE,
# normalized dense reward, end-effector control, 8 environments in one worker; benchmarks/rl_maniskill.py).
CUBE_SPEC = Path(__file__).resolve().parents[1] / "examples" / "specs" / "tuned" / "pushcube_state.yaml"


def cube_rl_spec(base_model: str, jobs: int) -> dict[str, Any]:
    spec = yaml.safe_load(CUBE_SPEC.read_text())
    spec.update(tenant="cube-pusher-rl", base_model=base_model)
    spec["scheduling"]["completion_target"] = jobs
    return spec


def reach_sft_spec(base_model: str, dataset_root: Path, jobs: int) -> dict[str, Any]:
    return {
        "tenant": "reacher-sft",
        "base_model": base_model,
        "task": "sft",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": REACH_OBSERVATION,
        "dataset": {"root": str(dataset_root), "repo_id": "demo/reacher-scripted"},
        "environment": REACH_ENVIRONMENT,  # where it is evaluated
        "scheduling": {"max_in_flight_jobs": 2, "completion_target": jobs},
        "training": {"samples_per_job": 64, "microbatch_size": 16, "learning_rate": 1e-3},
    }


def smolvla_reach_spec(base_model: str, dataset_root: Path, checkpoint: Path, jobs: int) -> dict[str, Any]:
    """A lab's SmolVLA policy, fine-tuned expert-only on the PushT-reach demonstrations."""
    return {
        **reach_sft_spec(base_model, dataset_root, jobs),
        "tenant": "smolvla-reacher",
        "action_module": {"kind": "smolvla", "checkpoint": str(checkpoint)},
        "training": {"samples_per_job": 64, "microbatch_size": 16, "learning_rate": 1e-3},
    }


def lab_smolvla_checkpoint(settings: Settings, dataset_root: Path) -> Path:
    """The SmolVLA checkpoint a lab brings: LeRobot's own classes at small dimensions over the
    deployment's VLM (the backbone its settings build), with the dataset's statistics in its processor."""
    from joynexus.artifacts.lerobot_smolvla import build_lerobot_smolvla_checkpoint
    from joynexus.data.normalization import load_dataset_stats
    from joynexus.models.placement import DevicePlacement
    from joynexus.services.configs import backbone_source

    root = settings.data_dir / "lerobot" / "smolvla-reacher"
    if (root / "model.safetensors").is_file():
        return root
    backbone = backbone_source(settings).build(DevicePlacement(device="cpu"))
    stats, _ = load_dataset_stats(dataset_root)
    layers = min(4, len(backbone.model.text_model.layers))
    side = backbone.image_size
    return build_lerobot_smolvla_checkpoint(
        root, backbone, camera_shapes={"observation.images.top": (3, 32, 32)}, state_dim=4, action_dim=2,
        stats={k: {s: stats[k][s] for s in ("mean", "std", "min", "max")} for k in ("observation.state", "action")},
        chunk_size=1, n_action_steps=1,
        num_steps=5, num_vlm_layers=layers, max_state_dim=8, max_action_dim=4, tokenizer_max_length=32,
        resize_imgs_with_padding=(side, side),
    )  # fmt: skip


def scripted_reach_policy(obs: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    """Aim the pusher at the block: the block's (x, y) in the state IS the unit-range target."""
    return np.asarray(obs["state"][2:4], dtype=np.float32) + rng.normal(0.0, 0.05, size=2).astype(np.float32)


def record_reach_demonstrations(environment: Any, data_dir: Path, episodes: int) -> Path:
    from joynexus.data.demonstrations import record_demonstrations

    root = data_dir / "datasets" / "reacher-scripted"
    if not (root / "meta" / "info.json").exists():
        config = {"simulator": "pusht", "task": "PushT-reach-v0", "cameras": ["top"], "image_size": [32, 32]}
        record_demonstrations(
            environment, config, scripted_reach_policy, root, "demo/reacher-scripted", episodes=episodes, seed=7
        )
    return root


def demo_spec(t: DemoTenant, dataset_root: Path, base_model: str, jobs: int, samples_per_job: int) -> dict[str, Any]:
    return {
        "tenant": t.tenant,
        "base_model": base_model,
        "task": "sft",
        "action_module": {"kind": t.module, "size": "small"},
        "observation": {
            "cameras": list(t.cameras),
            "image_size": list(t.image_size),
            "state_dim": t.state_dim,
            "action_dim": t.action_dim,
            "action_chunk": t.action_chunk,
            "instruction": t.task,
        },
        # The last episode is held out: the champion moves by the held-out loss (promotion).
        "dataset": {"root": str(dataset_root), "repo_id": f"demo/{t.tenant}", "validation_episodes": 1},
        "scheduling": {"priority": t.priority, "max_in_flight_jobs": 2, "completion_target": jobs},
        "training": {"samples_per_job": samples_per_job, "microbatch_size": 16, "learning_rate": 2e-3},
    }


def write_demo_datasets(data_dir: Path, tenants: tuple[DemoTenant, ...] = DEMO_TENANTS) -> dict[str, Path]:
    from joynexus.data.lerobot_dataset import write_synthetic_dataset

    roots = {}
    for i, t in enumerate(tenants):
        root = data_dir / "datasets" / t.tenant
        if not (root / "meta" / "info.json").exists():
            write_synthetic_dataset(
                root,
                f"demo/{t.tenant}",
                cameras=t.cameras,
                image_size=t.image_size,
                state_dim=t.state_dim,
                action_dim=t.action_dim,
                num_episodes=6,
                episode_length=40,
                task=t.task,
                seed=100 + i,
            )
        roots[t.tenant] = root
    return roots


@dataclass
class DemoResult:
    statuses: dict[str, WorkloadInfo]  # tenant_id -> its training workload's final status
    losses: dict[str, list[float]]  # tenant_id -> loss per optimizer step in this run
    evaluations: dict[str, dict[str, WorkloadInfo]]  # tenant_id -> {"before": ..., "after": ...}
    tenants: list[Tenant]
    backbone: dict[str, Any]
    seconds: float
    settings: Settings


def run_demo(
    settings: Settings | None = None,
    *,
    jobs_per_tenant: int = 12,
    samples_per_job: int = 64,
    tenants: tuple[DemoTenant, ...] = DEMO_TENANTS,
    simulators: bool = True,
    rl_jobs: int = 30,
    maniskill_jobs: int = 50,
    smolvla: bool = True,
    demo_episodes: int = 40,
    eval_episodes: int = 12,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> DemoResult:
    settings = settings or Settings()
    stage = on_stage or (lambda message: None)
    stage(f"data directory {settings.data_dir}")
    stage("writing LeRobot datasets")
    roots = write_demo_datasets(settings.data_dir, tenants)
    stage(
        "connecting to the deployment (a running one, else a local Ray with the Master Service, Training Queue, "
        "Training / Inference Model and Environment Services)"
    )
    cluster = connect(settings, mode="ray")
    master = cluster.master
    events = _EventFollower(cluster, on_event)
    try:
        backbone = cluster.training.backbone_info()
        model = backbone["model_id"]
        specs = [demo_spec(t, roots[t.tenant], model, jobs_per_tenant, samples_per_job) for t in tenants]
        jobs = {t.tenant: jobs_per_tenant for t in tenants}
        if simulators:
            stage(f"recording {demo_episodes} scripted PushT-reach demonstrations")
            reach_root = record_reach_demonstrations(cluster.environment, settings.data_dir, demo_episodes)
            specs += [reach_sft_spec(model, reach_root, jobs_per_tenant), reach_rl_spec(model, rl_jobs)]
            jobs.update({"reacher-sft": jobs_per_tenant, "reacher-rl": rl_jobs})
            if smolvla:
                stage("writing a lab's LeRobot SmolVLA checkpoint over the deployment's VLM")
                checkpoint = lab_smolvla_checkpoint(settings, reach_root)
                specs.append(smolvla_reach_spec(model, reach_root, checkpoint, jobs_per_tenant))
                jobs["smolvla-reacher"] = jobs_per_tenant
            if maniskill_jobs:
                specs.append(cube_rl_spec(model, maniskill_jobs))
                jobs["cube-pusher-rl"] = maniskill_jobs
        created = []
        for spec in specs:
            try:
                tenant = master.get_tenant(spec["tenant"])  # a re-run continues the same tenants
            except KeyError:
                tenant = master.create_tenant(spec)
            created.append(tenant)
            stage(f"tenant {tenant.tenant_id} ({tenant.spec.task.value}): schema {tenant.schema_signature}")
        evaluated = [t.tenant_id for t in created if t.backend_config.environment is not None]
        started = time.perf_counter()
        before = {t: master.evaluate(t, episodes=eval_episodes) for t in evaluated}
        for status in _wait_all(cluster, [s.workload_id for s in before.values()]):
            stage(f"evaluation of {status.tenant_id} before training: {_eval_line(status)}")
        submitted = {t.tenant_id: master.submit_workload(t.tenant_id, jobs=jobs[t.tenant_id]) for t in created}
        for tenant_id, status in submitted.items():
            stage(f"workload {status.workload_id} of {tenant_id}: {jobs[tenant_id]} {status.task.upper()} jobs")
            events.follow(status.workload_id)
        final = _wait_all(cluster, [s.workload_id for s in submitted.values()])
        # After training: the first episode of each tenant recorded (mp4 in the evaluation's MLflow run).
        after = {t: master.evaluate(t, episodes=eval_episodes, videos=1) for t in evaluated}
        after_final = {s.tenant_id: s for s in _wait_all(cluster, [s.workload_id for s in after.values()])}
        seconds = time.perf_counter() - started
        statuses = {s.tenant_id: s for s in final}
        losses = {s.tenant_id: master.workload_losses(s.workload_id) for s in final}
        evaluations = {
            t: {"before": master.get_workload(before[t].workload_id), "after": after_final[t]} for t in evaluated
        }
        return DemoResult(statuses, losses, evaluations, created, backbone, seconds, settings)
    finally:
        events.stop()
        cluster.close()


def _wait_all(cluster: Cluster, workload_ids: list[str], timeout_s: float = 7200.0) -> list[WorkloadInfo]:
    deadline = time.monotonic() + timeout_s
    return [cluster.wait_workload(w, max(0.0, deadline - time.monotonic())) for w in workload_ids]


class _EventFollower:
    """Polls the Master Service for the events of the workloads it follows and hands them to a
    callback (the progress bars): the Master is a service, events are rows it serves."""

    def __init__(self, cluster: Cluster, on_event: Callable[[dict[str, Any]], None] | None, poll_s: float = 0.5):
        self.cluster, self.on_event, self.poll_s = cluster, on_event, poll_s
        self._after: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, workload_id: str) -> None:
        if self.on_event is None:
            return
        self._after.setdefault(workload_id, 0)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="event-follower", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll()

    def _poll(self) -> None:
        for workload_id, after in list(self._after.items()):
            try:
                events = self.cluster.master.workload_events(workload_id, after)
            except Exception:  # a transient failure: the next poll catches up
                continue
            for event in events:
                self._after[workload_id] = event["seq"]
                self.on_event(event)  # type: ignore[misc]

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._poll()  # the last events


def _eval_line(status: WorkloadInfo) -> str:
    if status.result is None:
        return f"{status.state} ({status.error})"
    r = status.result
    line = f"v{r['policy_version']}: return {r['mean_return']:.2f}, success {r['success_rate']:.0%}"
    if "success_ci_low" in r:  # the 95% Wilson interval (services/producers/evaluation_stats.py)
        line += f" [95% CI {r['success_ci_low']:.0%}-{r['success_ci_high']:.0%}]"
    if r.get("videos"):
        line += f", video {r['videos'][0]} in MLflow run {status.run_id}"
    return line


# -- the command: `python -m recipes.main_job` (what ./scripts/run-main runs) ---------------------
console = Console(width=None if sys.stdout.isatty() else 140)  # logs are not terminals: no 80-column wrap


def check_backbone_preset(name: str | None) -> str | None:
    """`--backbone`: a preset of the backbone registry (checked here, before anything starts)."""
    if name is None:
        return None
    from joynexus.models.backbone import TinyBackboneSpec

    try:
        TinyBackboneSpec.preset(name)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    return name


def job_settings(data_dir: Path | None, backbone: str | None = None, backbone_path: Path | None = None) -> Settings:
    """The settings of this run: the embedded defaults (environment included), with the backbone the
    options name (a preset, or a local Hugging Face checkpoint directory) for the services it starts."""
    overrides: dict[str, Any] = {}
    if data_dir is not None:
        overrides["data_dir"] = data_dir.resolve()
    if backbone is not None and backbone_path is not None:
        raise typer.BadParameter("give --backbone (a preset) or --backbone-path (a directory), not both")
    if backbone is not None:
        overrides.update(backbone_preset=check_backbone_preset(backbone), backbone_path=None)
    if backbone_path is not None:
        if not backbone_path.expanduser().is_dir():
            raise typer.BadParameter(f"--backbone-path {str(backbone_path)!r} is not a directory")
        overrides["backbone_path"] = str(backbone_path.expanduser().resolve())
    return Settings(**overrides)


def main(
    data_dir: Path | None = typer.Option(
        None,
        envvar="JOYNEXUS_DATA_DIR",
        help="Where the store, datasets, checkpoints and MLflow live [default: $JOYNEXUS_DATA_DIR or ./var].",
    ),
    jobs: int = typer.Option(12, min=1, help="Training jobs per tenant in this run."),
    samples_per_job: int = typer.Option(64, min=1, help="Demonstration samples per training job."),
    simulators: bool = typer.Option(
        True, help="Include the simulator tenants (RL, SFT on recorded demos, evaluation)."
    ),
    rl_jobs: int = typer.Option(30, min=1, help="PPO updates of the PushT-reach RL tenant."),
    backbone: str | None = typer.Option(
        None,
        "--backbone",
        callback=check_backbone_preset,
        help="Backbone preset of the model services this run starts, e.g. smolvlm-256m for a real-size "
        "SmolVLM (random weights) [default: $JOYNEXUS_BACKBONE_PRESET or tiny].",
    ),
    backbone_path: Path | None = typer.Option(
        None,
        "--backbone-path",
        help="A local Hugging Face checkpoint directory (Idefics3 / SmolVLM, as save_pretrained writes it) "
        "to serve instead of a preset [default: $JOYNEXUS_BACKBONE_PATH].",
    ),
) -> None:
    """Run the main job: SFT, RL and evaluation side by side on one resident backbone per service."""
    settings = job_settings(data_dir, backbone, backbone_path)
    result = _run_with_progress(
        settings, jobs_per_tenant=jobs, samples_per_job=samples_per_job, simulators=simulators, rl_jobs=rl_jobs
    )
    failed = _print_results(result)
    if result.evaluations:
        console.print(_evaluations_table(result))
        for line in _evaluation_videos(result):
            console.print(f"evaluation video of {line}")
    _print_where(result)
    if failed:
        raise typer.Exit(code=1)


def _run_with_progress(settings: Settings, **demo_options: Any) -> DemoResult:
    """`run_demo` with one progress bar per tenant, fed from the workloads' events."""
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
        return run_demo(settings, on_event=on_event, on_stage=on_stage, **demo_options)


def _print_results(result: DemoResult) -> bool:
    """The per-tenant table (and each failed workload's error); returns whether any workload failed."""
    table = Table(
        title=f"main job: {len(result.tenants)} tenants, {result.seconds:.1f} s, one backbone per model service"
    )
    for column in ("tenant", "task", "module", "schema", "workload", "jobs", "steps", "first loss", "last loss",
                   "version", "MLflow model", "aliases"):  # fmt: skip
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
            _aliases(status),
        )
        if status.error:
            console.print(f"[red]{tenant.tenant_id}: {status.state}: {status.error}")
    console.print(table)
    return failed


def _aliases(status: WorkloadInfo) -> str:
    """Where the Master's promotion left `candidate` and `champion`, and by what metric."""
    decision = (status.result or {}).get("promotion")
    if not decision:
        return "-"
    value = "" if decision["value"] is None else f" {decision['metric']} {decision['value']:.4g}"
    return f"candidate v{decision['version']}, champion v{decision['champion']}{value}"


def _evaluations_table(result: DemoResult) -> Table:
    """Before/after evaluation of each simulator tenant."""
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
            cells += [f"v{r['policy_version']}", f"{r['mean_return']:.2f}", _success_cell(r)] if r else [
                pair[when].state, "-", "-"]  # fmt: skip
        evals.add_row(*cells)
    return evals


def _success_cell(r: dict[str, Any]) -> str:
    """The success rate with its 95% Wilson interval when the evaluation reported one."""
    if "success_ci_low" not in r:
        return f"{r['success_rate']:.0%}"
    return f"{r['success_rate']:.0%} [{r['success_ci_low']:.0%}-{r['success_ci_high']:.0%}]"


def _evaluation_videos(result: DemoResult) -> list[str]:
    """Each evaluated tenant's after-training video, as 'MLflow run <id>: <artifact path>'."""
    lines = []
    for tenant_id, pair in result.evaluations.items():
        after = pair["after"]
        for path in (after.result or {}).get("videos") or []:
            lines.append(f"{tenant_id}: MLflow run {after.run_id}, artifact {path}")
    return lines


def _print_where(result: DemoResult) -> None:
    """The shared backbone, and where the store, checkpoints and MLflow runs are."""
    info = result.backbone
    console.print(
        f"backbone [bold]{info['model_id']}[/]: {info['parameter_count']:,} frozen parameters, "
        f"{info['instances_created']} instance(s) in the Training Model Service (pid {info['pid']}) "
        f"for {len(result.tenants)} tenants"
    )
    s = result.settings
    console.print(f"control-plane store: {s.resolved_database_url()}")
    console.print(f"checkpoints: {s.checkpoint_root}")
    console.print(mlflow_ui_hint(s))


def mlflow_ui_hint(settings: Settings) -> str:
    """How to see the runs in the MLflow UI: the server of the deployment the job ran on (`joynexus
    up` serves the UI on its tracking server), else a `mlflow ui` over the embedded store."""
    from joynexus.ops.deployment_state import effective_settings

    uri = effective_settings(settings).resolved_mlflow_uri()
    head = "MLflow UI (runs, loss curves, registered tenant models):\n"
    if uri.startswith(("http://", "https://")):
        return f"{head}  open {uri}"
    return f"{head}  .venv/bin/mlflow ui --backend-store-uri {uri} --port 5000\n  then open http://127.0.0.1:5000"


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: never try the network for models or data
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    typer.run(main)
