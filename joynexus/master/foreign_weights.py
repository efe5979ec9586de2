"""Foreign weights (issue 24.5): weights trained elsewhere installed for a tenant as a new version.

The Master only admits and records: `admit_install` checks the request (the source, and a config
that must agree with the tenant's action module on every field it gives) and makes sure the
tenant's training slot exists. The weights go from the API server to the Training Model Service,
which checks the tensors against the slot and issues and checkpoints the next version
(`services.training.foreign`); the tenant's producer replica then serves that version and
registers it in MLflow with its provenance (`services.producers.foreign_weights`). No weight byte
passes through the Master.
"""

from __future__ import annotations

import json
from typing import Any

from joynexus.core.tenants import Tenant
from joynexus.master.tenant_slots import ensure_slot

MAX_SOURCE_CHARS = 512


def check_config(action_module: dict[str, Any], config: dict[str, Any] | None) -> None:
    """Each field the weights' config gives must equal the tenant's action module's."""
    for key, value in (config or {}).items():
        if key not in action_module:
            raise ValueError(f"config.{key}: not a field of the tenant's action module ({sorted(action_module)})")
        if json.loads(json.dumps(value)) != json.loads(json.dumps(action_module[key])):
            raise ValueError(
                f"config.{key}: the weights were trained with {value!r}, the tenant has {action_module[key]!r}"
            )


def admit_install(deployment: Any, tenant: Tenant, *, source: str, config: dict[str, Any] | None = None) -> None:
    """Check an install request and make sure the tenant's slot exists (a config, no tensor)."""
    if not source.strip() or len(source) > MAX_SOURCE_CHARS:
        raise ValueError(f"source: say where the weights come from (1..{MAX_SOURCE_CHARS} characters)")
    check_config(tenant.backend_config.action_module, config)
    ensure_slot(deployment.training_service, tenant)  # present already unless the service restarted
