"""Foreign weights (issue 24.5): weights trained elsewhere installed for a tenant as a new version,
checked tensor by tensor, served, and registered in MLflow with their provenance; an evaluation
declaration (paper 4.2) evaluates target tenants and versions and writes one comparison table."""

from __future__ import annotations

import base64
import hashlib
import json
import time

import pytest
import torch
from safetensors.torch import save as save_safetensors

from joynexus.artifacts import decode_tenant_payload
from joynexus.models.action_modules import build_action_module
from tests.api.conftest import TenantHandle, wire
from tests.helpers import sft_spec, write_dataset_for

PUSHT = {"simulator": "pusht", "task": "PushT-v0", "max_episode_steps": 3}


def foreign_state(t: TenantHandle, seed: int = 123) -> dict[str, torch.Tensor]:
    """The tenant's action module as another trainer would have it: same config, other weights."""
    torch.manual_seed(seed)
    return build_action_module(t.module_config).state_dict()


def install(api, t: TenantHandle, state: dict[str, torch.Tensor], *, admin: bool = False, **extra):
    body = {"weights": base64.b64encode(save_safetensors(state)).decode(), "source": "hf://lab/policy@abc", **extra}
    path = f"/v1/admin/tenants/{t.tenant_id}/weights/install" if admin else "/v1/weights/install"
    return api.client.post(path, json=body, headers=api.admin if admin else t.headers)


def problems(response) -> dict[str, str]:
    return {p["field"]: p["reason"] for p in response.json()["problems"]}


def handle(api, prefix: str, **shape) -> TenantHandle:
    spec = sft_spec(f"{prefix}-{time.monotonic_ns() % 10**8}", api.data_dir / "datasets" / prefix, jobs=1, **shape)
    write_dataset_for(spec, episodes=2, length=8)
    response = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert response.status_code == 201, response.text
    t = TenantHandle(spec["tenant"], response.json()["key"]["api_key"], spec)
    # The compiled module config (with its dims), as the weights' trainer would have used it.
    t.module_config = api.cluster.master.get_tenant(t.tenant_id).backend_config.action_module  # type: ignore[attr-defined]
    return t


@pytest.fixture(scope="module")
def arm(api) -> TenantHandle:
    return handle(api, "foreign-arm")


def test_installed_weights_become_a_served_version_with_provenance_in_mlflow(api, arm):
    state = foreign_state(arm)
    payload = save_safetensors(state)
    r = install(api, arm, state)
    assert r.status_code == 201, r.text
    installed = r.json()
    assert installed["version"] == 1 and installed["installed_by"] == "tenant"
    assert installed["sha256"] == hashlib.sha256(payload).hexdigest()
    # The exported version holds exactly the uploaded tensors, and it is served.
    exported = api.client.post("/v1/params/export", headers=arm.headers).json()
    assert exported["version"] == 1
    module_state, _ = decode_tenant_payload(base64.b64decode(exported["payload"]))
    for name, value in state.items():
        assert torch.equal(module_state[name], value), name
    versions = api.client.get("/v1/versions", headers=arm.headers).json()
    assert 1 in versions["serving_versions"] and 1 in [c["version"] for c in versions["checkpoints"]]
    predicted = api.client.post(
        "/v1/predict",
        json={"observations": wire({k: v for k, v in arm.batch(1).items() if k != "action"}), "policy_version": 1},
        headers=arm.headers,
    )
    assert predicted.status_code == 200 and predicted.json()["policy_version"] == 1, predicted.text
    tags = api.cluster.master.deployment.tracker.model_version_tags(arm.tenant_id, installed["registered_version"])
    assert tags["source"] == "hf://lab/policy@abc" and tags["sha256"] == installed["sha256"]
    assert tags["policy_version"] == "1" and tags["installed_by"] == "tenant"
    # The admin installs for the tenant too; the next version, never a reused number.
    r = install(api, arm, foreign_state(arm, seed=7), admin=True)
    assert r.status_code == 201 and r.json()["version"] == 2 and r.json()["installed_by"] == "admin", r.text
    assert install(api, arm, state, admin=False).status_code == 201  # v3
    forbidden = api.client.post(
        f"/v1/admin/tenants/{arm.tenant_id}/weights/install", json={"weights": "", "source": "x"}, headers=arm.headers
    )
    assert forbidden.status_code == 403


def test_bad_weights_are_refused_naming_the_tensor(api, arm):
    state = foreign_state(arm)
    name = sorted(state)[0]
    first_float = next(k for k in sorted(state) if state[k].is_floating_point())
    cases = {
        f"weights.{name}": ({**state, name: torch.zeros(3, 3, 3)}, "shape (3, 3, 3)"),
        f"weights.{first_float}": ({**state, first_float: torch.full_like(state[first_float], float("nan"))}, "NaN"),
        "weights.extra.bias": ({**state, "extra.bias": torch.zeros(1)}, "not a tensor"),
    }
    missing = dict(state)
    missing.pop(name)
    cases[f"weights.{name} "] = (missing, "missing")
    ints = {**state, first_float: state[first_float].to(torch.int32)}
    cases[f"weights.{first_float}  "] = (ints, "dtype torch.int32")
    before = api.client.get("/v1/versions", headers=arm.headers).json()["training_version"]
    for field, (bad, reason) in cases.items():
        r = install(api, arm, bad)
        assert r.status_code == 422, r.text
        assert reason in problems(r).get(field.strip(), ""), (field, r.json())
    r = api.client.post(
        "/v1/weights/install", json={"weights": "bm90IHNhZmV0ZW5zb3Jz", "source": "x"}, headers=arm.headers
    )
    assert r.status_code == 422 and "not a safetensors file" in problems(r)["weights"], r.text
    r = install(api, arm, state, config={"kind": "flow_matching"})
    assert r.status_code == 422 and "config.kind" in problems(r), r.text
    after = api.client.get("/v1/versions", headers=arm.headers).json()["training_version"]
    assert after == before  # nothing refused changed the tenant


def test_an_evaluation_declaration_compares_targets_in_one_mlflow_table(api):
    shape = dict(cameras=("top",), state_dim=2, action_dim=2, action_chunk=1)
    foreign, own = handle(api, "decl-foreign", **shape), handle(api, "decl-own", **shape)
    assert install(api, foreign, foreign_state(foreign)).status_code == 201
    body = {
        "targets": [{"tenant_id": foreign.tenant_id, "version": 1}, {"tenant_id": own.tenant_id}],
        "episodes": 1,
        "name": "foreign vs own",
        "environment": PUSHT,
    }
    assert api.client.post("/v1/admin/evaluations", json=body, headers=own.headers).status_code == 403
    bad = api.client.post(
        "/v1/admin/evaluations", json={**body, "targets": [{"tenant_id": "nobody"}]}, headers=api.admin
    )
    assert bad.status_code == 422 and "targets[0].tenant_id" in problems(bad), bad.text
    r = api.client.post("/v1/admin/evaluations", json=body, headers=api.admin)
    assert r.status_code == 202, r.text
    declaration = r.json()
    deadline = time.monotonic() + 120
    while declaration["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.2)
        declaration = api.client.get(f"/v1/evaluations/{declaration['declaration_id']}", headers=api.admin).json()
    assert declaration["state"] == "completed", declaration
    table = {row["tenant_id"]: row for row in declaration["table"]}
    assert table[foreign.tenant_id]["version"] == 1 and table[own.tenant_id]["version"] == 0
    for row in table.values():
        assert row["state"] == "completed" and row["episodes"] == 1 and row["success_rate"] is not None, row
    client = api.cluster.master.deployment.tracker.client
    path = client.download_artifacts(declaration["run_id"], "comparison.json")
    with open(path, encoding="utf-8") as f:
        logged = json.load(f)
    assert sorted(row[logged["columns"].index("tenant_id")] for row in logged["data"]) == sorted(table)
    # A target tenant reads its own row only; another tenant gets the 404 of a missing id.
    mine = api.client.get(f"/v1/evaluations/{declaration['declaration_id']}", headers=own.headers).json()
    assert [row["tenant_id"] for row in mine["table"]] == [own.tenant_id] and mine["run_id"] is None
    stranger = handle(api, "decl-stranger")
    r = api.client.get(f"/v1/evaluations/{declaration['declaration_id']}", headers=stranger.headers)
    assert r.status_code == 404
