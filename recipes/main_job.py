"""The main job: SFT, RL and evaluation side by side on ONE resident backbone per model service,
on the embedded defaults (local Ray, SQLite, local MLflow).

- three SFT tenants with different schemas and action modules, on generated LeRobot datasets;
- an SFT tenant on demonstrations recorded from a scripted policy in gym-pusht (PushT-reach);
- two RL tenants on different simulators: PushT-reach (GAE + PPO, learns within the run) and
  ManiSkill3 PushCube (GRPO + PPO, a few updates: camera rendering on a CPU is slow);
- evaluations of the simulator tenants before and after training.

A thin recipe over the library: write or record each tenant's data, create the tenants through the
Master Service, submit every workload at once, and report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from joynexus.core.tenants import Tenant
from joynexus.master.orchestrator import Deployment
from joynexus.master.workloads import WorkloadManager, WorkloadStatus
from joynexus.runtime import Settings


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


def cube_rl_spec(base_model: str, jobs: int) -> dict[str, Any]:
    return {
        "tenant": "cube-pusher-rl",
        "base_model": base_model,
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": ["base_camera"], "image_size": [32, 32], "state_dim": 25, "action_dim": 4,
                        "instruction": "push the cube to the goal region"},
        "environment": {"simulator": "maniskill", "task": "PushCube-v1", "control_mode": "pd_ee_delta_pos",
                        "reward_mode": "normalized_dense", "num_envs": 2, "horizon": 8},
        "rl": {"advantage": "grpo", "ppo_epochs": 2},
        "scheduling": {"max_in_flight_jobs": 1, "completion_target": jobs, "max_policy_staleness": 2},
        "training": {"samples_per_job": 16, "microbatch_size": 16, "learning_rate": 5e-5},
    }  # fmt: skip


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
        "dataset": {"root": str(dataset_root), "repo_id": f"demo/{t.tenant}"},
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
    statuses: dict[str, WorkloadStatus]  # tenant_id -> its training workload's final status
    losses: dict[str, list[float]]  # tenant_id -> loss per optimizer step in this run
    evaluations: dict[str, dict[str, WorkloadStatus]]  # tenant_id -> {"before": ..., "after": ...}
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
    maniskill_jobs: int = 2,
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
    stage("starting the deployment (local Ray; Training Queue, Training / Inference Model and Environment Services)")
    dep = Deployment.start(settings)
    manager = WorkloadManager(dep, on_event=on_event).start()
    try:
        backbone = dep.training_service.backbone_info()
        model = backbone["model_id"]
        specs = [demo_spec(t, roots[t.tenant], model, jobs_per_tenant, samples_per_job) for t in tenants]
        jobs = {t.tenant: jobs_per_tenant for t in tenants}
        if simulators:
            stage(f"recording {demo_episodes} scripted PushT-reach demonstrations")
            reach_root = record_reach_demonstrations(dep.environment_service, settings.data_dir, demo_episodes)
            specs += [reach_sft_spec(model, reach_root, jobs_per_tenant), reach_rl_spec(model, rl_jobs)]
            jobs.update({"reacher-sft": jobs_per_tenant, "reacher-rl": rl_jobs})
            if maniskill_jobs:
                specs.append(cube_rl_spec(model, maniskill_jobs))
                jobs["cube-pusher-rl"] = maniskill_jobs
        created = []
        for spec in specs:
            try:
                tenant = dep.creator.get(spec["tenant"])  # a re-run continues the same tenants
            except KeyError:
                tenant = dep.creator.create(spec)
            created.append(tenant)
            stage(f"tenant {tenant.tenant_id} ({tenant.spec.task.value}): schema {tenant.schema_signature}")
        evaluated = [t.tenant_id for t in created if t.backend_config.environment is not None]
        started = time.perf_counter()
        before = {t: manager.evaluate(t, episodes=eval_episodes) for t in evaluated}
        for status in manager.wait_all([s.workload_id for s in before.values()]):
            stage(f"evaluation of {status.tenant_id} before training: {_eval_line(status)}")
        submitted = {t.tenant_id: manager.submit(t.tenant_id, jobs=jobs[t.tenant_id]) for t in created}
        for tenant_id, status in submitted.items():
            stage(f"workload {status.workload_id} of {tenant_id}: {jobs[tenant_id]} {status.task.upper()} jobs")
        final = manager.wait_all([s.workload_id for s in submitted.values()])
        after = {t: manager.evaluate(t, episodes=eval_episodes) for t in evaluated}
        after_final = {s.tenant_id: s for s in manager.wait_all([s.workload_id for s in after.values()])}
        seconds = time.perf_counter() - started
        statuses = {s.tenant_id: s for s in final}
        losses = {s.tenant_id: manager.losses(s.workload_id) for s in final}
        evaluations = {t: {"before": manager.get(before[t].workload_id), "after": after_final[t]} for t in evaluated}
        return DemoResult(statuses, losses, evaluations, created, backbone, seconds, settings)
    finally:
        manager.stop()
        dep.shutdown()


def _eval_line(status: WorkloadStatus) -> str:
    if status.result is None:
        return f"{status.state} ({status.error})"
    r = status.result
    return f"v{r['policy_version']}: return {r['mean_return']:.2f}, success {r['success_rate']:.0%}"
