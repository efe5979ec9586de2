"""Lower-layer endpoints: training primitives, predict, weights, checkpoints, Training Queue, wire
formats — the happy path and the bad inputs (each answers 4xx naming the field)."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest
import torch

from joynexus.artifacts import decode_tenant_payload, encode_tenant_payload
from joynexus.protocol.wire import MSGPACK_MEDIA_TYPE, Tensor, msgpack_dumps, msgpack_loads, tensor
from tests.api.conftest import MAX_BODY_BYTES, wire


@pytest.fixture(scope="module")
def bad_tenant(api):
    return api.tenant("bad")


def slot_state(api, tenant_id):
    return api.cluster.training.target.tenant_state(tenant_id)


def problems(response) -> dict[str, str]:
    body = response.json()
    assert set(body) == {"code", "message", "problems"}, body
    return {p["field"]: p["reason"] for p in body["problems"]}


def test_train_batch_steps_only_the_callers_slot_and_meters_it(api):
    mine, other = api.tenant("tb"), api.tenant("tb-other")
    other_before = slot_state(api, other.tenant_id)
    r = api.client.post("/v1/train_batch", json=wire(mine.batch(4)), headers=mine.headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["version"], body["optimizer_steps"], body["samples"]) == (1, 1, 4)
    assert np.isfinite(body["loss"]) and body["device_seconds"] > 0
    other_after = slot_state(api, other.tenant_id)
    assert other_after["version"] == 0
    assert all(torch.equal(v, other_after["module"][k]) for k, v in other_before["module"].items())
    usage = api.client.get("/v1/usage", headers=mine.headers).json()
    assert usage["samples_trained"] == 4 and usage["device_seconds"]["training"] >= body["device_seconds"]


def test_forward_backward_and_optim_step_over_http_equal_train_batch(api):
    one, two = api.tenant("fbh", "flow"), api.tenant("fbh", "flow")
    batch = wire(one.batch(3, seed=5))
    stepped = api.client.post("/v1/train_batch", json=batch, headers=one.headers).json()
    fb = api.client.post("/v1/forward_backward", json=batch, headers=two.headers).json()
    assert fb["accumulated_microbatches"] == 1 and fb["version"] == 0
    applied = api.client.post("/v1/optim_step", headers=two.headers).json()
    assert applied["loss"] == stepped["loss"] and applied["version"] == stepped["version"] == 1
    a, b = slot_state(api, one.tenant_id)["module"], slot_state(api, two.tenant_id)["module"]
    assert all(torch.equal(v, b[k]) for k, v in a.items())
    again = api.client.post("/v1/optim_step", headers=two.headers)
    assert again.status_code == 409 and "forward_backward first" in again.json()["message"]


def test_advantage_weighted_forward_backward_needs_one_advantage_per_sample(api):
    t = api.tenant("adv")
    batch = wire(t.batch(4))
    r = api.client.post(
        "/v1/forward_backward",
        json={**batch, "loss": "advantage_weighted", "advantages": wire({"a": np.ones(4, np.float32)})["a"]},
        headers=t.headers,
    )
    assert r.status_code == 200, r.text
    missing = api.client.post("/v1/forward_backward", json={**batch, "loss": "advantage_weighted"}, headers=t.headers)
    assert missing.status_code == 422 and "advantages" in problems(missing)
    wrong = api.client.post(
        "/v1/forward_backward",
        json={**batch, "loss": "advantage_weighted", "advantages": wire({"a": np.ones(3, np.float32)})["a"]},
        headers=t.headers,
    )
    assert problems(wrong)["advantages.shape"] == "expected (4,), got (3,)"
    unknown = api.client.post("/v1/forward_backward", json={**batch, "loss": "ppo"}, headers=t.headers)
    assert unknown.status_code == 422 and "loss" in problems(unknown)


@pytest.mark.parametrize(
    ("change", "field", "needle"),
    [
        (lambda b: {**b, "images": b["images"].astype(np.int32)}, "images.dtype", "'int32' is not accepted"),
        (lambda b: {**b, "images": b["images"][:, :1]}, "images.shape", "expected (4, 2, 3, 32, 32)"),
        (lambda b: {**b, "images": b["images"][..., :16]}, "images.shape", "got (4, 2, 3, 32, 16)"),
        (lambda b: {**b, "images": b["images"] * 300}, "images", "[0, 1]"),
        (lambda b: {**b, "state": np.full((4, 4), np.nan, np.float32)}, "state", "NaN"),
        (lambda b: {**b, "state": b["state"][:, :3]}, "state.shape", "expected (4, 4)"),
        (lambda b: {**b, "action": b["action"][:, :1]}, "action.shape", "expected (4, 2, 3)"),
        (lambda b: {**b, "action_is_pad": np.zeros((4, 2), np.float32)}, "action_is_pad.dtype", "bool"),
        (lambda b: {**b, "instructions": ["a"] * 3}, "instructions", "expected 4 strings"),
        (lambda b: {**b, "images": np.zeros((0, 2, 3, 32, 32), np.float32)}, "images", "N >= 1"),
        (lambda b: {k: v for k, v in b.items() if k != "action"}, "action", "Field required"),
        (lambda b: {**b, "tenant_id": ["someone-else"] * 4}, "tenant_id", "Extra inputs"),
    ],
)
def test_bad_training_batches_answer_422_with_field_and_reason(api, bad_tenant, change, field, needle):
    t = bad_tenant
    r = api.client.post("/v1/train_batch", json=wire(change(t.batch(4))), headers=t.headers)
    assert r.status_code == 422, r.text
    found = problems(r)
    assert field in found and needle in found[field], found
    assert "Traceback" not in r.text
    assert slot_state(api, t.tenant_id)["version"] == 0  # nothing trained


def test_bytes_that_do_not_match_the_declared_shape_are_422(api):
    t = api.tenant("bytes")
    body = wire(t.batch(2))
    body["state"] = {"dtype": "float32", "shape": [2, 4], "data": body["state"]["data"][:-8]}
    r = api.client.post("/v1/train_batch", json=body, headers=t.headers)
    assert r.status_code == 422 and "needs 32" in r.json()["message"]


def test_oversize_payloads_are_413_before_any_work(api):
    t = api.tenant("big")
    big = np.zeros((1, 2, 3, 32, 32 * 200), np.float32)  # ~4.9 MB, over the test server's 4 MiB cap
    r = api.client.post("/v1/train_batch", json=wire({**t.batch(1), "images": big}), headers=t.headers)
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large"
    assert str(MAX_BODY_BYTES) in r.json()["message"]


def test_malformed_json_and_msgpack_bodies_are_422(api):
    t = api.tenant("junk")
    as_json = {**t.headers, "Content-Type": "application/json"}
    as_msgpack = {**t.headers, "Content-Type": MSGPACK_MEDIA_TYPE}
    r = api.client.post("/v1/train_batch", content=b"{not json", headers=as_json)
    assert r.status_code == 422
    r = api.client.post("/v1/train_batch", content=b"\xc1\xc1", headers=as_msgpack)
    assert r.status_code == 422 and problems(r)["body"].startswith("not valid msgpack")
    ext = msgpack.packb({"images": msgpack.ExtType(1, b"x")})
    r = api.client.post("/v1/train_batch", content=ext, headers=as_msgpack)
    assert r.status_code == 422 and "ext type" in r.json()["message"]


def test_msgpack_requests_and_answers_carry_raw_tensor_bytes(api):
    t = api.tenant("mp")
    batch = {k: tensor(v).model_dump() for k, v in t.batch(2).items()}
    headers = {**t.headers, "Content-Type": MSGPACK_MEDIA_TYPE, "Accept": MSGPACK_MEDIA_TYPE}
    r = api.client.post("/v1/train_batch", content=msgpack_dumps(batch), headers=headers)
    assert r.status_code == 200 and r.headers["content-type"] == MSGPACK_MEDIA_TYPE
    assert msgpack_loads(r.content)["version"] == 1
    api.client.post("/v1/weights/load", json={}, headers=t.headers)
    obs = {"observations": {"images": batch["images"], "state": batch["state"]}}
    r = api.client.post("/v1/predict", content=msgpack_dumps(obs), headers=headers)
    actions = msgpack_loads(r.content)["actions"]
    assert isinstance(actions["data"], bytes) and Tensor.model_validate(actions).to_numpy().shape == (2, 2, 3)


def test_an_idempotency_key_applies_a_step_once_and_replays_the_answer(api):
    t = api.tenant("idem")
    batch = wire(t.batch(2))
    headers = {**t.headers, "Idempotency-Key": "step-1"}
    first = api.client.post("/v1/train_batch", json=batch, headers=headers)
    second = api.client.post("/v1/train_batch", json=batch, headers=headers)
    assert first.json() == second.json() and second.headers["idempotent-replayed"] == "true"
    assert slot_state(api, t.tenant_id)["version"] == 1
    reused = api.client.post("/v1/train_batch", json=wire(t.batch(2, seed=9)), headers=headers)
    assert reused.status_code == 422 and "different request body" in reused.json()["message"]


def test_predict_goes_through_the_inference_queue_at_a_pinned_version(api):
    t = api.tenant("pred", "flow")
    obs = wire({"images": t.batch(3)["images"], "state": t.batch(3)["state"]})
    nothing = api.client.post("/v1/predict", json={"observations": obs}, headers=t.headers)
    assert nothing.status_code == 404 and "POST /v1/weights/load" in nothing.json()["message"]
    api.client.post("/v1/train_batch", json=wire(t.batch(3)), headers=t.headers)
    loaded = api.client.post("/v1/weights/load", json={}, headers=t.headers).json()
    assert loaded == {"version": 1, "serving_versions": [1]}
    seeds = [1, 2, 3]
    r = api.client.post("/v1/predict", json={"observations": obs, "seeds": seeds}, headers=t.headers)
    assert r.status_code == 200, r.text
    body = r.json()
    actions = Tensor.model_validate(body["actions"]).to_numpy()
    assert actions.shape == (3, 4, 5) and body["policy_version"] == 1 and body["device_seconds"] > 0
    again = api.client.post("/v1/predict", json={"observations": obs, "seeds": seeds}, headers=t.headers).json()
    np.testing.assert_allclose(Tensor.model_validate(again["actions"]).to_numpy(), actions, atol=1e-5)
    unknown = api.client.post("/v1/predict", json={"observations": obs, "policy_version": 7}, headers=t.headers)
    assert unknown.status_code == 404 and problems(unknown)["policy_version"]
    bad_seeds = api.client.post("/v1/predict", json={"observations": obs, "seeds": [1]}, headers=t.headers)
    assert problems(bad_seeds)["seeds"] == "expected 3 seeds (one per observation), got 1"
    usage = api.client.get("/v1/usage", headers=t.headers).json()
    assert usage["samples_predicted"] == 6 and usage["device_seconds"]["inference"] > 0


def test_load_weights_accepts_only_the_callers_own_module(api):
    mine, other = api.tenant("lw"), api.tenant("lw-other")
    exported = api.client.post("/v1/params/export", headers=mine.headers).json()
    assert exported["manifest"]["tenant_id"] == mine.tenant_id
    assert api.client.post("/v1/weights/load", json={"payload": exported["payload"]}, headers=mine.headers).json() == {
        "version": 0,
        "serving_versions": [0],
    }
    theirs = api.client.post("/v1/params/export", headers=other.headers).json()["payload"]
    r = api.client.post("/v1/weights/load", json={"payload": theirs}, headers=mine.headers)
    assert r.status_code == 422
    expected = f"must be {mine.tenant_id!r} for your tenant, got {other.tenant_id!r}"
    assert problems(r)["payload.manifest.tenant_id"] == expected
    assert api.cluster.inference.versions(other.tenant_id) == []  # nothing installed for anyone

    import base64

    tensors, manifest = decode_tenant_payload(base64.b64decode(exported["payload"]))
    grown = manifest.__class__(**{**manifest.__dict__, "module_config": {**manifest.module_config, "size": "large"}})
    r = api.client.post(
        "/v1/weights/load",
        json={"payload": base64.b64encode(encode_tenant_payload(tensors, grown)).decode()},
        headers=mine.headers,
    )
    assert r.status_code == 422 and "payload.manifest.module_config" in problems(r)
    junk = base64.b64encode(b"junk" * 10).decode()
    r = api.client.post("/v1/weights/load", json={"payload": junk}, headers=mine.headers)
    assert r.status_code == 422 and "not a safetensors payload" in problems(r)["payload"]
    assert api.client.post("/v1/weights/load", json={"version": 99}, headers=mine.headers).status_code == 404


def test_save_versions_manifest_and_export(api):
    t = api.tenant("ckpt")
    api.client.post("/v1/train_batch", json=wire(t.batch(2)), headers=t.headers)
    manifest = api.client.post("/v1/save", json={"include_optim": True}, headers=t.headers).json()
    assert manifest["policy_version"] == 1 and "optimizer.safetensors" in manifest["files"]
    versions = api.client.get("/v1/versions", headers=t.headers).json()
    assert versions["training_version"] == 1 and [c["version"] for c in versions["checkpoints"]] == [1]
    listed = versions["checkpoints"][0]
    assert listed["checkpoint_digest"] == manifest["digest"] and listed["size_bytes"] > 0
    fetched = api.client.get("/v1/checkpoints/1/manifest", headers=t.headers).json()
    assert fetched == manifest
    api.client.post("/v1/train_batch", json=wire(t.batch(2, seed=1)), headers=t.headers)  # now at v2, v1 on disk
    raw = api.client.get("/v1/versions/1/export", headers=t.headers)
    assert raw.headers["content-type"] == "application/octet-stream" and raw.headers["x-joynexus-version"] == "1"
    tensors, exported = decode_tenant_payload(raw.content)
    assert exported.tenant_id == t.tenant_id and exported.policy_version == 1
    # One digest names the version in `versions`, in its exports and in the MLflow registry's tag.
    assert listed["digest"] == raw.headers["x-joynexus-manifest-digest"] == exported.digest
    assert not any(name.startswith("backbone") for name in tensors)
    current = api.client.get("/v1/versions/2/export", params={"format": "json"}, headers=t.headers).json()
    assert current["version"] == 2
    for path in ("/v1/versions/5/export", "/v1/checkpoints/2/manifest", "/v1/checkpoints/7/manifest"):
        assert api.client.get(path, headers=t.headers).status_code == 404
    assert api.client.get("/v1/versions/-1/export", headers=t.headers).status_code == 422
    usage = api.client.get("/v1/usage", headers=t.headers).json()
    assert usage["storage_bytes"] >= versions["checkpoints"][0]["size_bytes"]


def test_training_queue_partitions_put_get_write_back_clear(api):
    t = api.tenant("queue")
    c, h = api.client, t.headers
    columns = {"obs": np.arange(12, dtype=np.float32).reshape(6, 2), "note": [f"s{i}" for i in range(6)]}
    body = {"columns": wire(columns)}
    info = c.post("/v1/queue/partitions/rollout-1", json=body, headers=h).json()
    assert (info["num_samples"], sorted(info["fields"])) == (6, ["note", "obs"]) and info["bytes"] > 0
    first = {"fields": ["obs", "note"], "batch_size": 4}
    got = c.post("/v1/queue/partitions/rollout-1/get", json=first, headers=h).json()
    assert got["indices"] == [0, 1, 2, 3] and got["columns"]["note"] == ["s0", "s1", "s2", "s3"]
    np.testing.assert_array_equal(Tensor.model_validate(got["columns"]["obs"]).to_numpy(), columns["obs"][:4])
    derived = {"columns": wire({"advantage": np.ones(4, np.float32)}), "indices": got["indices"], "task_name": "adv"}
    assert c.post("/v1/queue/partitions/rollout-1", json=derived, headers=h).status_code == 200
    rest = c.post("/v1/queue/partitions/rollout-1/get", json={"fields": ["obs"], "batch_size": 4}, headers=h).json()
    assert rest["indices"] == [4, 5]
    done = c.post("/v1/queue/partitions/rollout-1/get", json={"fields": ["obs"], "batch_size": 4}, headers=h).json()
    assert done["exhausted"] and done["indices"] == []
    assert [p["partition"] for p in c.get("/v1/queue/partitions", headers=h).json()] == ["rollout-1"]
    assert c.delete("/v1/queue/partitions/rollout-1", headers=h).json() == {"cleared": True}
    assert c.get("/v1/queue/partitions/rollout-1", headers=h).status_code == 404
    assert c.delete("/v1/queue/partitions/rollout-1", headers=h).status_code == 404


def test_training_queue_bad_inputs(api):
    t = api.tenant("queue-bad")
    c, h = api.client, t.headers
    ragged = {"columns": {**wire({"a": np.zeros(3, np.float32)}), "b": ["x", "y"]}}
    r = c.post("/v1/queue/partitions/p", json=ragged, headers=h)
    assert r.status_code == 422 and "same number of rows" in r.json()["message"]
    assert c.post("/v1/queue/partitions/../x", json=ragged, headers=h).status_code in (404, 422)
    assert c.post("/v1/queue/partitions/a%2Fb", json=ragged, headers=h).status_code in (404, 422)
    c.post("/v1/queue/partitions/p", json={"columns": wire({"a": np.zeros(3, np.float32)})}, headers=h)
    out_of_range = {"columns": wire({"d": np.zeros(2, np.float32)}), "indices": [1, 9]}
    r = c.post("/v1/queue/partitions/p", json=out_of_range, headers=h)
    assert r.status_code == 422 and "out of range" in problems(r)["indices"]
    r = c.post("/v1/queue/partitions/p/get", json={"fields": ["nope"], "batch_size": 2}, headers=h)
    assert r.status_code == 422 and "nope" in r.json()["message"] and "api/" not in r.json()["message"]
    r = c.post("/v1/queue/partitions/p/get", json={"fields": ["a"], "batch_size": 0}, headers=h)
    assert r.status_code == 422


def test_error_bodies_never_carry_a_traceback(api):
    r = api.client.get("/v1/no-such-route")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = api.client.put("/v1/train_batch")
    assert r.status_code == 405 and json.loads(r.text)["code"] == "method_not_allowed"


def test_columns_that_do_not_fit_the_partition_are_422(api):
    t = api.tenant("queue-fit")
    c, h = api.client, t.headers
    c.post("/v1/queue/partitions/p", json={"columns": wire({"a": np.zeros((3, 2), np.float32)})}, headers=h)
    wider = {"columns": wire({"a": np.zeros((2, 3), np.float32)})}
    assert c.post("/v1/queue/partitions/p", json=wider, headers=h).status_code == 422
    derived = {"columns": wire({"a": np.zeros((2, 5), np.float32)}), "indices": [0, 1]}
    assert c.post("/v1/queue/partitions/p", json=derived, headers=h).status_code == 422
    text = {"columns": {"a": ["x", "y"]}}
    assert c.post("/v1/queue/partitions/p", json=text, headers=h).status_code == 422
    assert c.get("/v1/queue/partitions/p", headers=h).json()["num_samples"] == 3


def test_an_unexpected_failure_is_a_500_with_a_reference_and_no_traceback(api, monkeypatch):
    t = api.tenant("boom")

    def explode(*_args, **_kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(api.app.state.gateway, "versions", explode)
    r = api.client.get("/v1/versions", headers=t.headers)
    assert r.status_code == 500 and r.json()["code"] == "internal"
    assert "reference" in r.json()["message"] and "secret" not in r.text and "Traceback" not in r.text


def test_a_body_without_content_length_is_still_capped(api):
    t = api.tenant("chunked")

    def chunks():
        for _ in range(5):
            yield b" " * (MAX_BODY_BYTES // 4)

    r = api.client.post("/v1/train_batch", content=chunks(), headers={**t.headers, "Content-Type": "application/json"})
    assert r.status_code == 413
