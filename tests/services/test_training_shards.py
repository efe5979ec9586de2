"""Tenant-sharded Training Model Services (issue 45.1), in one process: two shards (each its own tiny
backbone) behind `TrainingShards`, one actor loop per shard. Each shard's loop leases only its own
tenants' jobs and both train; a tenant moves between shards bit-exact through the paging format and
keeps training there; a lost shard's tenants resume on the other from their last checkpoints, with
every version number issued once."""

from __future__ import annotations

import time

import pytest
import torch

from joynexus.actors import SerializedService, handle_of, service_handle
from joynexus.core.store import ControlPlaneStore
from joynexus.core.tenants import BackendCapabilities
from joynexus.master.loops.shard_loops import ShardLoops
from joynexus.master.tenant_creator import TenantCreator
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import COMPLETED, TrainingScheduler
from joynexus.services.producers.sft import SFTProducer
from joynexus.services.training.service import TrainingModelService
from joynexus.services.training.shard_router import NoShardHoldsTenant, TrainingShardRouter
from joynexus.services.training.shards import TrainingShards
from tests.helpers import sft_spec, write_dataset_for

# Two module kinds (two group keys), two tenants each: placement keeps each pair on one shard.
TENANTS = {"oft-a": "oft_mlp", "oft-b": "oft_mlp", "flow-a": "flow_matching", "flow-b": "flow_matching"}


@pytest.fixture
def world(tmp_path):
    queue = TrainingQueue()
    services = [
        TrainingModelService(BackboneSource(preset="tiny"), tmp_path / "ckpt", queue=queue, num_threads=1)
        for _ in range(2)
    ]
    # Each shard serialized like its actor (its loop, moves and the test call it from several threads).
    shards = TrainingShards([SerializedService(s) for s in services], group_size=2)
    store = ControlPlaneStore(f"sqlite:///{tmp_path / 'control.db'}")
    scheduler = TrainingScheduler(store, release_partition=queue.clear)
    creator = TenantCreator(store, scheduler, BackendCapabilities.single(services[0].capabilities()))
    producers = {}
    for i, (name, module) in enumerate(TENANTS.items()):
        spec = sft_spec(name, tmp_path / "data" / name, module=module, jobs=None, max_in_flight=1)
        spec["training"]["checkpoint_every_jobs"] = 2  # versions between checkpoints exist only in memory
        write_dataset_for(spec, seed=i)
        tenant = creator.create({**spec, "base_model": services[0].backbone.model_id})
        shards.add_tenant(tenant.backend_config)
        data = tenant.spec.dataset
        producers[name] = SFTProducer.from_dataset(
            tenant.backend_config, scheduler, service_handle(TrainingQueue, queue), data.root, data.repo_id
        )
    yield {"shards": shards, "services": services, "scheduler": scheduler, "producers": producers}
    store.dispose()


def _train_rounds(world, rounds: int, tenants=TENANTS) -> list:
    """`rounds` jobs of each tenant, produced one at a time (in-flight bound 1), trained by the shard loops."""
    scheduler, outcomes = world["scheduler"], []
    loops = ShardLoops(scheduler, world["shards"], group_max=2, on_outcome=outcomes.append)
    loops.start(wait_s=0.05)
    try:
        for _ in range(rounds):
            jobs = [world["producers"][name].produce_once() for name in tenants]
            assert all(jobs)
            deadline = time.monotonic() + 120
            while any(scheduler.get(j.job_id).state != COMPLETED for j in jobs):
                assert time.monotonic() < deadline, [scheduler.get(j.job_id).state for j in jobs]
                time.sleep(0.02)
    finally:
        loops.stop()
    return outcomes


def test_each_shard_leases_only_its_tenants_and_both_train(world):
    shards = world["shards"]
    placed = {name: shards.placement.shard_of(name) for name in TENANTS}
    assert placed["oft-a"] == placed["oft-b"] != placed["flow-a"] == placed["flow-b"]  # groups kept together
    outcomes = _train_rounds(world, 2)
    assert len(outcomes) == 8 and {o.state for o in outcomes} == {"completed"}
    for outcome in outcomes:  # the job was leased by the loop of its tenant's shard
        assert outcome.job.lease_owner == f"actor-0/shard-{placed[outcome.job.tenant_id]}"
    for index, service in enumerate(world["services"]):
        mine = sorted(n for n, s in placed.items() if s == index)
        assert service.tenants() == mine
        assert all(service.tenant_status(n)["jobs_completed"] == 2 for n in mine)
    # Placement measured the shards' training seconds (its load signal).
    assert all(s["load_s"] > 0 for s in shards.placement.summary())


def test_a_tenant_moves_bit_exact_through_the_paging_format_and_trains_on(world):
    shards, services = world["shards"], world["services"]
    _train_rounds(world, 1)
    source = shards.placement.shard_of("oft-a")
    before = services[source].tenant_state("oft-a")
    moved = shards.move_tenant("oft-a")
    assert (moved["from"], moved["to"]) == (source, 1 - source) and moved["bytes"] > 0
    assert "oft-a" not in services[source].tenants()
    after = services[1 - source].tenant_state("oft-a")
    assert after["version"] == before["version"] == 1
    for part in ("module", "optimizer"):
        _assert_same(before[part], after[part])
    _train_rounds(world, 1)
    assert shards.policy_version("oft-a") == 2  # routed to its new shard
    assert services[1 - source].tenant_status("oft-a")["optimizer_steps"] == 4  # 2 jobs x 2 microbatches


def test_a_lost_shards_tenants_resume_elsewhere_from_their_checkpoints_no_version_reissued(world):
    shards, services = world["shards"], world["services"]
    outcomes = _train_rounds(world, 3)  # checkpoints at v2 (every 2 jobs); v3 lives only in memory
    lost = shards.placement.shard_of("flow-a")
    survivor = 1 - lost
    resumed = shards.shard_lost(lost)
    assert sorted(r["tenant_id"] for r in resumed) == ["flow-a", "flow-b"]
    assert all(r["shard"] == survivor and r["resumed"] and r["version"] == 2 for r in resumed)
    assert sorted(services[survivor].tenants()) == sorted(TENANTS)
    outcomes += _train_rounds(world, 2)
    versions: dict[str, list[int]] = {}
    for outcome in outcomes:
        versions.setdefault(outcome.job.tenant_id, []).append(outcome.metrics["version"])
    for name in ("flow-a", "flow-b"):  # v3 was issued before the loss: the resumed tenant goes on at v4
        assert versions[name] == [1, 2, 3, 4, 5]
        assert services[survivor].tenant_status(name)["jobs_completed"] == 4  # the checkpoint's 2 + 2
    for name in ("oft-a", "oft-b"):
        assert versions[name] == [1, 2, 3, 4, 5]
    assert {o.job.lease_owner for o in outcomes[-4:]} == {f"actor-0/shard-{survivor}"}


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_a_deployment_with_two_shards_runs_workloads_through_the_master(tmp_path):
    """JOYNEXUS_TRAINING_SHARDS=2 in one process: the Master's actor-loop role steps a loop per
    shard; two tenants of different module kinds land on different shards and both workloads
    complete and publish."""
    from joynexus.master.deployment import Deployment
    from joynexus.master.workloads.manager import WorkloadManager
    from joynexus.settings import Settings

    dep = Deployment.in_process(Settings(data_dir=tmp_path / "data", torch_threads=1, training_shards=2))
    try:
        shards = handle_of(dep.training_service).target
        assert isinstance(shards, TrainingShards) and shards.shard_count == 2
        for i, (name, module) in enumerate((("dep-oft", "oft_mlp"), ("dep-flow", "flow_matching"))):
            spec = sft_spec(name, tmp_path / "data-sets" / name, module=module, jobs=2)
            write_dataset_for(spec, seed=i)
            dep.creator.create(spec)
        manager = WorkloadManager(dep).start()
        try:
            ids = [manager.submit(name, jobs=2).workload_id for name in ("dep-oft", "dep-flow")]
            final = {s.tenant_id: s for s in manager.wait_all(ids, timeout_s=300)}
        finally:
            manager.stop()
        assert {s.state for s in final.values()} == {"completed"}
        assert {s.version for s in final.values()} == {2}
        assert shards.placement.shard_of("dep-oft") != shards.placement.shard_of("dep-flow")
        assert dep.inference_service.versions("dep-oft") == [2]
        assert dep.training_service.heartbeat()["tenants"] == ["dep-flow", "dep-oft"]
    finally:
        dep.shutdown()


def test_a_producers_router_reaches_each_tenant_on_its_shard_and_follows_a_move(world):
    """What a producer replica holds of a sharded Training Model Service (issue 45): each tenant's
    export / policy version / checkpoint goes to the shard holding its slot, found by asking the
    shards (no placement, no Master), and again after the tenant moved."""
    shards, services = world["shards"], world["services"]
    _train_rounds(world, 1)
    router = TrainingShardRouter([SerializedService(s) for s in services])
    for name in TENANTS:
        assert router.holder_of(name) == shards.placement.shard_of(name)
        assert router.policy_version(name) == 1
        assert router.export_params(name) == shards.export_params(name)
    assert router.tenants() == sorted(TENANTS)
    source = shards.placement.shard_of("oft-a")
    shards.move_tenant("oft-a")
    assert router.policy_version("oft-a") == 1  # the remembered shard no longer holds it: asked again
    assert router.holder_of("oft-a") == 1 - source
    (manifest,) = router.save(["oft-a"])
    assert manifest["tenant_id"] == "oft-a" and manifest["policy_version"] == 1
    with pytest.raises(NoShardHoldsTenant, match="no training shard of 2 holds tenant 'ghost'"):
        router.policy_version("ghost")
