"""Training shards on Ray (issue 45.1): two Training Model Service actors on the two bundles of one
placement group (`TrainingServiceConfig.shard_actors`), a shard loop each; one shard is killed
mid-run: the loop that held its job gives it back, the shard set sees the shard gone, its tenants
resume on the other shard from their checkpoints, and every job completes with every version
number issued once."""

from __future__ import annotations

import time
import uuid

import pytest

from joynexus.actors import init_ray, service_handle
from joynexus.core.store import ControlPlaneStore
from joynexus.core.tenants import BackendCapabilities
from joynexus.master.loops.shard_loops import ShardLoops
from joynexus.master.tenant_creator import TenantCreator
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import COMPLETED, TrainingScheduler
from joynexus.services.configs import TrainingQueueConfig, TrainingServiceConfig
from joynexus.services.producers.sft import SFTProducer
from joynexus.settings import Settings
from tests.helpers import ray_deployment, sft_spec, write_dataset_for

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray start and two backbones in actor processes

TENANTS = ("shard-a", "shard-b", "shard-c", "shard-d")


def test_two_shards_on_a_placement_group_survive_a_killed_shard(tmp_path):
    started_ray = not ray.is_initialized()
    init_ray(num_cpus=3)
    settings = Settings(
        data_dir=tmp_path, torch_threads=1, training_shards=2, training_group_max=2,
        ray_namespace=f"shards-{uuid.uuid4().hex[:8]}",
    )  # fmt: skip
    where = {"namespace": settings.ray_namespace, "detached": False}
    config = TrainingServiceConfig.from_settings(settings)
    queue_actor = TrainingQueueConfig().actor(**where)
    actors = config.shard_actors(queue_actor, **where)
    store = ControlPlaneStore(settings.resolved_database_url())
    loops = None
    try:
        queue = service_handle(TrainingQueue, queue_actor)
        shards = config.shard_set(actors)
        pids = {shards.shard(i).heartbeat()["pid"] for i in range(2)}
        assert len(pids) == 2  # two processes, two backbones
        scheduler = TrainingScheduler(store, release_partition=queue.clear)
        creator = TenantCreator(store, scheduler, BackendCapabilities.single(shards.capabilities()))
        model_id = shards.backbone_info()["model_id"]
        producers = {}
        for i, name in enumerate(TENANTS):
            # Two module kinds: each pair stays together on its own shard (group size 2).
            module = "oft_mlp" if i < 2 else "flow_matching"
            spec = sft_spec(name, tmp_path / "data" / name, base_model=model_id, module=module, jobs=None,
                            max_in_flight=1)  # fmt: skip
            write_dataset_for(spec, seed=i)
            tenant = creator.create(spec)
            shards.add_tenant(tenant.backend_config)
            data = tenant.spec.dataset
            producers[name] = SFTProducer.from_dataset(tenant.backend_config, scheduler, queue, data.root, data.repo_id)
        assert sorted(shards.shard(0).tenants() + shards.shard(1).tenants()) == sorted(TENANTS)
        assert shards.shard(0).tenants() and shards.shard(1).tenants()

        outcomes = []
        loops = ShardLoops(scheduler, shards, group_max=2, on_outcome=outcomes.append)
        loops.start(wait_s=0.05)

        def round_of_jobs(timeout_s: float = 180.0) -> None:
            jobs = [producers[name].produce_once() for name in TENANTS]
            assert all(jobs)
            deadline = time.monotonic() + timeout_s
            while any(scheduler.get(j.job_id).state != COMPLETED for j in jobs):
                assert time.monotonic() < deadline, [(j.tenant_id, scheduler.get(j.job_id).state) for j in jobs]
                time.sleep(0.05)

        round_of_jobs()
        victim = shards.placement.shard_of("shard-c")
        survivor = 1 - victim
        # Kill the shard while its next jobs are ready or in flight.
        jobs = [producers[name].produce_once() for name in TENANTS]
        ray.kill(actors[victim], no_restart=True)
        deadline = time.monotonic() + 180
        while any(scheduler.get(j.job_id).state != COMPLETED for j in jobs):
            assert time.monotonic() < deadline, [(j.tenant_id, scheduler.get(j.job_id).state) for j in jobs]
            time.sleep(0.05)
        round_of_jobs()
        assert shards.placement.live_shards() == [survivor]
        assert sorted(shards.shard(survivor).tenants()) == sorted(TENANTS)
        versions: dict[str, list[int]] = {}
        for outcome in outcomes:
            assert outcome.state == "completed"
            versions.setdefault(outcome.job.tenant_id, []).append(outcome.metrics["version"])
        for name in TENANTS:  # 3 jobs each, every version issued once, in order
            assert versions[name] == [1, 2, 3], (name, versions[name])
    finally:
        if loops is not None:
            loops.stop()
        store.dispose()
        for actor in (*actors, queue_actor):
            ray.kill(actor)
        if started_ray:
            ray.shutdown()


def test_the_master_and_its_producer_replica_run_workloads_over_two_shards(tmp_path):
    """The whole deployment on Ray with JOYNEXUS_TRAINING_SHARDS=2: the Master places two tenants
    of two group keys on the two shard actors, its producer replica (its own process) reaches each
    tenant's slot through the shard router to publish versions, and both workloads complete with
    every version issued once, each tenant on its own shard."""
    from joynexus.services.training.shard_router import shard_actor_name

    namespace = f"test-shards-master-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        data_dir=tmp_path / "data", ray_namespace=namespace, torch_threads=1, training_shards=2, producer_replicas=1
    )
    # Two shard bundles of 1 CPU each, and the inference / environment services need theirs: on a
    # 2-core host the default local Ray (2 CPUs) would leave the Inference Model Service pending.
    with ray_deployment(settings, num_cpus=4) as cluster:
        model_id = cluster.training.capabilities().model_id
        workloads = {}
        for i, (name, module) in enumerate((("sharded-oft", "oft_mlp"), ("sharded-flow", "flow_matching"))):
            spec = sft_spec(name, tmp_path / name, module=module, jobs=None, max_in_flight=1)
            write_dataset_for(spec, seed=i)
            cluster.master.create_tenant({**spec, "base_model": model_id})
            workloads[name] = cluster.master.submit_workload(name, jobs=2).workload_id
        for name, workload_id in workloads.items():
            final = cluster.wait_workload(workload_id, timeout_s=300)  # bounded calls to the Master
            assert final.state == "completed" and final.completed_jobs == 2, (name, final.state, final.error)
            assert final.version == 2 and final.registered_version is not None, final
        held = {
            i: set(ray.get(ray.get_actor(shard_actor_name(i), namespace=namespace).tenants.remote(), timeout=60))
            for i in range(2)
        }
        assert sorted(map(sorted, held.values())) == [["sharded-flow"], ["sharded-oft"]], held
