"""Grouped training on the real deployment (issue 25.1 and 25.4): the Training Queue and the Training
Model Service as named Ray actors, each its own process; the Master's ActorLoop leases three tenants'
ready jobs as one group and the service trains them with `train_jobs` over Ray; one tenant's NaN
fails its job alone. The service's own signals are read in its actor process, and its HTTP endpoint
(`ServiceMetrics.serve`, what JOYNEXUS_METRICS_PORT starts) answers from that process."""

from __future__ import annotations

import socket
import urllib.request
import uuid

import pytest

from joynexus.actors import init_ray, service_handle
from joynexus.core.store import ControlPlaneStore
from joynexus.core.tenants import BackendCapabilities
from joynexus.master.loops.actor_loop import ActorLoop
from joynexus.master.tenant_creator import TenantCreator
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import TrainingScheduler
from joynexus.services.configs import TrainingQueueConfig, TrainingServiceConfig
from joynexus.services.producers.sft import SFTProducer
from joynexus.services.training.service import TrainingModelService
from joynexus.settings import Settings
from tests.helpers import sft_spec, write_dataset_for

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray start and a backbone in an actor process: > 30 s on the shared CPU

TENANTS = ("ray-a", "ray-b", "ray-c")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_grouped_jobs_over_ray_and_the_service_signals_in_its_process(tmp_path):
    started_ray = not ray.is_initialized()
    init_ray(num_cpus=2)
    settings = Settings(data_dir=tmp_path, torch_threads=1, ray_namespace=f"grouped-{uuid.uuid4().hex[:8]}")
    where = {"namespace": settings.ray_namespace, "detached": False}
    queue_actor = TrainingQueueConfig().actor(**where)
    service_actor = TrainingServiceConfig.from_settings(settings).actor(queue_actor, **where)
    store = ControlPlaneStore(settings.resolved_database_url())
    try:
        queue = service_handle(TrainingQueue, queue_actor)
        service = service_handle(TrainingModelService, service_actor)
        scheduler = TrainingScheduler(store, release_partition=queue.clear)
        creator = TenantCreator(store, scheduler, BackendCapabilities.single(service.capabilities()))
        model_id = service.backbone_info()["model_id"]
        producers = {}
        for i, name in enumerate(TENANTS):
            spec = sft_spec(name, tmp_path / "datasets" / name, base_model=model_id, jobs=4)
            write_dataset_for(spec, seed=i)
            tenant = creator.create(spec)
            service.add_tenant(tenant.backend_config)
            data = tenant.spec.dataset
            producers[name] = SFTProducer.from_dataset(tenant.backend_config, scheduler, queue, data.root, data.repo_id)

        jobs = [producers[name].produce_once() for name in TENANTS]
        outcomes = ActorLoop(scheduler, service, group_max=8).step_all()
        assert [o.job.job_id for o in outcomes] == [j.job_id for j in jobs]
        assert [o.state for o in outcomes] == ["completed"] * 3
        assert all(o.metrics["group_size"] == 3 for o in outcomes)
        assert [service.policy_version(name) for name in TENANTS] == [1, 1, 1]

        # One tenant's NaN, inside the actor process: its job fails, the others complete.
        def poison(svc, tenant_id="ray-b"):
            import torch

            with torch.no_grad():
                for p in svc.slot_table.slot(tenant_id).module.parameters():
                    p.fill_(float("nan"))
            return True

        assert ray.get(service_actor.__ray_call__.remote(poison))
        jobs = [producers[name].produce_once() for name in TENANTS]
        outcomes = {o.job.tenant_id: o for o in ActorLoop(scheduler, service).step_all()}
        assert outcomes["ray-b"].state == "failed" and "non-finite" in outcomes["ray-b"].reason
        assert outcomes["ray-a"].state == outcomes["ray-c"].state == "completed"
        assert all(not queue.has_partition(j.partition_id) for j in jobs)

        # The signals live in the service's own process; its endpoint serves them from there.
        def signals(_svc):
            from joynexus.core.service_metrics import service_metrics

            registry = service_metrics().registry
            return (
                registry.get_sample_value("joynexus_training_jobs_total", {"tenant": "ray-a"}),
                registry.get_sample_value("joynexus_training_step_seconds_count", {"mode": "grouped"}),
            )

        jobs_a, grouped_steps = ray.get(service_actor.__ray_call__.remote(signals))
        assert jobs_a == 2 and grouped_steps >= 4  # 2 jobs x 2 microbatches, grouped rounds
        port = _free_port()

        def serve(_svc, port=port):
            from joynexus.core.service_metrics import service_metrics

            return service_metrics().serve(port)

        bound = ray.get(service_actor.__ray_call__.remote(serve))
        text = urllib.request.urlopen(f"http://127.0.0.1:{bound}/metrics", timeout=10).read().decode()
        assert 'joynexus_training_jobs_total{tenant="ray-a"} 2.0' in text
    finally:
        store.dispose()
        ray.kill(service_actor)
        ray.kill(queue_actor)
        if started_ray:
            ray.shutdown()
