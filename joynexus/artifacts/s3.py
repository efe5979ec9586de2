"""S3 backend of :class:`joynexus.artifacts.BlobStore`: tenant checkpoints in an S3 bucket (boto3).

``CheckpointStore(S3BlobStore("bucket", "prefix"))`` works unchanged, and so does
``CheckpointStore("s3://bucket/prefix")`` (what a Ray actor receives, since a location string
travels where a client object can not).

Semantics on an object store, where there is no directory rename:

* ``publish_dir`` uploads the files in the order given (``CheckpointStore`` puts the manifest last,
  so the manifest is the commit marker: readers only list versions whose manifest exists). Every
  PUT is conditional (``If-None-Match: *``), so two writers of the same version can never mix
  files: the one that loses the first file gets ``FileExistsError`` before writing anything. A
  failed publish deletes what it had uploaded.
* ``put_atomic`` is one PUT: S3 readers see either the old or the new object, never a mix.
* Integrity: the checkpoint layer verifies every file against the manifest's sha256 on load, so a
  corrupted object is refused whatever the store; boto3 also checksums each upload in transit.

Endpoint and credentials: ``endpoint_url`` argument, else ``JOYNEXUS_S3_ENDPOINT_URL``, else boto3's
own resolution (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, credentials from the standard AWS
chain: environment, shared files, instance or pod roles). Ray actors read the same environment
variables on their node.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from joynexus.artifacts.blobs import check_key
from joynexus.artifacts.codec import _FILE_NAME_RE

__all__ = ["ENDPOINT_ENV", "S3BlobStore", "configure_mlflow_s3", "export_endpoint", "split_s3_uri"]

ENDPOINT_ENV = "JOYNEXUS_S3_ENDPOINT_URL"
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_CONFLICT_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


def export_endpoint(checkpoint_root: str, endpoint_url: str | None) -> None:
    """An actor opens an s3:// checkpoint root with the endpoint in JOYNEXUS_S3_ENDPOINT_URL: export
    it before Ray starts, so a local Ray inherits it (a remote cluster's nodes must set it themselves)."""
    if endpoint_url and checkpoint_root.startswith("s3://"):
        os.environ.setdefault(ENDPOINT_ENV, endpoint_url)


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``; ValueError otherwise."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc or parsed.query or parsed.fragment:
        raise ValueError(f"invalid S3 URI {uri!r}: expected s3://<bucket>[/<prefix>]")
    return parsed.netloc, parsed.path.strip("/")


def configure_mlflow_s3(endpoint_url: str | None) -> None:
    """Point MLflow's S3 artifact repository at ``endpoint_url`` (it reads only its environment
    variable ``MLFLOW_S3_ENDPOINT_URL``); an explicit MLflow setting wins."""
    if endpoint_url:
        os.environ.setdefault("MLFLOW_S3_ENDPOINT_URL", endpoint_url)


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


class S3BlobStore:
    """:class:`joynexus.artifacts.BlobStore` over one bucket and key prefix."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        conditional_writes: bool = True,
        client: Any = None,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid S3 bucket {bucket!r}: expected a bucket name without '/'")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.endpoint_url = endpoint_url or os.environ.get(ENDPOINT_ENV) or None
        self.region_name = region_name
        # S3 (since 2024) and moto honour If-None-Match on PUT; turn off for stores that do not.
        self.conditional_writes = conditional_writes
        self._client = client
        self._client_lock = threading.Lock()

    @classmethod
    def from_uri(cls, uri: str, **kwargs: Any) -> S3BlobStore:
        bucket, prefix = split_s3_uri(uri)
        return cls(bucket, prefix, **kwargs)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def __repr__(self) -> str:
        where = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3BlobStore({self.uri!r}{where})"

    def __reduce__(self) -> tuple[Any, ...]:
        # A boto3 client does not pickle; the configuration does (Ray ships stores to actors).
        return (_rebuild, (self.bucket, self.prefix, self.endpoint_url, self.region_name, self.conditional_writes))

    @property
    def client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                import boto3

                # boto3 clients are thread-safe (sessions are not): one per store, built once.
                self._client = boto3.session.Session().client(
                    "s3", endpoint_url=self.endpoint_url, region_name=self.region_name
                )
            return self._client

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _dir_key(self, prefix: str) -> str:
        if not prefix:
            return f"{self.prefix}/" if self.prefix else ""
        return self._key(prefix) + "/"

    # ---- BlobStore -----------------------------------------------------------------------

    def read(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        full = self._key(key)
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=full)
        except ClientError as exc:
            if _error_code(exc) in _MISSING_CODES:
                raise FileNotFoundError(f"{self.uri}: no object {key!r}") from exc
            raise
        with response["Body"] as body:
            return body.read()

    def exists(self, key: str) -> bool:
        """True for an object, or for a "folder": any object under ``key/``."""
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as exc:
            if _error_code(exc) not in _MISSING_CODES:
                raise
        listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._dir_key(key), MaxKeys=1)
        return bool(listed.get("KeyCount", 0))

    def total_bytes(self, prefix: str) -> int:
        """Bytes of every object under ``prefix/`` (one listing, no per-object request)."""
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=self._dir_key(prefix))
        return sum(int(item["Size"]) for page in pages for item in page.get("Contents", []))

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix/`` -> its size, from one (paginated) listing."""
        start = self._dir_key(prefix)
        paginator = self.client.get_paginator("list_objects_v2")
        sizes: dict[str, int] = {}
        for page in paginator.paginate(Bucket=self.bucket, Prefix=start):
            for item in page.get("Contents", []):
                name = item["Key"][len(start) :]
                if name:
                    sizes[name] = int(item["Size"])
        return sizes

    def list_modified(self, prefix: str) -> dict[str, float]:
        """Every object under ``prefix/`` -> its LastModified (unix seconds), one listing."""
        start = self._dir_key(prefix)
        paginator = self.client.get_paginator("list_objects_v2")
        times: dict[str, float] = {}
        for page in paginator.paginate(Bucket=self.bucket, Prefix=start):
            for item in page.get("Contents", []):
                name = item["Key"][len(start) :]
                if name:
                    times[name] = item["LastModified"].timestamp()
        return times

    def list_dir(self, prefix: str) -> list[str]:
        start = self._dir_key(prefix)
        names: set[str] = set()
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=start, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                names.add(common["Prefix"][len(start) :].rstrip("/"))
            for obj in page.get("Contents", []):
                name = obj["Key"][len(start) :]
                if name:
                    names.add(name)
        return sorted(names)

    def publish_dir(self, prefix: str, files: Mapping[str, bytes]) -> None:
        for name in files:
            if not _FILE_NAME_RE.fullmatch(name) or name in {".", ".."}:
                raise ValueError(f"invalid file name {name!r}")
        if self.exists(prefix):
            raise FileExistsError(f"{self.uri}/{prefix} already exists")
        written: list[str] = []
        try:
            for name, data in files.items():  # in order: the last file is the commit marker
                key = self._key(f"{prefix}/{name}")
                self._put(key, bytes(data), only_if_absent=True, what=f"{self.uri}/{prefix}")
                written.append(key)
        except BaseException:
            self._delete_quietly(written)
            raise

    def put_atomic(self, key: str, data: bytes) -> None:
        self._put(self._key(key), bytes(data), only_if_absent=False, what=f"{self.uri}/{key}")

    def delete_prefix(self, prefix: str) -> int:
        """Delete the object ``prefix`` and every object under ``prefix/``; returns how many."""
        from botocore.exceptions import ClientError

        keys: list[str] = []
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(prefix))
            keys.append(self._key(prefix))
        except ClientError as exc:
            if _error_code(exc) not in _MISSING_CODES:
                raise
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self._dir_key(prefix)):
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = keys[start : start + 1000]
            response = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
            )
            errors = response.get("Errors") or []
            if errors:
                first = errors[0]
                raise OSError(
                    f"{self.uri}/{prefix}: {len(errors)} objects not deleted, e.g. {first.get('Key')!r}: "
                    f"{first.get('Code')} {first.get('Message')}"
                )
        return len(keys)

    # ---- helpers -------------------------------------------------------------------------

    def _put(self, key: str, data: bytes, *, only_if_absent: bool, what: str) -> None:
        from botocore.exceptions import ClientError

        extra = {"IfNoneMatch": "*"} if only_if_absent and self.conditional_writes else {}
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **extra)
        except ClientError as exc:
            if only_if_absent and _error_code(exc) in _CONFLICT_CODES:
                raise FileExistsError(f"{what} already exists (another writer published it)") from exc
            raise

    def _delete_quietly(self, keys: list[str]) -> None:
        if not keys:
            return
        try:
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys]})
        except Exception:  # cleanup is best effort; the caller's error is the one to report
            pass


def _rebuild(
    bucket: str, prefix: str, endpoint_url: str | None, region_name: str | None, conditional_writes: bool
) -> S3BlobStore:
    return S3BlobStore(
        bucket, prefix, endpoint_url=endpoint_url, region_name=region_name, conditional_writes=conditional_writes
    )
