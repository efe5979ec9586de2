"""Foreign weights (issue 24.5): weights trained elsewhere installed for a tenant as a new version.

The Master composes the services: the Training Model Service checks the tensors against the
tenant's slot and issues and checkpoints the next version (`services.training.foreign`); the new
version is served (Inference Model Service `load_weights`) and registered in MLflow with its
provenance as model-version tags (`source`, `sha256` of the uploaded bytes, `installed_by`),
beside the usual export digests. A checked config (the action module's, as the weights' trainer
knew it) must agree with the tenant's on every field it gives.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from joynexus.artifacts import decode_tenant_payload
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


def _service_value_error(error: BaseException) -> BaseException:
    """A service's ValueError (also behind Ray's wrapper) as a plain one with its own message."""
    cause = getattr(error, "cause", None) or error
    return ValueError(str(cause)) if isinstance(cause, ValueError) else error


def install_weights(
    deployment: Any,
    tenant: Tenant,
    weights: bytes,
    *,
    source: str,
    installed_by: str,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Check, install, serve and register; returns the new version and its provenance."""
    tenant_id = tenant.tenant_id
    if not source.strip() or len(source) > MAX_SOURCE_CHARS:
        raise ValueError(f"source: say where the weights come from (1..{MAX_SOURCE_CHARS} characters)")
    check_config(tenant.backend_config.action_module, config)
    sha256 = hashlib.sha256(weights).hexdigest()
    training = deployment.training_service
    ensure_slot(training, tenant)  # present already unless the service restarted
    try:
        manifest = training.install_weights(tenant_id, weights)
    except Exception as error:
        raise _service_value_error(error) from None
    version = int(manifest["policy_version"])
    payload = training.export_params(tenant_id)
    deployment.inference_service.load_weights(payload)
    provenance = {"source": source, "sha256": sha256, "installed_by": installed_by}
    tracker = deployment.tracker
    run_id = tracker.start_workload_run(
        tenant_id, f"install-{uuid.uuid4().hex[:12]}", {"policy_version": version, **provenance},
        tags={"task": "install_weights", **provenance},
    )  # fmt: skip
    _, exported = decode_tenant_payload(payload)
    registered = tracker.register_tenant_payload(run_id=run_id, tenant_id=tenant_id, payload=payload, manifest=exported)
    tracker.set_version_tags(tenant_id, registered, provenance)
    tracker.end_run(run_id, "FINISHED")
    deployment.checkpoints.pin(tenant_id, version)  # a registered version outlives retention
    return {
        "tenant_id": tenant_id,
        "version": version,
        "registered_version": registered,
        "run_id": run_id,
        "manifest_digest": exported.digest,
        **provenance,
    }
