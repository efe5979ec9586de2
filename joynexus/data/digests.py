"""The content digest of a dataset folder: what an S3 fetch, a server path and an upload's
content record (`joynexus.data.sources`, `joynexus.data.uploads`), in one place both import."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath

__all__ = ["DATASET_MANIFEST_FILE", "content_digest"]

DATASET_MANIFEST_FILE = "joynexus_dataset.json"  # an S3 fetch's manifest in its cache entry


def _pair_digest(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()


def content_digest(root: str | Path) -> str:
    """The digest of a dataset folder's content, the one an S3 fetch records: sha256 over the
    sorted (relative path, file sha256) pairs (hidden files and the cache manifest left out)."""
    base = Path(root)
    files: dict[str, str] = {}
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
        relative = path.relative_to(base).as_posix()
        if relative == DATASET_MANIFEST_FILE or any(part.startswith(".") for part in PurePosixPath(relative).parts):
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        files[relative] = digest.hexdigest()
    return _pair_digest(files)
