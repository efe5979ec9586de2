"""Where a store's bytes live, from its location: a local folder or an ``s3://bucket/prefix`` URI.
Its own module so that `blobs` (local) and `s3` stay independent of each other."""

from __future__ import annotations

from pathlib import Path

from joynexus.artifacts.blobs import BlobStore, LocalBlobStore
from joynexus.artifacts.s3 import S3BlobStore


def blob_store_for(location: str | Path | BlobStore) -> BlobStore:
    """A store given as itself, an ``s3://bucket/prefix`` URI (:mod:`joynexus.artifacts.s3`) or a
    local folder."""
    if isinstance(location, BlobStore):
        return location
    if isinstance(location, str) and location.startswith("s3://"):
        return S3BlobStore.from_uri(location)
    return LocalBlobStore(location)


def checkpoint_blobs(location: str, endpoint_url: str | None = None) -> BlobStore:
    """The blob store of a checkpoint location (`Settings.checkpoint_location`: a local folder or an
    s3:// URI) opened in this process; the one place both the services and clients open it."""
    if location.startswith("s3://"):
        return S3BlobStore.from_uri(location, endpoint_url=endpoint_url)
    return LocalBlobStore(location)
