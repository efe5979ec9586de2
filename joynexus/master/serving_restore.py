"""Serve again what was served (issue 26.7): after the Inference Model Service restarted in place,
the Master restarted, or a whole new deployment came up on the same store, each tenant's recorded
serving set (`core/serving_sets.py`: its loaded versions, and the newest as the version a request
without one is pinned to) is loaded back from the tenant's checkpoints, not replaced by whatever
version the training slot holds now.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from joynexus.core.serving_sets import ServingSetStore

if TYPE_CHECKING:
    from joynexus.master.deployment import Deployment

log = logging.getLogger(__name__)


def restore_serving_sets(deployment: Deployment) -> dict[str, list[int] | str]:
    """Load every recorded version the Inference Model Service lacks, oldest first (so the newest,
    the pinned one, is loaded last and nothing recorded is evicted). Returns, per tenant, the
    versions loaded or why not; tenants that are gone or unhealthy are left alone."""
    recorded = ServingSetStore(deployment.store).all()
    tenants = {t.tenant_id: t for t in deployment.creator.list()}
    inference = deployment.inference_service
    account: dict[str, list[int] | str] = {}
    for tenant_id, serving in sorted(recorded.items()):
        tenant = tenants.get(tenant_id)
        if tenant is None or tenant.status != "active":
            continue
        served = set(inference.versions(tenant_id))
        loaded: list[int] = []
        missing: list[str] = []
        for version in serving.versions:
            if version in served:
                continue
            try:
                # On the tenant's producer replica: the payload goes checkpoint -> inference there.
                deployment.producers.serve_version(tenant_id, version, from_slot=True)
            except Exception as error:  # e.g. a checkpoint pruned since; the tenant's other versions still load
                missing.append(f"v{version}: {type(error).__name__}: {error}"[:200])
                continue
            loaded.append(version)
        if missing:
            account[tenant_id] = f"not restored: {'; '.join(missing)}"
            log.warning("tenant %s: %s", tenant_id, account[tenant_id])
        elif loaded:
            account[tenant_id] = loaded
    return account


def describe(account: dict[str, list[int] | str]) -> str:
    """One line for the health report and the log."""
    restored = sum(1 for entry in account.values() if isinstance(entry, list))
    failed = {tenant: entry for tenant, entry in account.items() if isinstance(entry, str)}
    line = f"restored the serving sets of {restored} tenants"
    return line + (f"; not restored: {failed}" if failed else "")
