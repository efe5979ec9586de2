"""Issue 26 (5): deleting a tenant without its artifacts retires its id — a new tenant with that id
would inherit the old checkpoints and weights — until an admin purges them."""

from __future__ import annotations

from tests.api.conftest import wire


def test_a_deleted_tenants_id_is_refused_until_its_kept_artifacts_are_purged(api):
    t = api.tenant("reuse")
    assert api.client.post("/v1/train_batch", json=wire(t.batch(2)), headers=t.headers).status_code == 200
    assert api.client.post("/v1/save", json={}, headers=t.headers).json()["policy_version"] == 1
    path = f"/v1/admin/tenants/{t.tenant_id}"

    r = api.client.delete(f"{path}/artifacts", headers=api.admin)  # the tenant still exists
    assert r.status_code == 409 and "delete it" in r.json()["message"]
    r = api.client.delete(path, headers=api.admin)  # artifacts kept (the default)
    assert r.status_code == 200, r.text
    assert r.json()["removed"]["tenant_id_reusable"].startswith("no: ")

    r = api.client.post("/v1/admin/tenants", json=t.spec, headers=api.admin)
    assert r.status_code == 409, r.text
    [problem] = r.json()["problems"]
    assert problem["field"] == "tenant"
    assert f"tenant_id {t.tenant_id!r} cannot be reused" in problem["reason"]
    assert "checkpoints and registered model were kept" in problem["reason"] and "purge" in problem["reason"]
    assert api.cluster.checkpoints.versions(t.tenant_id) == [1]  # nothing of it was touched

    r = api.client.delete(f"{path}/artifacts", headers=api.admin)
    assert r.status_code == 200, r.text
    assert r.json()["removed"]["tombstone"] == "lifted"
    assert api.cluster.checkpoints.versions(t.tenant_id) == []

    r = api.client.post("/v1/admin/tenants", json=t.spec, headers=api.admin)
    assert r.status_code == 201, r.text
    headers = {"Authorization": f"Bearer {r.json()['key']['api_key']}"}
    versions = api.client.get("/v1/versions", headers=headers).json()
    assert versions["training_version"] == 0 and versions["checkpoints"] == []  # a fresh start


def test_checkpoints_left_under_an_id_without_a_tombstone_also_retire_it(api):
    """Checkpoints stored under an id no tenant has (a deletion from before tombstones, a store
    rebuilt beside old checkpoints) are not handed to a new tenant either."""
    spec = api.spec("orphan")
    from tests.artifacts.test_retention import _save

    _save(api.cluster.checkpoints, 3, tenant=spec["tenant"])
    r = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert r.status_code == 409, r.text
    assert "checkpoints of an earlier tenant with this id are still stored" in r.json()["problems"][0]["reason"]
    assert api.client.delete(f"/v1/admin/tenants/{spec['tenant']}/artifacts", headers=api.admin).status_code == 200
    assert api.client.post("/v1/admin/tenants", json=spec, headers=api.admin).status_code == 201
