"""Tenant checkpoints and export payloads.

Everything on disk or on the wire is safetensors (tensors) plus JSON (structure and scalars):
nothing is ever pickled or unpickled, so a tenant can not smuggle code into the shared service
through a checkpoint.

Storage goes through a tiny :class:`BlobStore` interface (read / list / atomically publish a
folder / atomically replace one object) so an object-store backend sits behind the same
:class:`CheckpointStore`: :class:`LocalBlobStore` here, ``S3BlobStore`` in :mod:`joynexus.artifacts_s3`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

__all__ = [
    "ACTION_MODULE_FILE",
    "MANIFEST_FILE",
    "OPTIMIZER_JSON_FILE",
    "OPTIMIZER_TENSORS_FILE",
    "BlobStore",
    "CheckpointError",
    "CheckpointStore",
    "LocalBlobStore",
    "PayloadError",
    "TenantManifest",
    "blob_store_for",
    "decode_tenant_payload",
    "encode_tenant_payload",
    "validate_tenant_id",
]

ACTION_MODULE_FILE = "action_module.safetensors"
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"
OPTIMIZER_JSON_FILE = "optimizer.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "LATEST"

# Key under which the manifest JSON travels inside a payload's safetensors metadata.
PAYLOAD_MANIFEST_KEY = "joynexus.manifest"
PAYLOAD_FORMAT_KEY = "joynexus.format"
PAYLOAD_FORMAT = "tenant-payload/1"
OPTIMIZER_FORMAT = "optimizer-state/1"

_TENANT_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_VERSION_DIR_RE = re.compile(r"v(\d{6,})")
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_TMP_PREFIX = ".tmp-"
# A safetensors header above this is junk, not a real module (protects against huge allocations).
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(RuntimeError):
    """A checkpoint or payload is corrupted, missing, or does not match its manifest."""


class PayloadError(CheckpointError, ValueError):
    """Bytes that are not a valid tenant payload (also a ValueError: it is bad input)."""


def validate_tenant_id(tenant_id: str) -> str:
    """Return ``tenant_id`` if safe as a single path segment / registry name part, else ValueError."""
    if not isinstance(tenant_id, str) or not _TENANT_ID_RE.fullmatch(tenant_id) or tenant_id in {".", ".."}:
        raise ValueError(
            f"invalid tenant_id {tenant_id!r}: expected 1-64 characters of [A-Za-z0-9._-], not '.' or '..'"
        )
    return tenant_id


def _validate_version(policy_version: int) -> int:
    # bool is an int subclass; True as a version is always a bug.
    if isinstance(policy_version, bool) or not isinstance(policy_version, int) or policy_version < 0:
        raise ValueError(f"invalid policy_version {policy_version!r}: expected an int >= 0")
    return policy_version


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _utc_now_iso() -> str:
    return datetime.now(UTC).isoformat()


# --------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantManifest:
    """What a tenant checkpoint / payload is: identity, compatibility keys and file hashes."""

    tenant_id: str
    policy_version: int
    schema_signature: str
    base_model_id: str
    module_kind: str
    module_config: dict  # JSON-able
    files: dict[str, str]  # file name -> sha256 hex
    created_at: str  # ISO 8601, UTC
    extra: dict  # e.g. {"optimizer_steps": 12}

    def _as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        # sort_keys keeps the file stable and diff-able; the digest uses its own compact form.
        return json.dumps(self._as_dict(), sort_keys=True, indent=2, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> TenantManifest:
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"manifest is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError("manifest JSON must be an object")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - raw.keys()
        if missing:
            raise CheckpointError(f"manifest is missing fields {sorted(missing)}")
        unknown = raw.keys() - names
        if unknown:
            raise CheckpointError(f"manifest has unknown fields {sorted(unknown)}")
        for key in ("tenant_id", "schema_signature", "base_model_id", "module_kind", "created_at"):
            if not isinstance(raw[key], str):
                raise CheckpointError(f"manifest field {key!r} must be a string")
        if isinstance(raw["policy_version"], bool) or not isinstance(raw["policy_version"], int):
            raise CheckpointError("manifest field 'policy_version' must be an int")
        for key in ("module_config", "files", "extra"):
            if not isinstance(raw[key], dict):
                raise CheckpointError(f"manifest field {key!r} must be an object")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in raw["files"].items()):
            raise CheckpointError("manifest field 'files' must map names to sha256 strings")
        return cls(**{k: raw[k] for k in names})

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON (sorted keys, compact): the identity of this manifest."""
        canonical = json.dumps(
            self._as_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
        return _sha256(canonical.encode("utf-8"))


# --------------------------------------------------------------------------------------------
# Tensor (de)serialisation helpers
# --------------------------------------------------------------------------------------------


def _prepare_tensors(state: Mapping[str, Any], what: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise TypeError(f"{what}: keys must be str, got {key!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what}: value for {key!r} is {type(value).__name__}, not a torch.Tensor")
        # clone: safetensors refuses tensors sharing storage (tied weights, views) and needs
        # contiguous CPU memory; modules here are small, so the copy is cheap.
        out[key] = value.detach().to("cpu").contiguous().clone()
    return out


def _save_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return _st_save(tensors, metadata=metadata)


def _read_safetensors_header(data: bytes) -> dict[str, Any]:
    """Parse the safetensors JSON header by hand: the library's bytes loader drops the metadata."""
    if len(data) < 8:
        raise PayloadError(f"not a safetensors payload: only {len(data)} bytes")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len == 0 or header_len > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise PayloadError(
            "not a safetensors payload: header length field is "
            f"{header_len} for {len(data)} bytes (junk, truncated, or another format such as pickle)"
        )
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PayloadError(f"not a safetensors payload: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise PayloadError("not a safetensors payload: header is not a JSON object")
    return header


def _load_tensors(data: bytes, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    header = _read_safetensors_header(data)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise PayloadError(f"{what}: safetensors metadata is not an object")
    try:
        tensors = _st_load(data)  # validates offsets / dtypes; pure data, no code execution
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise PayloadError(f"{what}: invalid safetensors data: {exc}") from exc
    return tensors, metadata


def encode_tenant_payload(module_state: dict[str, torch.Tensor], manifest: TenantManifest) -> bytes:
    """Serialise a module state as safetensors bytes with the manifest JSON in the metadata."""
    tensors = _prepare_tensors(module_state, "module_state")
    metadata = {PAYLOAD_FORMAT_KEY: PAYLOAD_FORMAT, PAYLOAD_MANIFEST_KEY: manifest.to_json()}
    return _save_tensors(tensors, metadata)


def decode_tenant_payload(payload: bytes) -> tuple[dict[str, torch.Tensor], TenantManifest]:
    """Inverse of :func:`encode_tenant_payload`; raises :class:`PayloadError` on anything else."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    tensors, metadata = _load_tensors(payload, "tenant payload")
    manifest_json = metadata.get(PAYLOAD_MANIFEST_KEY)
    if manifest_json is None:
        raise PayloadError(
            f"safetensors data carries no {PAYLOAD_MANIFEST_KEY!r} metadata: not a JoyNexus tenant payload"
        )
    try:
        manifest = TenantManifest.from_json(manifest_json)
    except CheckpointError as exc:
        raise PayloadError(f"tenant payload has a bad manifest: {exc}") from exc
    return tensors, manifest


# --------------------------------------------------------------------------------------------
# Optimizer state <-> (safetensors, JSON) without pickle
# --------------------------------------------------------------------------------------------
# The whole state_dict is walked once: every tensor is replaced by {"__tensor__": key} and stored
# under that key in optimizer.safetensors; tuples and dicts with non-str keys (the int parameter
# ids of "state") get tagged JSON forms so the exact structure comes back.

_TAG_TENSOR = "__tensor__"
_TAG_TUPLE = "__tuple__"
_TAG_ITEMS = "__items__"
_TAGS = {_TAG_TENSOR, _TAG_TUPLE, _TAG_ITEMS}


def _encode_optimizer_state(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}

    def tensor_key(path: list[str]) -> str:
        key = ".".join(path) or "root"
        base, n = key, 1
        while key in tensors:  # dotted names could collide; keep keys unique
            key, n = f"{base}#{n}", n + 1
        return key

    def enc(value: Any, path: list[str]) -> Any:
        if isinstance(value, torch.Tensor):
            key = tensor_key(path)
            tensors[key] = value.detach().to("cpu").contiguous().clone()
            return {_TAG_TENSOR: key}
        if value is None or isinstance(value, (bool, int, float, str)):
            if isinstance(value, float) and not math.isfinite(value):
                # allow_nan JSON is non-standard; keep such floats exact as 0-dim tensors instead.
                key = tensor_key(path)
                tensors[key] = torch.tensor(value, dtype=torch.float64)
                return {_TAG_TENSOR: key, "python": "float"}
            return value
        if isinstance(value, tuple):
            return {_TAG_TUPLE: [enc(v, [*path, str(i)]) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [enc(v, [*path, str(i)]) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            if all(isinstance(k, str) for k in value) and not (_TAGS & set(value)):
                return {k: enc(v, [*path, k]) for k, v in value.items()}
            items = []
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (int, str)):
                    raise TypeError(f"optimizer_state: unsupported dict key {k!r} at {'.'.join(path)}")
                items.append([k, enc(v, [*path, str(k)])])
            return {_TAG_ITEMS: items}
        raise TypeError(
            f"optimizer_state: unsupported value of type {type(value).__name__} at "
            f"{'.'.join(path) or '<root>'} (only tensors, JSON scalars, lists, tuples, dicts)"
        )

    structure = enc(dict(state), [])
    return tensors, {"format": OPTIMIZER_FORMAT, "state_dict": structure}


def _decode_optimizer_state(doc: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    if not isinstance(doc, dict) or doc.get("format") != OPTIMIZER_FORMAT or "state_dict" not in doc:
        raise CheckpointError(f"optimizer JSON is not in format {OPTIMIZER_FORMAT!r}")

    def dec(value: Any) -> Any:
        if isinstance(value, list):
            return [dec(v) for v in value]
        if isinstance(value, dict):
            if _TAG_TENSOR in value:
                key = value[_TAG_TENSOR]
                if key not in tensors:
                    raise CheckpointError(f"optimizer JSON references missing tensor {key!r}")
                if value.get("python") == "float":
                    return float(tensors[key].item())
                return tensors[key]
            if _TAG_TUPLE in value:
                return tuple(dec(v) for v in value[_TAG_TUPLE])
            if _TAG_ITEMS in value:
                return {k: dec(v) for k, v in value[_TAG_ITEMS]}
            return {k: dec(v) for k, v in value.items()}
        return value

    state = dec(doc["state_dict"])
    if not isinstance(state, dict):
        raise CheckpointError("optimizer state is not a dict")
    return state


# --------------------------------------------------------------------------------------------
# Blob storage
# --------------------------------------------------------------------------------------------


@runtime_checkable
class BlobStore(Protocol):
    """Minimal storage the checkpoint layer needs; keys are '/'-separated relative paths.

    An object-store backend implements ``publish_dir`` by uploading the files in the given order,
    the last one (the manifest) acting as the commit marker, and ``put_atomic`` as one PUT.
    """

    def read(self, key: str) -> bytes:
        """Return the object's bytes; FileNotFoundError if absent."""
        ...

    def exists(self, key: str) -> bool: ...

    def list_dir(self, prefix: str) -> list[str]:
        """Names of the direct children of ``prefix`` (empty list if none)."""
        ...

    def publish_dir(self, prefix: str, files: Mapping[str, bytes]) -> None:
        """Make ``files`` visible under ``prefix`` all at once; FileExistsError if it exists."""
        ...

    def put_atomic(self, key: str, data: bytes) -> None:
        """Replace one object so that readers see either the old or the new bytes."""
        ...


def _check_key(key: str) -> list[str]:
    parts = key.split("/")
    if not key or any(p in {"", ".", ".."} for p in parts) or "\\" in key or "\x00" in key:
        raise ValueError(f"invalid storage key {key!r}")
    return parts


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable; not every platform can open a directory.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


class LocalBlobStore:
    """:class:`BlobStore` on a local (POSIX) filesystem, crash-safe via fsync + rename."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*_check_key(key))

    def read(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def list_dir(self, prefix: str) -> list[str]:
        path = self._path(prefix) if prefix else self.root
        try:
            return sorted(p.name for p in path.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def publish_dir(self, prefix: str, files: Mapping[str, bytes]) -> None:
        target = self._path(prefix)
        for name in files:
            if not _FILE_NAME_RE.fullmatch(name) or name in {".", ".."}:
                raise ValueError(f"invalid file name {name!r}")
        if target.exists():
            raise FileExistsError(f"{target} already exists")
        target.parent.mkdir(parents=True, exist_ok=True)
        # Temp dir next to the target: same filesystem, so os.replace is an atomic rename.
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=target.parent))
        try:
            for name, data in files.items():
                _write_file_durably(tmp / name, data)
            _fsync_dir(tmp)
            try:
                os.replace(tmp, target)
            except OSError as exc:
                if target.exists():  # lost a race with another writer of the same version
                    raise FileExistsError(f"{target} already exists") from exc
                raise
            _fsync_dir(target.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def put_atomic(self, key: str, data: bytes) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
            _fsync_dir(target.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def blob_store_for(location: str | Path | BlobStore) -> BlobStore:
    """A store given as itself, an ``s3://bucket/prefix`` URI (:mod:`joynexus.artifacts_s3`) or a
    local folder."""
    if isinstance(location, BlobStore):
        return location
    if isinstance(location, str) and location.startswith("s3://"):
        from joynexus.artifacts_s3 import S3BlobStore

        return S3BlobStore.from_uri(location)
    return LocalBlobStore(location)


# --------------------------------------------------------------------------------------------
# Checkpoint store
# --------------------------------------------------------------------------------------------


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

    def _advance_latest(self, tenant_id: str, version: int) -> None:
        with self._latest_lock:
            current = self.latest_version(tenant_id)
            if current is None or version >= current:
                self.blobs.put_atomic(f"{self._tenant_prefix(tenant_id)}/{LATEST_FILE}", f"{version}\n".encode())

    # ---- read --------------------------------------------------------------------------

    def latest_version(self, tenant_id: str) -> int | None:
        """Version named by ``LATEST``; None if the tenant has no committed checkpoint."""
        key = f"{self._tenant_prefix(tenant_id)}/{LATEST_FILE}"
        try:
            text = self.blobs.read(key).decode("ascii").strip()
        except FileNotFoundError:
            return None
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"tenant {tenant_id!r}: LATEST is not ASCII") from exc
        if not text.isdigit():
            raise CheckpointError(f"tenant {tenant_id!r}: LATEST holds {text!r}, not a version number")
        return int(text)

    def versions(self, tenant_id: str) -> list[int]:
        """Complete (manifest present) checkpoint versions, ascending; temp folders ignored."""
        prefix = self._tenant_prefix(tenant_id)
        found = []
        for name in self.blobs.list_dir(prefix):
            m = _VERSION_DIR_RE.fullmatch(name)
            if m and self.blobs.exists(f"{prefix}/{name}/{MANIFEST_FILE}"):
                found.append(int(m.group(1)))
        return sorted(found)

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
