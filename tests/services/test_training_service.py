"""Training Model Service: one backbone for many tenants, tenant isolation, train_job contract,
export without backbone tensors, checkpoint resume, and an SFT loss that falls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from joynexus.actors import service_handle
from joynexus.artifacts import decode_tenant_payload
from joynexus.master.loops.actor_loop import ActorLoop
from joynexus.models.backbone import BackboneSource, ResidentBackbone
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import COMPLETED, FAILED
from joynexus.services.producers.sft import SFTProducer
from joynexus.services.training.service import TenantSlotError, TrainingModelService


def producer(world, name):
    tenant = world["tenants"][name]
    spec = tenant.spec.dataset
    return SFTProducer.from_dataset(
        tenant.backend_config,
        world["scheduler"],
        service_handle(TrainingQueue, world["queue"]),
        spec.root,
        spec.repo_id,
    )


def test_one_backbone_instance_serves_every_tenant(world):
    service = world["service"]
    before = ResidentBackbone.instances_created
    for i in range(5):
        cfg = world["tenants"]["alpha"].backend_config.model_copy(update={"tenant_id": f"extra{i}"})
        service.add_tenant(cfg)
    assert ResidentBackbone.instances_created == before
    assert len(service.tenants()) == 7
    assert service.backbone_info()["backbone_object_id"] == id(service.backbone)
    assert not any(p.requires_grad for p in service.backbone.model.parameters())


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_training_one_tenant_leaves_the_other_bit_identical(world):
    service, sched = world["service"], world["scheduler"]
    # Give beta some optimizer state first, so "identical" covers a non-empty state.
    producer(world, "beta").produce_once()
    ActorLoop(sched, service).step()
    beta_before = service.tenant_state("beta")
    alpha_before = service.tenant_state("alpha")
    for _ in range(2):
        producer(world, "alpha").produce_once()
        assert ActorLoop(sched, service).step().state == COMPLETED
    beta_after, alpha_after = service.tenant_state("beta"), service.tenant_state("alpha")
    assert _same(beta_before, beta_after)
    assert alpha_after["version"] == alpha_before["version"] + 2
    assert not _same(alpha_before["module"], alpha_after["module"])


def test_train_job_consumes_the_partition_and_bumps_only_that_version(world):
    service, sched, queue = world["service"], world["scheduler"], world["queue"]
    job = producer(world, "alpha").produce_once()
    assert queue.describe(job.partition_id)["num_samples"] == 16
    outcome = ActorLoop(sched, service).step()
    assert outcome.state == COMPLETED and outcome.job.job_id == job.job_id
    assert len(outcome.metrics["losses"]) == 2  # 16 samples / microbatch 8
    assert service.policy_version("alpha") == 1 and service.policy_version("beta") == 0
    assert not queue.has_partition(job.partition_id)
    assert sched.get(job.job_id).result["version"] == 1


def test_a_microbatch_with_another_tenants_samples_fails_the_job_only(world):
    service, sched, queue = world["service"], world["scheduler"], world["queue"]
    alpha_before = service.tenant_state("alpha")
    job = sched.reserve(
        tenant_id="alpha",
        task_type="sft",
        sample_count=8,
        metadata={"schema_signature": world["tenants"]["alpha"].schema_signature},
    )
    data = producer(world, "alpha")._partition_data(8)
    data["tenant_id"][3] = "beta"  # a foreign sample smuggled into alpha's partition
    queue.put(job.partition_id, data)
    sched.mark(job.job_id, "ready")
    outcome = ActorLoop(sched, service).step()
    assert outcome.state == FAILED and "mixes tenant_id" in outcome.reason
    assert sched.get(job.job_id).terminal_reason == outcome.reason
    assert not queue.has_partition(job.partition_id)
    assert _same(alpha_before, service.tenant_state("alpha"))  # the failed job changed nothing


def test_export_params_holds_only_the_tenants_module(world):
    service = world["service"]
    payload = service.export_params("beta")
    tensors, manifest = decode_tenant_payload(payload)
    module_state = service.tenant_state("beta")["module"]
    assert tensors.keys() == module_state.keys()
    assert all(torch.equal(tensors[k], module_state[k]) for k in tensors)
    backbone_numel = sum(p.numel() for p in service.backbone.model.parameters())
    assert sum(t.numel() for t in tensors.values()) < backbone_numel
    assert manifest.tenant_id == "beta" and manifest.schema_signature == world["tenants"]["beta"].schema_signature
    assert manifest.base_model_id == service.backbone.model_id
    with pytest.raises(KeyError):
        service.export_params("nobody")


def test_a_restarted_service_resumes_each_tenant_from_its_checkpoint(world):
    service, sched = world["service"], world["scheduler"]
    for name in ("alpha", "beta"):
        producer(world, name).produce_once()
        ActorLoop(sched, service).step()  # checkpoint_every_jobs=1: saved after the job
    saved = {name: service.tenant_state(name) for name in ("alpha", "beta")}
    restarted = TrainingModelService(BackboneSource(preset="tiny"), world["tmp"] / "ckpt", queue=world["queue"])
    for name, tenant in world["tenants"].items():
        info = restarted.add_tenant(tenant.backend_config)
        assert info["resumed"] is True and info["version"] == 1
        assert _same(saved[name], restarted.tenant_state(name))
    # The schema is checked on resume: a checkpoint never loads into a different interface.
    other = world["tenants"]["alpha"].backend_config.model_copy(update={"schema_signature": "vla1-different"})
    fresh = TrainingModelService(BackboneSource(preset="tiny"), world["tmp"] / "ckpt", queue=world["queue"])
    with pytest.raises(TenantSlotError, match="schema signature"):
        fresh.add_tenant(other)


def test_sft_loss_falls_on_a_learnable_dataset(world):
    service, sched = world["service"], world["scheduler"]
    losses = {"alpha": [], "beta": []}
    for _ in range(6):
        for name in losses:
            producer(world, name).produce_once()
        outcomes = ActorLoop(sched, service).step_all()  # both tenants' jobs, as one group
        assert len(outcomes) == 2
        for outcome in outcomes:
            assert outcome.state == COMPLETED, outcome.reason
            losses[outcome.job.tenant_id] += outcome.metrics["losses"]
    for name, series in losses.items():
        first, last = np.mean(series[:3]), np.mean(series[-3:])
        assert last < 0.7 * first, f"{name}: loss {first:.4f} -> {last:.4f}"
