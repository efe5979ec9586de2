"""TrainingModelService.forward_backward / optim_step, the lower-layer composition primitives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from joynexus.models.backbone import BackboneSource
from joynexus.services.training.service import TenantSlotError, TrainingModelService
from tests.api.conftest import SHAPES, sample_batch
from tests.helpers import compiled_config, sft_spec


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return TrainingModelService(BackboneSource(preset="tiny"), tmp_path_factory.mktemp("ckpt"), num_threads=1)


def add(service, tenant_id: str, shape: str):
    overrides = {k: v for k, v in SHAPES[shape].items()}
    config = compiled_config(tenant_id, service.capabilities(), **overrides)
    service.add_tenant(config, resume=False)
    return config


def columns(config, shape: str, n: int = 4, seed: int = 0) -> dict:
    batch = sample_batch(sft_spec("x", "/unused", **SHAPES[shape]), n, seed)
    return {
        **batch,
        "action_is_pad": np.zeros((n, config.action_chunk), dtype=bool),
        "task": [""] * n,
        "tenant_id": [config.tenant_id] * n,
        "schema_signature": [config.schema_signature] * n,
    }


def params(service, tenant_id):
    return service.tenant_state(tenant_id)["module"]


@pytest.mark.parametrize("shape", ["arm", "flow"])
def test_forward_backward_then_optim_step_is_exactly_train_batch(service, shape):
    a, b = add(service, f"fb-a-{shape}", shape), add(service, f"fb-b-{shape}", shape)
    for seed in range(3):
        stepped = service.train_batch(a.tenant_id, columns(a, shape, seed=seed))
        fb = service.forward_backward(b.tenant_id, columns(b, shape, seed=seed))
        applied = service.optim_step(b.tenant_id)
        assert fb["loss"] == stepped["loss"] == applied["loss"]
        assert applied["version"] == stepped["version"] and applied["optimizer_steps"] == stepped["optimizer_steps"]
    for name, value in params(service, a.tenant_id).items():
        assert torch.equal(value, params(service, b.tenant_id)[name]), name


def test_gradients_accumulate_until_optim_step_and_the_version_moves_once(service):
    cfg = add(service, "fb-acc", "arm")
    before = params(service, cfg.tenant_id)
    first = service.forward_backward(cfg.tenant_id, columns(cfg, "arm", seed=1))
    second = service.forward_backward(cfg.tenant_id, columns(cfg, "arm", seed=2))
    assert (first["accumulated_microbatches"], second["accumulated_microbatches"]) == (1, 2)
    assert second["accumulated_samples"] == 8 and second["version"] == 0
    assert all(torch.equal(v, params(service, cfg.tenant_id)[k]) for k, v in before.items())  # no step yet
    step = service.optim_step(cfg.tenant_id)
    assert (step["version"], step["microbatches"], step["samples"]) == (1, 2, 8)
    assert step["loss"] == pytest.approx((first["loss"] + second["loss"]) / 2)
    with pytest.raises(TenantSlotError, match="no pending gradients"):
        service.optim_step(cfg.tenant_id)


def test_advantage_weighted_loss_weighs_each_samples_loss(service):
    cfg = add(service, "fb-adv", "arm")
    data = columns(cfg, "arm")
    plain = service.forward_backward(cfg.tenant_id, data)["loss"]
    service.slot_table.pending_gradients.clear()
    ones = service.forward_backward(cfg.tenant_id, {**data, "advantages": np.ones(4)}, loss="advantage_weighted")
    assert ones["loss"] == pytest.approx(plain, rel=1e-5)  # equal-size samples, no padding: same mean
    service.slot_table.pending_gradients.clear()
    flipped = service.forward_backward(cfg.tenant_id, {**data, "advantages": -np.ones(4)}, loss="advantage_weighted")
    assert flipped["loss"] == pytest.approx(-plain, rel=1e-5)
    with pytest.raises(ValueError, match="advantages"):
        service.forward_backward(cfg.tenant_id, {**data, "advantages": np.ones(3)}, loss="advantage_weighted")
    with pytest.raises(ValueError, match="loss"):
        service.forward_backward(cfg.tenant_id, data, loss="ppo")


def test_an_interleaved_train_batch_invalidates_pending_gradients(service):
    cfg = add(service, "fb-stale", "arm")
    service.forward_backward(cfg.tenant_id, columns(cfg, "arm", seed=1))
    service.train_batch(cfg.tenant_id, columns(cfg, "arm", seed=2))
    with pytest.raises(TenantSlotError, match="discarded"):
        service.optim_step(cfg.tenant_id)


def test_another_tenants_samples_are_refused_and_change_nothing(service):
    a, b = add(service, "fb-own", "arm"), add(service, "fb-other", "arm")
    data = columns(b, "arm")
    with pytest.raises(TenantSlotError, match="tenant_id"):
        service.forward_backward(a.tenant_id, data)
    assert a.tenant_id not in service.slot_table.pending_gradients
