"""Issue 26 item 4: /metrics lists every tenant's series, so only the operator (admin) key reads it:
no key 401, a made-up key 401, a tenant's key 403, the operator 200 (through the real server)."""

from __future__ import annotations

import httpx

from tests.security.conftest import ADMIN_KEY


def test_metrics_need_the_operator_key(api, live_server, victim):
    with httpx.Client(base_url=live_server, timeout=60) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer made-up"}).status_code == 401
        tenant = client.get("/metrics", headers=victim.headers)
        assert tenant.status_code == 403 and victim.tenant_id not in tenant.text
        operator = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert operator.status_code == 200 and "joynexus_" in operator.text
        own = client.get("/v1/usage", headers=victim.headers)  # a tenant's own figures
        assert own.status_code == 200 and own.json()["tenant_id"] == victim.tenant_id
