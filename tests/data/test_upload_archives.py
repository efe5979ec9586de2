"""Issue 41.4 and 41.7: a malformed upload is refused as the archive's fault (DatasetUploadError:
422 over HTTP), naming the member it failed at, never a path of this server; the cases that used
to escape as 500s (a member that is a file and then a folder, truncated and corrupt archives,
garbage) and what an archive's headers may lie about (sizes)."""

from __future__ import annotations

import io
import random
import tarfile
import zipfile
from pathlib import Path

import pytest

from joynexus.data.uploads import DatasetUploadError, store_uploaded_dataset
from joynexus.data.validation import DatasetExpectation
from tests.helpers import sft_spec, tar_dataset, write_dataset_for

SHAPE = dict(cameras=("front",), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2)
EXPECTATION = DatasetExpectation(cameras=("front",), image_size=(32, 32), state_dim=4, action_dim=3)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    spec = sft_spec("archives", tmp_path_factory.mktemp("archives") / "arm", **SHAPE)
    write_dataset_for(spec, episodes=1, length=4)
    return Path(spec["dataset"]["root"])


def _tar(members: list[tuple[str, bytes | None]], mode: str = "w") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            else:
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _zip(members: list[tuple[str, bytes]], compression: int = zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, data in members:
            archive.writestr(name, data)
    return buffer.getvalue()


NOISE = random.Random(0).randbytes(50_000)  # incompressible: an archive's bytes are mostly its members'


def _corrupt_zip_member() -> bytes:
    data = bytearray(_zip([("a/meta/info.json", NOISE)], zipfile.ZIP_DEFLATED))
    data[1000:1020] = b"\xff" * 20  # inside the deflated bytes of the member
    return bytes(data)


MALFORMED = {
    "tar file then folder": (_tar([("d/x", b"1"), ("d/x", None)]), "'d/x' is both a file and a folder"),
    "tar folder then file": (_tar([("d/x", None), ("d/x", b"1")]), "'d/x' is both a folder and a file"),
    "tar inside a file": (_tar([("d/x", b"1"), ("d/x/y", b"2")]), "'d/x/y' lies inside 'd/x', which is a file"),
    "tar member twice": (_tar([("d/x", b"1"), ("d/x", b"2")]), "'d/x' appears twice"),
    "truncated tar.gz": (_tar([("d/x", NOISE)], "w:gz")[:25_000], "corrupt or truncated at member 'd/x'"),
    "zip file then folder": (_zip([("d/x", b"1"), ("d/x/", b"")]), "'d/x' is both a file and a folder"),
    "zip corrupt member": (_corrupt_zip_member(), "corrupt or truncated at member 'a/meta/info.json'"),
    "truncated zip": (_zip([("d/x", b"1" * 1000)])[:-30], "not a readable tar or zip archive"),
    "garbage": (b"\x1f\x8b" + bytes(range(256)) * 4, "not a readable tar or zip archive"),
    "plain garbage": (b"definitely not an archive" * 10, "not a readable tar or zip archive"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_archive_is_refused_naming_the_problem_not_a_server_path(tmp_path, case):
    body, expected = MALFORMED[case]
    with pytest.raises(DatasetUploadError) as refused:
        store_uploaded_dataset(
            body, tenant_id="t", repo_id="team/arm", datasets_dir=tmp_path, expectation=EXPECTATION,
            max_unpacked_bytes=1 << 20,
        )  # fmt: skip
    assert refused.value.field == "archive" and expected in refused.value.reason, refused.value.reason
    assert str(tmp_path) not in str(refused.value) and ".upload-" not in str(refused.value)
    assert [p.name for p in (tmp_path / "tenants" / "t").iterdir()] == []  # nothing left behind


def test_the_unpacked_size_is_also_counted_as_bytes_are_written(tmp_path, dataset, monkeypatch):
    """Declared sizes are checked first (below); what is written is counted as well, in case a
    reader trusts a size it should not: with the declared check off, the written count refuses."""
    from joynexus.data import archive_unpacking

    monkeypatch.setattr(archive_unpacking._Unpacking, "declare", lambda self, total: None)  # in this process
    body = tar_dataset(dataset, gz=True, extra={"big/zeros": b"\0" * (3 << 20)})
    with pytest.raises(DatasetUploadError, match="unpacks to more than 2,097,152 bytes"):
        limits = archive_unpacking.UnpackLimits(max_bytes=2 << 20, max_ratio=1e6)
        archive_unpacking.extract_archive(io.BytesIO(body), tmp_path, limits)


def test_a_validation_failure_names_the_file_inside_the_archive_not_the_servers_staging_folder(tmp_path, dataset):
    wrong = DatasetExpectation(cameras=("front",), image_size=(32, 32), state_dim=9, action_dim=3)
    body = tar_dataset(dataset, gz=False)
    for tar_body in (body, tar_dataset(dataset, gz=False, extra={f"{dataset.name}/meta/info.json.bak": b"{}"})):
        with pytest.raises(DatasetUploadError) as refused:
            store_uploaded_dataset(
                tar_body, tenant_id="t", repo_id="team/arm", datasets_dir=tmp_path, expectation=wrong,
                max_unpacked_bytes=64 << 20,
            )  # fmt: skip
        assert str(tmp_path) not in str(refused.value) and ".upload-" not in str(refused.value), refused.value
    broken = _tar([("d/meta/info.json", b"{not json"), ("d/data/chunk-000/file-000.parquet", b"PAR1")])
    with pytest.raises(DatasetUploadError) as refused:
        store_uploaded_dataset(
            broken, tenant_id="t", repo_id="team/arm", datasets_dir=tmp_path, expectation=EXPECTATION,
            max_unpacked_bytes=64 << 20,
        )  # fmt: skip
    message = str(refused.value)
    assert str(tmp_path) not in message and ".upload-" not in message and "info.json" in message, message


@pytest.mark.parametrize("kind", ["zip", "tar"])
def test_an_archive_declaring_more_than_the_bound_is_refused_before_its_bytes_are_unpacked(tmp_path, kind, monkeypatch):
    """Issue 41.5 (in part): the bound is checked against declared sizes first (a zip's central
    directory before any member, a tar member's header before its data)."""
    from joynexus.data import archive_unpacking

    members = [(f"d/part-{i}", NOISE[:40_000]) for i in range(3)]
    body = _zip(members) if kind == "zip" else _tar(members)
    written: list[int] = []
    real_file = archive_unpacking._Unpacking.file

    def counted(self, name, source):
        written.append(1)
        return real_file(self, name, source)

    monkeypatch.setattr(archive_unpacking._Unpacking, "file", counted)  # seen in this process only
    with pytest.raises(DatasetUploadError, match="declares more than 100,000 bytes unpacked"):
        limits = archive_unpacking.UnpackLimits(max_bytes=100_000)
        archive_unpacking.extract_archive(io.BytesIO(body), tmp_path, limits)
    assert len(written) == (0 if kind == "zip" else 2)  # the third tar header passes the bound
