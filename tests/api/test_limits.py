"""Limits on what a tenant may send and list: GET /v1/versions in pages, POST /v1/weights/load only
with versions (and manifests) this service issued and finite weights, and float inputs that would
overflow the float32 the services compute in."""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import pytest

from joynexus.artifacts import decode_tenant_payload, encode_tenant_payload
from joynexus.protocol.wire import tensor
from tests.api.conftest import wire


def problems(response) -> dict[str, str]:
    body = response.json()
    assert set(body) == {"code", "message", "problems"}, body
    return {p["field"]: p["reason"] for p in body["problems"]}


def step(api, t, seed: int = 0) -> int:
    r = api.client.post("/v1/train_batch", json=wire(t.batch(2, seed=seed)), headers=t.headers)
    assert r.status_code == 200, r.text
    return r.json()["version"]


def save(api, t) -> dict:
    r = api.client.post("/v1/save", json={"include_optim": False}, headers=t.headers)
    assert r.status_code == 200, r.text
    return r.json()


# -- GET /v1/versions in pages -------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpointed(api):
    """A tenant saved at versions 0..6; returns it and its checkpoints (version -> digest) as the
    store lists them (the training service's retention may have pruned the oldest)."""
    t = api.tenant("pages")
    digests = {0: save(api, t)["digest"]}
    for i in range(1, 7):
        assert step(api, t, seed=i) == i
        digests[i] = save(api, t)["digest"]
    kept = api.cluster.checkpoints.versions(t.tenant_id)
    assert len(kept) >= 5 and kept[-1] == 6  # enough for three pages of two
    return t, {v: digests[v] for v in kept}


def test_versions_come_in_pages_chained_by_next_after(api, checkpointed):
    t, digests = checkpointed
    kept = sorted(digests)
    pages, params = [], {"limit": 2}
    while True:
        r = api.client.get("/v1/versions", params=params, headers=t.headers)
        assert r.status_code == 200, r.text
        pages.append(r.json())
        if r.json()["next_after"] is None:
            break
        params = {"limit": 2, "after": r.json()["next_after"]}
        assert len(pages) <= len(kept), "next_after does not end"
    chunks = [kept[i : i + 2] for i in range(0, len(kept), 2)]
    assert [[c["version"] for c in p["checkpoints"]] for p in pages] == chunks
    assert [p["next_after"] for p in pages] == [c[-1] for c in chunks[:-1]] + [None]
    assert {c["version"]: c["checkpoint_digest"] for p in pages for c in p["checkpoints"]} == digests
    assert all(c["size_bytes"] > 0 for p in pages for c in p["checkpoints"])
    assert {(p["training_version"], p["optimizer_steps"]) for p in pages} == {(6, 6)}
    # the default page holds them all; a page that ends exactly at the last one says so
    everything = api.client.get("/v1/versions", headers=t.headers).json()
    assert [c["version"] for c in everything["checkpoints"]] == kept and everything["next_after"] is None
    exact = api.client.get("/v1/versions", params={"after": kept[-4], "limit": 3}, headers=t.headers).json()
    assert [c["version"] for c in exact["checkpoints"]] == kept[-3:] and exact["next_after"] is None
    assert api.client.get("/v1/versions", params={"after": 6}, headers=t.headers).json()["checkpoints"] == []


def test_versions_list_a_version_0_checkpoint_by_default(api):
    t = api.tenant("pages-v0")
    manifest = save(api, t)
    listed = api.client.get("/v1/versions", headers=t.headers).json()
    assert [(c["version"], c["checkpoint_digest"]) for c in listed["checkpoints"]] == [(0, manifest["digest"])]
    assert api.client.get("/v1/versions", params={"after": 0}, headers=t.headers).json()["checkpoints"] == []


@pytest.mark.parametrize(
    ("params", "field"),
    [({"limit": 0}, "limit"), ({"limit": 1001}, "limit"), ({"limit": "x"}, "limit"), ({"after": -1}, "after")],
)
def test_bad_version_paging_params_are_422_naming_the_field(api, checkpointed, params, field):
    t, _ = checkpointed
    r = api.client.get("/v1/versions", params=params, headers=t.headers)
    assert r.status_code == 422 and field in problems(r), r.text


# -- POST /v1/weights/load: issued versions, issued manifests, finite weights ------------------------


def exported(api, t, version: int | None = None) -> bytes:
    if version is None:
        r = api.client.post("/v1/params/export", headers=t.headers)
    else:
        r = api.client.get(f"/v1/versions/{version}/export", params={"format": "json"}, headers=t.headers)
    assert r.status_code == 200, r.text
    return base64.b64decode(r.json()["payload"])


def load(api, t, payload: bytes):
    return api.client.post("/v1/weights/load", json={"payload": base64.b64encode(payload).decode()}, headers=t.headers)


def altered(payload: bytes, tensors=None, **manifest_changes) -> bytes:
    state, manifest = decode_tenant_payload(payload)
    return encode_tenant_payload(tensors or state, dataclasses.replace(manifest, **manifest_changes))


def test_load_weights_refuses_versions_that_were_never_issued(api):
    t = api.tenant("lw-future")
    assert step(api, t) == 1
    current = exported(api, t)
    r = load(api, t, altered(current, policy_version=99))
    assert r.status_code == 422
    assert problems(r)["payload.manifest.version"] == "version 99 was never issued for your tenant (the newest is 1)"
    assert api.cluster.inference.versions(t.tenant_id) == []  # nothing installed
    fresh = api.tenant("lw-fresh")  # nothing issued at all: only its initial version 0 exists
    r = load(api, fresh, altered(exported(api, fresh), policy_version=1))
    assert r.status_code == 422 and "never issued" in problems(r)["payload.manifest.version"]


def test_load_weights_refuses_a_manifest_the_service_did_not_issue_for_that_version(api):
    t = api.tenant("lw-digest")
    step(api, t)
    save(api, t)  # a checkpoint of version 1
    step(api, t, seed=1)  # training goes on to version 2
    checkpointed, current = exported(api, t, 1), exported(api, t)
    forged = altered(checkpointed, extra={"optimizer_steps": 1000})
    r = load(api, t, forged)
    assert r.status_code == 422, r.text
    reason = problems(r)["payload.manifest.version"]
    assert "differs from the one this service issued" in reason and "load it by version" in reason
    r = load(api, t, altered(current, extra={"optimizer_steps": 1000}))  # the current training version
    assert r.status_code == 422 and "differs from the one" in problems(r)["payload.manifest.version"]
    assert api.cluster.inference.versions(t.tenant_id) == []
    # what the service issued loads: the checkpoint's export and the current parameters' export
    assert load(api, t, checkpointed).json() == {"version": 1, "serving_versions": [1]}
    assert load(api, t, current).json() == {"version": 2, "serving_versions": [1, 2]}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_load_weights_refuses_non_finite_weights_naming_the_tensor(api, bad):
    t = api.tenant("lw-nan")
    payload = exported(api, t)
    state, _ = decode_tenant_payload(payload)
    name = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    poisoned = {k: v.clone() for k, v in state.items()}
    poisoned[name].view(-1)[0] = bad
    r = load(api, t, altered(payload, tensors=poisoned))
    assert r.status_code == 422
    assert problems(r)["payload"] == f"tensor {name!r} holds NaN or infinite values"
    assert api.cluster.inference.versions(t.tenant_id) == []
    assert load(api, t, payload).json() == {"version": 0, "serving_versions": [0]}  # the finite original loads


# -- float inputs beyond float32 -----------------------------------------------------------------


def test_float64_inputs_that_overflow_float32_are_refused(api):
    t = api.tenant("f32")
    batch = t.batch(2)
    state64 = batch["state"].astype(np.float64)
    huge = state64.copy()
    huge[0, 0] = 1e39  # finite in float64, inf in float32
    body = {**wire(batch), "state": tensor(huge).model_dump(mode="json")}
    r = api.client.post("/v1/train_batch", json=body, headers=t.headers)
    assert r.status_code == 422 and problems(r)["state"].startswith("values overflow float32"), r.text
    action = batch["action"].astype(np.float64)
    action[1, 0, 0] = -1e300
    r = api.client.post(
        "/v1/train_batch", json={**wire(batch), "action": tensor(action).model_dump(mode="json")}, headers=t.headers
    )
    assert r.status_code == 422 and problems(r)["action"].startswith("values overflow float32")
    nan = state64.copy()
    nan[1, 1] = np.nan
    r = api.client.post(
        "/v1/train_batch", json={**wire(batch), "state": tensor(nan).model_dump(mode="json")}, headers=t.headers
    )
    assert r.status_code == 422 and problems(r)["state"] == "holds NaN or infinite values"
    assert api.client.get("/v1/versions", headers=t.headers).json()["optimizer_steps"] == 0  # no step was taken
    # float64 within float32's range is fine
    ok = api.client.post(
        "/v1/train_batch", json={**wire(batch), "state": tensor(state64).model_dump(mode="json")}, headers=t.headers
    )
    assert ok.status_code == 200 and ok.json()["version"] == 1

    assert api.client.post("/v1/weights/load", json={}, headers=t.headers).status_code == 200
    images = wire({"images": batch["images"]})["images"]
    observations = {"images": images, "state": tensor(huge).model_dump(mode="json")}
    r = api.client.post("/v1/predict", json={"observations": observations}, headers=t.headers)
    assert r.status_code == 422 and problems(r)["state"].startswith("values overflow float32"), r.text
    big_images = batch["images"].astype(np.float64)
    big_images[0, 0, 0, 0, 0] = 1e39
    observations = {
        "images": tensor(big_images).model_dump(mode="json"),
        "state": tensor(state64).model_dump(mode="json"),
    }
    r = api.client.post("/v1/predict", json={"observations": observations}, headers=t.headers)
    assert r.status_code == 422 and "images" in problems(r)
    observations = {"images": images, "state": tensor(state64).model_dump(mode="json")}
    r = api.client.post("/v1/predict", json={"observations": observations}, headers=t.headers)
    assert r.status_code == 200 and r.json()["policy_version"] == 1
