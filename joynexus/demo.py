"""The main job: several SFT tenants with different schemas and action modules post-train at the
same time on ONE resident backbone, on the embedded defaults (local Ray, SQLite, local MLflow).

A thin recipe over the library: generate each tenant's LeRobot dataset, create the tenants through
the Master Service, run the SFT workload, and report.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from joynexus.master.orchestrator import Deployment, SFTWorkloadOrchestrator, TenantProgress
from joynexus.master.tenant_creator import Tenant
from joynexus.runtime import Settings, call


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
    workload_id: str
    progress: dict[str, TenantProgress]
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
    on_progress: Any = None,
    on_stage: Any = None,
) -> DemoResult:
    settings = settings or Settings()
    stage = on_stage or (lambda message: None)
    stage(f"data directory {settings.data_dir}")
    stage("writing LeRobot datasets")
    roots = write_demo_datasets(settings.data_dir, tenants)
    stage("starting the deployment (local Ray, Training Queue, Training Model Service)")
    dep = Deployment.start(settings)
    try:
        backbone = call(dep.training_service, "backbone_info")
        workload_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        created = []
        for t in tenants:
            spec = demo_spec(t, roots[t.tenant], backbone["model_id"], jobs_per_tenant, samples_per_job)
            try:
                tenant = dep.creator.get(t.tenant)  # a re-run continues the same tenants from their checkpoints
            except KeyError:
                tenant = dep.creator.create(spec)
            created.append(tenant)
            stage(f"tenant {tenant.tenant_id}: schema {tenant.schema_signature}")
        # Each run trains `jobs_per_tenant` more jobs per tenant, on top of what earlier runs did.
        for tenant in created:
            done = dep.scheduler.counts(tenant.tenant_id).get("completed", 0)
            sched = tenant.spec.scheduling
            dep.scheduler.register_policy(
                tenant.tenant_id,
                "sft",
                priority=sched.priority,
                max_in_flight=sched.max_in_flight_jobs,
                completion_target=done + jobs_per_tenant,
            )
        started = time.perf_counter()
        progress = SFTWorkloadOrchestrator(dep).run(
            [_with_target(t, jobs_per_tenant) for t in created], workload_id=workload_id, on_progress=on_progress
        )
        return DemoResult(workload_id, progress, created, backbone, time.perf_counter() - started, settings)
    finally:
        dep.shutdown()


def _with_target(tenant: Tenant, jobs: int) -> Tenant:
    sched = tenant.spec.scheduling.model_copy(update={"completion_target": jobs})
    spec = tenant.spec.model_copy(update={"scheduling": sched})
    return Tenant(tenant.tenant_id, spec, tenant.schema_signature, tenant.backend_config)
