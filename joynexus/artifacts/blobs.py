"""Where artifact bytes live: a tiny BlobStore interface (read / list / atomically publish a folder /
atomically replace one object), on local disk here and on S3 in `joynexus.artifacts.s3`."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from joynexus.artifacts.codec import (
    _FILE_NAME_RE,
    _TMP_PREFIX,
)


@runtime_checkable
class BlobStore(Protocol):
    """Minimal storage the checkpoint layer needs; keys are '/'-separated relative paths.

    An object-store backend implements ``publish_dir`` by uploading the files in the given order,
    the last one (the manifest) acting as the commit marker, and ``put_atomic`` as one PUT.
    """

    def read(self, key: str) -> bytes:
        """Return the object's bytes; FileNotFoundError if absent."""
        ...

    def exists(self, key: str) -> bool: ...

    def list_dir(self, prefix: str) -> list[str]:
        """Names of the direct children of ``prefix`` (empty list if none)."""
        ...

    def total_bytes(self, prefix: str) -> int:
        """Bytes of every object under ``prefix`` (0 if none)."""
        ...

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix/`` in one listing: its key relative to ``prefix`` ('/'-separated)
        -> its size in bytes (empty if none)."""
        ...

    def publish_dir(self, prefix: str, files: Mapping[str, bytes]) -> None:
        """Make ``files`` visible under ``prefix`` all at once; FileExistsError if it exists."""
        ...

    def put_atomic(self, key: str, data: bytes) -> None:
        """Replace one object so that readers see either the old or the new bytes."""
        ...


def check_key(key: str) -> list[str]:
    parts = key.split("/")
    if not key or any(p in {"", ".", ".."} for p in parts) or "\\" in key or "\x00" in key:
        raise ValueError(f"invalid storage key {key!r}")
    return parts


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable; not every platform can open a directory.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


class LocalBlobStore:
    """:class:`BlobStore` on a local (POSIX) filesystem, crash-safe via fsync + rename."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key))

    def read(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def list_dir(self, prefix: str) -> list[str]:
        path = self._path(prefix) if prefix else self.root
        try:
            return sorted(p.name for p in path.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def publish_dir(self, prefix: str, files: Mapping[str, bytes]) -> None:
        target = self._path(prefix)
        for name in files:
            if not _FILE_NAME_RE.fullmatch(name) or name in {".", ".."}:
                raise ValueError(f"invalid file name {name!r}")
        if target.exists():
            raise FileExistsError(f"{target} already exists")
        target.parent.mkdir(parents=True, exist_ok=True)
        # Temp dir next to the target: same filesystem, so os.replace is an atomic rename.
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=target.parent))
        try:
            for name, data in files.items():
                _write_file_durably(tmp / name, data)
            _fsync_dir(tmp)
            try:
                os.replace(tmp, target)
            except OSError as exc:
                if target.exists():  # lost a race with another writer of the same version
                    raise FileExistsError(f"{target} already exists") from exc
                raise
            _fsync_dir(target.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def total_bytes(self, prefix: str) -> int:
        """Bytes of every file under ``prefix`` (0 if there is none). One walk that skips files
        removed while it runs (a prune or delete racing a usage read is no error)."""
        return sum(self.list_sizes(prefix).values())

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every file under ``prefix`` -> its size, from one walk of the folder (0 files if absent)."""
        root = self._path(prefix) if prefix else self.root
        sizes: dict[str, int] = {}
        # os.walk lists each folder once (rglob + is_file + stat would stat every entry twice).
        for folder, _dirs, names in os.walk(root):
            base = Path(folder).relative_to(root).parts
            for name in names:
                try:
                    size = os.stat(os.path.join(folder, name)).st_size
                except FileNotFoundError:  # removed while we walked (a concurrent delete or prune)
                    continue
                sizes["/".join((*base, name))] = size
        return sizes

    def list_modified(self, prefix: str) -> dict[str, float]:
        """Every file under ``prefix`` -> its modification time (unix seconds), like `list_sizes`."""
        root = self._path(prefix) if prefix else self.root
        times: dict[str, float] = {}
        for folder, _dirs, names in os.walk(root):
            base = Path(folder).relative_to(root).parts
            for name in names:
                try:
                    modified = os.stat(os.path.join(folder, name)).st_mtime
                except FileNotFoundError:  # removed while we walked
                    continue
                times["/".join((*base, name))] = modified
        return times

    def put_atomic(self, key: str, data: bytes) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
            _fsync_dir(target.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def delete_prefix(self, prefix: str) -> int:
        """Remove the object ``prefix`` or everything under ``prefix/``; returns how many files went.
        The folder is first renamed aside, so readers see it whole or not at all."""
        target = self._path(prefix)
        if target.is_file() or target.is_symlink():
            target.unlink()
            return 1
        if not target.exists():
            return 0
        doomed = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}deleted-{target.name}-", dir=target.parent))
        os.replace(target, doomed / target.name)
        _fsync_dir(target.parent)
        count = sum(1 for p in doomed.rglob("*") if not p.is_dir())
        shutil.rmtree(doomed)
        return count


# --------------------------------------------------------------------------------------------
# Checkpoint store
# --------------------------------------------------------------------------------------------
