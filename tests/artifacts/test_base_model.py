"""The base-model archive (GET /v1/base_model): a preset's archive is built once and unpacks into a
directory `BackboneSource(path=...)` loads with the same weights; extraction refuses members that
leave the destination or are not plain files."""

from __future__ import annotations

import io
import tarfile

import pytest
import torch

from joynexus.artifacts.base_model import base_model_archive, extract_base_model
from joynexus.models.backbone import BackboneSource
from joynexus.models.placement import DevicePlacement


def test_preset_archive_is_cached_and_loads_the_same_backbone(tmp_path):
    source = BackboneSource(preset="tiny")
    archive = base_model_archive(source, tmp_path / "cache")
    assert base_model_archive(source, tmp_path / "cache") == archive  # cached: built once
    folder = extract_base_model(archive.read_bytes(), tmp_path / "backbone")
    cpu = DevicePlacement(device="cpu")
    loaded = BackboneSource(path=str(folder), preset=None).build(cpu)
    built = source.build(cpu)
    assert loaded.model_id == built.model_id
    images, texts = [[torch.rand(3, 32, 32)]], ["pick up the cube"]
    torch.testing.assert_close(loaded.encode(images, texts).tokens, built.encode(images, texts).tokens)


def _tar(members: list[tarfile.TarInfo]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for member in members:
            tar.addfile(member, io.BytesIO(b"x" * member.size) if member.isfile() else None)
    return buffer.getvalue()


@pytest.mark.parametrize("name,kind", [("../escape.json", tarfile.REGTYPE), ("/abs.json", tarfile.REGTYPE),
                                       ("link", tarfile.SYMTYPE)])  # fmt: skip
def test_extraction_refuses_members_outside_the_destination(tmp_path, name, kind):
    member = tarfile.TarInfo(name)
    member.type, member.size = kind, 1 if kind == tarfile.REGTYPE else 0
    if kind == tarfile.SYMTYPE:
        member.linkname = "/etc/passwd"
    with pytest.raises(ValueError, match="not a file inside the archive root"):
        extract_base_model(_tar([member]), tmp_path / "out")
    assert not (tmp_path / "escape.json").exists()
