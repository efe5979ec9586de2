"""The one path by which a tenant gets its slot on the Training Model Service (issue 40, item 3).

A tenant is registered once: `TenantCreator.create` registers its training policy in the tenant's
own transaction, and `add_slot` creates its slot (the Master Service's `create_tenant`, and the
restore of a slot lost with a restarted service). Everything after that only needs the slot to be
there: `ensure_slot` returns its version, and creates it only when it is missing (a tenant made
with `TenantCreator.create` alone, as tests and benchmarks do, or a slot not restored yet). A
workload then sets only its completion target on the policy (`TrainingScheduler.set_completion_target`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from joynexus.core.tenants import Tenant

if TYPE_CHECKING:  # the Master imports this module: no service (torch) import at run time
    from joynexus.services.training.service import TrainingModelService


def add_slot(training: TrainingModelService, tenant: Tenant) -> dict[str, Any]:
    """Create the tenant's slot, restoring its last checkpoint if one exists (idempotent: a slot
    that exists is left as it is). The only `add_tenant` call of the Master."""
    return training.add_tenant(tenant.backend_config)


def ensure_slot(training: TrainingModelService, tenant: Tenant) -> int:
    """The policy version of the tenant's slot; the slot is created first if the service has none."""
    if tenant.tenant_id not in training.tenants():
        return int(add_slot(training, tenant)["version"])
    return int(training.policy_version(tenant.tenant_id))
