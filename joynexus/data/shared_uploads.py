"""Uploaded datasets shared through the artifact store (issue 43.3): with a bucket configured, an
upload is also kept at ``s3://<bucket>/<prefix>/datasets/<tenant>/uploads/<dataset id>/`` (the
tenant's own prefix, which the per-tenant role of infra/terraform reaches), its record
``.../<dataset id>.json`` written last as the commit marker. Any process of the deployment that
does not have an upload on its local disk (another API replica, the Master resolving
``dataset.id``) fetches it from there into its own ``<datasets>/tenants/<tenant>/<id>/``, checked
against the record's content digest, and from then on reads it locally.

Without a bucket (a laptop, one process) nothing changes: the local folder is the only copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from joynexus.data.digests import content_digest
from joynexus.data.uploads import CONTENT_KEY, DATASET_ID_PATTERN, UploadedDataset, find_tenant_dataset

if TYPE_CHECKING:
    from joynexus.artifacts.s3 import S3BlobStore
    from joynexus.settings import Settings

__all__ = ["delete_shared_upload", "fetch_shared_upload", "publish_upload", "shared_upload_records", "upload_store"]


def upload_store(settings: Settings) -> S3BlobStore | None:
    """The store of the deployment's shared uploads, or None without a bucket."""
    if not settings.s3_bucket:
        return None
    from joynexus.artifacts.s3 import S3BlobStore

    prefix = "/".join([*([settings.s3_prefix] if settings.s3_prefix else []), "datasets"])
    return S3BlobStore(settings.s3_bucket, prefix, endpoint_url=settings.s3_endpoint_url)


def _home(tenant_id: str) -> str:
    return f"{tenant_id}/uploads"


def publish_upload(store: S3BlobStore, tenant_id: str, uploaded: UploadedDataset) -> None:
    """Copy a stored upload's files to the shared store, then its record (the commit marker).
    Idempotent: an upload whose record is there already is left as it is."""
    record_key = f"{_home(tenant_id)}/{uploaded.sha256}.json"
    if store.exists(record_key):
        return
    record_path = uploaded.root.with_name(f"{uploaded.sha256}.json")
    record = json.loads(record_path.read_text())
    files = sorted(p for p in uploaded.root.rglob("*") if p.is_file())
    for path in files:  # streamed file by file: an upload may unpack to gigabytes
        key = store._key(f"{_home(tenant_id)}/{uploaded.sha256}/{path.relative_to(uploaded.root).as_posix()}")
        store.client.upload_file(str(path), store.bucket, key)
    store.put_atomic(record_key, (json.dumps(record, sort_keys=True) + "\n").encode())


def shared_upload_records(store: S3BlobStore, tenant_id: str) -> dict[str, dict[str, Any]]:
    """dataset id -> record of the tenant's committed shared uploads."""
    pattern = re.compile(DATASET_ID_PATTERN[:-1] + r"\.json$")
    records = {}
    for name in store.list_dir(_home(tenant_id)):
        if pattern.fullmatch(name):
            try:
                records[name.removesuffix(".json")] = json.loads(store.read(f"{_home(tenant_id)}/{name}"))
            except (FileNotFoundError, ValueError):
                continue  # deleted meanwhile, or not ours
    return records


def fetch_shared_upload(
    store: S3BlobStore, datasets_dir: str | Path, tenant_id: str, dataset_id: str
) -> UploadedDataset | None:
    """The tenant's upload ``dataset_id`` on this disk, fetched from the shared store if only there;
    None if neither has it. A fetched copy whose files do not digest to the record's content is refused."""
    found = find_tenant_dataset(datasets_dir, tenant_id, dataset_id)
    if found is not None:
        return found
    if not _is_id(dataset_id):
        return None
    try:
        record = json.loads(store.read(f"{_home(tenant_id)}/{dataset_id}.json"))
    except FileNotFoundError:
        return None
    home = Path(datasets_dir) / "tenants" / tenant_id
    home.mkdir(parents=True, exist_ok=True)
    prefix = f"{_home(tenant_id)}/{dataset_id}"
    with tempfile.TemporaryDirectory(dir=home, prefix=".fetch-") as tmp:
        staging = Path(tmp) / dataset_id
        for name in store.list_sizes(prefix):
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            store.client.download_file(store.bucket, store._key(f"{prefix}/{name}"), str(target))
        if not staging.is_dir() or content_digest(staging) != record.get(CONTENT_KEY):
            raise OSError(f"shared upload {dataset_id} of tenant {tenant_id!r} does not match its record")
        sidecar = home / f"{dataset_id}.json"
        entry = home / dataset_id
        try:
            os.rename(staging, entry)  # atomic: a concurrent fetch of the same upload keeps one copy
        except OSError:
            if not entry.is_dir():
                raise
            shutil.rmtree(staging, ignore_errors=True)
        staged_record = home / f".{dataset_id}.json.tmp-{os.getpid()}"
        staged_record.write_text(json.dumps(record, sort_keys=True) + "\n")
        os.replace(staged_record, sidecar)
    return find_tenant_dataset(datasets_dir, tenant_id, dataset_id)


def delete_shared_upload(store: S3BlobStore, tenant_id: str, dataset_id: str) -> bool:
    """Remove the tenant's shared upload (record first: readers stop finding it); True if it was there."""
    if not _is_id(dataset_id):
        return False
    removed = store.delete_prefix(f"{_home(tenant_id)}/{dataset_id}.json")
    return store.delete_prefix(f"{_home(tenant_id)}/{dataset_id}") + removed > 0


def _is_id(dataset_id: str) -> bool:
    return isinstance(dataset_id, str) and re.fullmatch(DATASET_ID_PATTERN, dataset_id) is not None
