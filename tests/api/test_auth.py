"""API keys: random, stored hashed, verified in constant time; every call scoped to the key's tenant."""

from __future__ import annotations

import hashlib

import pytest
from sqlalchemy import select

from joynexus.api.auth import ApiKeyStore
from joynexus.core.store import ApiKeyRecord, ControlPlaneStore


@pytest.fixture
def keys(tmp_path):
    store = ControlPlaneStore(f"sqlite:///{tmp_path / 'keys.db'}")
    yield ApiKeyStore(store)
    store.dispose()


def test_keys_are_random_and_only_their_sha256_is_stored(keys):
    first, second = keys.issue("alpha"), keys.issue("alpha")
    assert first.api_key != second.api_key and first.api_key.startswith(f"jnx_{first.key_id}_")
    with keys.store.transaction() as session:
        rows = session.scalars(select(ApiKeyRecord)).all()
        stored = {r.key_id: r.key_sha256 for r in rows}
        assert all(first.api_key not in str(vars(r)) for r in rows)
    assert stored[first.key_id] == hashlib.sha256(first.api_key.encode()).hexdigest()


def test_verify_binds_a_key_to_its_tenant_and_refuses_everything_else(keys):
    issued = keys.issue("alpha")
    principal = keys.verify(issued.api_key)
    assert (principal.role, principal.tenant_id) == ("tenant", "alpha")
    tampered = issued.api_key[:-1] + ("A" if issued.api_key[-1] != "A" else "B")
    for wrong in (tampered, "", "jnx_0000000000000000_" + "x" * 43, "Bearer " + issued.api_key, issued.key_id):
        assert keys.verify(wrong) is None
    keys.revoke(issued.key_id)
    assert keys.verify(issued.api_key) is None


def test_an_admin_key_is_generated_once_when_none_is_configured(keys):
    generated = keys.ensure_admin_key()
    assert generated and keys.verify(generated).is_admin
    assert keys.ensure_admin_key() is None  # never printed twice
    configured = ApiKeyStore(keys.store, admin_key="from-the-environment-0123")
    assert configured.verify("from-the-environment-0123").is_admin
    assert configured.ensure_admin_key() is None


def test_admin_key_from_env_must_be_long_enough(monkeypatch):
    from joynexus.api.auth import admin_key_from_env

    monkeypatch.setenv("JOYNEXUS_ADMIN_KEY", "short")
    with pytest.raises(ValueError, match="at least 16"):
        admin_key_from_env()


def test_missing_wrong_and_misplaced_keys_are_refused_with_a_clear_message(api):
    tenant = api.tenant("auth")
    c = api.client
    missing = c.get("/v1/tenant")
    assert missing.status_code == 401 and "missing API key" in missing.json()["message"]
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = c.get("/v1/tenant", headers={"Authorization": "Bearer jnx_0123456789abcdef_" + "x" * 43})
    assert wrong.status_code == 401 and wrong.json()["code"] == "unauthenticated"
    assert c.get("/v1/admin/tenants", headers=tenant.headers).status_code == 403
    admin_on_tenant_route = c.get("/v1/versions", headers=api.admin)
    assert admin_on_tenant_route.status_code == 403 and "tenant's API key" in admin_on_tenant_route.json()["message"]
    assert c.get("/v1/health").json()["status"] == "ok"


def test_admin_issues_and_revokes_keys_for_a_tenant(api):
    tenant = api.tenant("keys")
    c = api.client
    issued = c.post(f"/v1/admin/tenants/{tenant.tenant_id}/keys", json={"label": "ci"}, headers=api.admin).json()
    second = {"Authorization": f"Bearer {issued['api_key']}"}
    assert c.get("/v1/tenant", headers=second).json()["tenant_id"] == tenant.tenant_id
    listed = c.get(f"/v1/admin/tenants/{tenant.tenant_id}/keys", headers=api.admin).json()
    assert {k["label"] for k in listed} == {"first key", "ci"} and all("api_key" not in k for k in listed)
    revoked = c.delete(f"/v1/admin/keys/{issued['key_id']}", headers=api.admin).json()
    assert revoked["revoked_at"] is not None
    assert c.get("/v1/tenant", headers=second).status_code == 401
    assert c.get("/v1/tenant", headers=tenant.headers).status_code == 200  # the other key still works
    assert c.delete("/v1/admin/keys/nope", headers=api.admin).status_code == 404
    assert c.post("/v1/admin/tenants/nope/keys", json={}, headers=api.admin).status_code == 404
