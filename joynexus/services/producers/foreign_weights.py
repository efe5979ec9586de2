"""Foreign weights (issue 24.5) once installed: the API server sent the uploaded tensors to the
Training Model Service itself, which checked them and checkpointed them as the tenant's next
version; here, on the tenant's producer replica, that version is exported, served (Inference Model
Service `load_weights`) and registered in MLflow with its provenance as model-version tags
(`source`, `sha256` of the uploaded bytes, `installed_by`), then pinned against retention. The
payload moves between the services and this process only; the Master only admits and records."""

from __future__ import annotations

import uuid
from typing import Any

from joynexus.artifacts import decode_tenant_payload
from joynexus.services.producers.context import ProducerContext


def publish_installed(ctx: ProducerContext, tenant_id: str, version: int, provenance: dict[str, str]) -> dict[str, Any]:
    """Serve and register the slot's installed `version`; ValueError("version: ...") when the slot
    is at another version (something trained or installed over it meanwhile)."""
    payload = ctx.training_service.export_params(tenant_id)
    _, exported = decode_tenant_payload(payload)
    if exported.policy_version != version:
        raise ValueError(
            f"version: the slot of tenant {tenant_id!r} is at version {exported.policy_version}, not the installed "
            f"{version}; install again"
        )
    ctx.inference_service.load_weights(payload)
    tracker = ctx.tracker
    run_id = tracker.start_workload_run(
        tenant_id, f"install-{uuid.uuid4().hex[:12]}", {"policy_version": version, **provenance},
        tags={"task": "install_weights", **provenance},
    )  # fmt: skip
    registered = tracker.register_tenant_payload(run_id=run_id, tenant_id=tenant_id, payload=payload, manifest=exported)
    tracker.set_version_tags(tenant_id, registered, provenance)
    tracker.end_run(run_id, "FINISHED")
    ctx.checkpoints.pin(tenant_id, version)  # a registered version outlives retention
    return {
        "tenant_id": tenant_id,
        "version": version,
        "registered_version": registered,
        "run_id": run_id,
        "manifest_digest": exported.digest,
        **provenance,
    }
