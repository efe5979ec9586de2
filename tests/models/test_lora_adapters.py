"""Tenant-private LoRA adapters on the one shared backbone (issue 15.1): the spec field is validated
and compiled; a forward mixing adapters (and samples without one) equals each tenant's own forward;
grouped training equals per-tenant training while the base weights never change; the adapter is
versioned, checkpointed and restored with the module; the Inference Model Service serves tenants
with different adapters in one forward, equal to serving each alone."""

from __future__ import annotations

import shutil
from typing import Any

import numpy as np
import pytest
import torch

from joynexus.artifacts import CheckpointError
from joynexus.core.tenants import BackendCapabilities, BaseModelCapabilities
from joynexus.master.tenant_creator import SpecCompiler
from joynexus.models.backbone import BackboneSource, ResidentBackbone
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.inference.service import InferenceModelService
from joynexus.services.training.service import TrainingModelService
from joynexus.spec import SpecError, parse_workload_spec
from tests.helpers import TINY_MODEL_ID, assert_trained_state_close, random_microbatch, sft_spec
from tests.helpers import assert_state_close as _close

ATOL = 1e-5
# tenant -> (observation shape, module kind, adapter or None): two adapters of different ranks and
# targets, on different schemas and module kinds, and one tenant without an adapter.
TENANTS: dict[str, tuple[dict[str, Any], str, dict[str, Any] | None]] = {
    "lora-a": (
        dict(cameras=("front", "wrist"), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2),
        "oft_mlp",
        {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]},
    ),
    "lora-b": (
        dict(cameras=("top",), image_size=(24, 40), state_dim=6, action_dim=5, action_chunk=4),
        "flow_matching",
        {"rank": 2, "alpha": 16.0, "target_modules": ["o_proj", "down_proj", "gate_proj"]},
    ),
    "plain": (
        dict(cameras=("front",), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2),
        "oft_mlp",
        None,
    ),
}
ROWS = {"lora-a": 5, "lora-b": 3, "plain": 4}
TASKS = ("pick up the cube", "", "push the t-shaped block into the goal region and then open the top drawer")
STEPS = 3
# One tiny preset per backbone family: the adapter mechanics are the same on each family's decoder.
FAMILY_PRESETS = pytest.mark.parametrize("preset", ["tiny", "qwen3-vl-tiny"])


def _spec(name: str, **overrides: Any) -> dict[str, Any]:
    shape, kind, adapter = TENANTS[name]
    spec = sft_spec(name, "/unused", base_model=TINY_MODEL_ID, module=kind, **shape)
    spec.update(task="eval", dataset=None)  # compile the interface only (no dataset to validate)
    if adapter is not None:
        spec["adapter"] = {"kind": "lora", **adapter}
    spec.update(overrides)
    return spec


def _compile(spec: dict[str, Any], caps: BaseModelCapabilities) -> Any:
    return SpecCompiler(BackendCapabilities.single(caps)).compile(parse_workload_spec(spec))


def _config(name: str, caps: BaseModelCapabilities, seed: int) -> Any:
    # Compiled from a real spec; trained like an SFT tenant (train_batch does not look at the task).
    return _compile(_spec(name), caps).model_copy(update={"task_type": "sft", "seed": seed})


def _batch(config: Any, rows: int, seed: int) -> dict[str, Any]:
    return random_microbatch(config, rows, seed, tuple(TASKS))


def _base_weights(backbone: ResidentBackbone) -> dict[str, torch.Tensor]:
    """The backbone's own weights under their original names (peft moves a wrapped layer's weight
    to `<layer>.base_layer.weight`)."""
    return {
        k.replace(".base_layer.", "."): p.detach().clone()
        for k, p in backbone.model.named_parameters()
        if ".lora_" not in k
    }


# ------------------------------------------------------------------------------------- the spec
def test_the_adapter_spec_is_validated_with_field_names_and_compiled():
    caps = BaseModelCapabilities(model_id=TINY_MODEL_ID, feature_dim=64, max_images=3, image_size=32)
    config = _compile(_spec("lora-a"), caps)
    assert config.adapter == {
        "kind": "lora",
        "rank": 4,
        "alpha": 8.0,
        "target_modules": ["q_proj", "v_proj"],
        "dropout": 0.0,
    }
    assert _compile(_spec("plain"), caps).adapter is None

    def problems(adapter: dict[str, Any], capabilities: BaseModelCapabilities = caps) -> dict[str, str]:
        with pytest.raises(SpecError) as info:
            _compile(_spec("lora-a", adapter=adapter), capabilities)
        return dict(info.value.problems)

    assert "adapter.rank" in problems({"rank": 0})
    assert "less than or equal to 64" in problems({"rank": 65})["adapter.rank"]
    bad_target = problems({"target_modules": ["q_proj", "fc9"]})["adapter.target_modules"]
    assert "['fc9']" in bad_target and "q_proj" in bad_target  # names the culprit and the choices
    assert "adapter.target_modules" in problems({"target_modules": []})
    assert "only 0.0" in problems({"dropout": 0.1})["adapter.dropout"]
    assert "adapter.kind" in problems({"kind": "ia3"})
    narrow = BaseModelCapabilities(model_id=TINY_MODEL_ID, feature_dim=16, max_images=3, image_size=32)
    assert "limit of 16" in problems({"rank": 32}, narrow)["adapter.rank"]


@FAMILY_PRESETS
def test_capabilities_list_the_text_models_linear_layers(preset):
    backbone = BackboneSource(preset=preset).build()
    caps = BaseModelCapabilities.of_backbone(backbone)
    assert caps.lora_target_modules == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


# ---------------------------------------------------------------------------- the mixed forward
@FAMILY_PRESETS
def test_a_mixed_adapter_forward_equals_each_tenants_own_forward(preset):
    backbone = BackboneSource(preset=preset).build()
    rng = torch.Generator().manual_seed(0)
    images = [[torch.rand(3, 32, 32, generator=rng) for _ in range(1 + i % 2)] for i in range(6)]
    texts = [TASKS[i % len(TASKS)] for i in range(6)]
    before = backbone.encode(images, texts)
    frozen = _base_weights(backbone)
    for key, config in (("a", TENANTS["lora-a"][2]), ("b.1", TENANTS["lora-b"][2])):
        backbone.adapters.add(key, config, seed=1, trainable=True)
        # Fresh adapters are a no-op (B = 0): give them real weights.
        state = backbone.adapters.state_dict(key)
        backbone.adapters.load_state_dict(key, {k: 0.2 * torch.randn(v.shape, generator=rng) for k, v in state.items()})
    keys = ["a", None, "b.1", "a", "b.1", None]
    mixed = backbone.encode(images, texts, keys)
    for i, key in enumerate(keys):
        alone = backbone.encode(images[i : i + 1], texts[i : i + 1], [key])
        row = mixed.select([i]).trimmed()
        # float32 over several layers: a batch of 6 and a batch of 1 take different matmul kernels,
        # which round differently (up to 7e-5 on |values| ~3 on some CPUs).
        assert torch.allclose(row.tokens, alone.tokens, rtol=1e-4, atol=1e-4), (i, key)
        base_row = before.select([i]).trimmed()
        if key is None:  # a sample without an adapter is exactly what it was before adapters existed
            assert torch.equal(row.tokens, base_row.tokens) and torch.equal(row.pooled, base_row.pooled)
        else:
            assert not torch.allclose(row.tokens, base_row.tokens, atol=1e-3), (i, key)
    # An unrouted forward (every sample without an adapter) is the base model too.
    assert torch.equal(backbone.encode(images, texts).tokens, before.tokens)

    # With autograd: the same values, and a tenant's loss reaches only its own adapter.
    traced = backbone.encode(images, texts, keys, grad=True)
    assert torch.allclose(traced.tokens, mixed.tokens, rtol=0, atol=1e-6)
    loss = traced.select([0, 3]).pooled.square().sum()  # the rows of adapter "a"
    own, other = backbone.adapters.parameters("a"), backbone.adapters.parameters("b.1")
    grads = torch.autograd.grad(loss, own + other, allow_unused=True)
    assert all(g is not None and g.abs().sum() > 0 for g in grads[: len(own)])
    assert all(g is None or not g.any() for g in grads[len(own) :])
    assert not any(p.requires_grad for k, p in backbone.model.named_parameters() if ".lora_" not in k)

    with pytest.raises(KeyError, match="no LoRA adapter"):
        backbone.encode(images[:1], texts[:1], ["nobody"])
    assert backbone.adapters.remove("a") and backbone.adapters.remove("b.1")
    assert torch.equal(backbone.encode(images, texts).tokens, before.tokens)
    _close(frozen, _base_weights(backbone), 0.0, "base weights")


@FAMILY_PRESETS
def test_an_adapter_refuses_targets_and_tensors_that_do_not_fit(preset):
    backbone = BackboneSource(preset=preset).build()
    with pytest.raises(ValueError, match="not Linear layers"):
        backbone.adapters.add("x", {"rank": 2, "target_modules": ["fc9"]})
    backbone.adapters.add("x", {"rank": 2, "target_modules": ["q_proj"]})
    state = backbone.adapters.state_dict("x")
    key = next(iter(state))
    with pytest.raises(ValueError, match="expected shape"):
        backbone.adapters.load_state_dict("x", {**state, key: torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="missing"):
        backbone.adapters.load_state_dict("x", {k: v for k, v in state.items() if k != key})
    with pytest.raises(ValueError, match="finite"):
        backbone.adapters.load_state_dict("x", {**state, key: torch.full_like(state[key], float("nan"))})
    _close(state, backbone.adapters.state_dict("x"), 0.0, "unchanged after refusals")


# ------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two services with identical slots for TENANTS: one trained per tenant (train_batch), one in
    groups (train_group: ONE shared forward per step), STEPS steps each. `final` holds both
    services' tenant states right after (later tests go on using the grouped service)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lora")
    services = {
        mode: TrainingModelService(BackboneSource(preset="tiny"), root / mode) for mode in ("serial", "grouped")
    }
    caps = services["serial"].capabilities()
    configs = {name: _config(name, caps, seed) for seed, name in enumerate(TENANTS, start=1)}
    for service in services.values():
        for config in configs.values():
            service.add_tenant(config)
    initial = {name: services["grouped"].tenant_state(name) for name in TENANTS}
    base_before = _base_weights(services["grouped"].backbone)
    records = []
    for step in range(STEPS):
        names = list(TENANTS) if step % 2 == 0 else list(reversed(TENANTS))  # order must not matter
        batches = [(name, _batch(configs[name], ROWS[name], 10 * step + i)) for i, name in enumerate(names)]
        expected = {name: services["serial"].train_batch(name, data) for name, data in batches}
        records.append((expected, services["grouped"].train_group(batches)))
    final = {mode: {name: service.tenant_state(name) for name in TENANTS} for mode, service in services.items()}
    return {
        **services,
        "root": root,
        "configs": configs,
        "initial": initial,
        "final": final,
        "base_before": base_before,
        "records": records,
    }


def test_grouped_training_with_adapters_equals_per_tenant_training(trained):
    for expected, results in trained["records"]:
        for result in results:
            want = expected[result["tenant_id"]]
            assert "error" not in result, result
            assert result["version"] == want["version"]
            assert result["optimizer_steps"] == want["optimizer_steps"]
            assert result["loss"] == pytest.approx(want["loss"], abs=ATOL)
    for name in TENANTS:
        state = trained["final"]["grouped"][name]
        assert ("adapter" in state) == (TENANTS[name][2] is not None)
        lr = trained["configs"][name].learning_rate
        assert_trained_state_close(trained["final"]["serial"][name], state, lr, STEPS, where=name)
        assert state["version"] == STEPS


def test_training_changes_the_adapters_and_never_the_base_weights(trained):
    service = trained["grouped"]
    for name in ("lora-a", "lora-b"):
        before, after = trained["initial"][name]["adapter"], trained["final"]["grouped"][name]["adapter"]
        assert before.keys() == after.keys()
        # lora_B starts at zero (a no-op adapter) and moves from the first step; lora_A from the second.
        for kind in ("lora_A", "lora_B"):
            keys = [k for k in after if f".{kind}." in k]
            assert keys and all(not torch.equal(before[k], after[k]) for k in keys), (name, kind)
        assert any(float(v.abs().max()) > 0 for k, v in after.items() if ".lora_B." in k)
    _close(trained["base_before"], _base_weights(service.backbone), 0.0, "base weights")
    fresh = ResidentBackbone.build_tiny()  # the shared weights are still the preset's, bit for bit
    _close(_base_weights(fresh), _base_weights(service.backbone), 0.0, "base vs fresh")


def test_checkpoint_restore_round_trips_the_adapter(trained, tmp_path):
    grouped = trained["grouped"]
    manifests = {m["tenant_id"]: m for m in grouped.save()}
    assert manifests["lora-a"]["extra"]["adapter"]["rank"] == 4
    assert "adapter" not in manifests["plain"]["extra"]
    root = tmp_path / "checkpoints"
    shutil.copytree(trained["root"] / "grouped", root)  # a restarted service on the same files
    restored = TrainingModelService(BackboneSource(preset="tiny"), root)
    for name, config in trained["configs"].items():
        assert restored.add_tenant(config)["resumed"] is True
        _close(grouped.tenant_state(name), restored.tenant_state(name), 0.0, name)
        # The restored version exports the same bytes as before the "restart".
        assert restored.export_params(name) == grouped.export_params(name)
    # Both continue identically: the optimizer state of the adapter came back too.
    data = _batch(trained["configs"]["lora-a"], 4, 99)
    assert restored.train_batch("lora-a", data)["loss"] == pytest.approx(grouped.train_batch("lora-a", data)["loss"])
    _close(grouped.tenant_state("lora-a"), restored.tenant_state("lora-a"), ATOL, "after a step")

    # A checkpoint refuses a tenant whose adapter differs from the one it was trained with.
    other = TrainingModelService(BackboneSource(preset="tiny"), root)
    wrong = trained["configs"]["lora-a"].model_copy(
        update={"adapter": {**trained["configs"]["lora-a"].adapter, "alpha": 4.0}}
    )
    with pytest.raises(CheckpointError, match="adapter"):
        other.add_tenant(wrong)
    assert "lora-a" not in other.tenants() and not other.backbone.has_adapters()  # nothing left behind
    no_adapter = trained["configs"]["lora-a"].model_copy(update={"adapter": None})
    with pytest.raises(CheckpointError, match="no adapter"):
        other.add_tenant(no_adapter)


def test_removing_a_tenant_takes_its_adapter_off_the_backbone(tmp_path):
    service = TrainingModelService(BackboneSource(preset="tiny"), tmp_path)
    config = _config("lora-a", service.capabilities(), seed=3)
    service.add_tenant(config)
    assert service.backbone.adapters.keys() == ["lora-a"]
    assert service.remove_tenant("lora-a")
    assert not service.backbone.has_adapters()


# ------------------------------------------------------------------------------------ inference
def _observations(config: Any, rows: int, seed: int) -> list[Observation]:
    data = _batch(config, rows, seed)
    return [
        Observation(images=tuple(data["images"][i]), state=data["state"][i], instruction=data["task"][i])
        for i in range(rows)
    ]


def _serve_now(service: InferenceModelService) -> None:
    service.execute(service.queue.collect_prefix(service.max_batch_size, 0.0))


def test_inference_serves_different_adapters_in_one_forward_equal_to_each_alone(trained):
    trainer = trained["grouped"]
    service = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False, max_chunk_samples=None)
    try:
        for name in TENANTS:
            service.load_weights(trainer.export_params(name))
        assert len(service.backbone.adapters) == 2  # one per adapter tenant's served version
        requests = {name: (_observations(trained["configs"][name], ROWS[name], 7), [5, 6, 7, 8, 9]) for name in TENANTS}
        alone = {}
        for name, (obs, seeds) in requests.items():
            future = service.submit(name, obs, seeds=seeds[: len(obs)])
            _serve_now(service)
            alone[name] = future.result()
            assert alone[name]["batch_samples"] == len(obs)
        futures = {name: service.submit(name, obs, seeds=seeds[: len(obs)]) for name, (obs, seeds) in requests.items()}
        _serve_now(service)  # every tenant in ONE shared forward
        for name, future in futures.items():
            grouped = future.result()
            assert grouped["batch_samples"] == sum(ROWS.values())
            np.testing.assert_allclose(grouped["actions"], alone[name]["actions"], rtol=0, atol=ATOL)
        parts = service.stats()["recent_batches"][-1]["parts"]
        assert sorted(p["tenant_id"] for p in parts) == sorted(TENANTS)

        # What was served is the trained tenant's policy: its adapter's features, its module.
        name = "lora-a"
        obs = requests[name][0]
        images = [[torch.as_tensor(img) for img in o.images] for o in obs]
        texts = [o.instruction for o in obs]  # served as given (blank included)
        module = trainer._slot(name).module
        state = torch.stack([torch.as_tensor(o.state) for o in obs])
        expected = module.predict(trainer.backbone.encode(images, texts, [name] * len(obs)), state)
        served = futures[name].result()["actions"]
        np.testing.assert_allclose(served, expected.numpy(), rtol=0, atol=ATOL)
        without = module.predict(trainer.backbone.encode(images, texts), state)
        assert not np.allclose(served, without.numpy(), atol=1e-4)  # the adapter is really applied
    finally:
        service.close()


def test_an_evicted_version_keeps_serving_its_pinned_requests(trained):
    trainer = trained["grouped"]
    config = trained["configs"]["lora-a"]
    service = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False, max_versions_per_tenant=1)
    try:
        service.load_weights(trainer.export_params("lora-a"))
        old_version = trainer.policy_version("lora-a")
        obs = _observations(config, 2, 3)
        pinned = service.submit("lora-a", obs, seeds=[1, 2])
        _serve_now(service)
        reference = pinned.result()["actions"]
        pinned = service.submit("lora-a", obs, seeds=[1, 2])  # queued at the old version ...
        trainer.train_batch("lora-a", _batch(config, 3, 123))
        service.load_weights(trainer.export_params("lora-a"))  # ... which this evicts
        assert service.versions("lora-a") == [old_version + 1]
        assert len(service.backbone.adapters) == 1
        _serve_now(service)
        result = pinned.result()
        assert result["policy_version"] == old_version
        np.testing.assert_allclose(result["actions"], reference, rtol=0, atol=ATOL)
        assert len(service.backbone.adapters) == 1  # the re-installed old adapter left again
        assert service.remove_tenant("lora-a") == 1 and not service.backbone.has_adapters()
    finally:
        service.close()


def test_a_payload_whose_adapter_does_not_fit_is_refused(trained):
    from joynexus.artifacts import decode_tenant_payload, encode_tenant_payload
    from joynexus.services.inference.service import InferenceError

    tensors, manifest = decode_tenant_payload(trained["grouped"].export_params("lora-a"))
    service = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False)
    try:
        cut = {k: v for k, v in tensors.items() if ".v_proj." not in k}
        with pytest.raises(InferenceError, match="does not fit"):
            service.load_weights(encode_tenant_payload(cut, manifest))
        no_config = type(manifest)(**{**manifest.__dict__, "extra": {}})
        with pytest.raises(InferenceError, match="names no adapter"):
            service.load_weights(encode_tenant_payload(tensors, no_config))
        assert service.tenants() == [] and not service.backbone.has_adapters()
    finally:
        service.close()


def test_forward_backward_then_optim_step_trains_the_adapter_like_train_batch(tmp_path):
    services = [TrainingModelService(BackboneSource(preset="tiny"), tmp_path / str(i)) for i in range(2)]
    config = _config("lora-b", services[0].capabilities(), seed=4)
    for service in services:
        service.add_tenant(config)
    data = _batch(config, 4, 5)
    services[0].train_batch("lora-b", data)
    services[1].forward_backward("lora-b", data)
    services[1].optim_step("lora-b")
    states = [service.tenant_state("lora-b") for service in services]
    _close(states[0], states[1], 0.0, "primitives vs train_batch")
    assert any(float(v.abs().max()) > 0 for k, v in states[1]["adapter"].items() if ".lora_B." in k)


def test_ppo_trains_an_rl_tenants_adapter(tmp_path):
    """PPO reuses features across epochs for tenants without an adapter; an adapter tenant's
    features change with every step, so they are recomputed (with gradients) each microbatch."""
    from joynexus.scheduling.training_queue import TrainingQueue
    from joynexus.scheduling.training_scheduler import TrainingJob
    from joynexus.spec import RLSpec

    queue = TrainingQueue()
    service = TrainingModelService(BackboneSource(preset="tiny"), tmp_path, queue=queue)
    base = _config("lora-a", service.capabilities(), seed=6)
    config = base.model_copy(
        update={
            "task_type": "rl",
            "action_module": {**base.action_module, "stochastic": True, "value_head": True},
            "rl": RLSpec(ppo_epochs=2),
            "microbatch_size": 4,
        }
    )
    service.add_tenant(config)
    before = service.tenant_state("lora-a")
    rows = 8
    data = _batch(config, rows, 3)
    rng = np.random.default_rng(4)
    data.update(
        log_prob=rng.normal(-5, 1, rows).astype(np.float32),
        advantage=rng.standard_normal(rows).astype(np.float32),
        **{"return": rng.standard_normal(rows).astype(np.float32)},
    )
    queue.put("p-rl", data)
    job = TrainingJob(
        job_id="job-rl", policy_key="lora-a/rl", tenant_id="lora-a", task_type="rl", partition_id="p-rl",
        sample_count=rows, domain="vla", metadata={"schema_signature": config.schema_signature}, priority=0,
        created_seq=1, ready_seq=1, behavior_policy_version=0, max_policy_staleness=None,
        producer_role="rollout", consumer_role="actor", state="leased", lease_owner="test", terminal_reason=None,
    )  # fmt: skip
    result = service.train_job(job)
    assert result["version"] == 1 and len(result["losses"]) == 4  # 2 epochs x 2 microbatches
    after = service.tenant_state("lora-a")
    assert all(not torch.equal(before["adapter"][k], after["adapter"][k]) for k in after["adapter"] if ".lora_B." in k)
