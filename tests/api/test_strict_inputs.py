"""Issue 41.7b: bad input that answered 500 or was dropped without a word. A NUL byte in
dataset.root is refused by name (it was a 500); a route refuses a body it does not read (the
futures optim_step took `lr: 5` with 202 and applied nothing; now it takes the blocking call's
body); a string where a spec takes a number is refused, not coerced, while YAML's `1e-3` in a
spec file still reads as the number it is."""

from __future__ import annotations

import copy

import pytest

from joynexus.protocol.spec_yaml import load_spec_yaml
from joynexus.spec import SpecError, parse_workload_spec
from tests.api.conftest import wire


def problems(response) -> dict[str, str]:
    return {p["field"]: p["reason"] for p in response.json()["problems"]}


@pytest.mark.parametrize(
    ("path", "value", "field", "reason"),
    [
        (("dataset", "root"), "/data/a\x00b", "dataset.root", "NUL byte"),
        (("observation", "state_dim"), "4", "observation.state_dim", "not the string '4'"),
        (("observation", "image_size"), ["32", 32], "observation.image_size", "not the string '32'"),
        (("training", "learning_rate"), "0.001", "training.learning_rate", "not the string '0.001'"),
        (("observation", "action_dim"), True, "observation.action_dim", "expected a number, not True"),
    ],
)
def test_tenant_create_refuses_a_nul_path_and_coerced_numbers_by_name(api, path, value, field, reason):
    spec = api.spec("strict")
    spec[path[0]][path[1]] = value
    answer = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert answer.status_code == 422, answer.text
    assert reason in problems(answer)[field], answer.text


def test_spec_files_read_yaml_exponents_as_numbers():
    data = load_spec_yaml("learning_rate: 1e-3\nbig: 2E5\nquoted: '1e-3'\nword: e5\n")
    assert data == {"learning_rate": 0.001, "big": 200000.0, "quoted": "1e-3", "word": "e5"}


def test_a_valid_spec_with_numbers_still_parses(api):
    spec = copy.deepcopy(api.spec("strict-ok"))
    spec["training"]["learning_rate"] = 1  # an int where a float goes is a number as written
    assert parse_workload_spec(spec).training.learning_rate == 1.0
    spec["observation"]["state_dim"] = 4.5
    with pytest.raises(SpecError):
        parse_workload_spec(spec)


def test_the_futures_optim_step_applies_its_body_and_refuses_a_bad_one(api):
    t = api.tenant("strict-fut")
    assert api.client.post("/v1/futures/forward_backward", json=wire(t.batch(2)), headers=t.headers).status_code == 202
    refused = api.client.post("/v1/futures/optim_step", json={"lr": 5}, headers=t.headers)
    assert refused.status_code == 422 and "lr" in problems(refused), refused.text
    unknown = api.client.post("/v1/futures/optim_step", json={"learning_rate": 0.1}, headers=t.headers)
    assert unknown.status_code == 422 and "learning_rate" in problems(unknown), unknown.text
    step = api.client.post("/v1/futures/optim_step", json={"lr": 0.25}, headers=t.headers)
    assert step.status_code == 202, step.text
    done = api.client.get(f"/v1/futures/{step.json()['future_id']}", params={"wait_s": 30}, headers=t.headers)
    assert done.status_code == 200 and done.json()["lr"] == 0.25, done.text


def test_a_route_that_takes_no_body_refuses_one_naming_its_fields(api):
    t = api.tenant("strict-nobody")
    refused = api.client.post("/v1/params/export", json={"version": 3}, headers=t.headers)
    assert refused.status_code == 422, refused.text
    assert "takes no body" in problems(refused)["body"] and "['version']" in problems(refused)["body"]
    assert api.client.post("/v1/params/export", headers=t.headers).status_code == 200  # none: as before
    assert api.client.post("/v1/params/export", json={}, headers=t.headers).status_code == 200  # an empty one too
