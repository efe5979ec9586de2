"""Issue 26: a tenant's checkpointed versions through the API when something is wrong with them —
a corrupt checkpoint is flagged in the listing and answered 409 naming it while the intact ones
export as usual, and a repair shows at once (8); weights/load checks the tensors, not only the
manifest (10b); a tenant at its storage quota deletes versions to get back under it (10c)."""

from __future__ import annotations

import base64

from joynexus.artifacts import MANIFEST_FILE, decode_tenant_payload, encode_tenant_payload
from tests.api.conftest import wire


def problems(response) -> dict[str, str]:
    return {p["field"]: p["reason"] for p in response.json()["problems"]}


def step_and_save(api, t, times: int) -> list[int]:
    """Train one step and checkpoint it, `times` times: the checkpointed versions."""
    saved = []
    for seed in range(times):
        r = api.client.post("/v1/train_batch", json=wire(t.batch(2, seed=seed)), headers=t.headers)
        assert r.status_code == 200, r.text
        r = api.client.post("/v1/save", json={"include_optim": False}, headers=t.headers)
        assert r.status_code == 200, r.text
        saved.append(r.json()["policy_version"])
    return saved


def test_a_corrupt_checkpoint_is_flagged_409_and_the_others_still_export(api):
    t = api.tenant("corrupt")
    assert step_and_save(api, t, 3) == [1, 2, 3]
    folder = api.data_dir / "checkpoints" / "tenants" / t.tenant_id
    manifest = folder / "v000002" / MANIFEST_FILE
    good_manifest = manifest.read_bytes()
    manifest.write_bytes(b'{"tenant_id": "')  # truncated
    module = folder / "v000003" / "action_module.safetensors"
    good_module = module.read_bytes()
    module.write_bytes(good_module[:-16] + bytes(b ^ 0xFF for b in good_module[-16:]))  # flipped tensor bytes
    assert api.client.post("/v1/train_batch", json=wire(t.batch(2)), headers=t.headers).status_code == 200  # v4

    r = api.client.get("/v1/versions", headers=t.headers)
    assert r.status_code == 200, r.text
    listed = {c["version"]: c for c in r.json()["checkpoints"]}
    assert sorted(listed) == [1, 2, 3] and r.json()["training_version"] == 4
    assert listed[2]["corrupt"] is True and MANIFEST_FILE in listed[2]["problem"]
    assert listed[1]["corrupt"] is False and listed[1]["problem"] is None

    assert api.client.get("/v1/versions/1/export", headers=t.headers).status_code == 200
    for version, needle in ((2, MANIFEST_FILE), (3, "action_module.safetensors")):
        r = api.client.get(f"/v1/versions/{version}/export", headers=t.headers)
        assert r.status_code == 409, r.text
        assert r.json()["code"] == "checkpoint_corrupt" and f"version {version}" in r.json()["message"]
        assert needle in problems(r)["version"]
    r = api.client.post("/v1/weights/load", json={"version": 3}, headers=t.headers)
    assert r.status_code == 409 and r.json()["code"] == "checkpoint_corrupt"

    manifest.write_bytes(good_manifest)  # repaired in place: no restart, nothing remembered the failure
    module.write_bytes(good_module)
    assert not any(c["corrupt"] for c in api.client.get("/v1/versions", headers=t.headers).json()["checkpoints"])
    for version in (2, 3):
        assert api.client.get(f"/v1/versions/{version}/export", headers=t.headers).status_code == 200


def _tampered(payload: bytes) -> bytes:
    """The same manifest over other weights."""
    tensors, manifest = decode_tenant_payload(payload)
    name = next(n for n, v in tensors.items() if v.is_floating_point())
    tensors = {**tensors, name: tensors[name] + 1.0}
    return encode_tenant_payload(tensors, manifest)


def test_load_weights_refuses_an_issued_manifest_over_other_tensors(api):
    t = api.tenant("tensors")
    assert step_and_save(api, t, 1) == [1]
    assert api.client.post("/v1/train_batch", json=wire(t.batch(2, seed=5)), headers=t.headers).status_code == 200
    checkpointed = api.client.get("/v1/versions/1/export", headers=t.headers).content
    current = base64.b64decode(api.client.post("/v1/params/export", headers=t.headers).json()["payload"])

    for payload in (checkpointed, current):
        r = api.client.post("/v1/weights/load", json={"payload": base64.b64encode(_tampered(payload)).decode()},
                            headers=t.headers)  # fmt: skip
        assert r.status_code == 422, r.text
        assert "tensors differ" in problems(r)["payload"]
    assert api.cluster.inference.versions(t.tenant_id) == []  # nothing was installed
    for payload, version in ((checkpointed, 1), (current, 2)):  # the issued bytes still load
        r = api.client.post("/v1/weights/load", json={"payload": base64.b64encode(payload).decode()},
                            headers=t.headers)  # fmt: skip
        assert r.status_code == 200 and r.json()["version"] == version, r.text


def test_a_tenant_at_its_storage_quota_deletes_versions_to_get_under_it(api):
    t = api.tenant("quota")
    assert step_and_save(api, t, 3) == [1, 2, 3]
    used = api.client.get("/v1/usage", headers=t.headers).json()["storage_bytes"]
    r = api.client.put(f"/v1/admin/tenants/{t.tenant_id}/quota", json={"max_storage_bytes": used - 1},
                       headers=api.admin)  # fmt: skip
    assert r.status_code == 200, r.text
    assert api.client.post("/v1/save", json={}, headers=t.headers).status_code == 429  # over the quota

    r = api.client.delete("/v1/versions/1", headers=t.headers)
    assert r.status_code == 200, r.text
    deleted = r.json()
    assert deleted["version"] == 1 and deleted["freed_bytes"] > 0
    assert deleted["storage_bytes"] == used - deleted["freed_bytes"]
    assert [c["version"] for c in api.client.get("/v1/versions", headers=t.headers).json()["checkpoints"]] == [2, 3]
    r = api.client.delete("/v1/versions/3", headers=t.headers)  # LATEST: the slot resumes from it
    assert r.status_code == 409 and r.json()["code"] == "version_in_use" and "LATEST" in r.json()["message"]
    assert api.client.delete("/v1/versions/1", headers=t.headers).status_code == 404
    assert api.client.post("/v1/weights/load", json={"version": 2}, headers=t.headers).status_code == 200
    r = api.client.delete("/v1/versions/2", headers=t.headers)  # served
    assert r.status_code == 409 and "served" in r.json()["message"]
    assert api.client.post("/v1/save", json={}, headers=t.headers).status_code == 200  # under the quota again
