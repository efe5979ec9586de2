"""Packed tenant slots (issue 14.5, tenant density): beyond `max_active_tenants` the least recently
used resident Training Model Service slots keep their module and AdamW state in a few flat tensors.

Pack -> materialize is bit-exact; materialized tensors are views of the flat storage, so optimizer
steps update it in place and packing again copies nothing; tensors replaced meanwhile are still
captured. A tenant packed between every step trains bit-identically to one never packed (serial,
grouped, forward_backward + optim_step), exports, checkpoints and pages out to disk exactly; adapter
slots, slots with pending gradients and slots a call is using are never packed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from safetensors import safe_open

from joynexus.artifacts import decode_tenant_payload
from joynexus.core.tenants import BaseModelCapabilities
from joynexus.models.action_modules import ActionModuleConfig, build_action_module
from joynexus.models.backbone import BackboneSource
from joynexus.services.training.packing import ActiveSlots, PackedTrainingState
from joynexus.services.training.service import TenantSlotError, TrainingModelService
from tests.helpers import TINY_MODEL_ID, interface_config, random_microbatch
from tests.helpers import assert_state_equal as _equal

TASKS = ("pick up the cube", "", "open the top drawer")
LORA = {"kind": "lora", "rank": 2, "alpha": 4.0, "target_modules": ["q_proj", "v_proj"]}


# ------------------------------------------------------------------------- the packed form
def _trained_module(
    kind: str, steps: int = 2, device: str = "cpu", **config: Any
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny module on `device` and its AdamW after `steps` steps on seeded random gradients;
    `log_std` (if stochastic) never gets a gradient, so it has no optimizer state (a partly
    stateful optimizer)."""
    cfg = ActionModuleConfig(
        kind=kind, size="tiny", feature_dim=64, state_dim=4, action_dim=3, action_chunk=2, **config
    )
    torch.manual_seed(0)
    module = build_action_module(cfg).to(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.05, betas=(0.8, 0.95))
    _fake_steps(module, optimizer, steps, seed=1)
    return module, optimizer


def _fake_steps(module: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for name, param in module.named_parameters():
            grad = torch.randn(param.shape, generator=generator).to(param.device)
            param.grad = None if name == "log_std" else grad
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _snapshot(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "module": {k: v.clone() for k, v in module.state_dict().items()},
        "optimizer": {
            "state": {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()},
            "param_groups": optimizer.state_dict()["param_groups"],
        },
        "training": module.training,
    }


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(  # AdamW's foreach path, step counts on the CPU beside CUDA parameters
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
        ),
    ],
)
@pytest.mark.parametrize(
    "kind, config",
    [("oft_mlp", {"stochastic": True, "value_head": True}), ("flow_matching", {})],
    ids=["oft_mlp-stochastic-value", "flow_matching"],
)
def test_pack_then_materialize_is_bit_exact_and_trains_on_identically(kind, config, device):
    module, optimizer = _trained_module(kind, device=device, **config)
    module.eval()  # the training flag travels too
    before = _snapshot(module, optimizer)
    packed = PackedTrainingState.pack(module, optimizer)
    assert packed.nbytes == sum(t.numel() * t.element_size() for t in before["module"].values()) + sum(
        t.numel() * t.element_size() for s in before["optimizer"]["state"].values() for t in s.values()
    )
    if config.get("stochastic"):  # log_std never stepped: no state, and it stays without
        assert len(before["optimizer"]["state"]) == len(before["module"]) - 1
    assert packed.device.type == device and packed.state["step"].device.type == "cpu"
    rebuilt, rebuilt_optimizer = packed.materialize()
    assert type(rebuilt) is type(module) and type(rebuilt_optimizer) is type(optimizer)
    _equal(_snapshot(rebuilt, rebuilt_optimizer), before)
    assert [n for n, _ in rebuilt.named_parameters()] == [n for n, _ in module.named_parameters()]
    assert all(p.requires_grad and p.is_leaf for p in rebuilt.parameters())
    assert {p.device.type for p in rebuilt.parameters()} == {device}

    # The same further steps on the original and on the materialized copy: identical.
    _fake_steps(module, optimizer, 2, seed=7)
    _fake_steps(rebuilt, rebuilt_optimizer, 2, seed=7)
    _equal(_snapshot(rebuilt, rebuilt_optimizer), _snapshot(module, optimizer))
    # Two materializations are separate module objects over the same numbers.
    other, _ = packed.materialize()
    assert all(a is not b for a, b in zip(other.parameters(), rebuilt.parameters(), strict=True))
    _equal(other.state_dict(), rebuilt.state_dict())


def test_materialized_tensors_are_views_that_steps_update_in_place_and_repacking_copies_nothing():
    module, optimizer = _trained_module("oft_mlp")
    packed = PackedTrainingState.pack(module, optimizer)
    (flat,) = packed.params.flats.values()
    exp_avg = packed.state["exp_avg"].flats[torch.float32]
    rebuilt, rebuilt_optimizer = packed.materialize()
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    assert all(start <= p.data_ptr() < end for p in rebuilt.parameters())
    assert sum(p.numel() for p in rebuilt.parameters()) == flat.numel()
    moments = [s["exp_avg"] for s in rebuilt_optimizer.state.values()]
    assert all(m.untyped_storage().data_ptr() == exp_avg.untyped_storage().data_ptr() for m in moments)

    before = flat.clone()
    _fake_steps(rebuilt, rebuilt_optimizer, 1, seed=3)
    assert not torch.equal(flat, before)  # the step wrote into the flat storage
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in rebuilt.parameters()]))
    steps = packed.state["step"].flats[torch.float32]
    assert steps.tolist() == [3.0] * len(moments)  # AdamW's step counts, in place too

    repacked = PackedTrainingState.pack(rebuilt, rebuilt_optimizer, packed)
    assert repacked.params.flats[torch.float32] is flat and repacked.state["exp_avg"].flats[torch.float32] is exp_avg

    # Tensors something replaced (optimizer.load_state_dict makes new state tensors; a parameter's
    # data swapped) are not views any more: packing copies them into the flat storage.
    rebuilt, rebuilt_optimizer = repacked.materialize()
    rebuilt_optimizer.load_state_dict(copy.deepcopy(rebuilt_optimizer.state_dict()))  # as from a checkpoint
    assert rebuilt_optimizer.state[next(rebuilt.parameters())]["exp_avg"].data_ptr() != exp_avg.data_ptr()
    _fake_steps(rebuilt, rebuilt_optimizer, 1, seed=4)
    with torch.no_grad():
        rebuilt.action_out.bias.data = rebuilt.action_out.bias.data + 1.0  # a new tensor, not a view
    expected = _snapshot(rebuilt, rebuilt_optimizer)
    again = PackedTrainingState.pack(rebuilt, rebuilt_optimizer, repacked)
    assert again.params.flats[torch.float32] is flat  # same storage, updated
    _equal(_snapshot(*again.materialize()), expected)


def test_packing_refuses_an_optimizer_over_other_tensors_and_the_active_bound_is_validated():
    module, _ = _trained_module("oft_mlp")
    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(
        ValueError, match=r"optimizer: param_groups\[0\] holds a tensor that is not a parameter of the module"
    ):
        PackedTrainingState.pack(module, torch.optim.AdamW([*module.parameters(), stranger]))
    for bad in (0, -1, "x", True, 2.5):
        with pytest.raises(ValueError, match=f"max_active_tenants: must be an integer >= 1, got {bad!r}"):
            ActiveSlots(bad)


# ----------------------------------------------------------------- the Training Model Service
@pytest.fixture(scope="module")
def caps() -> BaseModelCapabilities:
    return BaseModelCapabilities(model_id=TINY_MODEL_ID, feature_dim=64, max_images=3, image_size=32)


def _config(name: str, caps: BaseModelCapabilities, kind: str, seed: int, adapter: dict | None = None) -> Any:
    return interface_config(name, caps, kind, seed, adapter)


def _service(tmp_path, name: str, configs: dict[str, Any], **kwargs: Any) -> TrainingModelService:
    service = TrainingModelService(
        BackboneSource(preset="tiny"), tmp_path / name, num_threads=1, placement="cpu", **kwargs
    )
    for config in configs.values():
        service.add_tenant(config)
    return service


def _active(service: TrainingModelService) -> set[str]:
    return {t for t in service.tenants() if (slot := service._slots.peek(t)) is not None and slot.is_active}


@pytest.fixture
def tenants(caps) -> dict[str, Any]:
    """Two oft_mlp tenants (one architecture: grouped steps batch them) and a flow-matching one."""
    return {
        "oft-a": _config("oft-a", caps, "oft_mlp", seed=1),
        "flow": _config("flow", caps, "flow_matching", seed=2),
        "oft-b": _config("oft-b", caps, "oft_mlp", seed=3),
    }


def test_a_tenant_packed_between_every_step_trains_bit_identically(tmp_path, tenants):
    """With room for one active slot, every call materializes its tenant and packs the previous
    one; serial steps, grouped steps (a batched group of two oft tenants plus the flow tenant) and
    forward_backward + optim_step end bit-identical to a service that never packs."""
    packed = _service(tmp_path, "packed", tenants, max_active_tenants=1)
    plain = _service(tmp_path, "plain", tenants)
    assert len(_active(packed)) == 1 and len(_active(plain)) == 3
    for step in range(3):
        for i, name in enumerate(["oft-a", "oft-b", "flow", "oft-b"]):
            batch = random_microbatch(tenants[name], 3 + i, 10 * step + i, TASKS)
            assert packed.train_batch(name, batch)["loss"] == plain.train_batch(name, batch)["loss"], (step, name)
            assert _active(packed) == {name}  # the others were packed when the call returned
    for step in range(2):
        group = [(name, random_microbatch(config, 2, 50 + step, TASKS)) for name, config in tenants.items()]
        got, want = packed.train_group(group), plain.train_group(group)
        assert [r["loss"] for r in got] == [r["loss"] for r in want] and not any("error" in r for r in got)
        assert len(_active(packed)) == 1
    for service in (packed, plain):
        service.forward_backward("flow", random_microbatch(tenants["flow"], 4, 77, TASKS))
    packed.train_batch("oft-a", random_microbatch(tenants["oft-a"], 2, 78, TASKS))
    assert "flow" in _active(packed)  # pending gradients: never packed
    plain.train_batch("oft-a", random_microbatch(tenants["oft-a"], 2, 78, TASKS))
    assert packed.optim_step("flow")["loss"] == plain.optim_step("flow")["loss"]

    for name in tenants:
        other = next(t for t in tenants if t != name)  # a step of another tenant packs this one
        for service in (packed, plain):
            service.train_batch(other, random_microbatch(tenants[other], 2, 90, TASKS))
        assert name not in _active(packed)
        slot = packed._slots.peek(name)
        state = packed.tenant_state(name)  # materializes it
        _equal(state, plain.tenant_state(name), name)
        assert state["optimizer"]["state"] and packed.tenant_status(name) == plain.tenant_status(name)
        # A packed slot holds its parameters and AdamW state (moments, step counts), and nothing more.
        tensors = [*state["module"].values(), *(t for s in state["optimizer"]["state"].values() for t in s.values())]
        assert slot.packed_state.nbytes == sum(t.numel() * t.element_size() for t in tensors)
    assert packed.residency_stats()["resident_bytes"] == sum(packed._slots.peek(t).nbytes() for t in tenants)
    assert packed.residency_stats()["page_outs"] == 0  # all resident: packed, not paged out


def test_a_grouped_call_keeps_every_slot_it_uses_active_until_it_returns(tmp_path, tenants, monkeypatch):
    service = _service(tmp_path, "packed", tenants, max_active_tenants=1)
    seen: list[set[str]] = []
    apply_step = service.trainer.apply_step

    def spy(slot, batch, loss):
        seen.append(_active(service))
        apply_step(slot, batch, loss)

    monkeypatch.setattr(service.trainer, "apply_step", spy)
    group = [(name, random_microbatch(config, 2, 5, TASKS)) for name, config in tenants.items()]
    assert not any("error" in r for r in service.train_group(group))
    assert seen and all(active == set(tenants) for active in seen)  # over the bound while pinned
    assert len(_active(service)) == 1


def test_a_packed_slot_exports_checkpoints_and_pages_out_and_back_bit_exact(tmp_path, tenants):
    configs = {name: tenants[name] for name in ("oft-a", "flow")}
    packed = _service(tmp_path, "packed", configs, max_active_tenants=1, max_resident_tenants=2)
    plain = _service(tmp_path, "plain", configs)
    for service in (packed, plain):
        for i, name in enumerate(["flow", "oft-a", "flow", "oft-a"]):
            service.train_batch(name, random_microbatch(configs[name], 3, i, TASKS))
    assert _active(packed) == {"oft-a"}

    # Export and checkpoint of a packed slot (materialized for it: views of one flat tensor).
    tensors, manifest = decode_tenant_payload(packed.export_params("flow"))
    _equal(tensors, plain.tenant_state("flow")["module"])
    assert manifest.policy_version == 2
    packed.save(["flow"])
    resumed = _service(tmp_path, "packed", {"flow": configs["flow"]})  # same checkpoint root
    _equal(resumed.tenant_state("flow"), plain.tenant_state("flow"))
    assert resumed.tenant_status("flow")["optimizer_steps"] == 2

    # Page the packed slot out: its file holds the flat tensors; it comes back packed and exact.
    packed.train_batch("oft-a", random_microbatch(configs["oft-a"], 3, 9, TASKS))
    plain.train_batch("oft-a", random_microbatch(configs["oft-a"], 3, 9, TASKS))
    assert not packed._slots.peek("flow").is_active
    assert packed._slots.page_out("flow") and not packed._slots.is_resident("flow")
    (spill_file,) = packed._slots.spill_dir.glob("flow-*")
    with safe_open(str(spill_file), "pt") as handle:
        names = set(handle.keys())
    assert {"packed/params/float32", "packed/state.exp_avg/float32", "packed/state.step/float32"} <= names
    assert packed.policy_version("flow") == 2 and not packed._slots.peek("flow").is_active  # paged in, packed
    _equal(packed.tenant_state("flow"), plain.tenant_state("flow"))
    for service in (packed, plain):  # and it trains on identically
        service.train_batch("flow", random_microbatch(configs["flow"], 3, 11, TASKS))
    _equal(packed.tenant_state("flow"), plain.tenant_state("flow"))
    assert packed.tenant_status("flow") == plain.tenant_status("flow")
    assert packed.remove_tenant("flow") and "flow" not in packed._active


def test_adapter_slots_are_never_packed(tmp_path, tenants, caps):
    configs = {"lora": _config("lora", caps, "oft_mlp", seed=5, adapter=LORA), "oft-a": tenants["oft-a"]}
    service = _service(tmp_path, "packed", configs, max_active_tenants=1)
    plain = _service(tmp_path, "plain", configs)
    for step in range(2):
        for name in ("lora", "oft-a"):
            batch = random_microbatch(configs[name], 3, step, TASKS)
            assert service.train_batch(name, batch)["loss"] == plain.train_batch(name, batch)["loss"]
    lora = service._slots.peek("lora")
    assert lora.is_active and lora.packed_state is None and "lora" not in service._active
    with pytest.raises(TenantSlotError, match="'lora': a slot with a LoRA adapter is never packed"):
        lora.pack()
    _equal(service.tenant_state("lora"), plain.tenant_state("lora"))


@pytest.mark.parametrize("bad", [0, -1, "x"])
def test_a_bad_active_bound_is_refused_naming_the_field(tmp_path, bad):
    with pytest.raises(ValueError, match=f"max_active_tenants: must be an integer >= 1, got {bad!r}"):
        TrainingModelService(BackboneSource(preset="tiny"), tmp_path, placement="cpu", max_active_tenants=bad)


def test_settings_read_the_active_bound_from_the_environment(monkeypatch, tmp_path):
    from joynexus.settings import Settings

    monkeypatch.setenv("JOYNEXUS_DATA_DIR", str(tmp_path))
    assert Settings().max_active_tenants == 64
    monkeypatch.setenv("JOYNEXUS_MAX_ACTIVE_TENANTS", "12")
    assert Settings().max_active_tenants == 12
    monkeypatch.setenv("JOYNEXUS_MAX_ACTIVE_TENANTS", "many")
    with pytest.raises(ValueError, match="JOYNEXUS_MAX_ACTIVE_TENANTS: expected an integer, got 'many'"):
        Settings()
    monkeypatch.setenv("JOYNEXUS_MAX_ACTIVE_TENANTS", "0")
    with pytest.raises(ValueError, match="max_active_tenants"):
        Settings()
