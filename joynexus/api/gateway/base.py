"""What every part of the gateway shares: the deployment's typed handles (`connect.Cluster`), the
API keys, the usage ledger and meter, the limits, and the tenant lookup every call starts with."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from joynexus.actors import handle_of
from joynexus.api.auth import ApiKeyStore
from joynexus.api.errors import ApiError, NotFound, QuotaExceeded
from joynexus.connect import Cluster
from joynexus.core.metering import UsageMeter
from joynexus.core.tenants import Tenant
from joynexus.master.usage import SpendCapReached, StorageQuotaReached, UsageLedger
from joynexus.protocol import schemas as s
from joynexus.services.sample_slices import SAMPLE_SLICE_CHUNKS

TENANT_CACHE_S = 2.0


@dataclass(frozen=True)
class ApiLimits:
    max_samples_per_request: int = s.MAX_SAMPLES_PER_REQUEST
    # Observations x n of one sampling call: each chunk is a draw (a flow head's whole Euler loop);
    # 512 x 64 ran 43 s on the Training Model Service and held other tenants' calls behind it.
    max_sampled_chunks_per_request: int = 1024
    # ... and reaches the service in slices of at most this many chunks, each its own turn beside
    # other tenants' calls and all one call holds on the service at once (joynexus.services.sample_slices).
    sample_slice_chunks: int = SAMPLE_SLICE_CHUNKS
    max_queue_bytes_per_tenant: int = 256 << 20
    max_partitions_per_tenant: int = 64
    max_string_chars: int = 4096


class GatewayBase:
    """The gateway's state; the operations per concern are the subclasses beside this module."""

    def __init__(self, cluster: Cluster, keys: ApiKeyStore, ledger: UsageLedger, *, limits: ApiLimits | None = None):
        self.cluster = cluster
        self.master = cluster.master
        self.keys = keys
        self.ledger = ledger
        # Lower-layer training calls are metered like the services meter theirs: batched rows.
        self.meter = UsageMeter(cluster.store)
        self.limits = limits or ApiLimits()
        self._tenants: dict[str, tuple[float, Tenant]] = {}  # short-lived cache of the Master's answers
        self._lock = threading.Lock()
        self._queue_bytes: dict[str, dict[str, int]] = {}  # per tenant: bytes put per partition name
        self._tenant_locks: dict[str, threading.Lock] = {}

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to start: the Master Service owns workloads, slots and admission."""

    def stop(self) -> None:
        """Write the metered lower-layer usage (the Master owns everything else)."""
        self.meter.try_flush()

    # -- the caller's tenant ----------------------------------------------------------------------
    def tenant(self, tenant_id: str, *, healthy: bool = True) -> Tenant:
        """The tenant (cached for TENANT_CACHE_S); `healthy` refuses an unhealthy one with its reason."""
        now = time.monotonic()
        with self._lock:
            cached = self._tenants.get(tenant_id)
        if cached is not None and now - cached[0] < TENANT_CACHE_S:
            tenant = cached[1]
        else:
            try:
                tenant = self.master.get_tenant(tenant_id)
            except KeyError:
                raise NotFound("tenant", tenant_id, "tenant_id") from None
            with self._lock:
                self._tenants[tenant_id] = (now, tenant)
        if healthy and tenant.status != "active":
            raise ApiError(
                f"tenant {tenant_id!r} is {tenant.status}: {tenant.status_reason}",
                [("tenant", tenant.status_reason or tenant.status)],
            ).with_status(409, "tenant_unhealthy")
        return tenant

    def tenants(self) -> list[Tenant]:
        return self.master.list_tenants()

    def _tenant_lock(self, tenant_id: str) -> threading.Lock:
        with self._lock:
            return self._tenant_locks.setdefault(tenant_id, threading.Lock())

    # -- quotas, usage, health --------------------------------------------------------------------
    def check_admission(self, tenant_id: str, *, storage: bool = False) -> None:
        """Refuse new work over the spend cap; with `storage` (a call that writes a checkpoint) also
        over the storage quota (listing checkpoints is not worth it on every predict or step)."""
        try:
            self.ledger.check_spend(tenant_id, storage=storage)
        except StorageQuotaReached as error:
            raise QuotaExceeded(str(error), [("quota.max_storage_bytes", str(error))]) from None
        except SpendCapReached as error:
            raise QuotaExceeded(str(error), [("quota.max_device_seconds", str(error))]) from None

    def usage(self, tenant_id: str) -> s.Usage:
        self.meter.flush()  # read-your-writes, as the Master does for the services' meters
        return self.master.usage(tenant_id)

    def health(self, timeout_s: float = 5.0) -> s.Health:
        """The Master's Health Manager's report per role; `down` when the Master does not answer."""
        try:
            roles = handle_of(self.master).probe("health", timeout_s)
        except Exception as error:
            detail = f"the Master Service does not answer: {type(error).__name__}: {error}"[:300]
            return s.Health(
                status="down", version=s.API_VERSION, roles={"master": s.RoleHealth(healthy=False, detail=detail)}
            )
        status = "ok" if all(entry["healthy"] for entry in roles.values()) else "degraded"
        return s.Health(
            status=status, version=s.API_VERSION, roles={name: s.RoleHealth(**entry) for name, entry in roles.items()}
        )
