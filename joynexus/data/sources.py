"""Where a tenant's dataset comes from: an admin path under allow-listed roots, or an S3 reference.

* ``dataset.root``: a server path. With ``JOYNEXUS_DATASET_ROOTS`` set (paths joined by ``os.pathsep``)
  it must resolve (symlinks followed) to a directory under one of them; a missing path and a
  disallowed one get the same answer, which names only what the caller sent, so a spec cannot probe
  which server paths exist. Unset: any path (the embedded, single-user default).
* ``dataset.uri: s3://bucket/prefix``: every object under the prefix is fetched (boto3) into a
  content-addressed cache, ``<cache>/<sha256>/``, where the digest is over the sorted (relative key,
  file sha256) pairs; ``joynexus_dataset.json`` in the entry is its manifest (uri, digest, each file's
  sha256). A spec's ``dataset.sha256`` pins the content: other bytes are refused.
* ``dataset.id``: a dataset the spec's tenant uploaded (``POST /v1/datasets``), resolved to its
  stored copy under ``<data_dir>/datasets/tenants/<tenant>/`` (`joynexus.data.uploads`); its digest
  is the id (the archive's sha256). Only the tenant's own uploads are looked at: another tenant's
  id and an unknown one get the same answer.

Every resolved spec records ``dataset.sha256`` (a server path's too: the same content digest as an
S3 fetch, over its files), and checkpoint manifests carry it as the data that trained them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from joynexus.artifacts.s3 import split_s3_uri
from joynexus.data.digests import DATASET_MANIFEST_FILE, _pair_digest, content_digest
from joynexus.data.uploads import find_tenant_dataset

if TYPE_CHECKING:
    from joynexus.settings import Settings
    from joynexus.spec import DatasetSpec, WorkloadSpec

__all__ = [
    "DATASET_MANIFEST_FILE",
    "DatasetSourceError",
    "FetchedDataset",
    "check_dataset_root",
    "content_digest",
    "fetch_s3_dataset",
    "parse_dataset_roots",
    "resolve_dataset",
    "resolve_dataset_source",
]

MAX_DATASET_OBJECTS = 100_000  # a prefix with more objects than a LeRobot dataset has is refused


class DatasetSourceError(ValueError):
    """A dataset source was refused; ``field`` is the spec field it is about."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.reason))


def parse_dataset_roots(value: str | None) -> tuple[Path, ...]:
    """``JOYNEXUS_DATASET_ROOTS``: absolute paths joined by ``os.pathsep`` (blank entries skipped)."""
    roots = []
    for part in (value or "").split(os.pathsep):
        if part.strip():
            path = Path(part.strip()).expanduser()
            if not path.is_absolute():
                raise ValueError(f"JOYNEXUS_DATASET_ROOTS: {part!r} is not an absolute path")
            roots.append(path)
    return tuple(roots)


def check_dataset_root(root: str, allowed: Sequence[Path]) -> Path:
    """``root`` resolved, if it is a directory under one of ``allowed`` (no roots: any directory
    path is passed on as it is). One message for missing and disallowed paths."""
    if not allowed:
        return Path(root)
    refused = DatasetSourceError(
        "dataset.root", f"{root!r} is not an available dataset directory (ask the operator for an allowed path)"
    )
    try:
        resolved = Path(root).expanduser().resolve(strict=True)
    except (OSError, RuntimeError):
        raise refused from None
    bases = [base.expanduser().resolve() for base in allowed]
    if not resolved.is_dir() or not any(resolved != base and resolved.is_relative_to(base) for base in bases):
        raise refused
    return resolved


class FetchedDataset:
    """A dataset in the cache: its local directory and content digest."""

    def __init__(self, root: Path, sha256: str):
        self.root, self.sha256 = root, sha256

    def __repr__(self) -> str:
        return f"FetchedDataset(root={str(self.root)!r}, sha256={self.sha256!r})"


def _relative_key(key: str, prefix: str) -> str:
    relative = key[len(prefix) :].lstrip("/") if prefix else key
    parts = PurePosixPath(relative).parts
    if not relative or relative.startswith("/") or any(p in ("..", ".", "") for p in parts) or "\\" in relative:
        raise DatasetSourceError("dataset.uri", f"object key {key!r} is not a safe relative file path")
    return relative


def fetch_s3_dataset(
    uri: str, cache_dir: str | Path, client: Any, *, expected_sha256: str | None = None
) -> FetchedDataset:
    """Fetch every object under ``uri`` into ``cache_dir/<sha256>/`` (reused when present) and
    return it. ``client``: a boto3 S3 client."""
    try:
        bucket, prefix = split_s3_uri(uri)
    except ValueError as error:
        raise DatasetSourceError("dataset.uri", str(error)) from None
    prefix = f"{prefix}/" if prefix else ""
    keys: list[str] = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys.extend(item["Key"] for item in page.get("Contents", []) if not item["Key"].endswith("/"))
            if len(keys) > MAX_DATASET_OBJECTS:
                raise DatasetSourceError("dataset.uri", f"more than {MAX_DATASET_OBJECTS} objects under {uri!r}")
    except DatasetSourceError:
        raise
    except Exception as error:  # botocore: no bucket, no access, no endpoint
        raise DatasetSourceError("dataset.uri", f"cannot list {uri!r}: {type(error).__name__}") from None
    if not keys:
        raise DatasetSourceError("dataset.uri", f"no objects under {uri!r}")
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        staging = Path(tmp) / "data"
        files: dict[str, str] = {}
        for key in sorted(keys):
            relative = _relative_key(key, prefix)
            target = staging / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, key, str(target))
            files[relative] = hashlib.sha256(target.read_bytes()).hexdigest()
        digest = _pair_digest(files)
        if expected_sha256 is not None and digest != expected_sha256:
            raise DatasetSourceError("dataset.sha256", f"{uri!r} holds content {digest}, not {expected_sha256}")
        entry = cache / digest
        if not entry.is_dir():
            manifest = {"uri": uri, "sha256": digest, "files": files}
            (staging / DATASET_MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            try:
                os.rename(staging, entry)  # atomic: a concurrent fetch of the same content keeps one entry
            except OSError:
                if not entry.is_dir():
                    raise
                shutil.rmtree(staging, ignore_errors=True)
    return FetchedDataset(entry, digest)


def resolve_dataset_source(
    spec: WorkloadSpec, settings: Settings, *, s3_client: Any = None, owner: str | None = None
) -> WorkloadSpec:
    """``spec`` with its dataset made local: a ``dataset.uri`` fetched into the cache under
    ``settings.data_dir``, a ``dataset.id`` found among the spec's tenant's uploads, a
    ``dataset.root`` checked against ``settings.dataset_roots`` (``root`` and ``sha256`` recorded
    for each). ``owner``: whose uploads a ``dataset.id`` is among (default the spec's tenant; a fork's
    source tenant). Refusals are a ``SpecError`` naming the field."""
    if spec.dataset is None:
        return spec
    dataset = resolve_dataset(spec.dataset, owner or spec.tenant, settings, s3_client=s3_client)
    return spec.model_copy(update={"dataset": dataset})


def resolve_dataset(dataset: DatasetSpec, owner: str, settings: Settings, *, s3_client: Any = None) -> DatasetSpec:
    """One dataset made local (see `resolve_dataset_source`); ``owner``: the tenant whose uploads
    a ``dataset.id`` names."""
    from joynexus.spec import SpecError

    try:
        if dataset.id is not None:
            found = find_tenant_dataset(settings.data_dir / "datasets", owner, dataset.id)
            if found is None and settings.s3_bucket:  # uploaded through another process of the deployment
                from joynexus.data.shared_uploads import fetch_shared_upload, upload_store

                store = upload_store(settings)
                assert store is not None
                found = fetch_shared_upload(store, settings.data_dir / "datasets", owner, dataset.id)
            if found is None:
                raise DatasetSourceError(
                    "dataset.id",
                    f"tenant {owner!r} has no uploaded dataset {dataset.id} (POST /v1/datasets uploads one, "
                    "GET /v1/datasets lists them)",
                )
            if dataset.sha256 is not None and dataset.sha256 != found.sha256:
                raise DatasetSourceError("dataset.sha256", f"dataset {dataset.id} has digest {found.sha256}")
            dataset = dataset.model_copy(update={"root": str(found.root), "sha256": found.sha256})
        elif dataset.uri is not None and dataset.root is None:
            if s3_client is None:
                import boto3

                s3_client = boto3.session.Session().client("s3", endpoint_url=settings.s3_endpoint_url)
            cache = settings.data_dir / "datasets" / "s3"
            fetched = fetch_s3_dataset(dataset.uri, cache, s3_client, expected_sha256=dataset.sha256)
            dataset = dataset.model_copy(update={"root": str(fetched.root), "sha256": fetched.sha256})
        elif dataset.uri is None:
            assert dataset.root is not None
            root = check_dataset_root(dataset.root, parse_dataset_roots(settings.dataset_roots))
            digest = content_digest(root) if root.is_dir() else None  # a missing folder: the creator says so
            if dataset.sha256 is not None and digest is not None and digest != dataset.sha256:
                raise DatasetSourceError("dataset.sha256", f"the dataset holds content {digest}, not {dataset.sha256}")
            dataset = dataset.model_copy(update={"root": str(root), "sha256": digest or dataset.sha256})
    except DatasetSourceError as error:
        raise SpecError([(error.field, error.reason)]) from None
    return dataset
