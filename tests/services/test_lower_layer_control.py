"""The Training Model Service's lower-layer controls of issue 28: the off-policy objectives of
`forward_backward` (importance_sampling, ppo_clip) at known importance ratios, per-call AdamW
hyperparameters of `optim_step`, and `load_state` rolling a slot back to a kept version."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from joynexus.artifacts import CheckpointError
from joynexus.models.backbone import BackboneSource
from joynexus.services.training.service import TrainingModelService
from joynexus.services.training.state_control import VersionNotKept
from tests.helpers import assert_state_equal, compiled_config, random_microbatch

LN2 = math.log(2.0)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return TrainingModelService(BackboneSource(preset="tiny"), tmp_path_factory.mktemp("ckpt"), num_threads=1)


def add(service, tenant_id: str, *, stochastic: bool = False):
    config = compiled_config(tenant_id, service.capabilities())
    if stochastic:  # an RL tenant's Gaussian policy
        config = config.model_copy(update={"action_module": {**config.action_module, "stochastic": True}})
    service.add_tenant(config, resume=False)
    return config


def log_prob_of_one(service, config, batch) -> float:
    """log pi(action | obs) of a one-sample batch: policy_gradient's loss with advantage 1 is -log pi."""
    loss = service.forward_backward(config.tenant_id, {**batch, "advantages": [1.0]}, loss="policy_gradient")["loss"]
    service.slot_table.pending_gradients.pop(config.tenant_id)
    return -loss


def test_off_policy_losses_at_known_importance_ratios(service):
    cfg = add(service, "offp-values", stochastic=True)
    batch = random_microbatch(cfg, 1, seed=3)
    logp = log_prob_of_one(service, cfg, batch)

    def loss(name, advantage, sampling, **config):
        data = {**batch, "advantages": [advantage], "sampling_logprobs": [sampling]}
        return service.forward_backward(cfg.tenant_id, data, loss=name, loss_config=config or None)["loss"]

    assert loss("importance_sampling", 0.7, logp) == pytest.approx(-0.7, abs=1e-4)  # ratio 1
    assert loss("importance_sampling", 1.0, logp - LN2) == pytest.approx(-2.0, abs=1e-4)  # ratio 2
    assert loss("ppo_clip", 1.0, logp - LN2) == pytest.approx(-1.2, abs=1e-4)  # clipped at 1 + 0.2
    assert loss("ppo_clip", 1.0, logp - LN2, clip_eps=0.5) == pytest.approx(-1.5, abs=1e-4)
    assert loss("ppo_clip", -1.0, logp - LN2) == pytest.approx(2.0, abs=1e-4)  # min picks the unclipped term
    assert loss("ppo_clip", 1.0, logp + LN2) == pytest.approx(-0.5, abs=1e-4)  # ratio 1/2 inside the lower bound


def test_ppo_clip_passes_no_gradient_outside_the_clip_range(service):
    clipped, unclipped = add(service, "offp-clip-a", stochastic=True), add(service, "offp-clip-b", stochastic=True)
    batch = random_microbatch(clipped, 1, seed=5)
    logp = log_prob_of_one(service, clipped, batch)
    for cfg, advantage in ((clipped, 1.0), (unclipped, -1.0)):
        data = {**random_microbatch(cfg, 1, seed=5), "advantages": [advantage], "sampling_logprobs": [logp - LN2]}
        service.forward_backward(cfg.tenant_id, data, loss="ppo_clip")
    assert service.optim_step(clipped.tenant_id)["grad_norm"] == 0.0
    assert service.optim_step(unclipped.tenant_id)["grad_norm"] > 0.0


@pytest.mark.parametrize(
    ("loss", "extra", "config", "needle"),
    [
        ("ppo_clip", {}, {"clip_eps": 0.0}, "loss_config.clip_eps"),
        ("ppo_clip", {}, {"clip_eps": 1.0}, "loss_config.clip_eps"),
        ("ppo_clip", {}, {"clip_eps": "wide"}, "loss_config.clip_eps"),
        ("importance_sampling", {}, {"clip_eps": 0.2}, "loss_config.clip_eps: not a parameter"),
        ("ppo_clip", {"sampling_logprobs": None}, None, "sampling_logprobs"),
        ("ppo_clip", {"sampling_logprobs": [0.0, 0.0]}, None, "sampling_logprobs"),
        ("importance_sampling", {"sampling_logprobs": [0.0, float("nan"), 0.0]}, None, "sampling_logprobs"),
    ],
)
def test_bad_loss_inputs_are_refused_naming_the_field(service, loss, extra, config, needle):
    cfg = add(service, f"offp-bad-{loss}-{len(str(extra))}-{len(str(config))}", stochastic=True)
    data = {**random_microbatch(cfg, 3, seed=1), "advantages": [1.0, 1.0, 1.0], "sampling_logprobs": [0.0] * 3}
    with pytest.raises(ValueError, match=needle):
        service.forward_backward(cfg.tenant_id, {**data, **extra}, loss=loss, loss_config=config)
    assert cfg.tenant_id not in service.slot_table.pending_gradients


def test_off_policy_losses_need_a_stochastic_policy(service):
    cfg = add(service, "offp-deterministic")
    data = {**random_microbatch(cfg, 2, seed=1), "advantages": [1.0, 1.0], "sampling_logprobs": [0.0, 0.0]}
    with pytest.raises(ValueError, match="'ppo_clip' needs a stochastic policy"):
        service.forward_backward(cfg.tenant_id, data, loss="ppo_clip")


def test_optim_step_hyperparameters_last_one_step(service):
    a, b = add(service, "adamw-a"), add(service, "adamw-b")
    start = service.tenant_state(a.tenant_id)["module"]
    for cfg in (a, b):
        service.forward_backward(cfg.tenant_id, random_microbatch(cfg, 4, seed=2))
    plain = service.optim_step(a.tenant_id)
    tuned = service.optim_step(b.tenant_id, {"lr": 10 * a.learning_rate, "betas": [0.5, 0.9], "weight_decay": 0.0})
    assert plain["lr"] == a.learning_rate and plain["betas"] == [0.9, 0.999] and plain["grad_clip"] == 1.0
    assert tuned["lr"] == pytest.approx(10 * a.learning_rate) and tuned["betas"] == [0.5, 0.9]
    assert tuned["weight_decay"] == 0.0
    # AdamW's first step moves each weight by ~lr (m / sqrt(v) = sign of the gradient): 10x further.
    moved_a = sum((v - start[k]).abs().sum() for k, v in service.tenant_state(a.tenant_id)["module"].items())
    moved_b = sum((v - start[k]).abs().sum() for k, v in service.tenant_state(b.tenant_id)["module"].items())
    assert 8 < float(moved_b / moved_a) < 11
    groups = service.tenant_state(b.tenant_id)["optimizer"]["param_groups"]
    assert all(g["lr"] == b.learning_rate and tuple(g["betas"]) == (0.9, 0.999) for g in groups)  # back to its own


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"lr": 0.0}, "lr: 0.0 must be a number in \\(0, 1\\]"),
        ({"lr": 2.0}, "lr:"),
        ({"betas": [1.0, 0.9]}, "betas\\[0\\]"),
        ({"betas": [0.9]}, "betas:"),
        ({"weight_decay": -0.1}, "weight_decay:"),
        ({"grad_clip": 0}, "grad_clip:"),
        ({"momentum": 0.9}, "momentum: not an AdamW step parameter"),
    ],
)
def test_bad_optim_step_hyperparameters_keep_the_pending_gradients(service, params, needle):
    cfg = add(service, f"adamw-bad-{len(service.tenants())}")
    service.forward_backward(cfg.tenant_id, random_microbatch(cfg, 2, seed=1))
    with pytest.raises(ValueError, match=needle):
        service.optim_step(cfg.tenant_id, params)
    assert service.optim_step(cfg.tenant_id)["version"] == 1


def test_load_state_rolls_module_and_optimizer_back_and_training_repeats_exactly(service):
    cfg = add(service, "rollback")
    batches = [random_microbatch(cfg, 4, seed=s) for s in range(4)]
    for batch in batches[:2]:
        service.train_batch(cfg.tenant_id, batch)
    service.save([cfg.tenant_id])
    at_v2 = service.tenant_state(cfg.tenant_id)
    later = [service.train_batch(cfg.tenant_id, batch)["loss"] for batch in batches[2:]]
    service.forward_backward(cfg.tenant_id, batches[0])  # pending gradients the rollback drops
    loaded = service.load_state(cfg.tenant_id, 2)
    assert loaded == {
        "tenant_id": cfg.tenant_id, "version": 2, "previous_version": 4, "optimizer_restored": True,
        "optimizer_steps": 2, "discarded_microbatches": 1,
    }  # fmt: skip
    now = service.tenant_state(cfg.tenant_id)
    assert_state_equal(now["module"], at_v2["module"], "module")
    assert_state_equal(now["optimizer"]["state"], at_v2["optimizer"]["state"], "optimizer")
    again = [service.train_batch(cfg.tenant_id, batch) for batch in batches[2:]]
    assert [r["loss"] for r in again] == later  # same weights, same AdamW moments, same randomness
    assert [r["version"] for r in again] == [5, 6]  # numbers never reused


def test_a_checkpoint_without_optimizer_state_loads_with_fresh_adamw(service):
    cfg = add(service, "rollback-no-optim")
    service.train_batch(cfg.tenant_id, random_microbatch(cfg, 4, seed=0))
    service.save([cfg.tenant_id], include_optim=False)
    service.train_batch(cfg.tenant_id, random_microbatch(cfg, 4, seed=1))
    loaded = service.load_state(cfg.tenant_id, 1)
    assert loaded["optimizer_restored"] is False and loaded["version"] == 1
    assert service.tenant_state(cfg.tenant_id)["optimizer"]["state"] == {}


def test_a_failed_load_state_changes_nothing(service):
    cfg = add(service, "rollback-fail")
    service.train_batch(cfg.tenant_id, random_microbatch(cfg, 4, seed=0))
    service.forward_backward(cfg.tenant_id, random_microbatch(cfg, 4, seed=1))
    before = service.tenant_state(cfg.tenant_id)
    with pytest.raises(VersionNotKept, match="version: tenant 'rollback-fail' has no checkpoint of version 7"):
        service.load_state(cfg.tenant_id, 7)
    # A checkpoint whose tensors do not fit: torch copies the ones that do before it raises.
    state = {k: torch.zeros_like(v) for k, v in before["module"].items()}
    name = next(iter(state))
    state[name] = torch.zeros(3, 3)
    service.checkpoints.save_tenant(
        tenant_id=cfg.tenant_id, policy_version=9, schema_signature=cfg.schema_signature,
        base_model_id=cfg.base_model_id, module_kind=cfg.action_module["kind"], module_config=cfg.action_module,
        module_state=state, optimizer_state=None,
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="does not fit"):
        service.load_state(cfg.tenant_id, 9)
    after = service.tenant_state(cfg.tenant_id)
    assert after["version"] == before["version"] == 1
    assert_state_equal(after["module"], before["module"], "module")
    assert_state_equal(after["optimizer"]["state"], before["optimizer"]["state"], "optimizer")
    assert service.optim_step(cfg.tenant_id)["microbatches"] == 1  # the pending gradients survived
    assert np.isfinite(service.tenant_status(cfg.tenant_id)["last_loss"])
