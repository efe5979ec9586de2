"""Spec checks that used to pass the tenant creator and fail later in the backend (slot build, SFT
producer, simulator, 32-bit store columns) are refused at create time, naming the field, with
nothing written."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from sqlalchemy import func, select

from joynexus.core.store import TenantRecord, TrainingPolicyRecord
from joynexus.core.tenants import BackendCapabilities, BaseModelCapabilities
from joynexus.master.tenant_creator import SpecCompiler, TenantCreator
from joynexus.models.action_modules import ACTION_MODULES, ActionModule, ActionModuleConfig
from joynexus.scheduling.training_scheduler import TrainingScheduler
from joynexus.spec import MAX_ENVIRONMENT_SEED, MAX_TRAINING_SEED, SpecError, parse_workload_spec
from tests.helpers import TINY_MODEL_ID

CAPS = BackendCapabilities.single(
    BaseModelCapabilities(model_id=TINY_MODEL_ID, feature_dim=64, max_images=3, image_size=32, max_action_dim=32)
)


def rl_spec(tenant: str = "rl", **changes: Any) -> dict[str, Any]:
    """An RL tenant on gym-pusht; without an environment probe compile checks only the simulator name."""
    spec: dict[str, Any] = {
        "tenant": tenant,
        "base_model": TINY_MODEL_ID,
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": ["top"], "image_size": [32, 32], "state_dim": 2, "action_dim": 2},
        "environment": {"simulator": "pusht", "task": "PushT-v0"},
        "scheduling": {"completion_target": 4},
    }
    return _merge(spec, changes)


def _merge(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def creator_for(store) -> TenantCreator:
    return TenantCreator(store, TrainingScheduler(store), CAPS)


def rows(store) -> tuple[int, int]:
    with store.transaction() as s:
        tenants = s.scalar(select(func.count()).select_from(TenantRecord))
        policies = s.scalar(select(func.count()).select_from(TrainingPolicyRecord))
    return tenants, policies


REFUSED = [
    # torch.manual_seed overflows ("Overflow when unpacking long long") when the slot is built.
    ("seed-2**70", {"training": {"seed": 2**70}}, "training.seed", "less than or equal"),
    ("seed-2**64", {"training": {"seed": MAX_TRAINING_SEED + 1}}, "training.seed", "less than or equal"),
    # numpy's default_rng (the SFT producer's sampler) takes no negative seed.
    ("seed-negative", {"training": {"seed": -1}}, "training.seed", "greater than or equal"),
    # ManiSkill seeds numpy's RandomState (< 2**32) with environment.seed + session offsets.
    ("env-seed-2**32", {"environment": {"seed": 2**32}}, "environment.seed", "less than or equal"),
    ("env-seed-2**70", {"environment": {"seed": 2**70}}, "environment.seed", "less than or equal"),
    # Integer columns of training_policies: 32-bit on PostgreSQL.
    ("completion-2**40", {"scheduling": {"completion_target": 2**40}}, "scheduling.completion_target", "less"),
    ("staleness-2**40", {"scheduling": {"max_policy_staleness": 2**40}}, "scheduling.max_policy_staleness", "less"),
]


@pytest.mark.parametrize(("change", "field", "reason"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_spec_the_backend_cannot_run_is_refused_before_anything_is_written(store, change, field, reason):
    creator = creator_for(store)
    with pytest.raises(SpecError) as caught:
        creator.create(rl_spec(**change))
    assert field in caught.value.fields, str(caught.value)
    assert reason in str(caught.value), str(caught.value)
    assert rows(store) == (0, 0)


def test_the_seed_bounds_are_declared_on_the_spec_fields():
    for change, field in (
        ({"training": {"seed": 2**70}}, "training.seed"),
        ({"environment": {"seed": MAX_ENVIRONMENT_SEED + 1}}, "environment.seed"),
    ):
        with pytest.raises(SpecError) as caught:
            parse_workload_spec(rl_spec(**change))
        assert caught.value.fields == [field]


class _BrokenHead(ActionModule):
    """A registered kind whose constructor fails for some configs, as a new head might."""

    kind = "broken_head"

    def __init__(self, config: ActionModuleConfig) -> None:
        super().__init__(config)
        if config.action_chunk > 4:
            raise ValueError(f"broken_head supports action_chunk <= 4, got {config.action_chunk}\nsecond line")

    def loss(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError

    def predict(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError


def test_a_module_the_backend_cannot_build_is_a_spec_problem_with_its_first_line(store, monkeypatch):
    monkeypatch.setitem(ACTION_MODULES, "broken_head", _BrokenHead)
    creator = creator_for(store)
    spec = rl_spec(task="eval", environment=None, action_module={"kind": "broken_head"})
    with pytest.raises(SpecError) as caught:
        creator.create(_merge(spec, {"observation": {"action_chunk": 8}}))
    assert caught.value.problems == [("action_module", "broken_head supports action_chunk <= 4, got 8")]
    assert rows(store) == (0, 0)
    creator.create(_merge(spec, {"observation": {"action_chunk": 4}}))  # the same kind, buildable
    assert rows(store) == (1, 0)


def test_rl_with_a_kind_without_a_tractable_density_is_refused_and_flow_matching_is_accepted(store, monkeypatch):
    monkeypatch.setitem(ACTION_MODULES, "broken_head", _BrokenHead)  # supports_rl = False
    creator = creator_for(store)
    spec = _merge(rl_spec(action_module={"kind": "broken_head"}), {"observation": {"action_chunk": 4}})
    with pytest.raises(SpecError) as caught:
        creator.create(spec)
    assert "action_module.kind" in caught.value.fields and "tractable" in str(caught.value)
    assert rows(store) == (0, 0)
    # flow_matching's RL density is its noise-injected chain (models.action_modules.flow_rl).
    for tenant, advantage in (("flow-gae", "gae"), ("flow-grpo", "grpo")):
        module = creator.create(
            rl_spec(tenant, action_module={"kind": "flow_matching"}, rl={"advantage": advantage})
        ).backend_config.action_module
        assert module["kind"] == "flow_matching" and module["stochastic"]
        assert module["value_head"] is (advantage == "gae")


def test_a_valid_rl_spec_with_oft_mlp_compiles_to_a_stochastic_module_with_a_critic(store):
    creator = creator_for(store)
    tenant = creator.create(rl_spec(training={"seed": MAX_TRAINING_SEED}, environment={"seed": MAX_ENVIRONMENT_SEED}))
    module = tenant.backend_config.action_module
    assert module["kind"] == "oft_mlp" and module["stochastic"] and module["value_head"]
    assert tenant.backend_config.seed == MAX_TRAINING_SEED
    assert rows(store) == (1, 1)
    grpo = creator.create(rl_spec("rl-grpo", rl={"advantage": "grpo"}))
    assert grpo.backend_config.action_module["value_head"] is False
    assert rows(store) == (2, 2)


def test_compiling_builds_on_the_meta_device_and_draws_no_random_numbers():
    compiler = SpecCompiler(CAPS)
    before = torch.random.get_rng_state()
    compiler.compile(parse_workload_spec(rl_spec(action_module={"kind": "oft_mlp", "size": "base"})))
    compiler.compile(parse_workload_spec(rl_spec(task="eval", action_module={"kind": "flow_matching"})))
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.fixture(scope="module")
def training_service(tmp_path_factory):
    from joynexus.models.backbone import BackboneSource
    from joynexus.services.training.service import TrainingModelService

    return TrainingModelService(BackboneSource(preset="tiny"), tmp_path_factory.mktemp("ckpt"), num_threads=1)


@pytest.mark.parametrize(
    "change",
    [
        {"training": {"seed": MAX_TRAINING_SEED}},
        {"rl": {"advantage": "grpo"}},
        {"task": "eval", "action_module": {"kind": "flow_matching", "size": "small"}},
        {"observation": {"state_dim": 0, "action_chunk": 16}},
        {"action_module": {"kind": "flow_matching", "size": "tiny"}},
    ],
    ids=["max-seed", "grpo", "eval-flow-matching", "no-state", "rl-flow-matching"],
)
def test_what_compiles_builds_a_slot_in_the_training_model_service(training_service, change):
    caps = BackendCapabilities.single(training_service.capabilities())
    spec = parse_workload_spec(rl_spec(f"slot-{len(training_service.tenants())}", **change))
    config = SpecCompiler(caps).compile(spec)
    training_service.add_tenant(config, resume=False)
    assert config.tenant_id in training_service.tenants()
