"""The checkpoint layout: one folder per tenant and version with a manifest and per-file digests,
the LATEST pointer, and the one place that decides which version is the latest."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from joynexus.artifacts.blobs import (
    BlobStore,
    blob_store_for,
)
from joynexus.artifacts.codec import (
    _FILE_NAME_RE,
    _TENANT_ID_RE,
    _VERSION_DIR_RE,
    ACTION_MODULE_FILE,
    LATEST_FILE,
    MANIFEST_FILE,
    OPTIMIZER_JSON_FILE,
    OPTIMIZER_TENSORS_FILE,
    CheckpointError,
    PayloadError,
    TenantManifest,
    _decode_optimizer_state,
    _encode_optimizer_state,
    _load_tensors,
    _prepare_tensors,
    _save_tensors,
    _sha256,
    _utc_now_iso,
    _validate_version,
    validate_tenant_id,
)

# Per-tenant high-water mark of every policy version the Training Model Service has issued
# (exported, published, returned), checkpointed or not: a restarted service never reuses one.
ISSUED_FILE = "ISSUED"


class CheckpointStore:
    """Versioned per-tenant checkpoints: ``tenants/<tenant_id>/v<version:06d>/`` + ``LATEST``.

    A version folder is immutable once published. ``LATEST`` is the commit pointer and only
    moves forward (to the highest version saved), so a late or concurrent save of an older
    version never rolls a tenant back.
    """

    def __init__(self, root: str | Path | BlobStore) -> None:
        self.blobs: BlobStore = blob_store_for(root)
        # Serialises read-modify-write of LATEST within this process.
        self._latest_lock = threading.Lock()
        self._pointers: dict[tuple[str, str], int] = {}  # (tenant, LATEST|ISSUED) -> value last written/read

    def __repr__(self) -> str:
        return f"CheckpointStore({self.blobs!r})"

    @staticmethod
    def _tenant_prefix(tenant_id: str) -> str:
        return f"tenants/{validate_tenant_id(tenant_id)}"

    @classmethod
    def _version_prefix(cls, tenant_id: str, version: int) -> str:
        return f"{cls._tenant_prefix(tenant_id)}/v{_validate_version(version):06d}"

    # ---- write -------------------------------------------------------------------------

    def save_tenant(
        self,
        *,
        tenant_id: str,
        policy_version: int,
        schema_signature: str,
        base_model_id: str,
        module_kind: str,
        module_config: dict,
        module_state: dict[str, torch.Tensor],
        optimizer_state: dict | None,
        extra: dict | None = None,
    ) -> TenantManifest:
        """Write one immutable checkpoint atomically, then move ``LATEST`` to it."""
        validate_tenant_id(tenant_id)
        _validate_version(policy_version)
        prefix = self._version_prefix(tenant_id, policy_version)
        if self.blobs.exists(f"{prefix}/{MANIFEST_FILE}") or self.blobs.exists(prefix):
            raise FileExistsError(
                f"checkpoint for tenant {tenant_id!r} version {policy_version} already exists "
                "(checkpoints are immutable; save a new policy_version)"
            )
        # Fail early on configs that cannot round-trip through JSON.
        try:
            json.dumps(module_config, allow_nan=False)
            json.dumps(extra or {}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"module_config / extra must be JSON-serialisable: {exc}") from exc

        small_meta = {"tenant_id": tenant_id, "policy_version": str(policy_version)}
        files: dict[str, bytes] = {
            ACTION_MODULE_FILE: _save_tensors(_prepare_tensors(module_state, "module_state"), small_meta)
        }
        if optimizer_state is not None:
            opt_tensors, opt_doc = _encode_optimizer_state(optimizer_state)
            files[OPTIMIZER_TENSORS_FILE] = _save_tensors(opt_tensors, small_meta)
            files[OPTIMIZER_JSON_FILE] = json.dumps(opt_doc, allow_nan=False).encode()  # keep key order

        manifest = TenantManifest(
            tenant_id=tenant_id,
            policy_version=policy_version,
            schema_signature=schema_signature,
            base_model_id=base_model_id,
            module_kind=module_kind,
            module_config=json.loads(json.dumps(module_config)),  # detached, JSON-normalised copy
            files={name: _sha256(data) for name, data in files.items()},
            created_at=_utc_now_iso(),
            extra=json.loads(json.dumps(extra or {})),
        )
        files[MANIFEST_FILE] = manifest.to_json().encode("utf-8")  # last: commit marker on S3

        self.blobs.publish_dir(prefix, files)
        self._advance_latest(tenant_id, policy_version)
        return manifest

    def record_issued_version(self, tenant_id: str, version: int) -> None:
        """Durably raise the tenant's issued-version high-water mark to ``version`` (never lowers
        it). Written like LATEST: one atomic replace, on local disk or S3."""
        _validate_version(version)
        self._raise_pointer(tenant_id, ISSUED_FILE, version, allow_equal=False)

    def issued_version(self, tenant_id: str) -> int | None:
        """The highest version ever recorded as issued for the tenant; None if none was."""
        return self._read_pointer(tenant_id, ISSUED_FILE)

    def delete_tenant(self, tenant_id: str) -> int:
        """Remove every object of the tenant (checkpoints, LATEST, ISSUED); returns how many."""
        delete = getattr(self.blobs, "delete_prefix", None)
        if delete is None:
            raise NotImplementedError(f"{self.blobs!r} cannot delete (it has no delete_prefix)")
        with self._latest_lock:
            self._pointers = {k: v for k, v in self._pointers.items() if k[0] != tenant_id}
            return int(delete(self._tenant_prefix(tenant_id)))

    def _advance_latest(self, tenant_id: str, version: int) -> None:
        self._raise_pointer(tenant_id, LATEST_FILE, version, allow_equal=True)

    def _raise_pointer(self, tenant_id: str, name: str, version: int, *, allow_equal: bool) -> None:
        """Move a version pointer file (LATEST, ISSUED) up to `version`, never down. The value this
        store last wrote or read is remembered, so the hot path (ISSUED on every new version) is
        one write, not a read and a write; this store is the pointers' only writer."""
        with self._latest_lock:
            current = self._pointers.get((tenant_id, name))
            if current is None:
                current = self._read_pointer(tenant_id, name)
            if current is None or version > current or (allow_equal and version == current):
                self.blobs.put_atomic(f"{self._tenant_prefix(tenant_id)}/{name}", f"{version}\n".encode())
                current = version
            self._pointers[(tenant_id, name)] = current

    def _read_pointer(self, tenant_id: str, name: str) -> int | None:
        key = f"{self._tenant_prefix(tenant_id)}/{name}"
        try:
            text = self.blobs.read(key).decode("ascii").strip()
        except FileNotFoundError:
            return None
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"tenant {tenant_id!r}: {name} is not ASCII") from exc
        if not text.isdigit():
            raise CheckpointError(f"tenant {tenant_id!r}: {name} holds {text!r}, not a version number")
        return int(text)

    # ---- read --------------------------------------------------------------------------

    def latest_version(self, tenant_id: str) -> int | None:
        """Version named by ``LATEST``; None if the tenant has no committed checkpoint."""
        return self._read_pointer(tenant_id, LATEST_FILE)

    def versions(self, tenant_id: str) -> list[int]:
        """Complete (manifest present) checkpoint versions, ascending; temp folders ignored."""
        prefix = self._tenant_prefix(tenant_id)
        found = []
        for name in self.blobs.list_dir(prefix):
            m = _VERSION_DIR_RE.fullmatch(name)
            if m and self.blobs.exists(f"{prefix}/{name}/{MANIFEST_FILE}"):
                found.append(int(m.group(1)))
        return sorted(found)

    def read_manifest(self, tenant_id: str, version: int) -> TenantManifest:
        """The manifest of one committed checkpoint, without reading its tensors."""
        validate_tenant_id(tenant_id)
        _validate_version(version)
        try:
            data = self.blobs.read(f"{self._version_prefix(tenant_id, version)}/{MANIFEST_FILE}")
        except FileNotFoundError as exc:
            raise CheckpointError(f"tenant {tenant_id!r} version {version}: no checkpoint") from exc
        return TenantManifest.from_json(data)

    def version_bytes(self, tenant_id: str, version: int) -> int:
        """Bytes one checkpoint version takes in the store."""
        return self.blobs.total_bytes(self._version_prefix(tenant_id, version))

    def tenant_bytes(self, tenant_id: str) -> int:
        """Bytes every checkpoint of the tenant takes in the store (its storage usage)."""
        return self.blobs.total_bytes(self._tenant_prefix(validate_tenant_id(tenant_id)))

    def tenants(self) -> list[str]:
        """Tenants with at least one committed checkpoint (a LATEST pointer)."""
        out = []
        for name in self.blobs.list_dir("tenants"):
            if _TENANT_ID_RE.fullmatch(name) and name not in {".", ".."}:
                if self.blobs.exists(f"tenants/{name}/{LATEST_FILE}"):
                    out.append(name)
        return sorted(out)

    def load_tenant(
        self, tenant_id: str, version: int | None = None
    ) -> tuple[TenantManifest, dict[str, torch.Tensor], dict | None]:
        """Load and verify a checkpoint (``None`` -> LATEST).

        Returns ``(manifest, module_state, optimizer_state_or_None)``; the optimizer state is
        in the exact shape ``torch.optim.Optimizer.load_state_dict`` expects.
        """
        validate_tenant_id(tenant_id)
        if version is None:
            version = self.latest_version(tenant_id)
            if version is None:
                raise CheckpointError(f"tenant {tenant_id!r} has no checkpoint (no LATEST)")
        _validate_version(version)
        prefix = self._version_prefix(tenant_id, version)
        where = f"tenant {tenant_id!r} version {version}"

        try:
            manifest_bytes = self.blobs.read(f"{prefix}/{MANIFEST_FILE}")
        except FileNotFoundError as exc:
            raise CheckpointError(f"{where}: checkpoint not found (file {MANIFEST_FILE} missing)") from exc
        try:
            manifest = TenantManifest.from_json(manifest_bytes)
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: file {MANIFEST_FILE} is invalid: {exc}") from exc
        if manifest.tenant_id != tenant_id or manifest.policy_version != version:
            raise CheckpointError(
                f"{where}: file {MANIFEST_FILE} describes tenant {manifest.tenant_id!r} "
                f"version {manifest.policy_version}"
            )
        if ACTION_MODULE_FILE not in manifest.files:
            raise CheckpointError(f"{where}: file {MANIFEST_FILE} lists no {ACTION_MODULE_FILE}")

        # Read each file once and hash those same bytes, so what we parse is what we verified.
        verified: dict[str, bytes] = {}
        for name, expected in manifest.files.items():
            if not _FILE_NAME_RE.fullmatch(name) or name in {".", "..", MANIFEST_FILE}:
                raise CheckpointError(f"{where}: file {MANIFEST_FILE} lists a bad file name {name!r}")
            try:
                data = self.blobs.read(f"{prefix}/{name}")
            except FileNotFoundError as exc:
                raise CheckpointError(f"{where}: file {name} is missing") from exc
            actual = _sha256(data)
            if actual != expected:
                raise CheckpointError(f"{where}: file {name} is corrupted (sha256 {actual} != manifest {expected})")
            verified[name] = data

        try:
            module_state, _ = _load_tensors(verified[ACTION_MODULE_FILE], ACTION_MODULE_FILE)
        except PayloadError as exc:
            raise CheckpointError(f"{where}: file {ACTION_MODULE_FILE}: {exc}") from exc

        optimizer_state: dict | None = None
        has_t, has_j = OPTIMIZER_TENSORS_FILE in verified, OPTIMIZER_JSON_FILE in verified
        if has_t != has_j:
            raise CheckpointError(
                f"{where}: optimizer state needs both {OPTIMIZER_TENSORS_FILE} and {OPTIMIZER_JSON_FILE}"
            )
        if has_t:
            try:
                opt_tensors, _ = _load_tensors(verified[OPTIMIZER_TENSORS_FILE], OPTIMIZER_TENSORS_FILE)
            except PayloadError as exc:
                raise CheckpointError(f"{where}: file {OPTIMIZER_TENSORS_FILE}: {exc}") from exc
            try:
                doc = json.loads(verified[OPTIMIZER_JSON_FILE])
                optimizer_state = _decode_optimizer_state(doc, opt_tensors)
            except (json.JSONDecodeError, UnicodeDecodeError, CheckpointError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{where}: file {OPTIMIZER_JSON_FILE} is invalid: {exc}") from exc
        return manifest, module_state, optimizer_state
