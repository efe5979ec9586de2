"""Batched heterogeneous module execution (issue 14): same-architecture tenants' modules run as one
computation over stacked parameters, equal to the per-tenant path within float tolerance -- the
kernels alone, inference through the Inference Model Service with mixed architectures in one batch,
and grouped training (losses, gradients, parameters after the step, a poisoned tenant isolated)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import joynexus.services.inference.decode as inference_module
import joynexus.services.training.grouped as grouped_training_module
from joynexus.models import module_batching as mb
from joynexus.models.action_modules import (
    ACTION_MODULES,
    ActionModule,
    ActionModuleConfig,
    available_action_modules,
    build_action_module,
)
from joynexus.models.backbone import BackboneFeatures, BackboneSource
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.inference.service import InferenceModelService
from joynexus.services.training.service import TrainingModelService
from tests.helpers import assert_trained_state_close, compiled_config, padded_microbatch

ATOL = 1e-5
# The library's registered kinds (a test file may register its own: those are left out, so the
# parameters stay the same whichever test files were collected).
# Kinds over token features (a layer-wise expert, smolvla, reads a LayerPrefix: tests/models/test_smolvla_parity.py).
KINDS = [
    k
    for k in available_action_modules()
    if ACTION_MODULES[k].__module__.startswith("joynexus.") and ACTION_MODULES[k].feature_form == "tokens"
]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ kernels
def _config(kind: str, **overrides: Any) -> ActionModuleConfig:
    fields: dict[str, Any] = dict(
        kind=kind, feature_dim=64, state_dim=5, action_dim=3, action_chunk=4, size="tiny", value_head=True
    )
    fields["stochastic"] = kind == "oft_mlp"
    fields.update(overrides)
    return ActionModuleConfig(**fields)


def _modules(config: ActionModuleConfig, count: int) -> list[ActionModule]:
    modules = []
    for seed in range(count):
        torch.manual_seed(seed)
        modules.append(build_action_module(config))
    return modules


def _features(rows: int, length: int, seed: int) -> BackboneFeatures:
    """Rows with different real lengths (as a shared forward over mixed prompts gives)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, length + 1, (rows,), generator=g)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    tokens = torch.randn(rows, length, 64, generator=g) * mask.unsqueeze(-1)
    return BackboneFeatures(tokens, mask, tokens.sum(1) / mask.sum(1, keepdim=True))


COUNTS = [2, 3, 1]  # unequal on purpose: padding rows must never show
# (state_dim, action_dim, chunk) per member: one group with padded dims. With a value head the
# state dim is part of the architecture (its LayerNorm spans features + state), so it is shared.
DIMS = {True: [(5, 3, 4), (5, 5, 2), (5, 2, 6)], False: [(5, 3, 4), (2, 5, 2), (7, 2, 6)]}


def _group_case(kind: str, value_head: bool = True, normalize_state: bool = False):
    modules = []
    for seed, (state, action, chunk) in enumerate(DIMS[value_head]):
        torch.manual_seed(seed)
        cfg = _config(
            kind, state_dim=state, action_dim=action, action_chunk=chunk, value_head=value_head,
            normalize_state=normalize_state,
        )  # fmt: skip
        module = build_action_module(cfg)
        # Each member's own statistics (a different scale and offset per member), as RL leaves them.
        module.observe_states(torch.randn(16, state, generator=torch.Generator().manual_seed(seed)) * (seed + 2) + seed)
        modules.append(module)
    features = _features(sum(COUNTS), 11, seed=1)
    offsets = np.cumsum([0, *COUNTS])
    rows = [list(range(offsets[i], offsets[i + 1])) for i in range(len(COUNTS))]
    g = torch.Generator().manual_seed(2)
    states = [torch.randn(n, m.config.state_dim, generator=g) for n, m in zip(COUNTS, modules, strict=True)]
    return modules, features, rows, states


def _chunk_shape(modules) -> tuple[int, int]:
    return max(m.config.action_chunk for m in modules), max(m.config.action_dim for m in modules)


@pytest.mark.parametrize("normalize_state", [False, True], ids=["raw-state", "normalized-state"])
@pytest.mark.parametrize("value_head", [True, False], ids=["value-head", "ragged-state"])
@pytest.mark.parametrize("kind", KINDS)
def test_batched_predict_and_value_equal_each_module_alone(kind, value_head, normalize_state):
    modules, features, rows, states = _group_case(kind, value_head, normalize_state)
    assert len(mb.group_by_architecture(modules)) == 1  # different dims, one group
    for module in modules:
        module.eval()
    inputs = mb.gather_inputs(features, rows, states)
    params = mb.StackedParameterCache().get(modules)
    noise = None
    if kind == "flow_matching":  # per-observation seeded draws, as the service makes them
        noise = mb.pad_rows(
            [
                torch.cat([m.draw_noise(1, torch.Generator().manual_seed(100 * g + i)) for i in range(len(r))])
                for g, (m, r) in enumerate(zip(modules, rows, strict=True))
            ],
            inputs.rows,
            _chunk_shape(modules),
        )
    actions = mb.unpad_actions(modules, inputs, mb.group_predict(modules, params, inputs, noise))
    values = inputs.unpad(mb.group_value(modules, params, inputs)) if value_head else None
    for g, (module, own_rows, state) in enumerate(zip(modules, rows, states, strict=True)):
        own = features.select(own_rows).trimmed()
        if kind == "flow_matching":
            expected = torch.cat(
                [
                    module.predict(own.select([i]), state[i : i + 1], torch.Generator().manual_seed(100 * g + i))
                    for i in range(len(own_rows))
                ]
            )
        else:
            expected = module.predict(own, state)
        assert actions[g].shape == expected.shape
        torch.testing.assert_close(actions[g], expected, atol=ATOL, rtol=1e-4)
        if value_head:
            torch.testing.assert_close(values[g], module.value(own, state), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("state_dim,size", [(0, "tiny"), (3, "small")], ids=["no-state", "deeper"])
def test_batched_flow_expert_without_a_state_token_or_deeper_equals_each_module_alone(state_dim, size):
    """The flow kernel's state-token handling (none: no token to drop) and more blocks, from
    parameters stacked without the cache (the kernel derives its folded constants itself)."""
    modules = []
    for seed, chunk in enumerate([3, 5]):
        torch.manual_seed(seed)
        cfg = _config("flow_matching", state_dim=state_dim, action_chunk=chunk, size=size, value_head=False)
        modules.append(build_action_module(cfg).eval())
    features = _features(3, 9, seed=4)
    rows = [[0, 1], [2]]
    states = [torch.randn(len(r), state_dim) for r in rows]
    inputs = mb.gather_inputs(features, rows, states)
    noise = mb.pad_rows(
        [
            m.draw_noise(len(r), torch.Generator().manual_seed(g))
            for g, (m, r) in enumerate(zip(modules, rows, strict=True))
        ],
        inputs.rows,
        _chunk_shape(modules),
    )
    actions = mb.unpad_actions(modules, inputs, mb.group_predict(modules, mb.stack_parameters(modules), inputs, noise))
    for g, (module, own_rows, state) in enumerate(zip(modules, rows, states, strict=True)):
        expected = module.predict(features.select(own_rows).trimmed(), state, torch.Generator().manual_seed(g))
        torch.testing.assert_close(actions[g], expected, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("normalize_state", [False, True], ids=["raw-state", "normalized-state"])
def test_batched_gaussian_policy_equals_each_modules_distribution(normalize_state):
    modules, features, rows, states = _group_case("oft_mlp", normalize_state=normalize_state)
    with torch.no_grad():
        for i, module in enumerate(modules):
            module.log_std.fill_(-0.3 * (i + 1))  # distinct stds per tenant
    inputs = mb.gather_inputs(features, rows, states)
    params = mb.stack_parameters(modules)
    mean = mb.group_policy_mean(modules, params, inputs)
    std = mb.group_policy_std(modules, params)
    noise = torch.randn(mean.shape, generator=torch.Generator().manual_seed(3))
    actions = mean + std * noise
    own_actions = mb.unpad_actions(modules, inputs, actions)
    log_probs = inputs.unpad(mb.group_log_prob(modules, mean, std, actions))
    for g, (module, own_rows, state) in enumerate(zip(modules, rows, states, strict=True)):
        dist = module.action_distribution(features.select(own_rows).trimmed(), state)
        cfg = module.config
        expected_actions = dist.mean + dist.stddev * noise[g, : len(own_rows), : cfg.action_chunk, : cfg.action_dim]
        torch.testing.assert_close(own_actions[g], expected_actions, atol=ATOL, rtol=1e-4)
        expected = dist.log_prob(expected_actions).sum(dim=(-1, -2))
        torch.testing.assert_close(log_probs[g], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_batched_loss_gives_each_module_its_own_loss_and_gradients(kind):
    modules, features, rows, states = _group_case(kind, value_head=False)
    g = torch.Generator().manual_seed(4)
    shapes = [(n, m.config.action_chunk, m.config.action_dim) for n, m in zip(COUNTS, modules, strict=True)]
    actions = [torch.randn(shape, generator=g) for shape in shapes]
    pads = [torch.rand(shape[:2], generator=g) < 0.3 for shape in shapes]
    inputs = mb.gather_inputs(features, rows, states)
    gens = [torch.Generator().manual_seed(50 + i) for i in range(len(modules))]
    losses = mb.group_loss(modules, mb.stack_parameters(modules), inputs, actions, pads, gens)
    losses.sum().backward()
    batched_grads = [{n: p.grad for n, p in m.named_parameters()} for m in modules]
    for i, module in enumerate(modules):
        module.zero_grad(set_to_none=True)
        own = features.select(rows[i]).trimmed()
        loss = module.loss(own, states[i], actions[i], pads[i], generator=torch.Generator().manual_seed(50 + i))
        loss.backward()
        assert abs(loss.item() - losses[i].item()) < ATOL
        for name, param in module.named_parameters():
            got = batched_grads[i][name]
            if param.grad is None:  # unused by the loss (log_std) in both paths
                assert got is None, name
            else:
                torch.testing.assert_close(got, param.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_modules_group_by_architecture_and_patched_modules_run_alone(monkeypatch):
    a, b = _modules(_config("oft_mlp"), 2)
    wider = build_action_module(_config("oft_mlp", action_dim=6, action_chunk=2))  # padded into a's group
    other_state = build_action_module(_config("oft_mlp", state_dim=2))  # value head over another state dim
    flow = build_action_module(_config("flow_matching"))
    fewer_steps = build_action_module(_config("flow_matching", num_inference_steps=4))
    groups = mb.group_by_architecture([a, flow, b, wider, fewer_steps, other_state])
    assert groups == [[0, 2, 3], [1], [4], [5]]
    assert mb.group_by_architecture([a, b, wider], pad_dims=False) == [[0, 1], [2]]  # identical configs only
    monkeypatch.setattr(b, "predict", lambda *args, **kwargs: None)
    assert mb.architecture_key(b) is None and mb.group_by_architecture([a, b]) == [[0], [1]]
    handle = a.action_out.register_forward_hook(lambda *args: None)
    assert mb.architecture_key(a) is None
    handle.remove()
    assert mb.architecture_key(a) == mb.architecture_key(wider) is not None
    with pytest.raises(ValueError, match="one architecture"):
        mb.stack_parameters([a, other_state])


def test_stacked_parameter_cache_reuses_and_invalidates_on_weight_changes():
    modules = _modules(_config("oft_mlp"), 2)
    cache = mb.StackedParameterCache()
    first = cache.get(modules)
    assert cache.get(modules) is first and (cache.hits, cache.misses) == (1, 1)
    assert cache.get(modules[::-1]) is not first  # another member order is another group
    with torch.no_grad():
        modules[1].action_out.bias.add_(1.0)  # an in-place weight change
    again = cache.get(modules)
    assert again is not first
    torch.testing.assert_close(again["action_out.bias"][1], modules[1].action_out.bias)
    modules[0].load_state_dict(modules[1].state_dict())
    # Linear weights are stacked transposed, (G, in, out).
    torch.testing.assert_close(cache.get(modules)["trunk.0.weight"][0], modules[1].trunk[0].weight.t())


# ------------------------------------------------------------------------------ services
SCHEMA_A = dict(cameras=("front", "wrist"), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2)
SCHEMA_B = dict(cameras=("top",), image_size=(24, 40), state_dim=6, action_dim=5, action_chunk=4)
# tenant -> (schema, kind, RL head: stochastic + value head): two kinds x two dims, groups of 1..3.
TENANTS = {
    "oa1": (SCHEMA_A, "oft_mlp", True),
    "oa2": (SCHEMA_A, "oft_mlp", True),
    "ob1": (SCHEMA_B, "oft_mlp", False),
    "ob2": (SCHEMA_B, "oft_mlp", False),
    "fa1": (SCHEMA_A, "flow_matching", False),
    "fa2": (SCHEMA_A, "flow_matching", False),
    "fa3": (SCHEMA_A, "flow_matching", False),
    "fb1": (SCHEMA_B, "flow_matching", False),
}


def _tenant_configs(capabilities: Any) -> dict[str, Any]:
    configs = {}
    for seed, (name, (schema, kind, rl)) in enumerate(TENANTS.items()):
        cfg = compiled_config(name, capabilities, module=kind, **schema)
        module = {**cfg.action_module, "size": "tiny", "value_head": rl, "stochastic": rl}
        configs[name] = cfg.model_copy(update={"seed": seed, "action_module": module, "learning_rate": 1e-3})
    return configs


@pytest.fixture(scope="module")
def payloads(tmp_path_factory):
    trainer = TrainingModelService(BackboneSource(preset="tiny"), tmp_path_factory.mktemp("ckpt"))
    out = {}
    for name, cfg in _tenant_configs(trainer.capabilities()).items():
        trainer.add_tenant(cfg)
        out[name] = trainer.export_params(name)
    return out


def _observation(schema: dict[str, Any], rng: np.random.Generator, k: int) -> Observation:
    h, w = schema["image_size"]
    return Observation(
        images=tuple(rng.random((3, h, w), dtype=np.float32) for _ in schema["cameras"]),
        state=rng.standard_normal(schema["state_dim"]).astype(np.float32),
        instruction="pick " + "x" * (2 + 3 * k),  # varied prompt lengths
    )


def test_inference_batches_mixed_architectures_equal_to_the_per_tenant_path(payloads, monkeypatch):
    service = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False, max_batch_size=10_000)
    try:
        for payload in payloads.values():
            service.load_weights(payload)
        rng = np.random.default_rng(0)
        plan = [("oa1", 2), ("fa1", 1), ("ob1", 3), ("fa2", 2), ("oa2", 1), ("fb1", 2), ("ob2", 1), ("fa3", 3)]
        plan += [("fa1", 2), ("oa1", 1)]  # a second request of a tenant: one member, its rows joined
        requests = []
        for k, (name, n) in enumerate(plan):
            schema, _, rl = TENANTS[name]
            obs = [_observation(schema, rng, k + i) for i in range(n)]
            requests.append(dict(tenant_id=name, observations=obs, seeds=[1000 * k + i for i in range(n)], sample=rl))

        def serve_all() -> list[dict[str, Any]]:
            futures = [service.submit(**r) for r in requests]
            service.execute(service.queue.collect_prefix(service.max_batch_size, 0.0))
            return [f.result() for f in futures]

        batched = serve_all()
        # 3 groups (oft A sampled, oft B, flow A + flow B padded to one), stacked once each.
        assert service._stacked.misses == 3 and len(service._stacked) == 3
        assert serve_all()[0]["batch_samples"] == sum(n for _, n in plan)
        assert service._stacked.misses == 3 and service._stacked.hits == 3  # reused, not restacked
        # The reference: the same batch decoded one request at a time by each tenant's own module.
        monkeypatch.setattr(inference_module, "architecture_key", lambda module: None)
        alone = serve_all()
    finally:
        service.close()
    for request, got, want in zip(requests, batched, alone, strict=True):
        schema = TENANTS[request["tenant_id"]][0]
        n = len(request["observations"])
        assert got["actions"].shape == (n, schema["action_chunk"], schema["action_dim"])
        np.testing.assert_allclose(got["actions"], want["actions"], atol=ATOL, rtol=1e-4)
        for key in ("values", "log_probs"):
            if want[key] is None:
                assert got[key] is None
            else:
                np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=1e-4)


def _microbatch(name: str, cfg: Any, rows: int, rng: np.random.Generator) -> dict[str, Any]:
    return padded_microbatch(name, TENANTS[name][0], cfg, rows, rng)


@pytest.fixture
def trainers(tmp_path):
    services = {
        mode: TrainingModelService(BackboneSource(preset="tiny"), tmp_path / mode) for mode in ("serial", "grouped")
    }
    configs = _tenant_configs(services["serial"].capabilities())
    for service in services.values():
        for cfg in configs.values():
            service.add_tenant(cfg)
    rng = np.random.default_rng(5)
    rows = {name: 2 + i % 3 for i, name in enumerate(TENANTS)}  # unequal row counts
    data = [{name: _microbatch(name, configs[name], rows[name], rng) for name in TENANTS} for _ in range(2)]
    return {**services, "data": data}


def _spy_group_losses(monkeypatch) -> list[int]:
    """Members of every batched loss the Training Model Service computes (calls through)."""
    sizes: list[int] = []
    real = grouped_training_module.group_loss

    def spied(modules, *args, **kwargs):
        sizes.append(len(modules))
        return real(modules, *args, **kwargs)

    monkeypatch.setattr(grouped_training_module, "group_loss", spied)
    return sizes


def test_grouped_training_batches_same_architecture_tenants_equal_to_serial_steps(trainers, monkeypatch):
    serial, grouped = trainers["serial"], trainers["grouped"]
    sizes = _spy_group_losses(monkeypatch)
    for step, data in enumerate(trainers["data"]):
        expected = {name: serial.train_batch(name, batch) for name, batch in data.items()}
        results = grouped.train_group(list(data.items()))
        assert [r["tenant_id"] for r in results] == list(TENANTS)
        for result in results:
            want = expected[result["tenant_id"]]
            assert "error" not in result, result
            assert result["loss"] == pytest.approx(want["loss"], abs=ATOL)
            assert result["version"] == want["version"] == step + 1
            assert result["module_seconds"] >= 0
    # Training batches identical configs only: oft A, oft B, flow A; flow B alone runs per tenant.
    assert sorted(sizes) == [2, 2, 2, 2, 3, 3]
    for name in TENANTS:
        # Rounding-level gradients (attention key biases) move by up to lr a step in either path.
        steps = len(trainers["data"])
        assert_trained_state_close(serial.tenant_state(name), grouped.tenant_state(name), 1e-3, steps, where=name)


def test_a_poisoned_tenant_in_a_batched_group_is_isolated(trainers, monkeypatch):
    serial, grouped = trainers["serial"], trainers["grouped"]
    sizes = _spy_group_losses(monkeypatch)
    bad = "fa2"
    with torch.no_grad():
        grouped._slots[bad].module.velocity_out.bias.fill_(float("nan"))
    before = grouped.tenant_state(bad)
    data = trainers["data"][0]
    results = {r["tenant_id"]: r for r in grouped.train_group(list(data.items()))}
    assert 3 in sizes  # the poisoned tenant was in a batched group
    assert "non-finite loss" in results[bad]["error"]
    assert results[bad]["loss"] is None and results[bad]["version"] == 0
    assert all(p.grad is None for p in grouped._slots[bad].module.parameters())
    after = grouped.tenant_state(bad)
    for key, value in before["module"].items():
        assert torch.equal(value.isnan(), after["module"][key].isnan()), key
        assert torch.equal(value.nan_to_num(), after["module"][key].nan_to_num()), key
    assert after["optimizer"]["state"] == {} and grouped.tenant_status(bad)["optimizer_steps"] == 0
    for name, batch in data.items():  # the others stepped exactly as they do alone
        if name == bad:
            continue
        want = serial.train_batch(name, batch)
        assert "error" not in results[name] and results[name]["loss"] == pytest.approx(want["loss"], abs=ATOL)
