"""Dataset validation: metadata schema checks + Great Expectations data checks."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before lerobot / huggingface_hub are imported

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from joynexus.data.lerobot_dataset import ACTION_KEY, STATE_KEY, write_synthetic_dataset
from joynexus.data.validation import (
    DatasetExpectation,
    DatasetValidationError,
    ValidationFailure,
    ValidationReport,
    validate_dataset,
)

REPO = "tenant/val"
GOOD = DatasetExpectation(cameras=("front", "wrist"), image_size=(16, 20), state_dim=3, action_dim=2)


@pytest.fixture(scope="module")
def good_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("val") / "good"
    return write_synthetic_dataset(
        root,
        REPO,
        cameras=GOOD.cameras,
        image_size=(16, 20),
        state_dim=3,
        action_dim=2,
        num_episodes=3,
        episode_length=10,
    )


def _corrupt(root: Path, column: str, row: int, value: Any, element: int | None = 0) -> None:
    """Overwrite one cell (or one element of a vector cell) in the first data parquet file."""
    path = sorted((root / "data").rglob("*.parquet"))[0]
    table = pq.read_table(path)
    pos = table.schema.get_field_index(column)
    field = table.schema.field(pos)
    values = table.column(column).to_pylist()
    if element is None:
        values[row] = value
    else:
        cell = list(values[row])
        cell[element] = value
        values[row] = cell
    table = table.set_column(pos, field, pa.array(values, type=field.type))
    pq.write_table(table, path)


def test_good_dataset_passes(good_root: Path) -> None:
    validate_dataset(good_root, REPO, GOOD)  # warm imports (lerobot + GE) outside the timing
    t0 = time.perf_counter()
    report = validate_dataset(good_root, REPO, GOOD)
    assert time.perf_counter() - t0 < 10
    assert report == ValidationReport(ok=True, failures=(), checked_rows=30)
    assert "OK" in report.summary()
    # image_size=None accepts any size
    assert validate_dataset(good_root, REPO, replace(GOOD, image_size=None)).ok


@pytest.mark.parametrize(
    "change, field",
    [
        ({"action_dim": 5}, "dataset.action_dim"),
        ({"state_dim": 7}, "dataset.state_dim"),
        ({"cameras": ("front", "top")}, "dataset.cameras"),
        ({"image_size": (16, 21)}, "dataset.image_size"),
    ],
)
def test_schema_mismatch_names_the_field(good_root: Path, change: dict, field: str) -> None:
    exp = replace(GOOD, **change)
    with pytest.raises(DatasetValidationError) as exc:
        validate_dataset(good_root, REPO, exp)
    err = exc.value
    assert isinstance(err, ValueError)
    assert err.field == field
    assert str(err) == err.report.summary()
    assert str(err).splitlines()[0].startswith(f"{field}: ")
    # Without raising: same failures, ok=False.
    report = validate_dataset(good_root, REPO, exp, raise_on_error=False)
    assert not report.ok and report.failures[0].field == field
    if field == "dataset.cameras":
        assert "top" in report.failures[0].reason


@pytest.mark.parametrize(
    "column, value, field",
    [
        (ACTION_KEY, float("nan"), "dataset.action"),
        (STATE_KEY, float("inf"), "dataset.observation.state"),
    ],
)
def test_non_finite_values_fail_data_checks(
    good_root: Path, tmp_path: Path, column: str, value: float, field: str
) -> None:
    root = tmp_path / "bad"
    shutil.copytree(good_root, root)
    _corrupt(root, column, row=4, value=value, element=1)
    report = validate_dataset(root, REPO, GOOD, raise_on_error=False)
    assert not report.ok
    assert report.checked_rows == 30
    assert [f.field for f in report.failures] == [field]
    assert "NaN/inf" in report.failures[0].reason and "1 of 30 rows" in report.failures[0].reason
    with pytest.raises(DatasetValidationError, match="NaN") as exc:
        validate_dataset(root, REPO, GOOD)
    assert exc.value.field == field


def test_decreasing_timestamp_fails(good_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "ts"
    shutil.copytree(good_root, root)
    _corrupt(root, "timestamp", row=5, value=0.05, element=None)  # frame 5 of episode 0 goes back in time
    report = validate_dataset(root, REPO, GOOD, raise_on_error=False)
    assert [f.field for f in report.failures] == ["dataset.timestamp"]


def test_video_cameras_fail_without_torchcodec(good_root: Path, tmp_path: Path, without_torchcodec) -> None:
    root = tmp_path / "video"
    shutil.copytree(good_root, root)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["observation.images.wrist"]["dtype"] = "video"
    info_path.write_text(json.dumps(info))
    with pytest.raises(DatasetValidationError, match="torchcodec") as exc:
        validate_dataset(root, REPO, GOOD)
    assert exc.value.field == "dataset.video_cameras" and "wrist" in str(exc.value)


@pytest.mark.parametrize("kind", ["missing", "empty", "plain"])
def test_not_a_dataset_fails_clearly(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "notds"
    if kind != "missing":
        root.mkdir()
    if kind == "plain":
        (root / "data.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DatasetValidationError) as exc:
        validate_dataset(root, REPO, GOOD)
    assert exc.value.field == "dataset.root"
    assert str(root) in str(exc.value)
    report = validate_dataset(root, REPO, GOOD, raise_on_error=False)
    assert not report.ok and report.checked_rows == 0


def test_report_summary_lists_one_line_per_failure() -> None:
    report = ValidationReport(
        ok=False,
        failures=(ValidationFailure("dataset.cameras", "missing 'top'"), ValidationFailure("dataset.action", "NaN")),
        checked_rows=3,
    )
    assert report.summary() == "dataset.cameras: missing 'top'\ndataset.action: NaN"
    err = DatasetValidationError(report)
    assert err.field == "dataset.cameras" and err.report is report


def test_frames_that_are_not_the_size_info_json_declares_are_refused_naming_both(tmp_path: Path) -> None:
    """Issue 41.6: a dataset whose info.json declares 16x20 while its frames hold 24x24 passed
    validation; the first frame of each camera is read and compared with what info.json says."""
    root = write_synthetic_dataset(tmp_path / "liar", REPO, cameras=GOOD.cameras, image_size=(24, 24), state_dim=3,
                                   action_dim=2, num_episodes=1, episode_length=4)  # fmt: skip
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    for camera in GOOD.cameras:
        feature = info["features"][f"observation.images.{camera}"]
        names = [str(n).lower() for n in feature.get("names") or []]
        feature["shape"] = [3, 16, 20] if names[:1] in (["channel"], ["channels"]) else [16, 20, 3]
    info_path.write_text(json.dumps(info))
    report = validate_dataset(root, REPO, GOOD, raise_on_error=False)
    lying = [f for f in report.failures if f.field == "dataset.image_size"]
    assert len(lying) == 2, report.failures
    assert "declares 16x20" in lying[0].reason and "is 24x24" in lying[0].reason and "row 0" in lying[0].reason
