"""Tenant creator: valid specs become tenants with a policy; bad ones name the field and leave nothing."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from joynexus.core.store import TenantRecord, TrainingPolicyRecord
from joynexus.core.tenants import BackendCapabilities, BaseModelCapabilities
from joynexus.master.tenant_creator import TenantCreator, TenantExists
from joynexus.scheduling.training_scheduler import TrainingScheduler
from joynexus.spec import SpecError
from tests.helpers import TINY_MODEL_ID, sft_spec, write_dataset_for

CAPS = BackendCapabilities.single(
    BaseModelCapabilities(model_id=TINY_MODEL_ID, feature_dim=64, max_images=3, image_size=32, max_action_dim=32)
)


@pytest.fixture(scope="module")
def dataset_spec(tmp_path_factory):
    """One real LeRobot dataset shared by the module's tests (writing one costs a second or two)."""
    root = tmp_path_factory.mktemp("ds") / "good"
    spec = sft_spec("good", root, cameras=("front", "wrist"), state_dim=4, action_dim=3)
    write_dataset_for(spec)
    return spec


def creator_for(store):
    return TenantCreator(store, TrainingScheduler(store), CAPS)


def rows(store):
    with store.transaction() as s:
        tenants = s.scalar(select(func.count()).select_from(TenantRecord))
        policies = s.scalar(select(func.count()).select_from(TrainingPolicyRecord))
    return tenants, policies


def test_a_valid_spec_becomes_a_tenant_with_its_policy(store, dataset_spec):
    creator = creator_for(store)
    tenant = creator.create(dataset_spec)
    assert tenant.schema_signature.startswith("vla1-")
    cfg = tenant.backend_config
    assert cfg.action_module["feature_dim"] == 64 and cfg.action_module["kind"] == "oft_mlp"
    assert cfg.cameras == ("front", "wrist") and cfg.action_dim == 3
    assert rows(store) == (1, 1)
    again = creator.get("good")
    assert again.schema_signature == tenant.schema_signature and again.backend_config == cfg
    policy = creator.scheduler.policy("good", "sft")
    assert policy.max_in_flight == 2 and policy.completion_target == 4


def test_the_signature_depends_on_the_interface_not_on_tenant_or_field_order(store, dataset_spec):
    creator = creator_for(store)
    a = creator.create(dataset_spec)
    reordered = dict(reversed(list({**dataset_spec, "tenant": "other"}.items())))
    b = creator.create(reordered)
    assert a.schema_signature == b.schema_signature


BAD = [
    ({"base_model": "acme/unknown-vlm"}, "base_model", "unknown base model"),
    ({"observation": {"cameras": ["a", "b", "c", "d"]}}, "observation.cameras", "camera slots"),
    ({"observation": {"cameras": ["front", "front"]}}, "observation.cameras", "unique"),
    ({"observation": {"action_dim": 0}}, "observation.action_dim", "greater than or equal to 1"),
    ({"observation": {"action_dim": 33}}, "observation.action_dim", "exceeds"),
    ({"observation": {"image_size": [4, 4]}}, "observation.image_size", "[8, 1024]"),
    ({"action_module": {"kind": "transformer_xl"}}, "action_module", "transformer_xl"),
    ({"action_module": {"size": "huge"}}, "action_module", "huge"),
    ({"tenant": "Bad Name!"}, "tenant", "pattern"),
    ({"task": "dance"}, "task", "dance"),
    ({"dataset": None}, "dataset", "required"),
    ({"dataset": {"root": "/nonexistent/joynexus", "repo_id": "x/y"}}, "dataset.root", "does not exist"),
    ({"training": {"microbatch_size": 64, "samples_per_job": 16}}, "training.microbatch_size", "larger"),
    ({"scheduling": {"max_in_flight_jobs": 0}}, "scheduling.max_in_flight_jobs", "greater than or equal to 1"),
    ({"unexpected": 1}, "unexpected", "Extra inputs"),
]


def _merge(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


@pytest.mark.parametrize(("change", "field", "reason"), BAD, ids=[b[1] + ":" + b[2][:12] for b in BAD])
def test_bad_specs_name_the_field_and_leave_nothing_behind(store, dataset_spec, change, field, reason):
    creator = creator_for(store)
    with pytest.raises(SpecError) as caught:
        creator.create(_merge(dataset_spec, change))
    error = caught.value
    assert any(f.startswith(field) for f in error.fields), str(error)
    assert reason in str(error), str(error)
    assert rows(store) == (0, 0)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"observation": {"action_dim": 5}}, "dataset.action_dim"),
        ({"observation": {"state_dim": 9}}, "dataset.state_dim"),
        ({"observation": {"cameras": ["front", "side"]}}, "dataset.cameras"),
        ({"observation": {"image_size": [64, 64]}}, "dataset.image_size"),
    ],
)
def test_a_dataset_that_does_not_match_the_spec_is_rejected(store, dataset_spec, change, field):
    creator = creator_for(store)
    with pytest.raises(SpecError) as caught:
        creator.create(_merge(dataset_spec, change))
    assert any(f.startswith(field) for f in caught.value.fields), str(caught.value)
    assert rows(store) == (0, 0)


def test_a_duplicate_tenant_is_refused_and_the_first_is_untouched(store, dataset_spec):
    creator = creator_for(store)
    first = creator.create(dataset_spec)
    with pytest.raises(TenantExists, match="already exists"):
        creator.create(_merge(dataset_spec, {"observation": {"action_chunk": 7}}))
    assert creator.get("good").backend_config == first.backend_config
    assert rows(store) == (1, 1)
