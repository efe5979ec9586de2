"""Tenant dataset uploads (``POST /v1/datasets``): a LeRobot dataset as a tar or zip archive,
unpacked safely, validated with Great Expectations against the tenant's observation interface,
and kept under ``<datasets>/tenants/<tenant>/<sha256 of the archive>/`` (only that tenant lists or
reads it). ``<sha256>.json`` beside the folder records its repo id and unpacked bytes, so listing
and the usage ledger do not walk the dataset's files.

Safe extraction: only regular files and folders; every member path relative, without ``..``, and
inside the destination; at most ``MAX_UPLOAD_MEMBERS`` members and ``max_unpacked_bytes`` in total
(a small archive cannot unpack into a large one). The dataset is the archive's root, or its one
top-level folder.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from joynexus.data.digests import content_digest

if TYPE_CHECKING:
    from joynexus.data.validation import DatasetExpectation

__all__ = [
    "DATASET_ID_PATTERN",
    "MAX_UPLOAD_MEMBERS",
    "DatasetUploadError",
    "UploadedDataset",
    "delete_tenant_dataset",
    "delete_tenant_datasets",
    "find_tenant_dataset",
    "store_uploaded_dataset",
    "tenant_dataset_bytes",
    "tenant_datasets",
]

MAX_UPLOAD_MEMBERS = 100_000
DATASET_ID_PATTERN = r"^[0-9a-f]{64}$"  # an upload's id: the sha256 of its archive
CONTENT_KEY = "content_sha256"  # in an upload's record: the digest of its files (data.digests)
_DATASET_ID_RE = re.compile(DATASET_ID_PATTERN)


class DatasetUploadError(ValueError):
    """An upload was refused; ``field`` names what was wrong."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True)
class UploadedDataset:
    sha256: str  # of the archive's bytes: the dataset's id
    repo_id: str
    root: Path
    nbytes: int  # unpacked size, counted in the tenant's storage


def _safe_name(name: str) -> str:
    path = PurePosixPath(name)
    unsafe = name.startswith("/") or "\\" in name or "\x00" in name or ".." in path.parts
    if unsafe or not path.parts:
        raise DatasetUploadError("archive", f"member {name!r} is not a relative path inside the archive")
    return path.as_posix()


# What a corrupt or truncated archive raises while it is read: the archive's fault, answered 4xx.
# (gzip's BadGzipFile and bz2's "Invalid data stream" are OSErrors without an errno; a filesystem
# error here carries one and is the server's.)
_CORRUPT = (
    tarfile.TarError,
    zipfile.BadZipFile,
    zlib.error,
    lzma.LZMAError,
    EOFError,
    NotImplementedError,
    RuntimeError,
)
_CHUNK = 1 << 20


class _Unpacking:
    """Where an archive's members go in ``dest``: each path once, a file never where a folder is
    (or inside a file), and the bytes actually written within ``max_unpacked_bytes``."""

    def __init__(self, dest: Path, max_unpacked_bytes: int):
        self.dest, self.max_unpacked_bytes = dest, max_unpacked_bytes
        self.files: set[str] = set()
        self.folders: set[str] = {"."}
        self.written = 0
        self.declared = 0

    def declare(self, total: int) -> None:
        """Refuse once the sizes the archive declares pass the bound, before their bytes are
        unpacked (what is written is counted too: declared sizes can lie)."""
        self.declared = total
        if total > self.max_unpacked_bytes:
            raise DatasetUploadError(
                "archive", f"declares more than {self.max_unpacked_bytes:,} bytes unpacked ({total:,})"
            )

    def folder(self, name: str) -> None:
        if name in self.files:
            raise DatasetUploadError("archive", f"member {name!r} is both a file and a folder")
        self._parents(name)
        self.folders.add(name)
        (self.dest / name).mkdir(parents=True, exist_ok=True)

    def file(self, name: str, source: io.BufferedIOBase | None) -> None:
        if name in self.folders:
            raise DatasetUploadError("archive", f"member {name!r} is both a folder and a file")
        if name in self.files:
            raise DatasetUploadError("archive", f"member {name!r} appears twice")
        self._parents(name)
        self.files.add(name)
        target = self.dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            while source is not None and (chunk := source.read(_CHUNK)):
                self.written += len(chunk)
                if self.written > self.max_unpacked_bytes:  # counted as written: sizes in headers can lie
                    raise DatasetUploadError("archive", f"unpacks to more than {self.max_unpacked_bytes:,} bytes")
                out.write(chunk)

    def _parents(self, name: str) -> None:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in self.files:
                raise DatasetUploadError("archive", f"member {name!r} lies inside {parent!r}, which is a file")
            self.folders.add(parent)


def _extract(data: bytes, dest: Path, max_unpacked_bytes: int) -> None:
    """Unpack a tar (any compression) or zip into ``dest`` with the checks of the module docstring;
    a malformed archive raises DatasetUploadError naming the member it failed at, never a path
    of this server."""
    unpacking = _Unpacking(dest, max_unpacked_bytes)
    member: str | None = None
    try:
        if data[:4] == b"PK\x03\x04":
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                members = archive.infolist()
                if len(members) > MAX_UPLOAD_MEMBERS:
                    raise DatasetUploadError("archive", f"more than {MAX_UPLOAD_MEMBERS} members")
                unpacking.declare(sum(info.file_size for info in members))  # the central directory: before any byte
                for info in members:
                    member = info.filename
                    _zip_member(archive, info, unpacking)
            return
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
            for count, info in enumerate(archive, start=1):  # headers read as they come, not all first
                member = info.name
                if count > MAX_UPLOAD_MEMBERS:
                    raise DatasetUploadError("archive", f"more than {MAX_UPLOAD_MEMBERS} members")
                unpacking.declare(unpacking.declared + max(info.size, 0))  # each header, before its data
                _tar_member(archive, info, unpacking)
    except DatasetUploadError:
        raise
    except (*_CORRUPT, OSError) as error:
        if isinstance(error, OSError) and not isinstance(error, gzip.BadGzipFile) and error.errno is not None:
            raise  # the server's filesystem, not the archive
        raise DatasetUploadError("archive", _corrupt_reason(error, member)) from None


def _zip_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, unpacking: _Unpacking) -> None:
    name = _safe_name(info.filename)
    if (info.external_attr >> 16) & 0o170000 == 0o120000:
        raise DatasetUploadError("archive", f"member {info.filename!r} is a link")
    if info.is_dir():
        unpacking.folder(name)
        return
    with archive.open(info) as source:
        unpacking.file(name, source)


def _tar_member(archive: tarfile.TarFile, info: tarfile.TarInfo, unpacking: _Unpacking) -> None:
    name = _safe_name(info.name)
    if info.isdir():
        unpacking.folder(name)
    elif info.isfile():
        unpacking.file(name, archive.extractfile(info))
    else:
        raise DatasetUploadError("archive", f"member {info.name!r} is not a regular file or folder")


def _corrupt_reason(error: BaseException, member: str | None) -> str:
    detail = str(error).strip() or type(error).__name__
    if member is None:
        return f"not a readable tar or zip archive ({detail})"
    return f"corrupt or truncated at member {member!r} ({detail})"


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
    max_unpacked_bytes: int,
) -> UploadedDataset:
    """Unpack, validate and keep an uploaded dataset. The same archive again is the same dataset,
    and so is another archive of the same files under the same repo id (a gzip's new time stamp,
    another packer): the tenant's upload with that content answers, stored and billed once (issue 41.18)."""
    from joynexus.data.validation import validate_dataset  # pandas and Great Expectations: only to store one

    digest = hashlib.sha256(data).hexdigest()
    home = Path(datasets_dir) / "tenants" / tenant_id
    entry = home / digest
    home.mkdir(parents=True, exist_ok=True)
    content: str | None = None
    if not entry.is_dir():
        with tempfile.TemporaryDirectory(dir=home, prefix=".upload-") as tmp:
            staging = Path(tmp) / "unpacked"
            staging.mkdir()
            _extract(data, staging, max_unpacked_bytes)
            root = _dataset_root(staging)
            report = validate_dataset(root, repo_id, expectation, raise_on_error=False)
            if report.failures:
                failure = report.failures[0]
                raise DatasetUploadError(failure.field, _inside_archive(failure.reason, staging))
            content = content_digest(root)
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
