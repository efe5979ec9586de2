"""Details of daily use over the tenant API (issue 30): predict defaults to the tenant's own
instruction, a flow-matching predict is deterministic unless seeds are given, a checkpointed version
that is not served says how to serve it, `tenant list` shows no image size for a state-only tenant,
and a PredictResult's repr carries no raw tensor bytes."""

from __future__ import annotations

import re

import numpy as np
from typer.testing import CliRunner

from joynexus.cli import app
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import Tensor
from tests.api.conftest import ADMIN_KEY, wire
from tests.helpers import sft_spec, write_dataset_for


def _predict(api, t, observations: dict, **fields) -> np.ndarray:
    r = api.client.post("/v1/predict", json={"observations": wire(observations), **fields}, headers=t.headers)
    assert r.status_code == 200, r.text
    return Tensor.model_validate(r.json()["actions"]).to_numpy()


def _served(api, prefix: str, shape: str = "arm"):
    t = api.tenant(prefix, shape)
    assert api.client.post("/v1/train_batch", json=wire(t.batch(4)), headers=t.headers).status_code == 200
    assert api.client.post("/v1/weights/load", json={}, headers=t.headers).json()["version"] == 1
    return t


def test_predict_without_instructions_uses_the_tenants_instruction(api):
    t = _served(api, "instr")
    batch = t.batch(2, seed=3)
    obs = {"images": batch["images"], "state": batch["state"]}
    default = _predict(api, t, obs)
    own = _predict(api, t, {**obs, "instructions": [t.spec["observation"]["instruction"]] * 2})
    empty = _predict(api, t, {**obs, "instructions": ["", ""]})
    np.testing.assert_array_equal(default, own)
    assert not np.allclose(default, empty)  # the instruction reaches the backbone: "" is another input


def test_flow_matching_predict_is_deterministic_unless_seeds_are_given(api):
    t = _served(api, "flow-det", "flow")
    batch = t.batch(3, seed=5)
    obs = {"images": batch["images"][[0, 1, 0]], "state": batch["state"][[0, 1, 0]]}
    first, second = _predict(api, t, obs), _predict(api, t, obs)
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(first[0], first[2])  # the same observation, the same actions
    seeded = _predict(api, t, obs, seeds=[11, 12, 13])
    assert not np.allclose(seeded, first)  # other noise when asked for
    np.testing.assert_array_equal(seeded, _predict(api, t, obs, seeds=[11, 12, 13]))


def test_predict_of_a_checkpointed_version_not_served_says_how_to_serve_it(api):
    t = _served(api, "unserved")  # v1 served
    assert api.client.post("/v1/save", json={"include_optim": False}, headers=t.headers).status_code == 200
    api.client.post("/v1/train_batch", json=wire(t.batch(4, seed=1)), headers=t.headers)  # v2 trained
    api.client.post("/v1/save", json={"include_optim": False}, headers=t.headers)
    api.client.post("/v1/weights/load", json={}, headers=t.headers)  # v2 served too
    api.client.post("/v1/train_batch", json=wire(t.batch(4, seed=2)), headers=t.headers)
    assert api.client.post("/v1/save", json={}, headers=t.headers).json()["policy_version"] == 3
    batch = t.batch(1)
    body = {"observations": wire({"images": batch["images"], "state": batch["state"]}), "policy_version": 3}
    r = api.client.post("/v1/predict", json=body, headers=t.headers)
    assert r.status_code == 404
    message = r.json()["message"]
    assert "checkpointed but not served" in message and '/v1/weights/load {"version": 3}' in message, message
    never = api.client.post("/v1/predict", json={**body, "policy_version": 42}, headers=t.headers)
    assert never.status_code == 404 and "weights/load" not in never.json()["message"]
    assert api.client.post("/v1/weights/load", json={"version": 3}, headers=t.headers).json()["version"] == 3
    assert api.client.post("/v1/predict", json=body, headers=t.headers).status_code == 200


def test_tenant_list_shows_no_image_size_for_a_state_only_tenant(api, live_server):
    spec = sft_spec("blind-list", api.data_dir / "datasets" / "blind-list", cameras=(), jobs=1)
    write_dataset_for(spec, episodes=2, length=12)
    assert api.client.post("/v1/admin/tenants", json=spec, headers=api.admin).status_code == 201
    seeing = api.tenant("seeing-list")
    env = {"JOYNEXUS_URL": live_server, "JOYNEXUS_ADMIN_KEY": ADMIN_KEY, "COLUMNS": "250"}
    listed = CliRunner().invoke(app, ["tenant", "list"], env=env)
    assert listed.exit_code == 0, listed.output
    rows = {line.split("│")[1].strip(): line for line in listed.output.splitlines() if line.count("│") > 5}
    assert not re.search(r"\d+x\d+", rows["blind-list"]), rows["blind-list"]
    assert "32x32" in rows[seeing.tenant_id]


def test_a_predict_result_repr_names_shapes_not_bytes():
    actions = np.arange(2 * 50 * 7, dtype=np.float32).reshape(2, 50, 7)
    result = s.PredictResult(
        policy_version=3, actions=Tensor.from_numpy(actions), batch_samples=2, device_seconds=0.01
    )
    text = repr(result)
    assert "b'" not in text and "\\x" not in text and len(text) < 400, text
    assert "shape=[2, 50, 7]" in text and "float32" in text and "policy_version=3" in text
