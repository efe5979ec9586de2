"""Issue 26: what a tenant sends or reads that used to leak, drift or break silently — event numbers
that counted every tenant's activity (10e), observation values that overflow into NaN actions (10f),
and a submitted spec whose fields (but one) were ignored without a word (10g)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from joynexus.api.errors import InvalidInput
from joynexus.api.gateway.tensors import finite_actions
from tests.api.conftest import wire
from tests.api.test_upper_layer import fields, wait_done


def events(api, t, workload_id, after=0):
    r = api.client.get(f"/v1/workloads/{workload_id}/events", params={"after": after}, headers=t.headers)
    assert r.status_code == 200, r.text
    return r.json()["events"]


def submitted_and_cancelled(api, t) -> str:
    r = api.client.post("/v1/workloads", json={"jobs": 50}, headers=t.headers)
    assert r.status_code == 202, r.text
    workload_id = r.json()["workload_id"]
    assert api.client.post(f"/v1/workloads/{workload_id}/cancel", headers=t.headers).status_code == 200
    assert wait_done(api, t, workload_id)["state"] == "cancelled"
    return workload_id


def test_event_numbers_count_only_the_workloads_own_events(api):
    busy, quiet = api.tenant("busy"), api.tenant("quiet")
    theirs = submitted_and_cancelled(api, busy)
    mine = submitted_and_cancelled(api, quiet)

    for tenant, workload_id in ((busy, theirs), (quiet, mine)):
        seqs = [e["seq"] for e in events(api, tenant, workload_id)]
        assert len(seqs) >= 2 and seqs == list(range(1, len(seqs) + 1))  # nothing of the other tenant shows
    assert [e["seq"] for e in events(api, quiet, mine, after=1)][:1] == [2]  # `after` continues from a number
    r = api.client.get(f"/v1/workloads/{mine}/stream", headers=quiet.headers)
    ids = [int(line[4:]) for line in r.text.splitlines() if line.startswith("id: ")]
    assert len(ids) >= 2 and ids == list(range(1, len(ids) + 1))


def test_observation_values_beyond_the_state_range_are_refused_naming_state(api):
    t = api.tenant("overflow")
    assert api.client.post("/v1/train_batch", json=wire(t.batch(2)), headers=t.headers).status_code == 200
    assert api.client.post("/v1/weights/load", json={}, headers=t.headers).status_code == 200
    batch = t.batch(2, seed=3)
    for value in (3e38, -1e12):
        state = batch["state"].copy()
        state[1, 0] = value
        body = {"observations": wire({"images": batch["images"], "state": state})}
        r = api.client.post("/v1/predict", json=body, headers=t.headers)
        assert r.status_code == 422, r.text
        assert "out of range" in fields(r)["state"] and "[1, 0]" in fields(r)["state"]
    body = {"observations": wire({"images": batch["images"], "state": batch["state"]})}
    r = api.client.post("/v1/predict", json=body, headers=t.headers)
    assert r.status_code == 200, r.text


def test_non_finite_actions_never_reach_a_robot():
    ok = np.zeros((3, 2, 2), dtype=np.float32)
    assert finite_actions(ok) is ok
    bad = ok.copy()
    bad[1, 0, 1] = np.nan
    bad[2, 1, 0] = np.inf
    with pytest.raises(InvalidInput) as raised:
        finite_actions(bad)
    assert raised.value.problems[0][0] == "state" and "samples [1, 2]" in raised.value.problems[0][1]


def test_a_submitted_spec_may_change_only_what_a_workload_applies(api):
    t = api.tenant("submit")
    spec = copy.deepcopy(t.spec)
    spec["training"] = {**spec.get("training", {}), "learning_rate": 0.5}
    spec["rl"] = {"value_coef": 2.0}
    spec["scheduling"] = {**spec.get("scheduling", {}), "completion_target": 1, "priority": 7}
    r = api.client.post("/v1/workloads", json={"spec": spec}, headers=t.headers)
    assert r.status_code == 422, r.text
    refused = fields(r)
    assert set(refused) == {"spec.training.learning_rate", "spec.rl.value_coef", "spec.scheduling.priority"}
    assert "0.5 differs from your tenant's" in refused["spec.training.learning_rate"]
    assert "completion_target" in r.json()["message"]
    assert api.client.get("/v1/workloads", headers=t.headers).json() == []  # nothing was submitted

    applied = copy.deepcopy(t.spec)
    applied["scheduling"] = {**applied.get("scheduling", {}), "completion_target": 1}
    r = api.client.post("/v1/workloads", json={"spec": applied}, headers=t.headers)
    assert r.status_code == 202 and r.json()["target_jobs"] == 1, r.text
    wait_done(api, t, r.json()["workload_id"])
