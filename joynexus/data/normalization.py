"""Per-tenant normalization of state and actions, with LeRobot's modes and defaults.

LeRobot (0.4.4, ``lerobot.configs.types``) normalizes each feature by its type: ``VISUAL`` images,
the robot ``STATE`` and the ``ACTION``, each with a ``NormalizationMode``; its policies default to
VISUAL: IDENTITY, STATE: MEAN_STD, ACTION: MEAN_STD. The statistics come from the dataset's
``meta/stats.json`` (per feature ``mean``/``std``/``min``/``max``); a dataset without one has them
computed here from its parquet frames and cached outside the dataset, keyed by its content.

A tenant's `Normalizer` (modes + the statistics it uses) is compiled into its backend config, so it
travels with every version: the SFT producer normalizes the demonstrations it queues, the Inference
Model Service normalizes incoming state and un-normalizes actions (predict, stream, evaluations),
checkpoints hold it as ``normalization.json`` beside the weights, exports carry it and the MLflow
registry tags it. RL tenants act in the unit range mapped onto the simulator's action bounds, which
is MIN_MAX with the simulator's bounds (`for_simulator`); the rollout applies it, not the service.

Formulas are LeRobot's: MEAN_STD ``(x - mean) / (std + eps)``; MIN_MAX ``2 (x - min) / (max - min + eps) - 1``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

STATE_KEY = "observation.state"  # the LeRobot feature keys (as in joynexus.data.lerobot_dataset)
ACTION_KEY = "action"
EPS = 1e-8  # LeRobot's epsilon in both formulas
QUANTILE_EPS = 1e-8  # LeRobot's NormalizerProcessorStep eps, used only for an empty quantile range
STATS_FILE = "stats.json"  # in a dataset's meta/ folder, and in the cache
NORMALIZATION_FILE = "normalization.json"  # beside a checkpoint's / export's weights
STATS_CACHE_ENV = "JOYNEXUS_STATS_CACHE"  # where computed statistics are cached (default: beside the dataset)
STATS_CACHE_DIRNAME = ".joynexus-stats"
SIMULATOR_BOUNDS_SOURCE = "simulator-bounds"  # an RL tenant's: applied by the rollout, not the Inference Service


class NormalizationMode(StrEnum):
    """LeRobot's modes (``lerobot.configs.types.NormalizationMode``) that JoyNexus applies."""

    MEAN_STD = "MEAN_STD"
    MIN_MAX = "MIN_MAX"
    IDENTITY = "IDENTITY"
    QUANTILES = "QUANTILES"  # [q01, q99] onto [-1, 1] (π0.5's default)
    QUANTILE10 = "QUANTILE10"  # [q10, q90] onto [-1, 1]


class FeatureType(StrEnum):
    """LeRobot's feature types that a tenant's spec can name (``lerobot.configs.types.FeatureType``)."""

    VISUAL = "VISUAL"
    STATE = "STATE"
    ACTION = "ACTION"


# LeRobot's policies' `normalization_mapping` default (ACT, Diffusion, SmolVLA, pi0 ...).
DEFAULT_MODES: dict[str, str] = {
    FeatureType.VISUAL.value: NormalizationMode.IDENTITY.value,
    FeatureType.STATE.value: NormalizationMode.MEAN_STD.value,
    FeatureType.ACTION.value: NormalizationMode.MEAN_STD.value,
}
FEATURE_KEYS = {FeatureType.STATE.value: STATE_KEY, FeatureType.ACTION.value: ACTION_KEY}
_NEEDED = {
    NormalizationMode.MEAN_STD.value: ("mean", "std"),
    NormalizationMode.MIN_MAX.value: ("min", "max"),
    NormalizationMode.QUANTILES.value: ("q01", "q99"),
    NormalizationMode.QUANTILE10.value: ("q10", "q90"),
}


class StatsError(ValueError):
    """A dataset's statistics are missing, malformed or do not fit the tenant's dimensions."""


def check_modes(mapping: Mapping[str, Any] | None) -> dict[str, str]:
    """The spec's ``normalization`` mapping completed with LeRobot's defaults; raise ValueError naming
    the bad feature type or mode. Names are case-insensitive (``action: min_max``)."""
    modes = dict(DEFAULT_MODES)
    for raw_type, raw_mode in (mapping or {}).items():
        feature = str(raw_type).upper()
        if feature not in DEFAULT_MODES:
            raise ValueError(f"unknown feature type {raw_type!r}; expected one of {sorted(DEFAULT_MODES)}")
        mode = str(raw_mode).upper() if isinstance(raw_mode, str) else raw_mode
        if mode not in _MODE_NAMES:
            raise ValueError(
                f"{feature}: unknown normalization mode {raw_mode!r}; expected one of {sorted(_MODE_NAMES)}"
            )
        if feature == FeatureType.VISUAL.value and mode != NormalizationMode.IDENTITY.value:
            raise ValueError(
                f"VISUAL: mode {raw_mode!r} is not supported; only IDENTITY (the backbone's image "
                "processor normalizes camera images)"
            )
        modes[feature] = mode
    return modes


_MODE_NAMES = {m.value for m in NormalizationMode}


@dataclass(frozen=True)
class Normalizer:
    """A tenant's normalization: the mode per feature type and the statistics of the features it
    normalizes (feature key -> {"mean", "std", "min", "max"} lists), with where they came from."""

    modes: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_MODES))
    stats: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    source: str = ""

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_stats(
        cls, modes: Mapping[str, str], stats: Mapping[str, Any], dims: Mapping[str, int], source: str = ""
    ) -> Normalizer:
        """Keep the statistics each non-IDENTITY feature needs; `dims`: feature type -> the tenant's
        dimension (0: the feature is not used). Raise StatsError naming the feature and what is wrong."""
        modes = check_modes(modes)
        kept: dict[str, dict[str, list[float]]] = {}
        for feature, key in FEATURE_KEYS.items():
            mode, dim = modes[feature], int(dims.get(feature, 0))
            if mode == NormalizationMode.IDENTITY.value or dim == 0:
                continue
            entry = stats.get(key)
            if not isinstance(entry, Mapping):
                raise StatsError(f"{key}: no statistics for {feature} ({mode} needs {list(_NEEDED[mode])})")
            kept[key] = {}
            for name in _NEEDED[mode]:
                if name not in entry:
                    raise StatsError(f"{key}: statistics lack {name!r}, which {mode} needs")
                values = np.asarray(entry[name], dtype=np.float64).reshape(-1)
                if values.shape != (dim,):
                    raise StatsError(f"{key}.{name}: {values.shape[0]} values, but the tenant's {feature} has {dim}")
                if not np.all(np.isfinite(values)):
                    raise StatsError(f"{key}.{name}: values must be finite")
                kept[key][name] = [float(v) for v in values]
        return cls(modes=modes, stats=kept, source=source)

    @classmethod
    def from_lerobot_checkpoint(cls, checkpoint: Any) -> Normalizer | None:
        """A LeRobot policy directory's processor statistics (``checkpoint``: what a kind's
        ``read_checkpoint`` returns: its config, stats, state_dim, action_dim) under its config's
        modes; None when it has no normalizer step."""
        if not checkpoint.stats:
            return None
        modes = {k: str(v) for k, v in (checkpoint.config.get("normalization_mapping") or {}).items()}
        dims = {"STATE": checkpoint.state_dim, "ACTION": checkpoint.action_dim}
        return cls.from_stats(modes, checkpoint.stats, dims, source="lerobot-processor")

    @classmethod
    def for_simulator(cls, action_low: Any, action_high: Any) -> Normalizer:
        """An RL tenant's: actions MIN_MAX over the simulator's action bounds (the unit range the
        policy acts in, `envs.base.unit_to_bounds`), state as the simulator reports it."""
        low = [float(v) for v in np.asarray(action_low, dtype=np.float64).reshape(-1)]
        high = [float(v) for v in np.asarray(action_high, dtype=np.float64).reshape(-1)]
        modes = {**DEFAULT_MODES, FeatureType.STATE.value: "IDENTITY", FeatureType.ACTION.value: "MIN_MAX"}
        return cls(modes=modes, stats={ACTION_KEY: {"min": low, "max": high}}, source=SIMULATOR_BOUNDS_SOURCE)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Normalizer | None:
        if not data:
            return None
        return cls(
            modes=dict(data["modes"]),
            stats={k: dict(v) for k, v in data["stats"].items()},
            source=str(data.get("source", "")),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"modes": dict(self.modes), "stats": {k: dict(v) for k, v in self.stats.items()}, "source": self.source}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)

    def tags(self) -> dict[str, str]:
        """MLflow tags: the modes and where the statistics came from (the full statistics are in
        the version's normalization.json)."""
        tags = {f"normalization.{feature.lower()}": mode for feature, mode in sorted(self.modes.items())}
        tags["normalization.source"] = self.source or "none"
        return tags

    # -- application ---------------------------------------------------------------------------
    def _apply(self, feature: str, x: Any, inverse: bool) -> np.ndarray:
        arr = np.asarray(x, dtype=np.float32)
        key = FEATURE_KEYS[feature]
        mode = self.modes.get(feature, NormalizationMode.IDENTITY.value)
        if mode == NormalizationMode.IDENTITY.value or key not in self.stats or arr.shape[-1:] == (0,):
            return arr
        s = self.stats[key]
        if mode == NormalizationMode.MEAN_STD.value:
            shift, scale = np.asarray(s["mean"]), np.asarray(s["std"]) + EPS
        elif mode == NormalizationMode.MIN_MAX.value:  # onto [-1, 1]
            low, high = np.asarray(s["min"]), np.asarray(s["max"])
            shift, scale = (low + high) / 2.0, (high - low + EPS) / 2.0
        else:  # a quantile range onto [-1, 1], LeRobot's: eps only where the range is empty
            low, high = (np.asarray(s[name]) for name in _NEEDED[mode])
            span = np.where(high - low == 0, QUANTILE_EPS, high - low)
            shift, scale = low + span / 2.0, span / 2.0
        if arr.shape[-1] != shift.shape[0]:
            raise ValueError(f"{key}: last dimension {arr.shape[-1]}, but the statistics have {shift.shape[0]}")
        out = arr * scale + shift if inverse else (arr - shift) / scale
        return out.astype(np.float32)

    def normalize_state(self, state: Any) -> np.ndarray:
        return self._apply(FeatureType.STATE.value, state, inverse=False)

    def normalize_action(self, action: Any) -> np.ndarray:
        return self._apply(FeatureType.ACTION.value, action, inverse=False)

    def unnormalize_action(self, action: Any) -> np.ndarray:
        return self._apply(FeatureType.ACTION.value, action, inverse=True)


# --------------------------------------------------------------------------------------
# Dataset statistics: meta/stats.json, or computed and cached
# --------------------------------------------------------------------------------------


def dataset_digest(root: str | Path) -> str:
    """A content key of a LeRobot dataset's frames: sha256 over meta/info.json and its data/ files."""
    root = Path(root)
    digest = hashlib.sha256()
    files = [root / "meta" / "info.json", *sorted((root / "data").rglob("*.parquet"))]
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def compute_stats(root: str | Path) -> dict[str, dict[str, list[float]]]:
    """mean / std / min / max / count of the dataset's state and action over every frame (the
    parquet columns LeRobot writes), in stats.json's layout."""
    import pyarrow.parquet as pq

    root = Path(root)
    files = sorted((root / "data").rglob("*.parquet"))
    if not files:
        raise StatsError(f"{root}: no parquet frames under data/ to compute statistics from")
    columns: dict[str, list[np.ndarray]] = {STATE_KEY: [], ACTION_KEY: []}
    for path in files:
        table = pq.read_table(path, columns=[c for c in columns if c in pq.read_schema(path).names])
        for key in columns:
            if key in table.column_names:
                columns[key].append(np.asarray(table.column(key).to_pylist(), dtype=np.float64))
    stats: dict[str, dict[str, list[float]]] = {}
    for key, parts in columns.items():
        if not parts:
            continue
        values = np.concatenate(parts).reshape(sum(len(p) for p in parts), -1)
        stats[key] = {
            "mean": values.mean(axis=0).tolist(),
            "std": values.std(axis=0).tolist(),
            "min": values.min(axis=0).tolist(),
            "max": values.max(axis=0).tolist(),
            **{f"q{q:02d}": np.quantile(values, q / 100, axis=0).tolist() for q in (1, 10, 90, 99)},
            "count": [int(values.shape[0])],
        }
    return stats


def stats_cache_dir(root: str | Path) -> Path:
    """Where computed statistics of the dataset at `root` are cached: $JOYNEXUS_STATS_CACHE, or a
    `.joynexus-stats` folder beside the dataset (never inside it: datasets may be read-only)."""
    configured = os.environ.get(STATS_CACHE_ENV)
    return Path(configured) if configured else Path(root).resolve().parent / STATS_CACHE_DIRNAME


def load_dataset_stats(root: str | Path, cache_dir: str | Path | None = None) -> tuple[dict[str, Any], str]:
    """The dataset's statistics and their source: ``meta/stats.json`` when present, else computed
    from the frames and cached under `cache_dir` (default `stats_cache_dir`) by content digest."""
    root = Path(root)
    path = root / "meta" / STATS_FILE
    if path.is_file():
        try:
            return json.loads(path.read_text()), "meta/stats.json"
        except (OSError, ValueError) as exc:
            raise StatsError(f"{path}: unreadable statistics: {exc}") from exc
    key = dataset_digest(root)
    cached = Path(cache_dir or stats_cache_dir(root)) / key / STATS_FILE
    if cached.is_file():
        return json.loads(cached.read_text()), f"computed:{key[:16]}"
    stats = compute_stats(root)
    try:  # atomic publish, so concurrent tenant creations never read half a file
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stats, allow_nan=False))
        tmp.replace(cached)
    except OSError as exc:  # a read-only place: use the statistics uncached
        log.warning("cannot cache dataset statistics at %s: %s", cached, exc)
    return stats, f"computed:{key[:16]}"


def dataset_normalizer(
    root: str | Path,
    modes: Mapping[str, str] | None,
    state_dim: int,
    action_dim: int,
    cache_dir: str | Path | None = None,
) -> Normalizer:
    """A tenant's normalizer from its dataset's statistics (see `load_dataset_stats`)."""
    modes = check_modes(modes)
    dims = {FeatureType.STATE.value: state_dim, FeatureType.ACTION.value: action_dim}
    if all(modes[f] == NormalizationMode.IDENTITY.value or dims[f] == 0 for f in dims):
        return Normalizer(modes=modes, stats={}, source="identity")
    stats, source = load_dataset_stats(root, cache_dir)
    return Normalizer.from_stats(modes, stats, dims, source)
