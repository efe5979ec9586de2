"""Master Service: the deployment handles and the workload orchestrator (paper section 4.1.1).

`Deployment` connects the control plane (SQL store, Training Scheduler, tenant creator) to the
execution plane (the named Ray actors: Training Queue, Training Model Service) and to MLflow.
`SFTWorkloadOrchestrator` materializes the roles an SFT workload needs — one producer per tenant
and the shared actor loop — runs them concurrently, and on completion checkpoints, exports and
registers each tenant's policy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from joynexus.master.store import ControlPlaneStore
from joynexus.master.tenant_creator import BackendCapabilities, BaseModelCapabilities, Tenant, TenantCreator
from joynexus.registry import ExperimentTracker
from joynexus.runtime import Settings, call, init_ray
from joynexus.scheduling.training_queue import TrainingQueueClient, training_queue_actor
from joynexus.scheduling.training_scheduler import COMPLETED, FAILED, TrainingScheduler
from joynexus.services.actor_loop import ActorLoop, ActorOutcome
from joynexus.services.sft_producer import SFTProducer
from joynexus.services.training import BackboneSource, training_service_actor

log = logging.getLogger(__name__)


@dataclass
class Deployment:
    settings: Settings
    store: ControlPlaneStore
    scheduler: TrainingScheduler
    queue: TrainingQueueClient
    training_service: Any  # Ray actor handle of TrainingModelService
    creator: TenantCreator
    tracker: ExperimentTracker

    @classmethod
    def start(cls, settings: Settings | None = None) -> Deployment:
        settings = settings or Settings()
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        init_ray(settings.ray_address)
        queue = TrainingQueueClient(training_queue_actor(namespace=settings.ray_namespace))
        source = BackboneSource(
            preset=None if settings.backbone_path else settings.backbone_preset, path=settings.backbone_path
        )
        service = training_service_actor(
            source,
            settings.checkpoint_root,
            queue.handle,
            num_threads=settings.torch_threads,
            namespace=settings.ray_namespace,
        )
        caps = BaseModelCapabilities(**_capabilities_fields(call(service, "capabilities")))
        store = ControlPlaneStore(settings.resolved_database_url())
        scheduler = TrainingScheduler(store, release_partition=queue.clear)
        creator = TenantCreator(store, scheduler, BackendCapabilities.single(caps))
        tracker = ExperimentTracker(settings.resolved_mlflow_uri(), artifact_location=_artifact_location(settings))
        return cls(settings, store, scheduler, queue, service, creator, tracker)

    def shutdown(self) -> None:
        self.store.dispose()


def _capabilities_fields(caps: Any) -> dict[str, Any]:
    return {name: getattr(caps, name) for name in BaseModelCapabilities.__dataclass_fields__}


def _artifact_location(settings: Settings) -> str | None:
    if settings.mlflow_tracking_uri:
        return None  # a tracking server decides where artifacts live
    return (settings.data_dir / "mlflow" / "artifacts").resolve().as_uri()


@dataclass
class TenantProgress:
    tenant_id: str
    target_jobs: int
    completed_jobs: int = 0
    failed_jobs: int = 0
    optimizer_steps: int = 0
    losses: list[float] = field(default_factory=list)
    version: int = 0
    run_id: str | None = None
    registered_version: int | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.completed_jobs >= self.target_jobs


ProgressCallback = Callable[[TenantProgress], None]


class SFTWorkloadOrchestrator:
    def __init__(self, deployment: Deployment, *, max_failures_per_tenant: int = 3):
        self.deployment = deployment
        self.max_failures = max_failures_per_tenant
        self._lock = threading.Lock()

    def run(
        self,
        tenants: list[Tenant],
        *,
        workload_id: str,
        on_progress: ProgressCallback | None = None,
        timeout_s: float = 3600.0,
    ) -> dict[str, TenantProgress]:
        dep = self.deployment
        progress: dict[str, TenantProgress] = {}
        producers: dict[str, SFTProducer] = {}
        for tenant in tenants:
            target = tenant.spec.scheduling.completion_target
            if target is None:
                raise ValueError(f"tenant {tenant.tenant_id!r}: an SFT workload run needs scheduling.completion_target")
            slot = call(dep.training_service, "add_tenant", tenant.backend_config)
            state = TenantProgress(tenant.tenant_id, target, version=slot["version"])
            state.run_id = dep.tracker.start_workload_run(
                tenant.tenant_id, workload_id, _run_params(tenant), tags={"task": "sft"}
            )
            progress[tenant.tenant_id] = state
            assert tenant.spec.dataset is not None
            producers[tenant.tenant_id] = SFTProducer.from_dataset(
                tenant.backend_config, dep.scheduler, dep.queue, tenant.spec.dataset.root, tenant.spec.dataset.repo_id
            )

        stop = threading.Event()

        def on_outcome(outcome: ActorOutcome) -> None:
            state = progress.get(outcome.job.tenant_id)
            if state is None:
                return
            with self._lock:
                if outcome.state == COMPLETED and outcome.metrics is not None:
                    first_step = state.optimizer_steps
                    state.losses.extend(outcome.metrics["losses"])
                    state.optimizer_steps += len(outcome.metrics["losses"])
                    state.completed_jobs += 1
                    state.version = outcome.metrics["version"]
                    for i, loss in enumerate(outcome.metrics["losses"]):
                        dep.tracker.log_metrics(state.run_id, {"train/loss": loss}, step=first_step + i + 1)
                    dep.tracker.log_metrics(
                        state.run_id,
                        {"policy_version": state.version, "jobs_completed": state.completed_jobs},
                        step=state.optimizer_steps,
                    )
                else:
                    state.failed_jobs += 1
                    state.failures.append(outcome.reason or outcome.state)
            if on_progress is not None:
                on_progress(state)

        actor = ActorLoop(dep.scheduler, dep.training_service, on_outcome=on_outcome)
        threads = [threading.Thread(target=actor.run, args=(stop,), name="actor-loop", daemon=True)]
        producer_errors: dict[str, BaseException] = {}

        def produce(tenant_id: str) -> None:
            try:
                producers[tenant_id].run(stop)
            except BaseException as error:  # surfaced after the run; other tenants continue
                producer_errors[tenant_id] = error

        threads += [
            threading.Thread(target=produce, args=(tid,), name=f"sft-producer-{tid}", daemon=True) for tid in producers
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                with self._lock:
                    finished = all(
                        s.done or s.failed_jobs >= self.max_failures or s.tenant_id in producer_errors
                        for s in progress.values()
                    )
                if finished:
                    break
                time.sleep(0.1)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
        for tenant_id, error in producer_errors.items():
            progress[tenant_id].failures.append(f"producer: {type(error).__name__}: {error}")
        self._finish(tenants, progress)
        return progress

    def _finish(self, tenants: list[Tenant], progress: dict[str, TenantProgress]) -> None:
        """Checkpoint, export and register every tenant that trained; close its MLflow run."""
        dep = self.deployment
        from joynexus.artifacts import decode_tenant_payload

        for tenant in tenants:
            state = progress[tenant.tenant_id]
            ok = state.done and not state.failures
            if state.completed_jobs:
                call(dep.training_service, "save", [tenant.tenant_id], True)
                payload = call(dep.training_service, "export_params", tenant.tenant_id)
                _, manifest = decode_tenant_payload(payload)
                state.registered_version = dep.tracker.register_tenant_payload(
                    run_id=state.run_id, tenant_id=tenant.tenant_id, payload=payload, manifest=manifest
                )
            dep.tracker.end_run(state.run_id, "FINISHED" if ok else "FAILED")


def _run_params(tenant: Tenant) -> dict[str, Any]:
    cfg = tenant.backend_config
    return {
        "tenant_id": cfg.tenant_id,
        "base_model_id": cfg.base_model_id,
        "schema_signature": cfg.schema_signature,
        "cameras": ",".join(cfg.cameras),
        "image_size": "x".join(str(s) for s in cfg.image_size),
        "state_dim": cfg.state_dim,
        "action_dim": cfg.action_dim,
        "action_chunk": cfg.action_chunk,
        "action_module": cfg.action_module["kind"],
        "action_module_size": cfg.action_module.get("size"),
        "learning_rate": cfg.learning_rate,
        "microbatch_size": cfg.microbatch_size,
        "samples_per_job": cfg.samples_per_job,
        "completion_target": tenant.spec.scheduling.completion_target,
        "max_in_flight_jobs": tenant.spec.scheduling.max_in_flight_jobs,
        "priority": tenant.spec.scheduling.priority,
    }


__all__ = ["Deployment", "SFTWorkloadOrchestrator", "TenantProgress", "FAILED"]
