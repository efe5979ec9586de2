"""Decision-grade evaluation reports: an evaluation suite (several tasks or seeds in one declaration),
each entry's success with its 95% Wilson interval (`evaluation_stats`), every episode's record, and
rollout videos (mp4 from the simulator's renderer) for a sample of episodes, all logged to the
evaluation's MLflow run:

* ``evaluation/episodes.json`` -- one row per episode (MLflow table: entry, task, seed, episode,
  return, length, success, video);
* ``evaluation/summary.json`` -- per entry and pooled: episodes, successes, success rate, interval,
  mean return / length;
* ``evaluation/videos/<entry>-episode<j>.mp4`` -- the first `videos` episodes of every entry.

A suite entry is a partial environment (e.g. ``{"task": "PushT-v0"}`` or ``{"seed": 7}``) laid over
the tenant's declared environment; an evaluation without a suite is the one entry of the tenant's own.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from joynexus.core.tenants import TenantBackendConfig
from joynexus.services.producers.evaluation_stats import wilson_interval

if TYPE_CHECKING:  # evaluation.py runs suites through this module: no import back at run time
    from joynexus.services.producers.evaluation import EvaluationResult

__all__ = [
    "EPISODES_TABLE",
    "MAX_SUITE_ENTRIES",
    "MAX_VIDEOS",
    "SuiteReport",
    "check_suite",
    "log_report",
    "run_suite",
    "write_video",
]

MAX_SUITE_ENTRIES = 16
MAX_VIDEOS = 8  # per suite entry: each frame is rendered and shipped from the simulator's worker
EPISODES_TABLE = "evaluation/episodes.json"
SUMMARY_FILE = "evaluation/summary.json"
VIDEO_DIR = "evaluation/videos"
VIDEO_FPS = 10


def check_suite(suite: Any, videos: Any) -> list[dict[str, Any]]:
    """The suite's entries (partial environments), checked: ValueError("suite...: reason")."""
    if isinstance(videos, bool) or not isinstance(videos, int) or not 0 <= videos <= MAX_VIDEOS:
        raise ValueError(f"videos: expected an int in 0..{MAX_VIDEOS} (episodes recorded per entry), got {videos!r}")
    if suite is None:
        return [{}]
    if not isinstance(suite, list) or not 1 <= len(suite) <= MAX_SUITE_ENTRIES:
        raise ValueError(f"suite: expected 1..{MAX_SUITE_ENTRIES} entries (partial environments), got {suite!r}"[:300])
    for i, entry in enumerate(suite):
        if not isinstance(entry, dict) or not entry:
            raise ValueError(f"suite[{i}]: expected a non-empty mapping of environment fields, got {entry!r}"[:300])
    return [dict(entry) for entry in suite]


def entry_label(config: TenantBackendConfig) -> str:
    env = config.environment
    assert env is not None
    return f"{env.task}@seed{env.seed}"


def write_video(frames: list[np.ndarray], path: Path, fps: int = VIDEO_FPS) -> Path:
    """Frames (H, W, 3) uint8 as an H.264 mp4 (imageio's ffmpeg writer)."""
    import imageio.v2 as imageio

    if not frames:
        raise ValueError(f"{path.name}: no frames to write")
    with imageio.get_writer(path, fps=fps, codec="libx264", macro_block_size=1, ffmpeg_log_level="error") as writer:
        for frame in frames:
            writer.append_data(np.asarray(frame, dtype=np.uint8))
    return path


@dataclass
class SuiteReport:
    """The results of every entry of a suite at one policy version, and the recorded videos."""

    entries: list[tuple[str, EvaluationResult]]
    videos: dict[tuple[int, int], Path] = field(default_factory=dict)  # (entry, episode) -> mp4

    def episode_records(self) -> list[dict[str, Any]]:
        rows = []
        for e, (label, result) in enumerate(self.entries):
            for j in range(result.episodes):
                video = self.videos.get((e, j))
                rows.append(
                    {
                        "entry": label, "task": result.task, "seed": result.seeds[j], "episode": j,
                        "return": result.returns[j], "length": result.lengths[j], "success": result.successes[j],
                        "video": f"{VIDEO_DIR}/{video.name}" if video is not None else "",
                    }
                )  # fmt: skip
        return rows

    def summary(self) -> dict[str, Any]:
        """The pooled result (every entry's episodes together) at the top level -- the fields of an
        `EvaluationResult` plus its interval -- and one row per entry under ``suite``."""
        rows = [_entry_row(label, result) for label, result in self.entries]
        first = self.entries[0][1]
        successes = [s for _, r in self.entries for s in r.successes]
        returns = [x for _, r in self.entries for x in r.returns]
        lengths = [x for _, r in self.entries for x in r.lengths]
        low, high = wilson_interval(sum(successes), len(successes))
        return {
            "tenant_id": first.tenant_id, "policy_version": first.policy_version,
            "simulator": first.simulator, "task": first.task if len(self.entries) == 1 else "suite",
            "episodes": len(successes), "successes": int(sum(successes)),
            "success_rate": float(np.mean(successes)), "success_ci_low": low, "success_ci_high": high,
            "mean_return": float(np.mean(returns)), "mean_length": float(np.mean(lengths)),
            "returns": returns, "suite": rows,
            "videos": [f"{VIDEO_DIR}/{path.name}" for path in self.videos.values()],
        }  # fmt: skip


def _entry_row(label: str, result: EvaluationResult) -> dict[str, Any]:
    low, high = result.success_ci
    return {
        "entry": label, "task": result.task, "episodes": result.episodes, "successes": int(sum(result.successes)),
        "success_rate": result.success_rate, "success_ci_low": low, "success_ci_high": high,
        "mean_return": result.mean_return, "mean_length": result.mean_length,
    }  # fmt: skip


def run_suite(
    configs: list[TenantBackendConfig],
    environment: Any,
    inference: Any,
    *,
    version: int,
    episodes: int,
    videos: int,
    video_dir: Path,
    evaluate: Callable[..., EvaluationResult],
) -> SuiteReport:
    """Every entry's `episodes` episodes at ONE `version` through `evaluate` (`evaluate_policy`,
    seeded by episode index: two versions see the same episodes), the first `videos` of each
    recorded to `video_dir`."""
    report = SuiteReport(entries=[])
    for e, config in enumerate(configs):
        label = entry_label(config)

        def save(episode: int, frames: list[np.ndarray], e: int = e, label: str = label) -> None:
            name = f"{e:02d}-{label.replace('/', '_')}-episode{episode}.mp4"
            report.videos[(e, episode)] = write_video(frames, video_dir / name)

        result = evaluate(
            config, environment, inference, version=version, episodes=episodes, videos=videos,
            on_video=save if videos else None,
        )  # fmt: skip
        report.entries.append((label, result))
    return report


def log_report(tracker: Any, run_id: str, report: SuiteReport) -> dict[str, Any]:
    """The report's episode table, summary and videos as artifacts of the MLflow run; its summary."""
    summary = report.summary()
    records = report.episode_records()
    client = tracker.client
    columns = list(records[0]) if records else []
    client.log_table(run_id, data={c: [row[c] for row in records] for c in columns}, artifact_file=EPISODES_TABLE)
    client.log_dict(run_id, summary, SUMMARY_FILE)
    for path in report.videos.values():
        client.log_artifact(run_id, str(path), VIDEO_DIR)
    return summary


def video_workdir() -> tempfile.TemporaryDirectory:
    """Where an evaluation writes its mp4s before they are logged (removed after)."""
    return tempfile.TemporaryDirectory(prefix="joynexus-eval-videos-")
