"""The caller's tenant, which every call starts with: the Master's answer, cached for a moment."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from joynexus.api.errors import ApiError, NotFound
from joynexus.core.tenants import Tenant

if TYPE_CHECKING:  # the type only: the API server is a client of the Master Service
    from joynexus.master.service import MasterService

TENANT_CACHE_S = 2.0


class TenantDirectory:
    """Tenant lookup over the Master Service with a short-lived cache of its answers (a call's
    checks read the tenant several times; the Master is asked at most every TENANT_CACHE_S)."""

    def __init__(self, master: MasterService):
        self._master = master
        self._cache: dict[str, tuple[float, Tenant]] = {}
        self._lock = threading.Lock()

    def tenant(self, tenant_id: str, *, healthy: bool = True) -> Tenant:
        """The tenant (cached for TENANT_CACHE_S); `healthy` refuses an unhealthy one with its reason."""
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(tenant_id)
        if cached is not None and now - cached[0] < TENANT_CACHE_S:
            tenant = cached[1]
        else:
            try:
                tenant = self._master.get_tenant(tenant_id)
            except KeyError:
                raise NotFound("tenant", tenant_id, "tenant_id") from None
            self.remember(tenant, now)
        if healthy and tenant.status != "active":
            raise ApiError(
                f"tenant {tenant_id!r} is {tenant.status}: {tenant.status_reason}",
                [("tenant", tenant.status_reason or tenant.status)],
            ).with_status(409, "tenant_unhealthy")
        return tenant

    def tenants(self) -> list[Tenant]:
        return self._master.list_tenants()

    def remember(self, tenant: Tenant, at: float | None = None) -> None:
        """Cache the Master's answer about `tenant` (a tenant just created need not be asked for)."""
        with self._lock:
            self._cache[tenant.tenant_id] = (time.monotonic() if at is None else at, tenant)

    def forget(self, tenant_id: str) -> None:
        """A deleted tenant is asked for again (and answers 404)."""
        with self._lock:
            self._cache.pop(tenant_id, None)
