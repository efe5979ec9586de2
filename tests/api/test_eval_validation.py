"""An evaluation request is checked when it is submitted (issue 16): the version exists (served or
as a checkpoint), the simulator is registered, the task exists, and the simulator gives the cameras
and state the tenant's schema needs. A bad request is a 422 naming the field; nothing starts."""

from __future__ import annotations

import time

import pytest

from tests.helpers import sft_spec, write_dataset_for

# gym-pusht's PushT-v0 with the "top" camera gives state [agent x, agent y] and takes (x, y).
PUSHT = {"simulator": "pusht", "task": "PushT-v0", "max_episode_steps": 3}


def fields(response) -> dict[str, str]:
    return {p["field"]: p["reason"] for p in response.json()["problems"]}


def wait_done(api, tenant, workload_id, timeout_s=120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = api.client.get(f"/v1/workloads/{workload_id}", headers=tenant.headers).json()
        if status["state"] in ("completed", "failed", "cancelled"):
            return status
        time.sleep(0.1)
    raise AssertionError(f"workload {workload_id} still {status['state']} after {timeout_s} s")


@pytest.fixture(scope="module")
def pusher(api):
    """An SFT tenant whose schema fits gym-pusht (camera "top", state 2, action 2)."""
    from tests.api.conftest import TenantHandle

    spec = sft_spec(
        "eval-pusher", api.data_dir / "datasets" / "eval-pusher", cameras=("top",), state_dim=2, action_dim=2,
        action_chunk=1, jobs=1,
    )  # fmt: skip
    write_dataset_for(spec, episodes=2, length=8)
    response = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert response.status_code == 201, response.text
    return TenantHandle(spec["tenant"], response.json()["key"]["api_key"], spec)


def evaluate(api, tenant, **body):
    return api.client.post("/v1/workloads", json={"task": "eval", **body}, headers=tenant.headers)


def no_evaluations(api, tenant) -> bool:
    listed = api.client.get("/v1/workloads", headers=tenant.headers).json()
    items = listed["workloads"] if isinstance(listed, dict) else listed
    return not [w for w in items if w["task"] == "eval"]


def test_an_unknown_simulator_is_refused_naming_environment_simulator(api, pusher):
    r = evaluate(api, pusher, environment={"simulator": "mujoco-nope", "task": "Anything-v0"})
    assert r.status_code == 422, r.text
    assert "not a registered simulator" in fields(r)["environment.simulator"]
    assert "pusht" in fields(r)["environment.simulator"]  # says what is known


def test_an_unknown_task_is_refused_naming_environment_task(api, pusher):
    r = evaluate(api, pusher, environment={"simulator": "pusht", "task": "PushT-nope-v9"})
    assert r.status_code == 422, r.text
    assert "PushT-nope-v9" in fields(r)["environment.task"]


def test_a_simulator_without_the_tenants_cameras_is_refused_naming_environment_cameras(api):
    arm = api.tenant("eval-arm")  # cameras front + wrist: gym-pusht renders only "top"
    r = evaluate(api, arm, environment=PUSHT)
    assert r.status_code == 422, r.text
    assert "front" in fields(r)["environment.cameras"] and "top" in fields(r)["environment.cameras"]
    assert no_evaluations(api, arm)


def test_a_task_whose_state_does_not_fit_the_schema_is_refused(api, pusher):
    # PushT-reach gives a 4-dim state; the tenant's schema has 2.
    r = evaluate(api, pusher, environment={"simulator": "pusht", "task": "PushT-reach-v0"})
    assert r.status_code == 422, r.text
    assert "state_dim 4" in fields(r)["environment.task"]


def test_a_malformed_environment_names_its_field(api, pusher):
    r = evaluate(api, pusher, environment={"simulator": "pusht", "task": "PushT-v0", "num_envs": 0})
    assert r.status_code == 422 and "environment.num_envs" in fields(r)


def test_a_version_that_exists_nowhere_is_refused_naming_version(api, pusher):
    r = evaluate(api, pusher, version=99, environment=PUSHT)
    assert r.status_code == 422, r.text
    assert "no policy version 99" in fields(r)["version"]
    assert no_evaluations(api, pusher)


def test_a_tenant_without_an_environment_must_name_one(api, pusher):
    r = evaluate(api, pusher)
    assert r.status_code == 422 and "environment" in fields(r)


def test_a_checkpointed_version_that_is_not_served_is_evaluated(api, pusher):
    from tests.api.conftest import sample_batch, wire

    batch = wire(sample_batch(pusher.spec, 2, seed=0))
    trained = api.client.post("/v1/train_batch", json=batch, headers=pusher.headers)
    assert trained.status_code == 200, trained.text
    version = trained.json()["version"]
    assert api.client.post("/v1/save", json={}, headers=pusher.headers).status_code == 200
    served = api.client.get("/v1/versions", headers=pusher.headers).json()["serving_versions"]
    assert version not in served
    r = evaluate(api, pusher, version=version, episodes=1, environment=PUSHT)
    assert r.status_code == 202, r.text
    done = wait_done(api, pusher, r.json()["workload_id"])
    assert done["state"] == "completed", done
    assert done["result"]["policy_version"] == version and done["result"]["episodes"] == 1
