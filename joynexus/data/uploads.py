"""Tenant dataset uploads (``POST /v1/datasets``): a LeRobot dataset as a tar or zip archive,
unpacked safely, validated with Great Expectations against the tenant's observation interface,
and kept under ``<datasets>/tenants/<tenant>/<sha256 of the archive>/`` (only that tenant lists or
reads it).

Safe extraction: only regular files and folders; every member path relative, without ``..``, and
inside the destination; at most ``MAX_UPLOAD_MEMBERS`` members and ``max_unpacked_bytes`` in total
(a small archive cannot unpack into a large one). The dataset is the archive's root, or its one
top-level folder.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from joynexus.data.validation import DatasetExpectation, validate_dataset

__all__ = ["MAX_UPLOAD_MEMBERS", "DatasetUploadError", "UploadedDataset", "store_uploaded_dataset", "tenant_datasets"]

MAX_UPLOAD_MEMBERS = 100_000


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
    if name.startswith("/") or "\\" in name or any(part == ".." for part in path.parts) or not path.parts:
        raise DatasetUploadError("archive", f"member {name!r} is not a relative path inside the archive")
    return path.as_posix()


def _extract(data: bytes, dest: Path, max_unpacked_bytes: int) -> None:
    """Unpack a tar (any compression) or zip into ``dest`` with the checks of the module docstring."""
    total = 0
    if data[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
            if len(members) > MAX_UPLOAD_MEMBERS:
                raise DatasetUploadError("archive", f"more than {MAX_UPLOAD_MEMBERS} members")
            for info in members:
                name = _safe_name(info.filename)
                if (info.external_attr >> 16) & 0o170000 == 0o120000:
                    raise DatasetUploadError("archive", f"member {info.filename!r} is a link")
                total += info.file_size
                if total > max_unpacked_bytes:
                    raise DatasetUploadError("archive", f"unpacks to more than {max_unpacked_bytes:,} bytes")
                target = dest / name
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
        return
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
    except tarfile.TarError:
        raise DatasetUploadError("archive", "not a tar or zip archive") from None
    with archive:
        members = archive.getmembers()
        if len(members) > MAX_UPLOAD_MEMBERS:
            raise DatasetUploadError("archive", f"more than {MAX_UPLOAD_MEMBERS} members")
        for member in members:
            _safe_name(member.name)
            if not (member.isfile() or member.isdir()):
                raise DatasetUploadError("archive", f"member {member.name!r} is not a regular file or folder")
            total += member.size
            if total > max_unpacked_bytes:
                raise DatasetUploadError("archive", f"unpacks to more than {max_unpacked_bytes:,} bytes")
        archive.extractall(dest, filter="data")  # the stdlib's own checks as well


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
    """Unpack, validate and keep an uploaded dataset (the same archive again is the same dataset)."""
    digest = hashlib.sha256(data).hexdigest()
    home = Path(datasets_dir) / "tenants" / tenant_id
    entry = home / digest
    home.mkdir(parents=True, exist_ok=True)
    if not entry.is_dir():
        with tempfile.TemporaryDirectory(dir=home, prefix=".upload-") as tmp:
            staging = Path(tmp) / "unpacked"
            staging.mkdir()
            _extract(data, staging, max_unpacked_bytes)
            root = _dataset_root(staging)
            report = validate_dataset(root, repo_id, expectation, raise_on_error=False)
            if report.failures:
                failure = report.failures[0]
                raise DatasetUploadError(failure.field, failure.reason)
            try:
                os.rename(root, entry)
            except OSError:
                if not entry.is_dir():
                    raise
    nbytes = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
    return UploadedDataset(digest, repo_id, entry, nbytes)


def tenant_datasets(datasets_dir: str | Path, tenant_id: str) -> list[UploadedDataset]:
    """The tenant's uploaded datasets (only its own folder is read)."""
    home = Path(datasets_dir) / "tenants" / tenant_id
    if not home.is_dir():
        return []
    found = []
    for entry in sorted(p for p in home.iterdir() if p.is_dir() and not p.name.startswith(".")):
        nbytes = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
        found.append(UploadedDataset(entry.name, "", entry, nbytes))  # repo_id: not kept on disk
    return found
