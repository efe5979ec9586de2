"""The checkpoint layout: one folder per tenant and version with a manifest and per-file digests,
the LATEST pointer, and the one place that decides which version is the latest."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from joynexus.artifacts.blobs import (
    BlobStore,
)
from joynexus.artifacts.codec import (
    _FILE_NAME_RE,
    _TENANT_ID_RE,
    _VERSION_DIR_RE,
    ACTION_MODULE_FILE,
    FORKED_FROM_KEY,
    LATEST_FILE,
    MANIFEST_FILE,
    NORMALIZATION_FILE,
    OPTIMIZER_JSON_FILE,
    OPTIMIZER_TENSORS_FILE,
    VERSION_CREATED_AT_KEY,
    CheckpointError,
    PayloadError,
    TenantManifest,
    _load_tensors,
    _save_tensors,
    _sha256,
    _utc_now_iso,
    _validate_version,
    action_module_file,
    decode_optimizer_state,
    encode_optimizer_state,
    export_manifest,
    validate_tenant_id,
)
from joynexus.artifacts.stores import blob_store_for, checkpoint_blobs
from joynexus.settings import Settings

if TYPE_CHECKING:  # clients that list versions or read manifests never import torch
    import torch

# Per-tenant high-water mark of every policy version the Training Model Service has issued
# (exported, published, returned), checkpointed or not: a restarted service never reuses one.
ISSUED_FILE = "ISSUED"
# Per-tenant versions retention never prunes (the ones registered in MLflow): {"pinned": [1, 4]}.
PINS_FILE = "PINS"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionInfo:
    """One committed checkpoint version as listed: its manifest's time and digest, its bytes, and
    `problem`: None, or why the version cannot be used (its manifest is unreadable or describes
    another version, or a file it names is missing); such a version is listed, not hidden.
    `export_digest`: the digest of the manifest its exports carry (`export_manifest`: what the MLflow
    registry's `manifest_digest` tag and an export's `X-JoyNexus-Manifest-Digest` say for this version)."""

    version: int
    created_at: str
    digest: str
    size_bytes: int
    problem: str | None = None
    export_digest: str = ""


class VersionInUse(ValueError):
    """A version that may not be deleted (LATEST's, or pinned: registered in MLflow)."""


@dataclass(frozen=True)
class _Listed:
    """What one listing shows of a version folder."""

    committed: bool
    size_bytes: int
    names: frozenset[str]


class CheckpointStore:
    """Versioned per-tenant checkpoints: ``tenants/<tenant_id>/v<version:06d>/`` + ``LATEST``.

    A version folder is immutable once published. ``LATEST`` is the commit pointer and only
    moves forward (to the highest version saved), so a late or concurrent save of an older
    version never rolls a tenant back.

    Retention: with ``keep_last=K``, every successful save of a new version prunes the tenant's
    older versions except the last K (by version number), the pinned ones (:meth:`pin`: the
    versions registered in MLflow) and the one ``LATEST`` names. ``None`` keeps every version.
    """

    writes = True  # False: a reader's view of a folder another process writes (a data-parallel rank > 0)

    def __init__(self, root: str | Path | BlobStore, *, keep_last: int | None = None) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"invalid keep_last {keep_last!r}: expected an int >= 1, or None to keep every version")
        self.blobs: BlobStore = blob_store_for(root)
        self.keep_last = keep_last
        # Serialises read-modify-write of LATEST, ISSUED and PINS within this process.
        self._latest_lock = threading.Lock()
        # One prune at a time: concurrent saves would otherwise list and delete the same folders.
        self._prune_lock = threading.Lock()
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
        files: dict[str, bytes] = {ACTION_MODULE_FILE: action_module_file(module_state, tenant_id, policy_version)}
        if optimizer_state is not None:
            opt_tensors, opt_doc = encode_optimizer_state(optimizer_state)
            files[OPTIMIZER_TENSORS_FILE] = _save_tensors(opt_tensors, small_meta)
            files[OPTIMIZER_JSON_FILE] = json.dumps(opt_doc, allow_nan=False).encode()  # keep key order
        if (extra or {}).get("normalization"):  # beside the weights, readable without JoyNexus
            files[NORMALIZATION_FILE] = json.dumps(extra["normalization"], indent=2, sort_keys=True).encode()

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
        if self.keep_last is not None:
            try:
                self.prune(tenant_id)
            except Exception:  # the save itself succeeded; the next save prunes again
                log.warning("tenant %r: pruning old checkpoints after version %d failed", tenant_id, policy_version,
                            exc_info=True)  # fmt: skip
        return manifest

    # ---- retention ---------------------------------------------------------------------

    def pin(self, tenant_id: str, version: int) -> None:
        """Durably exempt ``version`` from pruning (a version registered in MLflow). The pins are
        a small JSON object under the tenant's prefix, so every store on the same root (the
        Master's, the Training Model Service's) sees them, across restarts."""
        validate_tenant_id(tenant_id)
        _validate_version(version)
        with self._latest_lock:
            pins = self.pinned(tenant_id)
            if version in pins:
                return
            doc = {"pinned": sorted(pins | {version})}
            self.blobs.put_atomic(f"{self._tenant_prefix(tenant_id)}/{PINS_FILE}", json.dumps(doc).encode())

    def pinned(self, tenant_id: str) -> set[int]:
        """The tenant's pinned versions (empty if none was pinned)."""
        key = f"{self._tenant_prefix(tenant_id)}/{PINS_FILE}"
        try:
            raw = self.blobs.read(key)
        except FileNotFoundError:
            return set()
        try:
            values = json.loads(raw)["pinned"]
            if not isinstance(values, list):
                raise TypeError("'pinned' is not a list")
            return {_validate_version(v) for v in values}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"tenant {tenant_id!r}: {PINS_FILE} is invalid ({exc})") from exc

    def prune(self, tenant_id: str) -> list[int]:
        """Delete the tenant's versions outside (last ``keep_last`` ∪ pinned ∪ LATEST's); returns
        the deleted versions, ascending. Nothing when ``keep_last`` is None. Pointers stay."""
        if self.keep_last is None:
            return []
        delete = getattr(self.blobs, "delete_prefix", None)
        if delete is None:
            raise NotImplementedError(f"{self.blobs!r} cannot delete (it has no delete_prefix)")
        with self._prune_lock:
            present = self.versions(tenant_id)
            # Pins and LATEST are read before anything goes: an unreadable one raises, nothing is lost.
            keep = set(present[-self.keep_last :]) | self.pinned(tenant_id)
            latest = self.latest_version(tenant_id)
            if latest is not None:
                keep.add(latest)
            doomed = [v for v in present if v not in keep]
            for version in doomed:
                prefix = self._version_prefix(tenant_id, version)
                # The manifest first: a version exists while its manifest does, so readers never
                # list a half-deleted version (S3 deletes a folder's objects one batch at a time).
                delete(f"{prefix}/{MANIFEST_FILE}")
                delete(prefix)
            return doomed

    def record_issued_version(self, tenant_id: str, version: int) -> None:
        """Durably raise the tenant's issued-version high-water mark to ``version`` (never lowers
        it). Written like LATEST: one atomic replace, on local disk or S3."""
        _validate_version(version)
        self._raise_pointer(tenant_id, ISSUED_FILE, version, allow_equal=False)

    def issued_version(self, tenant_id: str) -> int | None:
        """The highest version ever recorded as issued for the tenant; None if none was."""
        return self._read_pointer(tenant_id, ISSUED_FILE)

    def fork_version(self, source_id: str, version: int, new_tenant: str) -> TenantManifest:
        """The source's `version` (verified on read) written as `new_tenant`'s version 0, its
        manifest noting where it came from (`FORKED_FROM_KEY`). Runs where the tensors may be
        held (the Training Model Service), never in the Master."""
        manifest, module_state, optimizer_state = self.load_tenant(source_id, version)
        extra = {k: v for k, v in manifest.extra.items() if k != VERSION_CREATED_AT_KEY}  # v0 is made now
        extra[FORKED_FROM_KEY] = {"tenant_id": source_id, "version": version}
        return self.save_tenant(
            tenant_id=new_tenant,
            policy_version=0,
            schema_signature=manifest.schema_signature,
            base_model_id=manifest.base_model_id,
            module_kind=manifest.module_kind,
            module_config=manifest.module_config,
            module_state=module_state,
            optimizer_state=optimizer_state,
            extra=extra,
        )

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
        """Complete (manifest present) checkpoint versions, ascending; temp folders ignored.
        One listing of the tenant's prefix, whatever the number of versions."""
        return sorted(self._listed_versions(tenant_id))

    def _listed_versions(self, tenant_id: str) -> dict[int, _Listed]:
        """One listing of the tenant: committed version -> what the listing shows of its folder."""
        found: dict[int, _Listed] = {}
        for key, size in self.blobs.list_sizes(self._tenant_prefix(tenant_id)).items():
            folder, sep, name = key.partition("/")
            m = _VERSION_DIR_RE.fullmatch(folder) if sep else None
            # Only the canonical folder name: read_manifest and load_tenant look there.
            if m is None or folder != f"v{int(m.group(1)):06d}":
                continue
            version = int(m.group(1))
            entry = found.get(version, _Listed(False, 0, frozenset()))
            found[version] = _Listed(
                entry.committed or name == MANIFEST_FILE, entry.size_bytes + size, entry.names | {name}
            )
        return {v: entry for v, entry in found.items() if entry.committed}

    def version_infos(self, tenant_id: str, *, after: int = -1, limit: int | None = None) -> list[VersionInfo]:
        """Committed versions greater than ``after``, ascending, at most ``limit`` of them: one
        listing of the tenant's prefix (sizes included) and one manifest read per version returned.
        The default ``after=-1`` includes version 0; page on with ``after=<last version returned>``."""
        if isinstance(after, bool) or not isinstance(after, int):
            raise ValueError(f"invalid after {after!r}: expected an int (list versions greater than it)")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"invalid limit {limit!r}: expected an int >= 0, or None for no limit")
        listed = self._listed_versions(tenant_id)
        out: list[VersionInfo] = []
        for version in sorted(v for v in listed if v > after):
            if limit is not None and len(out) >= limit:
                break
            size = listed[version].size_bytes
            try:
                manifest = self.read_manifest(tenant_id, version)
            except CheckpointError as error:
                if not self.blobs.exists(f"{self._version_prefix(tenant_id, version)}/{MANIFEST_FILE}"):
                    continue  # pruned since the listing: no longer a version
                # Present but unreadable: listed with the reason, so one bad version never hides
                # the others (read fresh on every listing: a repaired file shows up at once).
                out.append(VersionInfo(version, "", "", size, problem=f"file {MANIFEST_FILE} is invalid: {error}"))
                continue
            problem = _listing_problem(manifest, tenant_id, version, listed[version].names)
            out.append(
                VersionInfo(
                    version, manifest.created_at, manifest.digest, size, problem, export_manifest(manifest).digest
                )
            )
        return out

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
        """Bytes the tenant's checkpoints take in the store (its storage usage): committed versions
        and pointers; crash leftovers (temp entries, version folders without a manifest) are not
        billed (`joynexus.artifacts.leftovers` removes them). One listing, tolerant of files that
        vanish while it runs (a concurrent prune)."""
        from joynexus.artifacts.leftovers import billable_bytes

        return billable_bytes(self.blobs.list_sizes(self._tenant_prefix(validate_tenant_id(tenant_id))))

    def has_objects(self, tenant_id: str) -> bool:
        """Whether anything of the tenant id is stored (checkpoints, LATEST, ISSUED, PINS)."""
        from joynexus.artifacts.leftovers import leftover_entries

        listing = self.blobs.list_sizes(self._tenant_prefix(validate_tenant_id(tenant_id)))
        leftovers = leftover_entries(listing)
        return any(key.partition("/")[0] not in leftovers for key in listing)

    def delete_version(self, tenant_id: str, version: int) -> int:
        """Delete one committed version (never LATEST's nor a pinned one: VersionInUse says which);
        KeyError if there is no such version. Returns the bytes it took. Allowed whatever the
        tenant's storage quota: deleting is how a tenant gets back under it."""
        _validate_version(version)
        delete = getattr(self.blobs, "delete_prefix", None)
        if delete is None:
            raise NotImplementedError(f"{self.blobs!r} cannot delete (it has no delete_prefix)")
        with self._prune_lock:
            listed = self._listed_versions(tenant_id)
            if version not in listed:
                raise KeyError(f"tenant {tenant_id!r} has no checkpoint version {version}")
            if version == self.latest_version(tenant_id):
                raise VersionInUse(
                    f"version {version} is the tenant's latest checkpoint (LATEST): its slot resumes from it"
                )
            if version in self.pinned(tenant_id):
                raise VersionInUse(f"version {version} is registered in the model registry (pinned)")
            prefix = self._version_prefix(tenant_id, version)
            delete(f"{prefix}/{MANIFEST_FILE}")  # first: readers never list a half-deleted version
            delete(prefix)
            return listed[version].size_bytes

    def tenants(self) -> list[str]:
        """Tenants with at least one committed checkpoint (a LATEST pointer)."""
        out = []
        for name in self.blobs.list_dir("tenants"):
            if _TENANT_ID_RE.fullmatch(name) and name not in {".", ".."}:
                if self.blobs.exists(f"tenants/{name}/{LATEST_FILE}"):
                    out.append(name)
        return sorted(out)

    def load_tenant(
        self, tenant_id: str, version: int | None = None, *, map_location: str | torch.device | None = None
    ) -> tuple[TenantManifest, dict[str, torch.Tensor], dict | None]:
        """Load and verify a checkpoint (``None`` -> LATEST).

        Returns ``(manifest, module_state, optimizer_state_or_None)``; the optimizer state is
        in the exact shape ``torch.optim.Optimizer.load_state_dict`` expects.

        Checkpoints are device-independent (safetensors records no device; tensors are written
        from CPU copies), so one written on a GPU loads on a CPU and back. ``map_location`` puts the
        module state on that device (None: the CPU). The optimizer state stays on the CPU:
        ``Optimizer.load_state_dict`` moves each tensor to its parameter's device itself, and keeps
        ``step`` on the CPU as a fresh non-capturable optimizer does.
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
        if map_location is not None:
            module_state = {name: tensor.to(map_location) for name, tensor in module_state.items()}

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
                optimizer_state = decode_optimizer_state(doc, opt_tensors)
            except (json.JSONDecodeError, UnicodeDecodeError, CheckpointError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{where}: file {OPTIMIZER_JSON_FILE} is invalid: {exc}") from exc
        return manifest, module_state, optimizer_state


def _listing_problem(manifest: TenantManifest, tenant_id: str, version: int, names: frozenset[str]) -> str | None:
    """Why a listed version cannot be used, from its manifest and the listing alone (no tensor
    bytes are read; a file whose bytes changed is found when the version is loaded)."""
    if manifest.tenant_id != tenant_id or manifest.policy_version != version:
        return f"file {MANIFEST_FILE} describes tenant {manifest.tenant_id!r} version {manifest.policy_version}"
    if ACTION_MODULE_FILE not in manifest.files:
        return f"file {MANIFEST_FILE} lists no {ACTION_MODULE_FILE}"
    missing = sorted(name for name in manifest.files if name not in names)
    if missing:
        return f"file {missing[0]} is missing"
    return None


def checkpoint_store(settings: Settings) -> CheckpointStore:
    """The deployment's checkpoint store, as the Master and clients read it."""
    return CheckpointStore(checkpoint_blobs(settings.checkpoint_location, settings.s3_endpoint_url))
