"""The deployment's base model as a portable checkpoint archive (``GET /v1/base_model``).

An export names its base model by id (``joynexus/tiny-smolvlm`` for a preset), which nobody outside
can resolve. ``base_model_archive`` writes the backbone checkpoint directory the services build
(a local checkpoint directory as it is; a preset through ``save_pretrained``, deterministic from its
seed) as one uncompressed tar, cached per source; ``extract_base_model`` unpacks one safely (regular
files and folders only, every path inside the destination) into a directory that
``BackboneSource(path=...)`` (and the LeRobot plugin) load.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the API serves the archive; only building a preset's needs the backbone (torch)
    from joynexus.models.backbone import BackboneSource

__all__ = ["BASE_MODEL_MEDIA_TYPE", "base_model_archive", "extract_base_model"]

BASE_MODEL_MEDIA_TYPE = "application/x-tar"


def base_model_archive(source: BackboneSource, cache_dir: str | Path) -> Path:
    """A tar of ``source``'s checkpoint directory (files at the archive root), built once per source
    into ``cache_dir`` (atomic: concurrent callers each get a complete file)."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(source.model_dump_json().encode()).hexdigest()[:24]
    archive = cache / f"base-model-{key}.tar"
    if archive.is_file():
        return archive
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        if source.path is not None:
            folder = Path(source.path).expanduser()
        else:  # a preset: the same weights every service builds from it
            from joynexus.models.placement import DevicePlacement

            folder = Path(tmp) / "backbone"
            source.build(DevicePlacement(device="cpu", autocast=False)).save_pretrained(folder)
        partial = Path(tmp) / "archive.tar"
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            for file in sorted(p for p in folder.rglob("*") if p.is_file()):
                tar.add(file, arcname=file.relative_to(folder).as_posix(), recursive=False)
        os.replace(partial, archive)
    return archive


def extract_base_model(archive: bytes | str | Path, dest: str | Path) -> Path:
    """Unpack a ``base_model_archive`` into ``dest`` (created; must not hold files). Members that
    are not regular files or folders, or whose path leaves ``dest``, are refused."""
    root = Path(dest).expanduser()
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"base model destination {str(root)!r} is not empty")
    root.mkdir(parents=True, exist_ok=True)
    source = tarfile.open(fileobj=io.BytesIO(archive)) if isinstance(archive, bytes) else tarfile.open(archive)
    with source as tar:
        for member in tar.getmembers():
            target = (root / member.name).resolve()
            if not (member.isfile() or member.isdir()) or not target.is_relative_to(root.resolve()):
                raise ValueError(f"base model archive: member {member.name!r} is not a file inside the archive root")
        tar.extractall(root, filter="data")  # the stdlib's own checks as well
    if not (root / "config.json").is_file():
        raise ValueError("base model archive: no config.json at its root")
    return root
