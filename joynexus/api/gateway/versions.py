"""Policy versions of the caller's tenant: the version list, checkpoint manifests, exports of a
version's tenant payload, checkpointing the slot, and installing serving weights (load_weights)
with the checks that keep a payload to the caller's own module and issued versions."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from joynexus.api.errors import ApiError, InvalidInput, NotFound
from joynexus.api.gateway.admission import Admission
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.service_errors import cause_of, service_errors
from joynexus.artifacts import (
    ACTION_MODULE_FILE,
    CheckpointError,
    CheckpointStore,
    PayloadError,
    TenantManifest,
    VersionInfo,
    VersionInUse,
    action_module_file,
    decode_tenant_payload,
    encode_tenant_payload,
    export_manifest,
    payload_digest,
)
from joynexus.core.tenants import Tenant
from joynexus.protocol import schemas as s

if TYPE_CHECKING:
    from joynexus.master.usage import UsageLedger
    from joynexus.services.inference.endpoint import InferenceEndpoint
    from joynexus.services.training.service import TrainingModelService


def manifest_model(manifest: TenantManifest) -> s.Manifest:
    return s.Manifest(**json.loads(manifest.to_json()), digest=manifest.digest)


class Versions:
    """The caller's versions across the Training Model Service (the slot's current one), the
    checkpoint store (kept ones) and the Inference Model Service (served ones)."""

    def __init__(
        self,
        training: TrainingModelService,
        inference: InferenceEndpoint,
        checkpoints: CheckpointStore,
        directory: TenantDirectory,
        admission: Admission,
        ledger: UsageLedger,
    ):
        self._training, self._inference, self._checkpoints = training, inference, checkpoints
        self._directory, self._admission, self._ledger = directory, admission, ledger

    def list_versions(self, tenant_id: str, after: int | None = None, limit: int = 100) -> s.Versions:
        """One page of checkpoints (versions > `after`, None: from version 0 on; ascending, at most
        `limit`) from ONE listing of the tenant's checkpoints; `next_after` continues (None: no more)."""
        status = self._slot_status(tenant_id)
        # One more than asked for says whether another page follows without a second listing.
        start = -1 if after is None else after
        infos = self._checkpoints.version_infos(tenant_id, after=start, limit=limit + 1)
        page = infos[:limit]
        if status is None:  # no slot: its latest checkpoint failed to load; say which and why
            page = [self._verified(tenant_id, info) for info in page]
        checkpoints = [
            s.CheckpointInfo(
                version=i.version,
                created_at=i.created_at,
                digest=i.export_digest or i.digest,
                size_bytes=i.size_bytes,
                checkpoint_digest=i.digest or None,
                corrupt=i.problem is not None,
                problem=i.problem,
            )
            for i in page
        ]
        return s.Versions(
            training_version=None if status is None else status["version"],
            optimizer_steps=None if status is None else status["optimizer_steps"],
            checkpoints=checkpoints,
            serving_versions=self._inference.versions(tenant_id),
            next_after=page[-1].version if len(infos) > limit else None,
        )

    def _slot_status(self, tenant_id: str) -> dict[str, Any] | None:
        """The training slot's status; None when the tenant has no slot loaded (it is unhealthy:
        e.g. its latest checkpoint is corrupt), so its other versions stay listable and exportable."""
        if self._directory.tenant(tenant_id, healthy=False).status == "active":
            return self._training.tenant_status(tenant_id)
        try:
            return self._training.tenant_status(tenant_id)
        except Exception as error:
            if isinstance(cause_of(error), KeyError):  # UnknownTenant: no slot
                return None
            raise

    def _verified(self, tenant_id: str, info: VersionInfo) -> VersionInfo:
        """The latest version, read whole (every file against its digest) when the tenant has no
        slot: what kept its slot from loading shows in the listing. Other versions as listed."""
        if info.problem is not None or info.version != self._checkpoints.latest_version(tenant_id):
            return info
        try:
            self._checkpoints.load_tenant(tenant_id, info.version)
        except CheckpointError as error:
            return dataclasses.replace(info, problem=str(error))
        return info

    def _checkpoint_manifest(self, tenant_id: str, version: int) -> TenantManifest:
        """The manifest of one of the tenant's checkpoints (no tensors read)."""
        if version not in self._checkpoints.versions(tenant_id):
            raise NotFound("checkpoint version", version, "version")
        try:
            return self._checkpoints.read_manifest(tenant_id, version)
        except CheckpointError as error:
            raise _corrupt(version, error) from None

    def checkpoint_manifest(self, tenant_id: str, version: int) -> s.Manifest:
        return manifest_model(self._checkpoint_manifest(tenant_id, version))

    def export(self, tenant_id: str, version: int | None = None) -> tuple[bytes, TenantManifest]:
        """The tenant payload of `version` (None: the current training parameters)."""
        status = self._slot_status(tenant_id)
        if status is None and version is None:
            self._directory.tenant(tenant_id)  # 409 tenant_unhealthy, with the reason: no current parameters
        if version is None or (status is not None and version == status["version"]):
            payload = self._training.export_params(tenant_id)
            return payload, decode_tenant_payload(payload)[1]
        if version not in self._checkpoints.versions(tenant_id):
            raise NotFound("policy version", version, "version")
        try:
            manifest, module_state, _ = self._checkpoints.load_tenant(tenant_id, version)
        except CheckpointError as error:
            raise _corrupt(version, error) from None
        # The manifest every export of this version carries (= the MLflow registry's manifest_digest tag).
        exported = export_manifest(manifest)
        return encode_tenant_payload(module_state, exported), exported

    def delete_version(self, tenant_id: str, version: int) -> s.VersionDeleted:
        """Delete one checkpointed version: not LATEST's (the slot resumes from it), not a registered
        one, not one being served. No admission check: a tenant at or over its storage quota
        deletes versions to get back under it."""
        self._directory.tenant(tenant_id, healthy=False)
        served = self._inference.versions(tenant_id)
        if version in served:
            raise ApiError(
                f"version {version} is being served ({served}); load another version first",
                [("version", "being served")],
            ).with_status(409, "version_in_use")
        try:
            freed = self._checkpoints.delete_version(tenant_id, version)
        except KeyError:
            raise NotFound("checkpoint version", version, "version") from None
        except VersionInUse as error:
            raise ApiError(f"version {version} cannot be deleted: {error}", [("version", str(error))]).with_status(
                409, "version_in_use"
            ) from None
        return s.VersionDeleted(version=version, freed_bytes=freed, storage_bytes=self._ledger.storage_bytes(tenant_id))

    def save(self, tenant_id: str, include_optim: bool) -> s.Manifest:
        self._admission.check(tenant_id, storage=True)
        manifests = self._training.save([tenant_id], include_optim)
        return s.Manifest.model_validate(manifests[0])

    def load_weights(self, tenant_id: str, request: s.LoadWeightsRequest) -> s.LoadWeightsResult:
        tenant = self._directory.tenant(tenant_id)
        if request.payload is not None:
            if request.version is not None:
                raise InvalidInput("version", "give either payload or version, not both")
            payload = request.payload
            module_state, manifest = self._check_payload(tenant, payload)
            self._check_payload_finite(module_state)
            self._check_payload_issued(tenant_id, manifest, module_state)
        else:
            payload, _ = self.export(tenant_id, request.version)
        with service_errors("payload"):
            try:
                loaded = self._inference.load_weights(payload)
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
        import torch  # here: the tensors exist, torch is loaded; the API starts without it

        for name, value in module_state.items():
            if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
                raise InvalidInput("payload", f"tensor {name!r} holds NaN or infinite values")

    def _check_payload_issued(self, tenant_id: str, manifest: TenantManifest, module_state: dict[str, Any]) -> None:
        """Only versions this service issued, with the manifest it issued them with: a made-up
        version would later collide with the real one of that number in the serving versions."""
        version = manifest.policy_version
        field = "payload.manifest.version"
        with service_errors("payload"):
            current = self._training.policy_version(tenant_id)
        issued = self._checkpoints.issued_version(tenant_id)
        # The slot's own version counts as issued (version 0 exists before anything is recorded).
        newest = current if issued is None else max(issued, current)
        if version < 0 or version > newest:
            raise InvalidInput(field, f"version {version} was never issued for your tenant (the newest is {newest})")
        checkpointed: TenantManifest | None = None
        try:  # one read, not a listing of every checkpoint: a missing manifest means no checkpoint
            checkpointed = self._checkpoints.read_manifest(tenant_id, version)
        except CheckpointError as error:
            if not isinstance(error.__cause__, FileNotFoundError):
                raise _corrupt(version, error) from None
        exported: TenantManifest | None = None
        exported_tensors: dict[str, Any] = {}
        if version == current:
            with service_errors("payload"):
                exported_tensors, exported = decode_tenant_payload(self._training.export_params(tenant_id))
            # Each export stamps its own created_at: compare everything but the time stamp.
            exported = dataclasses.replace(exported, created_at=manifest.created_at)
        # The tensors must be the ones issued with that manifest, not only the manifest: a payload
        # that copies an issued manifest onto other weights would serve them as that version.
        # Issued manifests of a checkpoint: its own (older exports) and the one exports carry now.
        if checkpointed is not None and manifest.digest in (checkpointed.digest, export_manifest(checkpointed).digest):
            issued = checkpointed.files.get(ACTION_MODULE_FILE)
            if issued != payload_digest(action_module_file(module_state, tenant_id, version)):
                raise _other_tensors(version)
        elif exported is not None and manifest.digest == exported.digest:
            if not _same_tensors(module_state, exported_tensors):
                raise _other_tensors(version)
        elif checkpointed is not None or exported is not None:
            raise InvalidInput(
                field,
                f"the manifest of version {version} differs from the one this service issued for it "
                f"(digest {manifest.digest[:16]}); to serve that version, load it by version instead",
            )


def _same_tensors(ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    import torch

    return ours.keys() == theirs.keys() and all(
        ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]) for name in ours
    )


def _other_tensors(version: int) -> InvalidInput:
    return InvalidInput(
        "payload",
        f"the tensors differ from the ones this service issued as version {version} (the manifest matches, "
        "the weights do not); to serve that version, load it by version instead",
    )


def _corrupt(version: int, error: CheckpointError) -> ApiError:
    """A checkpoint that exists but cannot be used: the caller's version, named, not a server error."""
    return ApiError(f"checkpoint version {version} is corrupt: {error}", [("version", str(error))]).with_status(
        409, "checkpoint_corrupt"
    )
