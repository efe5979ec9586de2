"""The action-module extension seam: this file alone adds a third kind (its module, its own config
knob and its own grouped kernel) without touching shared code, and the kind then builds from a
mapping, trains grouped beside the built-in kinds through `TrainingModelService.train_group` equal
to serial `train_batch`, and serves grouped through `InferenceModelService` (one shared backbone
forward for all three kinds) equal to the module's own `predict`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pydantic
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import joynexus.services.inference.decode as inference_module
import joynexus.services.training.grouped as grouped_training_module
from joynexus.models.action_modules import (
    ActionModule,
    ActionModuleConfig,
    available_action_modules,
    build_action_module,
    register_action_module,
)
from joynexus.models.backbone import BackboneFeatures, BackboneSource
from joynexus.models.grouped_kernels import GroupDims, GroupInputs, Kernel, StackedParameters, linear, masked_means
from joynexus.models.module_batching import architecture_key
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.inference.service import InferenceModelService
from joynexus.services.training.service import TrainingModelService
from tests.helpers import assert_trained_state_close, compiled_config, padded_microbatch

KIND = "test_linear_head"
ATOL = 1e-5


# ------------------------------------------------------------------------------ the new kind
class LinearHeadConfig(ActionModuleConfig):
    """The kind's own knob: the hidden width of its one hidden layer."""

    hidden: int = pydantic.Field(default=32, ge=1, le=1024)

    def architecture_fields(self) -> tuple[Any, ...]:
        return (self.hidden,)


class LinearHeadKernel(Kernel):
    """`LinearHead` over stacked parameters (its forward and its masked-MSE loss)."""

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, p: StackedParameters, cfg: ActionModuleConfig, x: GroupInputs) -> torch.Tensor:
        self.calls += 1
        hidden = F.gelu(linear(torch.cat([x.pooled, x.state], dim=-1), p["proj.weight"], p["proj.bias"]))
        out = linear(hidden, p["action_out.weight"], p["action_out.bias"])
        return out.view(x.groups, x.rows, cfg.action_chunk, cfg.action_dim)

    def predict(
        self, p: StackedParameters, cfg: ActionModuleConfig, x: GroupInputs, noise: Any, dims: GroupDims
    ) -> torch.Tensor:
        return self.forward(p, cfg, x)

    def loss(
        self,
        p: StackedParameters,
        cfg: ActionModuleConfig,
        x: GroupInputs,
        actions: torch.Tensor,
        action_is_pad: torch.Tensor,
        noise: Any,
        dims: GroupDims,
    ) -> torch.Tensor:
        own = dims.action_mask(actions.device)
        return masked_means((self.forward(p, cfg, x) - actions).pow(2), action_is_pad, x.valid, own)


@register_action_module(KIND)
class LinearHead(ActionModule):
    """Pooled features + state -> one GELU layer -> the whole chunk (`action_out`: the name the
    stacking pads as a (chunk, action) layout)."""

    config_class = LinearHeadConfig
    kernel = LinearHeadKernel()
    config: LinearHeadConfig

    def __init__(self, config: LinearHeadConfig) -> None:
        super().__init__(config)
        self.proj = nn.Linear(config.feature_dim + config.state_dim, config.hidden)
        self.action_out = nn.Linear(config.hidden, config.action_chunk * config.action_dim)

    def forward(self, features: BackboneFeatures, state: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.proj(torch.cat([features.pooled, state], dim=-1)))
        return self.action_out(hidden).view(-1, self.config.action_chunk, self.config.action_dim)

    def loss(
        self,
        features: BackboneFeatures,
        state: torch.Tensor,
        actions: torch.Tensor,
        action_is_pad: torch.Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        self._check_inputs(features, state, actions, action_is_pad)
        return self._masked_mean((self(features, state) - actions).pow(2), action_is_pad)

    def predict(
        self, features: BackboneFeatures, state: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        self._check_inputs(features, state)
        with torch.no_grad():
            return self(features, state)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ config and build
def test_the_kind_builds_from_a_mapping_with_its_own_knob():
    assert KIND in available_action_modules()
    fields = dict(kind=KIND, feature_dim=64, state_dim=3, action_dim=2, action_chunk=4, size="tiny")
    module = build_action_module({**fields, "hidden": 24})
    assert type(module) is LinearHead and type(module.config) is LinearHeadConfig and module.config.hidden == 24
    assert ActionModuleConfig(**fields) == LinearHeadConfig(**fields)  # the kind picks its config class
    assert architecture_key(module) is not None  # it declares a kernel: it runs grouped
    with pytest.raises(ValueError, match="hidden") as bad:
        build_action_module({**fields, "hidden": 0})
    assert "0" in str(bad.value)
    with pytest.raises(ValueError, match="num_inference_steps"):  # the flow knob is not this kind's
        ActionModuleConfig(**fields, num_inference_steps=3)


# ------------------------------------------------------------------------------ beside the built-in kinds
SCHEMA_A = dict(cameras=("front", "wrist"), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2)
SCHEMA_B = dict(cameras=("top",), image_size=(24, 40), state_dim=6, action_dim=5, action_chunk=4)
# tenant -> (schema, kind): two tenants of the new kind (a group of two), one of each built-in kind.
TENANTS = {
    "lin1": (SCHEMA_A, KIND),
    "lin2": (SCHEMA_A, KIND),
    "oft": (SCHEMA_B, "oft_mlp"),
    "flow": (SCHEMA_A, "flow_matching"),
}


def _tenant_configs(capabilities: Any) -> dict[str, Any]:
    configs = {}
    for seed, (name, (schema, kind)) in enumerate(TENANTS.items()):
        cfg = compiled_config(name, capabilities, module=kind, **schema)
        module = {**cfg.action_module, "size": "tiny"}
        if kind == KIND:
            module["hidden"] = 24
        configs[name] = cfg.model_copy(update={"seed": seed, "action_module": module, "learning_rate": 1e-3})
    return configs


def _microbatch(name: str, cfg: Any, rows: int, rng: np.random.Generator) -> dict[str, Any]:
    return padded_microbatch(name, TENANTS[name][0], cfg, rows, rng)


def test_the_kind_trains_grouped_beside_the_built_in_kinds_equal_to_serial_steps(tmp_path, monkeypatch):
    services = {
        mode: TrainingModelService(BackboneSource(preset="tiny"), tmp_path / mode) for mode in ("serial", "grouped")
    }
    configs = _tenant_configs(services["serial"].capabilities())
    for service in services.values():
        for cfg in configs.values():
            service.add_tenant(cfg)
    assert type(services["grouped"]._slots["lin1"].module.config) is LinearHeadConfig
    rng = np.random.default_rng(5)
    rows = {"lin1": 3, "lin2": 2, "oft": 4, "flow": 2}
    data = [{name: _microbatch(name, configs[name], rows[name], rng) for name in TENANTS} for _ in range(2)]
    sizes: list[int] = []
    real = grouped_training_module.group_loss

    def spied(modules, *args, **kwargs):
        sizes.append(len(modules))
        return real(modules, *args, **kwargs)

    monkeypatch.setattr(grouped_training_module, "group_loss", spied)
    serial, grouped = services["serial"], services["grouped"]
    for step, batch in enumerate(data):
        expected = {name: serial.train_batch(name, microbatch) for name, microbatch in batch.items()}
        results = grouped.train_group(list(batch.items()))
        assert [r["tenant_id"] for r in results] == list(TENANTS)
        for result in results:
            want = expected[result["tenant_id"]]
            assert "error" not in result, result
            assert result["loss"] == pytest.approx(want["loss"], abs=ATOL)
            assert result["version"] == want["version"] == step + 1
    assert sizes == [2, 2]  # the two new-kind tenants ran as one stacked group, each step
    for name in TENANTS:
        want, got = serial.tenant_state(name), grouped.tenant_state(name)
        assert_trained_state_close(want, got, 1e-3, len(data), where=name)


def _observation(schema: dict[str, Any], rng: np.random.Generator, k: int) -> Observation:
    h, w = schema["image_size"]
    return Observation(
        images=tuple(rng.random((3, h, w), dtype=np.float32) for _ in schema["cameras"]),
        state=rng.standard_normal(schema["state_dim"]).astype(np.float32),
        instruction="pick " + "x" * (2 + 3 * k),
    )


def test_the_kind_serves_grouped_in_one_shared_forward_equal_to_its_own_predict(tmp_path, monkeypatch):
    trainer = TrainingModelService(BackboneSource(preset="tiny"), tmp_path / "ckpt")
    configs = _tenant_configs(trainer.capabilities())
    payloads = {}
    for cfg in configs.values():
        trainer.add_tenant(cfg)
        payloads[cfg.tenant_id] = trainer.export_params(cfg.tenant_id)
    service = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False, max_batch_size=10_000)
    forwards: list[int] = []
    encode = service.backbone.encode

    def counted(images, instructions, *args, **kwargs):
        forwards.append(len(images))
        return encode(images, instructions, *args, **kwargs)

    monkeypatch.setattr(service.backbone, "encode", counted)
    try:
        for payload in payloads.values():
            service.load_weights(payload)
        rng = np.random.default_rng(0)
        plan = [("lin1", 2), ("oft", 1), ("lin2", 3), ("flow", 2)]
        requests = []
        for k, (name, n) in enumerate(plan):
            obs = [_observation(TENANTS[name][0], rng, k + i) for i in range(n)]
            requests.append(dict(tenant_id=name, observations=obs, seeds=[1000 * k + i for i in range(n)]))

        def serve_all() -> list[dict[str, Any]]:
            futures = [service.submit(**r) for r in requests]
            service.execute(service.queue.collect_prefix(service.max_batch_size, 0.0))
            return [f.result() for f in futures]

        calls = LinearHead.kernel.calls
        batched = serve_all()
        assert forwards == [sum(n for _, n in plan)]  # ONE backbone forward for the three kinds
        assert LinearHead.kernel.calls == calls + 1  # the two new-kind tenants decoded as one group
        # The reference: each request decoded alone by its tenant's own module (`predict`).
        monkeypatch.setattr(inference_module, "architecture_key", lambda module: None)
        alone = serve_all()
        assert LinearHead.kernel.calls == calls + 1
    finally:
        service.close()
    for request, got, want in zip(requests, batched, alone, strict=True):
        schema = TENANTS[request["tenant_id"]][0]
        assert got["actions"].shape == (len(request["observations"]), schema["action_chunk"], schema["action_dim"])
        np.testing.assert_allclose(got["actions"], want["actions"], atol=ATOL, rtol=1e-4)
