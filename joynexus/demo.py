"""The main job: several SFT tenants with different schemas and action modules post-train at the
same time on ONE resident backbone, on the embedded defaults (local Ray, SQLite, local MLflow).

A thin recipe over the library: generate each tenant's LeRobot dataset, create the tenants through
the Master Service, run the SFT workload, and report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from joynexus.master.orchestrator import Deployment
from joynexus.master.tenant_creator import Tenant
from joynexus.master.workloads import WorkloadManager, WorkloadStatus
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
    statuses: dict[str, WorkloadStatus]  # tenant_id -> its workload's final status
    losses: dict[str, list[float]]  # tenant_id -> loss per optimizer step in this run
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
    on_event: Callable[[dict[str, Any]], None] | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> DemoResult:
    settings = settings or Settings()
    stage = on_stage or (lambda message: None)
    stage(f"data directory {settings.data_dir}")
    stage("writing LeRobot datasets")
    roots = write_demo_datasets(settings.data_dir, tenants)
    stage("starting the deployment (local Ray, Training Queue, Training and Inference Model Services)")
    dep = Deployment.start(settings)
    manager = WorkloadManager(dep, on_event=on_event).start()
    try:
        backbone = call(dep.training_service, "backbone_info")
        created = []
        for t in tenants:
            spec = demo_spec(t, roots[t.tenant], backbone["model_id"], jobs_per_tenant, samples_per_job)
            try:
                tenant = dep.creator.get(t.tenant)  # a re-run continues the same tenants from their checkpoints
            except KeyError:
                tenant = dep.creator.create(spec)
            created.append(tenant)
            stage(f"tenant {tenant.tenant_id}: schema {tenant.schema_signature}")
        started = time.perf_counter()
        submitted = {t.tenant_id: manager.submit(t.tenant_id, jobs=jobs_per_tenant) for t in created}
        for tenant_id, status in submitted.items():
            stage(f"workload {status.workload_id} of {tenant_id}: {jobs_per_tenant} SFT jobs")
        final = manager.wait_all([s.workload_id for s in submitted.values()])
        seconds = time.perf_counter() - started
        statuses = {s.tenant_id: s for s in final}
        losses = {s.tenant_id: manager.losses(s.workload_id) for s in final}
        return DemoResult(statuses, losses, created, backbone, seconds, settings)
    finally:
        manager.stop()
        dep.shutdown()
