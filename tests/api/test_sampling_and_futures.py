"""Issue 28 over HTTP: `sample` / `compute_logprobs` on the training slot, and futures of lower-layer
calls (`POST /v1/futures/{call}`, `GET /v1/futures/{id}`): per-tenant order, the blocking calls'
answers and errors, bounded kept results."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from joynexus.protocol.wire import Tensor
from tests.api.conftest import wire

_ids = itertools.count(1)


def stochastic_tenant(api, prefix: str):
    """An RL tenant (its oft_mlp head is a Gaussian policy) on gym-pusht."""
    from tests.api.conftest import TenantHandle

    tenant_id = f"{prefix}-{next(_ids)}"
    spec = {
        "tenant": tenant_id,
        "base_model": "joynexus/tiny-smolvlm",
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {"cameras": ["top"], "image_size": [32, 32], "state_dim": 2, "action_dim": 2,
                        "action_chunk": 2, "instruction": "push the T-shaped block onto the target"},
        "environment": {"simulator": "pusht", "task": "PushT-v0", "max_episode_steps": 8},
    }  # fmt: skip
    response = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert response.status_code == 201, response.text
    return TenantHandle(tenant_id, response.json()["key"]["api_key"], spec)


def observations(t, n: int, seed: int = 0) -> dict:
    batch = t.batch(n, seed)
    return wire({"images": batch["images"], "state": batch["state"]})


def array(body: dict, name: str) -> np.ndarray:
    return Tensor.model_validate(body[name]).to_numpy()


def slot(api, tenant_id: str) -> dict:
    return api.cluster.training.target.tenant_state(tenant_id)


def collect(api, t, future_id: str, wait_s: float = 30.0):
    return api.client.get(f"/v1/futures/{future_id}", params={"wait_s": wait_s}, headers=t.headers)


def test_sample_is_seeded_and_its_log_probs_are_what_compute_logprobs_gives(api):
    t = stochastic_tenant(api, "samp")
    before = slot(api, t.tenant_id)
    body = {"observations": observations(t, 2), "n": 3, "seed": 7}
    first = api.client.post("/v1/sample", json=body, headers=t.headers)
    assert first.status_code == 200, first.text
    out = first.json()
    actions, log_probs = array(out, "actions"), array(out, "log_probs")
    assert actions.shape == (2, 3, 2, 2) and log_probs.shape == (2, 3) and out["seed"] == 7 and out["version"] == 0
    again = api.client.post("/v1/sample", json=body, headers=t.headers).json()
    np.testing.assert_array_equal(array(again, "actions"), actions)  # same seed, same draws
    other = api.client.post("/v1/sample", json={**body, "seed": 8}, headers=t.headers).json()
    assert not np.allclose(array(other, "actions"), actions)
    assert not np.allclose(actions[:, 0], actions[:, 1])  # n distinct draws per observation
    # Score the drawn chunks (each observation repeated n times): the sampler's own log-probs.
    obs = t.batch(2, 0)
    scored = api.client.post(
        "/v1/compute_logprobs",
        json=wire(
            {
                "images": np.repeat(obs["images"], 3, axis=0),
                "state": np.repeat(obs["state"], 3, axis=0),
                "action": actions.reshape(6, 2, 2),
            }
        ),
        headers=t.headers,
    )
    assert scored.status_code == 200, scored.text
    np.testing.assert_allclose(array(scored.json(), "log_probs"), log_probs.reshape(6), rtol=1e-4, atol=1e-4)
    # A cooler temperature draws closer to the mean: higher density there.
    cool = api.client.post("/v1/sample", json={**body, "temperature": 0.25}, headers=t.headers).json()
    assert array(cool, "log_probs").mean() > log_probs.mean()
    after = slot(api, t.tenant_id)  # forward only: nothing moved
    assert after["version"] == 0 and all(torch.equal(v, after["module"][k]) for k, v in before["module"].items())


def test_sampling_names_a_head_that_cannot_do_it(api):
    arm, flow = api.tenant("samp-det"), api.tenant("samp-flow", "flow")
    refused = api.client.post("/v1/sample", json={"observations": observations(arm, 2)}, headers=arm.headers)
    assert refused.status_code == 422 and "'oft_mlp' (stochastic=False) is deterministic" in refused.text
    scored = api.client.post("/v1/compute_logprobs", json=wire(arm.batch(2)), headers=arm.headers)
    assert scored.status_code == 422 and "'oft_mlp' (stochastic=False)" in scored.text
    # A flow-matching head samples (n noise draws) but has no density.
    drawn = api.client.post("/v1/sample", json={"observations": observations(flow, 2), "n": 2, "seed": 1},
                            headers=flow.headers)  # fmt: skip
    assert drawn.status_code == 200, drawn.text
    assert array(drawn.json(), "actions").shape == (2, 2, 4, 5) and drawn.json()["log_probs"] is None
    no_density = api.client.post("/v1/compute_logprobs", json=wire(flow.batch(2)), headers=flow.headers)
    assert no_density.status_code == 422 and "'flow_matching'" in no_density.text
    hot = api.client.post("/v1/sample", json={"observations": observations(flow, 1), "temperature": 2.0},
                          headers=flow.headers)  # fmt: skip
    assert hot.status_code == 422 and "temperature" in hot.text
    too_many = api.client.post("/v1/sample", json={"observations": observations(flow, 1), "n": 65},
                               headers=flow.headers)  # fmt: skip
    assert too_many.status_code == 422 and "n" in {p["field"].split(".")[-1] for p in too_many.json()["problems"]}


def test_futures_run_in_order_and_answer_what_the_blocking_calls_answer(api):
    blocking, pipelined = api.tenant("fut-b"), api.tenant("fut-p")
    batches = [wire(blocking.batch(3, seed=s)) for s in (1, 2)]
    expected = [api.client.post("/v1/forward_backward", json=b, headers=blocking.headers).json() for b in batches]
    expected_step = api.client.post("/v1/optim_step", headers=blocking.headers).json()
    submitted = [api.client.post("/v1/futures/forward_backward", json=b, headers=pipelined.headers) for b in batches]
    submitted.append(api.client.post("/v1/futures/optim_step", headers=pipelined.headers))
    assert [r.status_code for r in submitted] == [202, 202, 202], [r.text for r in submitted]
    ids = [r.json()["future_id"] for r in submitted]
    # Collected in reverse: the step still ran after both microbatches.
    step = collect(api, pipelined, ids[2])
    assert step.status_code == 200 and step.headers["x-joynexus-future-kind"] == "optim_step"
    got = [collect(api, pipelined, i).json() for i in ids[:2]]
    assert [g["accumulated_microbatches"] for g in got] == [1, 2]
    assert [g["loss"] for g in got] == [e["loss"] for e in expected]
    assert step.json()["loss"] == expected_step["loss"] and step.json()["version"] == 1
    a, b = slot(api, blocking.tenant_id)["module"], slot(api, pipelined.tenant_id)["module"]
    assert all(torch.equal(v, b[k]) for k, v in a.items())
    # Kept results can be collected again; another tenant's id is not found.
    assert collect(api, pipelined, ids[0]).json() == got[0]
    assert collect(api, blocking, ids[0]).status_code == 404


def test_a_failed_future_answers_the_blocking_calls_error_and_bad_input_is_refused_at_submission(api):
    t = api.tenant("fut-err")
    step = api.client.post("/v1/futures/optim_step", headers=t.headers)
    assert step.status_code == 202
    failed = collect(api, t, step.json()["future_id"])
    assert failed.status_code == 409 and "forward_backward first" in failed.json()["message"]
    bad = wire(t.batch(2))
    bad["state"] = wire({"s": np.zeros((2, 9), np.float32)})["s"]
    refused = api.client.post("/v1/futures/forward_backward", json=bad, headers=t.headers)
    assert refused.status_code == 422 and "state.shape" in {p["field"] for p in refused.json()["problems"]}
    unknown = api.client.get("/v1/futures/fut-1-0123456789ab", headers=t.headers)
    assert unknown.status_code == 404 and unknown.json()["problems"][0]["field"] == "future_id"
    malformed = api.client.get("/v1/futures/not-a-future", headers=t.headers)
    assert malformed.status_code == 422


def test_predict_sample_and_compute_logprobs_futures(api):
    t = stochastic_tenant(api, "fut-pred")
    api.client.post("/v1/weights/load", json={}, headers=t.headers)
    body = {"observations": observations(t, 2), "seeds": [1, 2]}
    blocking = api.client.post("/v1/predict", json=body, headers=t.headers).json()
    ids = [
        api.client.post("/v1/futures/predict", json=body, headers=t.headers).json()["future_id"],
        api.client.post("/v1/futures/sample", json={"observations": observations(t, 2), "n": 2, "seed": 3},
                        headers=t.headers).json()["future_id"],  # fmt: skip
        api.client.post("/v1/futures/compute_logprobs", json=wire(t.batch(2)), headers=t.headers).json()["future_id"],
    ]
    predicted, sampled, scored = (collect(api, t, i) for i in ids)
    np.testing.assert_array_equal(array(predicted.json(), "actions"), array(blocking, "actions"))
    direct = api.client.post("/v1/sample", json={"observations": observations(t, 2), "n": 2, "seed": 3},
                             headers=t.headers).json()  # fmt: skip
    np.testing.assert_array_equal(array(sampled.json(), "actions"), array(direct, "actions"))
    assert array(scored.json(), "log_probs").shape == (2,)


@pytest.mark.parametrize("wait_s", [0.0])
def test_a_pending_future_answers_202(api, wait_s):
    t = api.tenant("fut-wait")
    ids = [
        api.client.post("/v1/futures/forward_backward", json=wire(t.batch(8, seed=s)), headers=t.headers).json()
        for s in range(3)
    ]
    last = api.client.get(f"/v1/futures/{ids[-1]['future_id']}", params={"wait_s": wait_s}, headers=t.headers)
    assert last.status_code in (200, 202)
    if last.status_code == 202:
        assert last.json()["state"] in ("pending", "running") and last.json()["kind"] == "forward_backward"
    assert collect(api, t, ids[-1]["future_id"]).json()["accumulated_microbatches"] == 3


def test_one_sampling_call_is_bounded_in_chunks_drawn_blocking_and_as_a_future(api):
    """Issue 41.1 (in part): 512 observations x n=64 ran 43 s and stalled other tenants' calls; one
    call may draw at most max_sampled_chunks_per_request (1,024) chunks, refused naming `n`."""
    t = stochastic_tenant(api, "samp-bound")
    for route in ("/v1/sample", "/v1/futures/sample"):
        refused = api.client.post(route, json={"observations": observations(t, 17), "n": 64}, headers=t.headers)
        assert refused.status_code == 422, refused.text
        reason = {p["field"]: p["reason"] for p in refused.json()["problems"]}["n"]
        assert "1,088 chunks" in reason and "max_sampled_chunks_per_request" in reason
    at_bound = api.client.post("/v1/sample", json={"observations": observations(t, 16), "n": 64}, headers=t.headers)
    assert at_bound.status_code == 200, at_bound.text
    assert array(at_bound.json(), "actions").shape[:2] == (16, 64)
