"""Verified API keys are remembered briefly so a burst of one tenant's calls does not take a worker
thread each for authentication (issue 26.3), and never outlive a revocation or a tenant deletion
made through this server."""

from __future__ import annotations

import asyncio

from joynexus.api.auth import ApiKeyStore


def test_a_burst_of_calls_with_one_key_is_one_store_read_and_then_none(api):
    keys = ApiKeyStore(api.cluster.store)
    issued = keys.issue("burst-tenant")
    reads = []
    verify = keys.verify

    def counted(api_key: str):  # the real verify, counted
        reads.append(api_key)
        return verify(api_key)

    keys.verify = counted

    async def burst() -> list:
        return await asyncio.gather(*[keys.authenticate(issued.api_key) for _ in range(50)])

    principals = asyncio.run(burst())
    assert {p.tenant_id for p in principals} == {"burst-tenant"} and len(reads) == 1
    assert asyncio.run(keys.authenticate(issued.api_key)).tenant_id == "burst-tenant" and len(reads) == 1
    assert asyncio.run(keys.authenticate("jnx_0000000000000000_" + "x" * 43)) is None  # unknown: not kept
    keys.revoke(issued.key_id)
    assert keys.cached(issued.api_key) is None and asyncio.run(keys.authenticate(issued.api_key)) is None


def test_a_deleted_tenants_key_is_refused_at_once(api):
    tenant = api.tenant("cache-deleted")
    assert api.client.get("/v1/tenant", headers=tenant.headers).status_code == 200  # verified: remembered
    deleted = api.client.delete(f"/v1/admin/tenants/{tenant.tenant_id}", headers=api.admin)
    assert deleted.status_code == 200, deleted.text
    assert api.client.get("/v1/tenant", headers=tenant.headers).status_code == 401
