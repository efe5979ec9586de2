"""Policy versions of the caller's tenant: the version list, checkpoint manifests, exports of a
version's tenant payload, checkpointing the slot, and installing serving weights (load_weights)
with the checks that keep a payload to the caller's own module and issued versions."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from joynexus.api.errors import ApiError, InvalidInput, NotFound
from joynexus.api.gateway.base import GatewayBase
from joynexus.api.gateway.service_errors import cause_of, service_errors
from joynexus.artifacts import (
    CheckpointError,
    PayloadError,
    TenantManifest,
    decode_tenant_payload,
    encode_tenant_payload,
    export_manifest,
)
from joynexus.core.tenants import Tenant
from joynexus.protocol import schemas as s


def manifest_model(manifest: TenantManifest) -> s.Manifest:
    return s.Manifest(**json.loads(manifest.to_json()), digest=manifest.digest)


class VersionOperations(GatewayBase):
    def versions(self, tenant_id: str, after: int | None = None, limit: int = 100) -> s.Versions:
        """One page of checkpoints (versions > `after`, None: from version 0 on; ascending, at most
        `limit`) from ONE listing of the tenant's checkpoints; `next_after` continues (None: no more)."""
        status = self.cluster.training.tenant_status(tenant_id)
        # One more than asked for says whether another page follows without a second listing.
        start = -1 if after is None else after
        infos = self.cluster.checkpoints.version_infos(tenant_id, after=start, limit=limit + 1)
        page = infos[:limit]
        checkpoints = [
            s.CheckpointInfo(
                version=i.version,
                created_at=i.created_at,
                digest=i.export_digest,
                size_bytes=i.size_bytes,
                checkpoint_digest=i.digest,
            )
            for i in page
        ]
        return s.Versions(
            training_version=status["version"],
            optimizer_steps=status["optimizer_steps"],
            checkpoints=checkpoints,
            serving_versions=self.cluster.inference.versions(tenant_id),
            next_after=page[-1].version if len(infos) > limit else None,
        )

    def _checkpoint_manifest(self, tenant_id: str, version: int) -> TenantManifest:
        """The manifest of one of the tenant's checkpoints (no tensors read)."""
        if version not in self.cluster.checkpoints.versions(tenant_id):
            raise NotFound("checkpoint version", version, "version")
        return self.cluster.checkpoints.read_manifest(tenant_id, version)

    def checkpoint_manifest(self, tenant_id: str, version: int) -> s.Manifest:
        return manifest_model(self._checkpoint_manifest(tenant_id, version))

    def export(self, tenant_id: str, version: int | None = None) -> tuple[bytes, TenantManifest]:
        """The tenant payload of `version` (None: the current training parameters)."""
        current = self.cluster.training.policy_version(tenant_id)
        if version is None or version == current:
            payload = self.cluster.training.export_params(tenant_id)
            return payload, decode_tenant_payload(payload)[1]
        if version not in self.cluster.checkpoints.versions(tenant_id):
            raise NotFound("policy version", version, "version")
        try:
            manifest, module_state, _ = self.cluster.checkpoints.load_tenant(tenant_id, version)
        except CheckpointError as error:
            raise ApiError(f"checkpoint version {version} cannot be read: {error}").with_status(
                500, "checkpoint_unreadable"
            ) from None
        # The manifest every export of this version carries (= the MLflow registry's manifest_digest tag).
        exported = export_manifest(manifest)
        return encode_tenant_payload(module_state, exported), exported

    def save(self, tenant_id: str, include_optim: bool) -> s.Manifest:
        self.check_admission(tenant_id, storage=True)
        manifests = self.cluster.training.save([tenant_id], include_optim)
        return s.Manifest.model_validate(manifests[0])

    def load_weights(self, tenant_id: str, request: s.LoadWeightsRequest) -> s.LoadWeightsResult:
        tenant = self.tenant(tenant_id)
        if request.payload is not None:
            if request.version is not None:
                raise InvalidInput("version", "give either payload or version, not both")
            payload = request.payload
            module_state, manifest = self._check_payload(tenant, payload)
            self._check_payload_finite(module_state)
            self._check_payload_issued(tenant_id, manifest)
        else:
            payload, _ = self.export(tenant_id, request.version)
        with service_errors("payload"):
            try:
                loaded = self.cluster.inference.load_weights(payload)
            except RuntimeError as error:  # load_state_dict: names or shapes differ from the module
                cause = cause_of(error)
                if type(cause) is RuntimeError:
                    first = str(cause).strip().splitlines()[0]
                    raise InvalidInput("payload", f"tensors do not fit the tenant's action module: {first}") from None
                raise
        return s.LoadWeightsResult(version=loaded["version"], serving_versions=loaded["loaded"])

    @staticmethod
    def _check_payload(tenant: Tenant, payload: bytes) -> tuple[dict[str, Any], TenantManifest]:
        """A payload may only install the caller's own module, with the interface and module
        config the tenant was created with (so it cannot name another tenant or grow the module).
        Returns the decoded (module_state, manifest)."""
        try:
            module_state, manifest = decode_tenant_payload(payload)
        except PayloadError as error:
            raise InvalidInput("payload", str(error)) from None
        cfg = tenant.backend_config
        for field, got, expected in (
            ("tenant_id", manifest.tenant_id, cfg.tenant_id),
            ("schema_signature", manifest.schema_signature, cfg.schema_signature),
            ("base_model_id", manifest.base_model_id, cfg.base_model_id),
        ):
            if got != expected:
                raise InvalidInput(f"payload.manifest.{field}", f"must be {expected!r} for your tenant, got {got!r}")
        if json.loads(json.dumps(manifest.module_config)) != json.loads(json.dumps(cfg.action_module)):
            raise InvalidInput(
                "payload.manifest.module_config", "differs from the action module config your tenant was created with"
            )
        # A payload cannot add, drop or reshape the tenant's LoRA adapter on the shared backbone.
        adapter = (manifest.extra or {}).get("adapter")
        if json.loads(json.dumps(adapter)) != json.loads(json.dumps(cfg.adapter)):
            raise InvalidInput(
                "payload.manifest.extra.adapter", "differs from the adapter config your tenant was created with"
            )
        return module_state, manifest

    @staticmethod
    def _check_payload_finite(module_state: dict[str, Any]) -> None:
        """NaN / Inf weights would serve NaN actions to robots: refuse them by tensor name."""
        for name, value in module_state.items():
            if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
                raise InvalidInput("payload", f"tensor {name!r} holds NaN or infinite values")

    def _check_payload_issued(self, tenant_id: str, manifest: TenantManifest) -> None:
        """Only versions this service issued, with the manifest it issued them with: a made-up
        version would later collide with the real one of that number in the serving versions."""
        version = manifest.policy_version
        field = "payload.manifest.version"
        with service_errors("payload"):
            current = self.cluster.training.policy_version(tenant_id)
        issued = self.cluster.checkpoints.issued_version(tenant_id)
        # The slot's own version counts as issued (version 0 exists before anything is recorded).
        newest = current if issued is None else max(issued, current)
        if version < 0 or version > newest:
            raise InvalidInput(field, f"version {version} was never issued for your tenant (the newest is {newest})")
        expected: list[str] = []  # digests of the manifests this service gave version `version`
        try:  # one read, not a listing of every checkpoint: a missing manifest means no checkpoint
            stored = self.cluster.checkpoints.read_manifest(tenant_id, version)
            expected += [export_manifest(stored).digest, stored.digest]  # an export of it; an older export
        except CheckpointError as error:
            if not isinstance(error.__cause__, FileNotFoundError):
                raise ApiError(f"checkpoint version {version} cannot be read: {error}").with_status(
                    500, "checkpoint_unreadable"
                ) from None
        if version == current:
            with service_errors("payload"):
                _, exported = decode_tenant_payload(self.cluster.training.export_params(tenant_id))
            # Each export stamps its own created_at: compare everything but the time stamp.
            expected.append(dataclasses.replace(exported, created_at=manifest.created_at).digest)
        if expected and manifest.digest not in expected:
            raise InvalidInput(
                field,
                f"the manifest of version {version} differs from the one this service issued for it "
                f"(digest {manifest.digest[:16]}); to serve that version, load it by version instead",
            )
