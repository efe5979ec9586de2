"""Validate a tenant's LeRobot dataset against what a post-training job expects.

Two stages:
1. schema checks from the LeRobot metadata (cameras, image shapes, state/action dims,
   video cameras only where this machine can decode them) — cheap and they explain most
   tenant mistakes;
2. data checks on the frames with Great Expectations 1.x (pandas, ephemeral context):
   finite state/action vectors of the expected length, non-null indices and timestamps
   that never go backwards within an episode.

Failures carry spec-facing field names ("dataset.action_dim", "dataset.cameras",
"dataset.observation.state", ...) so callers can point the tenant at the right knob.
"""

from __future__ import annotations

import io
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pandas as pd

from joynexus.data.lerobot_dataset import (
    ACTION_KEY,
    STATE_KEY,
    VIDEO_UNSUPPORTED_MSG,
    DatasetInfo,
    NotALeRobotDatasetError,
    inspect_dataset,
)

logger = logging.getLogger(__name__)

# Index/time columns every LeRobot v3.0 frame table carries.
_INDEX_COLUMNS = ("episode_index", "frame_index", "timestamp")


@dataclass(frozen=True)
class DatasetExpectation:
    cameras: tuple[str, ...]
    image_size: tuple[int, int] | None  # (H, W); None = any
    state_dim: int
    action_dim: int


@dataclass(frozen=True)
class ValidationFailure:
    field: str
    reason: str


@dataclass(frozen=True)
class ValidationReport:
    ok: bool
    failures: tuple[ValidationFailure, ...]
    checked_rows: int

    def summary(self) -> str:
        """One line per failure, ``field: reason``; a single OK line when there are none."""
        if not self.failures:
            return f"dataset OK ({self.checked_rows} rows checked)"
        return "\n".join(f"{f.field}: {f.reason}" for f in self.failures)


class DatasetValidationError(ValueError):
    def __init__(self, report: ValidationReport) -> None:
        super().__init__(report.summary())
        self.report = report
        self.field = report.failures[0].field if report.failures else None


# --------------------------------------------------------------------------------------
# Schema checks (metadata only)
# --------------------------------------------------------------------------------------


def _schema_failures(info: DatasetInfo, exp: DatasetExpectation) -> list[ValidationFailure]:
    out: list[ValidationFailure] = []
    missing = [c for c in exp.cameras if c not in info.cameras]
    if missing:
        out.append(
            ValidationFailure(
                "dataset.cameras",
                f"missing camera(s) {missing}; dataset has {list(info.cameras)}",
            )
        )
    if exp.image_size is not None:
        want_h, want_w = exp.image_size
        for cam in exp.cameras:
            if cam not in info.image_shapes:
                continue
            _, h, w = info.image_shapes[cam]
            if (h, w) != (want_h, want_w):
                out.append(
                    ValidationFailure(
                        "dataset.image_size",
                        f"camera {cam!r} is {h}x{w} (HxW), expected {want_h}x{want_w}",
                    )
                )
    for cam in info.image_shapes:
        c = info.image_shapes[cam][0]
        if cam in exp.cameras and c != 3:
            out.append(ValidationFailure("dataset.image_size", f"camera {cam!r} has {c} channels, expected 3 (RGB)"))
    # A video key this machine cannot decode (no torchcodec / FFmpeg) blocks reading: lerobot
    # decodes every video key per frame, requested or not.
    video = list(info.undecodable_video_cameras)
    if video:
        out.append(
            ValidationFailure("dataset.video_cameras", f"cameras {video} are stored as video; {VIDEO_UNSUPPORTED_MSG}")
        )
    if info.state_dim is None:
        out.append(ValidationFailure("dataset.state_dim", f"dataset has no {STATE_KEY!r} feature"))
    elif info.state_dim != exp.state_dim:
        out.append(
            ValidationFailure("dataset.state_dim", f"{STATE_KEY} has dim {info.state_dim}, expected {exp.state_dim}")
        )
    if info.action_dim is None:
        out.append(ValidationFailure("dataset.action_dim", f"dataset has no {ACTION_KEY!r} feature"))
    elif info.action_dim != exp.action_dim:
        out.append(
            ValidationFailure(
                "dataset.action_dim", f"{ACTION_KEY} has dim {info.action_dim}, expected {exp.action_dim}"
            )
        )
    if info.num_frames == 0:
        out.append(ValidationFailure("dataset.num_frames", "dataset has no frames"))
    return out


# --------------------------------------------------------------------------------------
# Data checks (Great Expectations on the frame table)
# --------------------------------------------------------------------------------------


def _frame_image_failures(root: Path, info: DatasetInfo, exp: DatasetExpectation) -> list[ValidationFailure]:
    """The first stored frame of each expected image camera against what info.json declares: a
    dataset whose metadata says 32 px and whose frames hold 48 px passed every other check, and
    only training found out. One PNG per camera is decoded (video cameras are not read here)."""
    import pyarrow.parquet as pq
    from PIL import Image, UnidentifiedImageError

    files = sorted((root / "data").rglob("*.parquet"))
    cameras = [c for c in exp.cameras if c in info.image_shapes and c not in info.stored_as_video]
    if not files or not cameras:
        return []
    first = files[0]
    shown = first.relative_to(root).as_posix()
    names = set(pq.read_schema(first).names)
    out = []
    for camera in cameras:
        column = f"observation.images.{camera}"
        if column not in names:
            out.append(ValidationFailure("dataset.cameras", f"camera {camera!r}: {shown} has no column {column!r}"))
            continue
        cell = pq.read_table(first, columns=[column]).slice(0, 1).to_pylist()
        data = (cell[0][column] or {}).get("bytes") if cell and isinstance(cell[0][column], dict) else None
        if not data:
            continue  # stored by path (not embedded): lerobot reads it from there
        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                channels = len(image.getbands())
        except (UnidentifiedImageError, OSError) as error:
            reason = f"camera {camera!r}: {shown} row 0 is not an image ({error})"
            out.append(ValidationFailure("dataset.image_size", reason))
            continue
        declared = info.image_shapes[camera]
        if (channels, height, width) != tuple(declared):
            out.append(
                ValidationFailure(
                    "dataset.image_size",
                    f"camera {camera!r}: meta/info.json declares {declared[1]}x{declared[2]} (HxW) with {declared[0]} "
                    f"channels, but its first frame ({shown}, row 0) is {height}x{width} with {channels}",
                )
            )
    return out


def _read_frames(root: Path) -> pd.DataFrame:
    """Frame table without image columns (they are large PNG blobs we do not need here)."""
    import pyarrow.parquet as pq

    files = sorted((root / "data").rglob("*.parquet"))
    if not files:
        raise NotALeRobotDatasetError(f"{root} has no frame data: no parquet files under {root / 'data'}")
    wanted = (STATE_KEY, ACTION_KEY, *_INDEX_COLUMNS)
    frames = []
    for f in files:
        names = set(pq.read_schema(f).names)
        frames.append(pq.read_table(f, columns=[c for c in wanted if c in names]).to_pandas())
    return pd.concat(frames, ignore_index=True)


def _vector_columns(df: pd.DataFrame, key: str, prefix: str) -> pd.DataFrame:
    """Per-row ``<prefix>_len`` / ``<prefix>_finite`` columns.

    GE length expectations on list-valued columns mark every row unexpected (GE 1.24), so we
    validate derived scalar columns instead.
    """
    if key not in df.columns:
        return pd.DataFrame(index=df.index)

    def _len(v: Any) -> float:
        # NaN (not -1) for a missing vector so the not-null check names it as missing.
        return float("nan") if v is None else float(len(v))

    def _finite(v: Any) -> bool:
        if v is None:
            return False
        arr = np.asarray(v, dtype=np.float64)
        return bool(np.isfinite(arr).all())

    col = df[key]
    return pd.DataFrame({f"{prefix}_len": col.map(_len), f"{prefix}_finite": col.map(_finite)}, index=df.index)


def _derived_frame(df: pd.DataFrame) -> pd.DataFrame:
    parts = [
        _vector_columns(df, STATE_KEY, "state"),
        _vector_columns(df, ACTION_KEY, "action"),
        df[[c for c in _INDEX_COLUMNS if c in df.columns]],
    ]
    out = pd.concat(parts, axis=1)
    if {"episode_index", "frame_index", "timestamp"} <= set(df.columns):
        # Order by (episode, frame) so "non-decreasing within an episode" is a diff per group.
        ordered = df.sort_values(["episode_index", "frame_index"], kind="stable")
        step = ordered.groupby("episode_index", sort=False)["timestamp"].diff()
        out["timestamp_monotonic"] = (step.isna() | (step >= 0)).reindex(df.index)
    return out


# column -> spec-facing field name
_FIELD_OF_COLUMN = {
    "state_len": f"dataset.{STATE_KEY}",
    "state_finite": f"dataset.{STATE_KEY}",
    "action_len": f"dataset.{ACTION_KEY}",
    "action_finite": f"dataset.{ACTION_KEY}",
    "episode_index": "dataset.episode_index",
    "frame_index": "dataset.frame_index",
    "timestamp": "dataset.timestamp",
    "timestamp_monotonic": "dataset.timestamp",
}


def _quiet_gx() -> ModuleType:
    # No usage statistics, no progress bars; GE logs a lot at INFO.
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import great_expectations as gx
    return gx


def _gx_failures(derived: pd.DataFrame, exp: DatasetExpectation) -> list[ValidationFailure]:
    gx = _quiet_gx()
    gxe = gx.expectations

    def why(reason: str) -> dict[str, str]:
        # The human reason travels with the expectation and comes back on its result.
        return {"reason": reason}

    expectations: list[Any] = []
    for col, dim, what in (("state", exp.state_dim, STATE_KEY), ("action", exp.action_dim, ACTION_KEY)):
        if f"{col}_len" not in derived.columns:
            continue
        expectations += [
            gxe.ExpectColumnValuesToNotBeNull(column=f"{col}_len", meta=why(f"{what} is missing")),
            gxe.ExpectColumnValuesToBeBetween(
                column=f"{col}_len",
                min_value=dim,
                max_value=dim,
                meta=why(f"{what} vector length differs from the expected {dim}"),
            ),
            gxe.ExpectColumnValuesToBeInSet(
                column=f"{col}_finite", value_set=[True], meta=why(f"{what} has NaN/inf values")
            ),
        ]
    for col in _INDEX_COLUMNS:
        if col in derived.columns:
            expectations.append(gxe.ExpectColumnValuesToNotBeNull(column=col, meta=why(f"{col} has null values")))
    if "timestamp_monotonic" in derived.columns:
        expectations.append(
            gxe.ExpectColumnValuesToBeInSet(
                column="timestamp_monotonic", value_set=[True], meta=why("timestamp decreases within an episode")
            )
        )

    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    # Ephemeral, in-memory stores, no data docs, no analytics, no tqdm bars per validation.
    config = DataContextConfig(
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False, metric_calculations=False),
        store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
    )
    context = gx.get_context(mode="ephemeral", project_config=config)
    source = context.data_sources.add_pandas(name="joynexus_frames")
    asset = source.add_dataframe_asset(name="frames")
    batch_def = asset.add_batch_definition_whole_dataframe("all_frames")
    suite = gx.ExpectationSuite(name="joynexus_dataset")
    for expectation in expectations:
        suite.add_expectation(expectation)
    batch = batch_def.get_batch(batch_parameters={"dataframe": derived})
    result = batch.validate(suite, result_format="SUMMARY")

    out: list[ValidationFailure] = []
    for res in result.results:
        if res.success:
            continue
        cfg = res.expectation_config
        column = cfg.kwargs.get("column", "?")
        field = _FIELD_OF_COLUMN.get(column, f"dataset.{column}")
        if res.exception_info and res.exception_info.get("raised_exception"):
            out.append(
                ValidationFailure(
                    field, f"check {cfg.type} on {column} errored: {res.exception_info.get('exception_message')}"
                )
            )
            continue
        stats = res.result or {}
        n_bad = stats.get("unexpected_count")
        sample = stats.get("partial_unexpected_index_list") or []
        detail = f" ({n_bad} of {stats.get('element_count', len(derived))} rows"
        detail += f", e.g. rows {list(sample)[:5]})" if sample else ")"
        reason = (cfg.meta or {}).get("reason") or f"{cfg.type} failed on {column}"
        out.append(ValidationFailure(field, reason + detail))
    return out


def validate_dataset(
    root: str | Path,
    repo_id: str,
    expectation: DatasetExpectation,
    *,
    raise_on_error: bool = True,
) -> ValidationReport:
    """Validate the LeRobot dataset at ``root`` against ``expectation``.

    Raises :class:`DatasetValidationError` (a ``ValueError``) on failure unless
    ``raise_on_error`` is False, in which case the report has ``ok=False``.
    """
    root = Path(root)
    t0 = time.perf_counter()
    failures: list[ValidationFailure] = []
    rows = 0
    try:
        info = inspect_dataset(root, repo_id)
    except NotALeRobotDatasetError as exc:
        failures.append(ValidationFailure("dataset.root", str(exc)))
    else:
        failures.extend(_schema_failures(info, expectation))
        failures.extend(_frame_image_failures(root, info, expectation))
        try:
            frames = _read_frames(root)
        except (NotALeRobotDatasetError, OSError, ValueError) as exc:
            failures.append(ValidationFailure("dataset.data", f"cannot read frames: {exc}"))
        else:
            rows = len(frames)
            for key, field in ((STATE_KEY, "dataset.state_dim"), (ACTION_KEY, "dataset.action_dim")):
                if key not in frames.columns and not any(f.field == field for f in failures):
                    failures.append(ValidationFailure(f"dataset.{key}", f"frame data has no {key!r} column"))
            if rows:
                failures.extend(_gx_failures(_derived_frame(frames), expectation))
    report = ValidationReport(ok=not failures, failures=tuple(failures), checked_rows=rows)
    logger.debug("validated %s in %.2fs: %s", root, time.perf_counter() - t0, report.summary())
    if failures and raise_on_error:
        raise DatasetValidationError(report)
    return report
