"""Codecs of tenant artifacts: the manifest, the export payload (safetensors with the manifest in
its metadata) and optimizer state as safetensors + JSON. Nothing is ever pickled or unpickled, so a
tenant cannot smuggle code into the shared service through a checkpoint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where tensors are made or read: manifests and digests need no torch
    import torch

ACTION_MODULE_FILE = "action_module.safetensors"
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"
OPTIMIZER_JSON_FILE = "optimizer.json"
MANIFEST_FILE = "manifest.json"
NORMALIZATION_FILE = "normalization.json"  # a version's normalizer (joynexus.data.normalization), beside its weights
LATEST_FILE = "LATEST"

# Key under which the manifest JSON travels inside a payload's safetensors metadata.
PAYLOAD_MANIFEST_KEY = "joynexus.manifest"
PAYLOAD_FORMAT_KEY = "joynexus.format"
PAYLOAD_FORMAT = "tenant-payload/1"
OPTIMIZER_FORMAT = "optimizer-state/1"
# Manifest `extra` key: when the version's weights were made (ISO 8601, UTC). An export's manifest
# takes it as its created_at, so every export of one version is the same bytes (see export_manifest).
VERSION_CREATED_AT_KEY = "version_created_at"
# Manifest `extra` key of a fork's version 0: {"tenant_id", "version"} it was forked from.
FORKED_FROM_KEY = "forked_from"
# Manifest `extra` key: the tenant's cameras and their [height, width] (an export declares them).
OBSERVATION_KEY = "observation"
# Manifest `extra` key: the content digest of the dataset whose jobs trained the version last (the
# spec's resolved dataset.sha256); `extra["datasets"]` lists every dataset that trained it.
DATASET_SHA256_KEY = "dataset_sha256"

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
    import torch

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
    """safetensors bytes that are a function of the tensors and metadata alone (see _canonical_header)."""
    from safetensors.torch import save as _st_save

    return _canonical_header(_st_save(tensors, metadata=metadata))


def _canonical_header(data: bytes) -> bytes:
    """Rewrite a safetensors header with its metadata keys sorted.

    The library serialises ``__metadata__`` from a Rust HashMap, whose order is random per process
    (and per map), so two saves of the same tensors and metadata differ in bytes once the metadata
    has two keys. Tensor entries keep the library's (deterministic) order and offsets; the header
    is padded with spaces to 8 bytes, as the library does, so the data stays aligned.
    """
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    metadata = header.pop("__metadata__", None)
    canonical: dict[str, Any] = {}
    if metadata:
        canonical["__metadata__"] = {key: metadata[key] for key in sorted(metadata)}
    canonical.update(header)
    text = json.dumps(canonical, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + header_len :]


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
    from safetensors.torch import load as _st_load

    try:
        tensors = _st_load(data)  # validates offsets / dtypes; pure data, no code execution
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise PayloadError(f"{what}: invalid safetensors data: {exc}") from exc
    return tensors, metadata


def action_module_file(module_state: Mapping[str, Any], tenant_id: str, policy_version: int) -> bytes:
    """The bytes of a checkpoint's action_module.safetensors for this module state (a function of the
    tensors, the tenant and the version alone): its sha256 is the manifest's digest of the file."""
    metadata = {"tenant_id": tenant_id, "policy_version": str(policy_version)}
    return _save_tensors(_prepare_tensors(module_state, "module_state"), metadata)


def encode_tenant_payload(module_state: dict[str, torch.Tensor], manifest: TenantManifest) -> bytes:
    """Serialise a module state as safetensors bytes with the manifest JSON in the metadata."""
    tensors = _prepare_tensors(module_state, "module_state")
    metadata = {PAYLOAD_FORMAT_KEY: PAYLOAD_FORMAT, PAYLOAD_MANIFEST_KEY: manifest.to_json()}
    return _save_tensors(tensors, metadata)


def export_manifest(manifest: TenantManifest) -> TenantManifest:
    """The manifest every export of this manifest's version carries: no checkpoint file hashes, and
    created_at the time the version's weights were made (``extra["version_created_at"]``; manifests
    written before it was recorded keep their own time). Applied to a checkpoint's manifest it gives
    the manifest ``TrainingModelService.export_params`` gave that version."""
    created = manifest.extra.get(VERSION_CREATED_AT_KEY)
    return dataclasses.replace(
        manifest, files={}, created_at=created if isinstance(created, str) else manifest.created_at
    )


def payload_digest(payload: bytes) -> str:
    """sha256 hex of a payload's bytes (equal for every export of one version)."""
    return _sha256(bytes(payload))


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


def encode_optimizer_state(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    import torch

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


def decode_optimizer_state(doc: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
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
