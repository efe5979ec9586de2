"""Unpacking an uploaded archive (tar in any compression, or zip) safely and off the serving process.

Refused as the archive is read, never after (issue 41.5): a member path that is not relative or
climbs out with ``..``; anything but regular files and folders; more than ``max_files`` members; more
than ``max_bytes`` in total, by the sizes the archive declares (a zip's central directory before any
member, each tar header before its data) and by the bytes actually written (declared sizes can lie);
and more than ``max_ratio`` times the compressed bytes read so far (a decompression bomb is refused
after a bounded amount of work, whatever it declares).

`unpack_archive` runs the reading in a child process at a lower CPU priority: Python's archive
readers hold the GIL for most of their work, so in a serving process's thread they would stall its
event loop and every tenant's calls. The caller may call it off (`cancelled`, set when the client
hangs up): the child is killed at once, nothing more is read."""

from __future__ import annotations

import gzip
import io
import json
import lzma
import os
import subprocess
import sys
import tarfile
import threading
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

__all__ = [
    "DEFAULT_MAX_COMPRESSION_RATIO",
    "DEFAULT_MAX_FILES",
    "ArchiveTooLarge",
    "DatasetUploadError",
    "UnpackLimits",
    "UploadCancelled",
    "extract_archive",
    "unpack_archive",
]

# A LeRobot dataset is mostly parquet and mp4, both compressed already: it packs to about its own
# size. 100 x leaves room for well-compressing metadata; a bomb expands by 1,000 x and more.
DEFAULT_MAX_COMPRESSION_RATIO = 100.0
# Members (files and folders) of one upload. LeRobot v3 keeps a dataset in few files; a v2.1 one has
# a parquet per episode and an mp4 per episode and camera: thousands. Each member costs about
# 0.3 ms of CPU to unpack, so 20,000 is a few seconds of a niced child process at most.
DEFAULT_MAX_FILES = 20_000
# Bytes any archive may unpack to beyond max_ratio x its compressed bytes: a small archive of
# small files (info.json, tasks.jsonl) compresses far better than a dataset as a whole.
RATIO_ALLOWANCE_BYTES = 1 << 20
CHILD_NICENESS = 10  # the child yields the CPU to the serving process's calls
_CHUNK = 1 << 20


class DatasetUploadError(ValueError):
    """An upload was refused; ``field`` names what was wrong."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


class ArchiveTooLarge(DatasetUploadError):
    """The archive unpacks (or declares it unpacks) to more than the byte bound."""


class UploadCancelled(Exception):
    """The upload was called off (its client hung up) while its archive was being unpacked."""


@dataclass(frozen=True)
class UnpackLimits:
    """What one archive may unpack to (the module docstring says how each is enforced)."""

    max_bytes: int
    max_files: int = DEFAULT_MAX_FILES
    max_ratio: float = DEFAULT_MAX_COMPRESSION_RATIO

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_files", "max_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"UnpackLimits.{name}: expected a number > 0, got {value!r}")

    def ratio_bound(self, compressed: int) -> float:
        return self.max_ratio * compressed + RATIO_ALLOWANCE_BYTES


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


class _Unpacking:
    """Where an archive's members go in ``dest``: each path once, a file never where a folder is
    (or inside a file), within the limits. ``progress()`` answers (compressed bytes read, bytes they
    expanded to) so far, for the ratio bound."""

    def __init__(self, dest: Path, limits: UnpackLimits, progress: Callable[[], tuple[int, int]]):
        self.dest, self.limits, self.progress = dest, limits, progress
        self.files: set[str] = set()
        self.folders: set[str] = {"."}
        self.written = 0
        self.declared = 0
        self.members = 0
        self.current: str | None = None  # the member being read, named when the archive is corrupt

    def count(self, name: str) -> None:
        """One more member (before it is unpacked): within the file count and the ratio so far."""
        self.current = name
        self.members += 1
        if self.members > self.limits.max_files:
            raise DatasetUploadError(
                "archive", f"has more than {self.limits.max_files:,} files and folders (at member {name!r})"
            )
        self.check_ratio(name)

    def declare(self, total: int) -> None:
        """Refuse once the sizes the archive declares pass the bound, before their bytes are
        unpacked (what is written is counted too: declared sizes can lie)."""
        self.declared = total
        if total > self.limits.max_bytes:
            raise ArchiveTooLarge("archive", f"declares more than {self.limits.max_bytes:,} bytes unpacked ({total:,})")

    def check_ratio(self, name: str) -> None:
        compressed, expanded = self.progress()
        if expanded > self.limits.ratio_bound(compressed):
            raise DatasetUploadError(
                "archive",
                f"expands to more than {self.limits.max_ratio:g} times its compressed size "
                f"({expanded:,} bytes from {compressed:,}, at member {name!r})",
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
                if self.written > self.limits.max_bytes:  # counted as written: sizes in headers can lie
                    raise ArchiveTooLarge("archive", f"unpacks to more than {self.limits.max_bytes:,} bytes")
                self.check_ratio(name)
                out.write(chunk)

    def _parents(self, name: str) -> None:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in self.files:
                raise DatasetUploadError("archive", f"member {name!r} lies inside {parent!r}, which is a file")
            self.folders.add(parent)


def extract_archive(source: BinaryIO, dest: Path, limits: UnpackLimits) -> None:
    """Unpack a tar (any compression) or zip read from ``source`` (seekable) into ``dest``, in this
    process, with the checks of the module docstring; a malformed archive raises DatasetUploadError
    naming the member it failed at, never a path of this server."""
    unpacking = _Unpacking(dest, limits, lambda: (0, 0))
    try:
        head = source.read(4)
        source.seek(0)
        if head == b"PK\x03\x04":
            _extract_zip(source, unpacking)
            return
        with tarfile.open(fileobj=source, mode="r:*") as archive:
            stream = archive.fileobj  # the decompressed stream (the source itself for a plain tar)
            unpacking.progress = lambda: (source.tell(), stream.tell())
            for info in archive:  # headers read as they come, not all first
                unpacking.count(info.name)
                unpacking.declare(unpacking.declared + max(info.size, 0))  # each header, before its data
                _tar_member(archive, info, unpacking)
    except DatasetUploadError:
        raise
    except (*_CORRUPT, OSError) as error:
        if isinstance(error, OSError) and not isinstance(error, gzip.BadGzipFile) and error.errno is not None:
            raise  # the server's filesystem, not the archive
        raise DatasetUploadError("archive", _corrupt_reason(error, unpacking.current)) from None


def _extract_zip(source: BinaryIO, unpacking: _Unpacking) -> None:
    limits = unpacking.limits
    with zipfile.ZipFile(source) as archive:
        members = archive.infolist()
        size = source.seek(0, io.SEEK_END)
        if len(members) > limits.max_files:
            raise DatasetUploadError("archive", f"has more than {limits.max_files:,} files and folders")
        declared = sum(info.file_size for info in members)  # the central directory: before any byte
        unpacking.declare(declared)
        if declared > limits.ratio_bound(size):
            raise DatasetUploadError(
                "archive",
                f"declares more than {limits.max_ratio:g} times its compressed size unpacked "
                f"({declared:,} bytes from {size:,})",
            )
        begun = 0  # compressed bytes of the members begun so far
        unpacking.progress = lambda: (begun, unpacking.written)
        for info in members:
            begun += info.compress_size
            unpacking.count(info.filename)
            _zip_member(archive, info, unpacking)


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


WORKER_MODULE = __name__  # run as `python -m joynexus.data.archive_unpacking ARCHIVE DEST LIMITS_JSON`


def unpack_archive(
    archive: Path, dest: Path, limits: UnpackLimits, *, cancelled: threading.Event | None = None
) -> None:
    """`extract_archive` of the file ``archive`` into ``dest`` in a child process at a lower CPU
    priority; returns when it is done, raises what it refused with, or UploadCancelled (the child
    killed) once ``cancelled`` is set.

    A fresh interpreter (not a fork of the serving process, its threads and memory; not
    multiprocessing, which re-runs the parent's main script in the child) that imports only this
    module: about 0.1 s per upload."""
    command = [sys.executable, "-m", WORKER_MODULE, str(archive), str(dest), json.dumps(asdict(limits))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the same joynexus
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        while True:
            try:
                child.wait(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                if cancelled is not None and cancelled.is_set():
                    raise UploadCancelled("the upload was called off while its archive was unpacked") from None
        out, err = child.communicate()
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    try:
        outcome = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        detail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"the unpacking worker exited with code {child.returncode}: {detail[0]}") from None
    if outcome is None:
        return
    kind, field, reason = outcome
    if kind == "too_large":
        raise ArchiveTooLarge(field, reason)
    if kind == "refused":
        raise DatasetUploadError(field, reason)
    raise RuntimeError(f"unpacking failed in the worker: {reason}")


def _child_main(archive: str, dest: str, limits: UnpackLimits) -> object:
    """What the child answers on its last line of output: null, or [kind, field, reason]."""
    try:
        os.nice(CHILD_NICENESS)
    except OSError:  # not allowed here: unpack at the same priority
        pass
    try:
        with open(archive, "rb") as source:
            extract_archive(source, Path(dest), limits)
        return None
    except ArchiveTooLarge as error:
        return ["too_large", error.field, error.reason]
    except DatasetUploadError as error:
        return ["refused", error.field, error.reason]
    except Exception as error:  # the server's fault (a full disk): the parent answers 500
        return ["failed", "", f"{type(error).__name__}: {error}"]


if __name__ == "__main__":
    _archive, _dest, _limits = sys.argv[1:4]
    print(json.dumps(_child_main(_archive, _dest, UnpackLimits(**json.loads(_limits)))), flush=True)
