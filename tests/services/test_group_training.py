"""Group-batched training (paper 5.2): one shared backbone forward per group of tenants, each
tenant's own update on its own rows, equal to serial training; refusals happen before any tenant
steps, and a failing tenant leaves its slot unchanged while the others step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from joynexus.actors import service_handle
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.services.producers.sft import SFTProducer
from joynexus.services.training.service import TenantSlotError, TrainingModelService, UnknownTenant
from tests.helpers import assert_state_close as _assert_close
from tests.helpers import assert_trained_state_close

# tenant -> (schema/dataset of conftest's TENANT_SHAPES, action-module kind): 2 schemas x 2 kinds.
GROUP = {
    "a-oft": ("alpha", "oft_mlp"),
    "a-flow": ("alpha", "flow_matching"),
    "b-oft": ("beta", "oft_mlp"),
    "b-flow": ("beta", "flow_matching"),
}
ROWS = {"a-oft": 8, "a-flow": 5, "b-oft": 3, "b-flow": 6}  # unequal on purpose: row slices must line up
# Instructions of different token lengths (and blanks, filled with the tenant's default), so the
# shared forward pads every tenant's rows to another tenant's longest prompt.
TASKS = ("pick up the cube", "", "push the t-shaped block into the goal region and then open the top drawer")
STEPS = 3
ATOL = 1e-5


@pytest.fixture
def group(world, datasets):
    """The four GROUP tenants (real SFT tenants, distinct seeds), their microbatches for STEPS steps,
    and two services holding identical initial slots: one trained serially, one in groups."""
    model_id = world["service"].backbone.model_id
    configs, data = {}, {}
    for seed, (name, (schema, kind)) in enumerate(GROUP.items(), start=1):
        base = datasets[schema]
        spec = {
            **base,
            "tenant": name,
            "base_model": model_id,
            "action_module": {"kind": kind, "size": "tiny"},
            "training": {**base["training"], "seed": seed},
        }
        cfg = configs[name] = world["creator"].create(spec).backend_config
        producer = SFTProducer.from_dataset(
            cfg,
            world["scheduler"],
            service_handle(TrainingQueue, world["queue"]),
            base["dataset"]["root"],
            base["dataset"]["repo_id"],
        )
        data[name] = [_with_tasks(producer._partition_data(ROWS[name]), seed + step) for step in range(STEPS)]
    services = {}
    for mode in ("serial", "grouped"):
        services[mode] = TrainingModelService(BackboneSource(preset="tiny"), world["tmp"] / mode, num_threads=1)
        for cfg in configs.values():
            services[mode].add_tenant(cfg)
    return {"configs": configs, "data": data, **services}


def _with_tasks(data: dict[str, Any], offset: int) -> dict[str, Any]:
    return {**data, "task": [TASKS[(offset + i) % len(TASKS)] for i in range(len(data["task"]))]}


def _batches(group, step: int, names=tuple(GROUP)) -> list[tuple[str, dict[str, Any]]]:
    return [(name, group["data"][name][step]) for name in names]


def _count_encodes(monkeypatch, service: TrainingModelService) -> list[int]:
    """Rows of every shared backbone forward the service runs from now on."""
    calls: list[int] = []
    encode = service.backbone.encode

    def counted(images, instructions):
        calls.append(len(images))
        return encode(images, instructions)

    monkeypatch.setattr(service.backbone, "encode", counted)
    return calls


def test_grouped_training_equals_serial_training_per_tenant(group):
    serial, grouped = group["serial"], group["grouped"]
    initial = {name: grouped.tenant_state(name) for name in GROUP}
    for step in range(STEPS):
        # Group order must not matter: every tenant's update sees only its own rows and slot.
        names = tuple(GROUP) if step % 2 == 0 else tuple(reversed(GROUP))
        expected = {name: serial.train_batch(name, data) for name, data in _batches(group, step, names)}
        results = grouped.train_group(_batches(group, step, names))
        assert [r["tenant_id"] for r in results] == list(names)
        for result in results:
            want = expected[result["tenant_id"]]
            assert "error" not in result, result
            assert result["version"] == want["version"] == step + 1
            assert result["optimizer_steps"] == want["optimizer_steps"] == step + 1
            assert result["loss"] == pytest.approx(want["loss"], abs=ATOL)
            assert result["encode_seconds"] >= 0 and result["module_seconds"] >= 0
    for name in GROUP:
        state = grouped.tenant_state(name)
        lr = group["configs"][name].learning_rate
        assert_trained_state_close(serial.tenant_state(name), state, lr, STEPS, where=name)
        assert any(not torch.equal(initial[name]["module"][k], v) for k, v in state["module"].items()), name
        assert grouped.tenant_status(name)["samples_trained"] == STEPS * ROWS[name]


def test_a_group_runs_one_shared_forward(group, monkeypatch):
    serial_calls = _count_encodes(monkeypatch, group["serial"])
    grouped_calls = _count_encodes(monkeypatch, group["grouped"])
    for step in range(2):
        for name, data in _batches(group, step):
            group["serial"].train_batch(name, data)
        group["grouped"].train_group(_batches(group, step))
    assert grouped_calls == [sum(ROWS.values())] * 2  # one forward over all four tenants' rows
    assert serial_calls == [ROWS[name] for name in GROUP] * 2


@pytest.mark.parametrize("column", ["tenant_id", "schema_signature"])
def test_a_foreign_sample_rejects_the_group_before_any_tenant_steps(group, monkeypatch, column):
    service = group["grouped"]
    before = {name: service.tenant_state(name) for name in GROUP}
    calls = _count_encodes(monkeypatch, service)
    batches = _batches(group, 0)
    # The bad sample sits in the LAST tenant's microbatch: validation must come before any step.
    last, data = batches[-1]
    foreign = (
        group["configs"]["a-oft"].tenant_id if column == "tenant_id" else group["configs"]["a-oft"].schema_signature
    )
    batches[-1] = (last, {**data, column: [*data[column][:-1], foreign]})
    with pytest.raises(TenantSlotError, match=f"mixes {column}"):
        service.train_group(batches)
    assert calls == []
    for name in GROUP:
        _assert_close(before[name], service.tenant_state(name), 0.0, name)


# Faults injected into one tenant's module; each returns the function that removes it.
def _raise_in_loss(monkeypatch, module):
    def broken(*args, **kwargs):
        raise RuntimeError("tenant module bug")

    monkeypatch.setattr(module, "loss", broken)
    return monkeypatch.undo


def _nan_loss(monkeypatch, module):
    loss = module.loss
    monkeypatch.setattr(module, "loss", lambda *args, **kwargs: loss(*args, **kwargs) * float("nan"))
    return monkeypatch.undo


def _raise_in_backward(monkeypatch, module):
    # A hook on the output layer fires early in backward: some gradients already exist when it raises.
    def broken(grad):
        raise RuntimeError("tenant module bug in backward")

    return module.velocity_out.weight.register_hook(broken).remove


@pytest.mark.parametrize(
    ("fault", "message"),
    [(_raise_in_loss, "tenant module bug"), (_nan_loss, "non-finite loss"), (_raise_in_backward, "in backward")],
    ids=["loss-raises", "nan-loss", "backward-raises"],
)
def test_a_failing_tenant_keeps_its_slot_while_the_others_step(group, monkeypatch, fault, message):
    serial, grouped = group["serial"], group["grouped"]
    bad = "a-flow"
    module = grouped._slots[bad].module
    bad_before = grouped.tenant_state(bad)
    remove_fault = fault(monkeypatch, module)
    results = grouped.train_group(_batches(group, 0))

    by_tenant = {r["tenant_id"]: r for r in results}
    assert message in by_tenant[bad]["error"]
    assert by_tenant[bad]["loss"] is None and by_tenant[bad]["version"] == 0
    assert by_tenant[bad]["optimizer_steps"] == 0
    _assert_close(bad_before, grouped.tenant_state(bad), 0.0, bad)
    assert all(p.grad is None for p in module.parameters())  # no partial gradients left behind
    assert grouped.tenant_status(bad)["samples_trained"] == 0
    # The others stepped exactly as they would have alone.
    for name, data in _batches(group, 0):
        if name == bad:
            continue
        assert "error" not in by_tenant[name] and by_tenant[name]["version"] == 1
        serial.train_batch(name, data)
        lr = group["configs"][name].learning_rate
        assert_trained_state_close(serial.tenant_state(name), grouped.tenant_state(name), lr, 1, where=name)

    # Once the fault is gone, the tenant trains again from its untouched slot.
    remove_fault()
    results = grouped.train_group(_batches(group, 1))
    assert all("error" not in r for r in results), results
    assert grouped.policy_version(bad) == 1


@pytest.mark.parametrize("case", ["duplicate", "unknown", "empty"])
def test_groups_that_cannot_run_are_refused_before_any_tenant_steps(group, monkeypatch, case):
    service = group["grouped"]
    before = {name: service.tenant_state(name) for name in GROUP}
    calls = _count_encodes(monkeypatch, service)
    batches = _batches(group, 0)
    if case == "duplicate":
        batches.append(("b-oft", group["data"]["b-oft"][1]))
        with pytest.raises(ValueError, match="tenant 'b-oft' appears more than once"):
            service.train_group(batches)
    elif case == "unknown":
        batches.append(("nobody", group["data"]["b-oft"][1]))
        with pytest.raises(UnknownTenant, match="nobody"):
            service.train_group(batches)
    else:
        name, data = batches[-1]
        batches[-1] = (name, {key: value[:0] for key, value in data.items()})
        with pytest.raises(TenantSlotError, match=f"tenant {name!r}: empty microbatch"):
            service.train_group(batches)
    assert calls == []
    for name in GROUP:
        _assert_close(before[name], service.tenant_state(name), 0.0, name)
    assert service.train_group([]) == []
