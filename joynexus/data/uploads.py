"""Tenant dataset uploads (``POST /v1/datasets``): a LeRobot dataset as a tar or zip archive,
unpacked safely, validated with Great Expectations against the tenant's observation interface,
and kept under ``<datasets>/tenants/<tenant>/<sha256 of the archive>/`` (only that tenant lists or
reads it). ``<sha256>.json`` beside the folder records its repo id and unpacked bytes, so listing
and the usage ledger do not walk the dataset's files.

Safe extraction (`joynexus.data.archive_unpacking`): only regular files and folders, every member
path relative and inside the destination, within the upload's `UnpackLimits` (bytes, files, ratio)
as the archive is read, in a child process the caller may call off when its client hangs up. The
dataset is the archive's root, or its one top-level folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from joynexus.data.archive_unpacking import (
    ArchiveTooLarge,
    DatasetUploadError,
    UnpackLimits,
    UploadCancelled,
    unpack_archive,
)
from joynexus.data.digests import content_digest

if TYPE_CHECKING:
    from joynexus.data.validation import DatasetExpectation

__all__ = [
    "DATASET_ID_PATTERN",
    "ArchiveTooLarge",
    "DatasetUploadError",
    "UnpackLimits",
    "UploadCancelled",
    "UploadedDataset",
    "delete_tenant_dataset",
    "delete_tenant_datasets",
    "find_tenant_dataset",
    "store_uploaded_dataset",
    "tenant_dataset_bytes",
    "tenant_datasets",
]

DATASET_ID_PATTERN = r"^[0-9a-f]{64}$"  # an upload's id: the sha256 of its archive
CONTENT_KEY = "content_sha256"  # in an upload's record: the digest of its files (data.digests)
_DATASET_ID_RE = re.compile(DATASET_ID_PATTERN)


@dataclass(frozen=True)
class UploadedDataset:
    sha256: str  # of the archive's bytes: the dataset's id
    repo_id: str
    root: Path
    nbytes: int  # unpacked size, counted in the tenant's storage


def _dataset_root(folder: Path) -> Path:
    if (folder / "meta" / "info.json").is_file():
        return folder
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
    if len(entries) == 1 and (entries[0] / "meta" / "info.json").is_file():
        return entries[0]
    raise DatasetUploadError("archive", "no LeRobot dataset (meta/info.json) at its root or in its one top folder")


def store_uploaded_dataset(
    data: bytes,
    *,
    tenant_id: str,
    repo_id: str,
    datasets_dir: str | Path,
    expectation: DatasetExpectation,
    max_unpacked_bytes: int | None = None,
    limits: UnpackLimits | None = None,
    cancelled: threading.Event | None = None,
) -> UploadedDataset:
    """Unpack, validate and keep an uploaded dataset. The same archive again is the same dataset,
    and so is another archive of the same files under the same repo id (a gzip's new time stamp,
    another packer): the tenant's upload with that content answers, stored and billed once (issue 41.18).

    ``limits`` bound the unpacking (or ``max_unpacked_bytes`` alone, the other limits at their
    defaults). Once ``cancelled`` is set (the client hung up) the work stops and UploadCancelled
    is raised; nothing is kept."""
    if (limits is None) == (max_unpacked_bytes is None):
        raise ValueError("pass either limits or max_unpacked_bytes")
    limits = limits or UnpackLimits(max_bytes=max_unpacked_bytes)
    from joynexus.data.validation import validate_dataset  # pandas and Great Expectations: only to store one

    digest = hashlib.sha256(data).hexdigest()
    home = Path(datasets_dir) / "tenants" / tenant_id
    entry = home / digest
    home.mkdir(parents=True, exist_ok=True)
    content: str | None = None
    if not entry.is_dir():
        with tempfile.TemporaryDirectory(dir=home, prefix=".upload-") as tmp:
            staging, archive = Path(tmp) / "unpacked", Path(tmp) / "archive"
            staging.mkdir()
            archive.write_bytes(data)  # the child reads it from here, not through a pipe
            unpack_archive(archive, staging, limits, cancelled=cancelled)
            archive.unlink()
            root = _dataset_root(staging)
            report = validate_dataset(root, repo_id, expectation, raise_on_error=False)
            if report.failures:
                failure = report.failures[0]
                raise DatasetUploadError(failure.field, _inside_archive(failure.reason, staging))
            content = content_digest(root)
            if cancelled is not None and cancelled.is_set():
                raise UploadCancelled("the upload was called off before it was kept")
            same = _upload_with_content(home, content, repo_id)
            if same is not None:
                return same
            try:
                os.rename(root, entry)
            except OSError:
                if not entry.is_dir():
                    raise
    recorded = _read_record(entry)
    if recorded is not None:
        return recorded
    nbytes = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
    content = content or content_digest(entry)
    record = {"dataset_id": digest, "repo_id": repo_id, "bytes": nbytes, CONTENT_KEY: content}
    sidecar = entry.with_name(f"{digest}.json")
    staging_record = sidecar.with_name(f".{digest}.json.tmp")
    staging_record.write_text(json.dumps(record, sort_keys=True) + "\n")
    os.replace(staging_record, sidecar)
    return UploadedDataset(digest, repo_id, entry, nbytes)


def _upload_with_content(home: Path, content: str, repo_id: str) -> UploadedDataset | None:
    """The tenant's kept upload of `repo_id` whose files digest to `content` (its record says), or
    None. The same files under another repo id are another dataset (a workload names both)."""
    for sidecar in sorted(home.glob("*.json")):
        entry = sidecar.with_suffix("")
        if not _DATASET_ID_RE.fullmatch(entry.name) or not entry.is_dir():
            continue
        try:
            record = json.loads(sidecar.read_text())
            same = record.get(CONTENT_KEY) == content and record.get("repo_id") == repo_id
        except (OSError, ValueError, AttributeError):
            continue
        if same:
            return _entry(entry)
    return None


def _inside_archive(reason: str, staging: Path) -> str:
    """`reason` with paths under the staging folder written as paths inside the archive: an answer
    names what the tenant sent, never where this server keeps it."""
    reason = reason.replace(f"{staging}{os.sep}", "")
    return reason.replace(str(staging), "the archive's root")


def _read_record(entry: Path) -> UploadedDataset | None:
    """The dataset in folder ``entry`` from its record beside it (None: no readable record)."""
    try:
        record = json.loads(entry.with_name(f"{entry.name}.json").read_text())
        return UploadedDataset(entry.name, str(record["repo_id"]), entry, int(record["bytes"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _entry(entry: Path) -> UploadedDataset:
    recorded = _read_record(entry)
    if recorded is not None:
        return recorded
    nbytes = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())  # kept before records existed
    return UploadedDataset(entry.name, "", entry, nbytes)


def find_tenant_dataset(datasets_dir: str | Path, tenant_id: str, dataset_id: str) -> UploadedDataset | None:
    """The tenant's upload ``dataset_id``, or None: an id that is not a sha256, another tenant's
    and a missing one look alike (only the tenant's own folder is read)."""
    if not isinstance(dataset_id, str) or not _DATASET_ID_RE.fullmatch(dataset_id):
        return None
    entry = Path(datasets_dir) / "tenants" / tenant_id / dataset_id
    return _entry(entry) if entry.is_dir() else None


def delete_tenant_dataset(datasets_dir: str | Path, tenant_id: str, dataset_id: str) -> UploadedDataset | None:
    """Remove the tenant's upload ``dataset_id`` (its folder and record); None if it has none.
    Versions trained on it keep its digest in their manifests."""
    found = find_tenant_dataset(datasets_dir, tenant_id, dataset_id)
    if found is None:
        return None
    # Renamed away first: a concurrent reader sees the dataset whole or not at all.
    doomed = found.root.with_name(f".deleting-{found.sha256}-{os.getpid()}")
    os.rename(found.root, doomed)
    found.root.with_name(f"{found.sha256}.json").unlink(missing_ok=True)
    shutil.rmtree(doomed, ignore_errors=True)
    return found


def delete_tenant_datasets(datasets_dir: str | Path, tenant_id: str) -> int:
    """Remove every upload of a tenant (its deletion with its artifacts); returns how many there were."""
    found = tenant_datasets(datasets_dir, tenant_id)
    for dataset in found:
        delete_tenant_dataset(datasets_dir, tenant_id, dataset.sha256)
    shutil.rmtree(Path(datasets_dir) / "tenants" / tenant_id, ignore_errors=True)  # staging leftovers too
    return len(found)


def tenant_dataset_bytes(datasets_dir: str | Path, tenant_id: str) -> int:
    """Unpacked bytes of the tenant's uploads (what its storage quota counts beside checkpoints)."""
    return sum(d.nbytes for d in tenant_datasets(datasets_dir, tenant_id))


def tenant_datasets(datasets_dir: str | Path, tenant_id: str) -> list[UploadedDataset]:
    """The tenant's uploaded datasets (only its own folder is read)."""
    home = Path(datasets_dir) / "tenants" / tenant_id
    if not home.is_dir():
        return []
    return [_entry(p) for p in sorted(home.iterdir()) if p.is_dir() and _DATASET_ID_RE.fullmatch(p.name)]
