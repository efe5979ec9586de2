"""Grouped training in the actor loop (paper 5.2, issue 25.1): several tenants' ready jobs leased as
one group (lease order, one job per tenant, admitted jobs only), trained through one shared forward
per round with results equal to one-at-a-time training, and one tenant's NaN failing that job alone."""

from __future__ import annotations

import pytest
import torch

from joynexus.actors import service_handle
from joynexus.core.store import ControlPlaneStore
from joynexus.core.tenants import BackendCapabilities
from joynexus.master.loops.actor_loop import ActorLoop, training_group_max_from_env
from joynexus.master.tenant_creator import TenantCreator
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import COMPLETED, FAILED, LEASED, READY, TrainingScheduler
from joynexus.services.producers.sft import SFTProducer
from joynexus.services.training.service import TrainingModelService
from tests.helpers import assert_trained_state_close, sft_spec, write_dataset_for

# Two tenants of one architecture (their losses batch into one computation) and one of another
# schema and module kind (its rows share the forward only).
SHAPES = {
    "arm-a": dict(cameras=("front",), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2),
    "arm-b": dict(cameras=("front",), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2),
    "flow-c": dict(
        cameras=("top",), image_size=(24, 40), state_dim=6, action_dim=5, action_chunk=4, module="flow_matching"
    ),
}


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grouped-datasets")
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        # 24 samples per job, microbatch 8 for arm-a, 12 for the others: jobs of 3 and 2 rounds.
        mb = 8 if name == "arm-a" else 12
        spec = sft_spec(name, root / name, jobs=4, samples_per_job=24, microbatch_size=mb, **shape)
        write_dataset_for(spec, seed=i)
        out[name] = spec
    return out


SERIAL = "-serial"  # a copy of each tenant (same seed, same dataset) trained one job at a time


@pytest.fixture(scope="module")
def world(tmp_path_factory, specs):
    """One Training Model Service with each tenant of SHAPES and its serial copy (module scope: the
    tests run in order, the NaN test last)."""
    path = tmp_path_factory.mktemp("grouped")
    queue = TrainingQueue()
    service = TrainingModelService(BackboneSource(preset="tiny"), path / "ckpt", queue=queue, num_threads=1)
    store = ControlPlaneStore(f"sqlite:///{path / 'control.db'}")
    scheduler = TrainingScheduler(store, release_partition=queue.clear)
    creator = TenantCreator(store, scheduler, BackendCapabilities.single(service.capabilities()))
    producers = {}
    for name, spec in specs.items():
        for tenant_id in (name, name + SERIAL):
            tenant = creator.create({**spec, "tenant": tenant_id, "base_model": service.backbone.model_id})
            service.add_tenant(tenant.backend_config)
            data = tenant.spec.dataset
            producers[tenant_id] = SFTProducer.from_dataset(
                tenant.backend_config, scheduler, service_handle(TrainingQueue, queue), data.root, data.repo_id
            )
    yield {"queue": queue, "service": service, "scheduler": scheduler, "producers": producers}
    store.dispose()


def _produce(world, suffix=""):
    return {name: world["producers"][name + suffix].produce_once() for name in SHAPES}


def test_several_tenants_train_as_one_group_equal_to_one_at_a_time(world):
    service, scheduler = world["service"], world["scheduler"]
    jobs = _produce(world)
    outcomes = ActorLoop(scheduler, service, group_max=8).step_all()
    assert [o.job.job_id for o in outcomes] == [jobs[n].job_id for n in SHAPES]  # lease (FIFO) order
    assert [o.state for o in outcomes] == [COMPLETED] * 3
    assert all(o.metrics["group_size"] == 3 for o in outcomes)
    assert all(not world["queue"].has_partition(j.partition_id) for j in jobs.values())

    _produce(world, SERIAL)
    one_at_a_time = ActorLoop(scheduler, service, group_max=1)
    serial_outcomes = [one_at_a_time.step() for _ in SHAPES]
    assert [o.state for o in serial_outcomes] == [COMPLETED] * 3
    assert one_at_a_time.step(wait_s=0.01) is None

    for name, g, s in zip(SHAPES, outcomes, serial_outcomes, strict=True):
        assert (g.job.tenant_id, s.job.tenant_id) == (name, name + SERIAL)
        assert g.metrics["version"] == s.metrics["version"] == 1  # one version per job, as train_job
        assert g.metrics["samples"] == s.metrics["samples"] == 24
        # one wrap-up for both paths: the same fields, the learning rate the steps ran at included
        assert set(g.metrics) - {"group_size", "group_seconds"} == set(s.metrics)
        assert g.metrics["learning_rate"] == s.metrics["learning_rate"]
        assert g.metrics["optimizer_steps"] == s.metrics["optimizer_steps"] == (3 if name == "arm-a" else 2)
        torch.testing.assert_close(torch.tensor(g.metrics["losses"]), torch.tensor(s.metrics["losses"]))
        g_state, s_state = service.tenant_state(name), service.tenant_state(name + SERIAL)
        # Two kernels round differently; AdamW turns rounding-noise gradients into +-lr steps.
        lr = service.slot_table.slot(name).config.learning_rate
        assert_trained_state_close(s_state, g_state, lr, g.metrics["optimizer_steps"], where=name)


def test_a_nan_tenant_fails_alone(world):
    service = world["service"]
    versions = {name: service.policy_version(name) for name in SHAPES}
    with torch.no_grad():  # arm-b's module now yields a NaN loss
        for param in service.slot_table.slot("arm-b").module.parameters():
            param.fill_(float("nan"))
    jobs = _produce(world)
    outcomes = {o.job.tenant_id: o for o in ActorLoop(world["scheduler"], service).step_all()}
    assert outcomes["arm-b"].state == FAILED and "non-finite" in outcomes["arm-b"].reason
    assert outcomes["arm-a"].state == outcomes["flow-c"].state == COMPLETED
    assert outcomes["arm-a"].metrics["group_size"] == 3
    assert service.policy_version("arm-a") == versions["arm-a"] + 1
    assert service.policy_version("flow-c") == versions["flow-c"] + 1
    assert service.policy_version("arm-b") == versions["arm-b"]  # no step applied
    for job in jobs.values():  # every terminal outcome clears its partition
        assert not world["queue"].has_partition(job.partition_id)
    assert world["scheduler"].get(jobs["arm-b"].job_id).state == FAILED


def _reserve_ready(sched, tenant, task="sft", **kw):
    job = sched.reserve(tenant_id=tenant, task_type=task, sample_count=4, metadata={"schema_signature": "s"}, **kw)
    assert job is not None
    return sched.mark(job.job_id, READY)


def test_companions_keep_lease_order_one_job_per_tenant_and_admission(tmp_path):
    sched = TrainingScheduler(ControlPlaneStore(f"sqlite:///{tmp_path / 'c.db'}"))
    for tenant in ("t0", "t1", "t2", "t3"):
        sched.register_policy(tenant, "sft", max_in_flight=2)
    sched.register_policy("urgent", "sft", priority=5)
    sched.register_policy("r0", "rl", max_policy_staleness=0)
    order = [_reserve_ready(sched, t) for t in ("t0", "t0", "t1", "t2", "t3")]
    rl = _reserve_ready(sched, "r0", task="rl", behavior_policy_version=0)
    other_base = sched.reserve(tenant_id="t1", task_type="sft", sample_count=4, metadata={"base_model": "other"})
    head = sched.lease_next(owner="actor")
    assert head.job_id == order[0].job_id
    # t0's second job waits for its first; two companions at most.
    companions = sched.lease_companions(head, 2, owner="actor")
    assert [j.job_id for j in companions] == [order[2].job_id, order[3].job_id]
    assert all(j.state == LEASED and j.lease_owner == "actor" for j in companions)
    # A higher-priority job comes first among companions, then FIFO; an RL job joins an SFT group
    # (one backbone forward per round; its staleness is the loop's check, its objective its own).
    urgent = _reserve_ready(sched, "urgent")
    assert [j.tenant_id for j in sched.lease_companions(head, 8, owner="actor")] == ["urgent", "t3", "r0"]
    assert sched.get(urgent.job_id).state == LEASED and sched.get(rl.job_id).state == LEASED
    # Only admitted jobs are leased: t0 is at its in-flight bound, leased or not.
    assert sched.reserve(tenant_id="t0", task_type="sft", sample_count=4) is None
    assert sched.get(order[1].job_id).state == READY
    # Another base model is another group.
    sched.mark(other_base.job_id, READY)
    assert sched.lease_companions(sched.lease_next(owner="actor"), 4, owner="actor") == []


def test_stale_rl_head_is_dropped_and_group_max_one_is_the_old_loop(tmp_path, monkeypatch):
    sched = TrainingScheduler(ControlPlaneStore(f"sqlite:///{tmp_path / 's.db'}"))
    sched.register_policy("r0", "rl", max_policy_staleness=0)
    sched.register_policy("t1", "sft")
    stale = _reserve_ready(sched, "r0", task="rl", behavior_policy_version=0)
    # Another base model: not the stale head's companion (this fake service trains nothing).
    sched.mark(
        sched.reserve(tenant_id="t1", task_type="sft", sample_count=4, metadata={"base_model": "b"}).job_id, READY
    )

    class Versions:  # the loop asks only versions before dropping a stale job
        def policy_version(self, tenant_id: str) -> int:
            return 2

    outcomes = ActorLoop(sched, Versions(), group_max=8).step_all()
    assert [(o.job.job_id, o.state, o.reason) for o in outcomes] == [(stale.job_id, "dropped", "policy_stale")]
    assert sched.get(stale.job_id).state == "dropped"

    monkeypatch.setenv("JOYNEXUS_TRAINING_GROUP_MAX", "1")
    assert training_group_max_from_env() == 1 and ActorLoop(sched, Versions()).group_max == 1
    monkeypatch.setenv("JOYNEXUS_TRAINING_GROUP_MAX", "0")
    with pytest.raises(ValueError, match="JOYNEXUS_TRAINING_GROUP_MAX must be an integer >= 1, got 0"):
        training_group_max_from_env()
    monkeypatch.delenv("JOYNEXUS_TRAINING_GROUP_MAX")
    assert training_group_max_from_env() == 8
