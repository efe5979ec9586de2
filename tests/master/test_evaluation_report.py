"""Decision-grade evaluation: a suite (several seeds or tasks in one declaration) reports each
entry's and the pooled success with a 95% Wilson interval, every episode's record and mp4 videos
from the simulator's renderer as MLflow artifacts; the champion rule compares the candidate's
interval lower bound with the champion's success rate."""

from __future__ import annotations

import json
from pathlib import Path

import imageio.v2 as imageio
import pytest

from joynexus.master.deployment import Deployment
from joynexus.master.workloads.manager import WorkloadManager
from joynexus.registry import CHAMPION_ALIAS
from joynexus.services.producers.evaluation_stats import SUCCESS_CI_LOW_METRIC, wilson_interval
from joynexus.settings import Settings
from tests.services.test_rl_loop import rl_spec
from tests.test_promotion import evaluate, register


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    """One in-process deployment for the module (each test uses its own tenant)."""
    deployment = Deployment.in_process(Settings(data_dir=tmp_path_factory.mktemp("data"), torch_threads=1))
    yield deployment
    deployment.shutdown()


@pytest.mark.parametrize(
    ("successes", "trials", "low", "high"),
    # Reference values: Wilson score intervals at z = 1.96 (e.g. Newcombe 1998, table I).
    [(0, 4, 0.0, 0.4899), (4, 4, 0.5101, 1.0), (5, 10, 0.2366, 0.7634), (81, 263, 0.2553, 0.3662), (0, 0, 0.0, 1.0)],
)
def test_wilson_interval_matches_reference_values(successes, trials, low, high):
    got = wilson_interval(successes, trials)
    assert got == pytest.approx((low, high), abs=1e-4)


def test_wilson_interval_refuses_impossible_counts():
    with pytest.raises(ValueError, match="successes/trials"):
        wilson_interval(5, 4)


def short_spec(tenant: str) -> dict:
    spec = rl_spec(tenant)
    spec["environment"]["max_episode_steps"] = 4
    return spec


def test_an_evaluation_suite_logs_intervals_episode_records_and_videos(dep, tmp_path):
    dep.creator.create(short_spec("judge"))
    manager = WorkloadManager(dep).start()
    try:
        info = manager.evaluate("judge", episodes=2, suite=[{"seed": 1}, {"seed": 2}], videos=1)
        status = manager.wait(info.workload_id, timeout_s=300)
    finally:
        manager.stop()
    assert status.state == "completed", status.error
    result = status.result
    assert result["episodes"] == 4 and [row["entry"] for row in result["suite"]] == [
        "PushT-v0@seed1",
        "PushT-v0@seed2",
    ]
    for row in [result, *result["suite"]]:
        assert 0.0 <= row["success_ci_low"] <= row["success_rate"] <= row["success_ci_high"] <= 1.0
        assert row["success_ci_high"] - row["success_ci_low"] > 0.3  # 2-4 episodes: a wide interval
    run_id = status.run_id
    client = dep.tracker.client
    metrics = client.get_run(run_id).data.metrics
    assert metrics[SUCCESS_CI_LOW_METRIC] == pytest.approx(result["success_ci_low"])
    table = Path(client.download_artifacts(run_id, "evaluation/episodes.json", str(tmp_path)))
    episodes = json.loads(table.read_text())
    rows = [dict(zip(episodes["columns"], values, strict=True)) for values in episodes["data"]]
    # Seeds follow the entry's environment seed + the evaluation offset + the episode index.
    assert [(r["entry"], r["seed"], r["episode"]) for r in rows] == [
        ("PushT-v0@seed1", 10_001, 0), ("PushT-v0@seed1", 10_002, 1),
        ("PushT-v0@seed2", 10_002, 0), ("PushT-v0@seed2", 10_003, 1),
    ]  # fmt: skip
    videos = [r["video"] for r in rows if r["video"]]
    assert len(videos) == 2 and videos == result["videos"]
    for row in rows:
        if not row["video"]:
            continue
        local = client.download_artifacts(run_id, row["video"], str(tmp_path))
        frames = imageio.mimread(local)
        # The reset frame, then one per step: from the renderer (256 px), not the 32 px camera.
        assert len(frames) == row["length"] + 1 and frames[0].shape == (256, 256, 3)


def test_a_bad_suite_is_refused_naming_the_entry(dep):
    dep.creator.create(short_spec("judged"))
    manager = WorkloadManager(dep)
    with pytest.raises(ValueError, match=r"suite\[1\]\.environment\.task"):
        manager.evaluate("judged", suite=[{"seed": 1}, {"task": "NoSuchTask-v0"}])
    with pytest.raises(ValueError, match="videos"):
        manager.evaluate("judged", videos=99)


def test_the_champion_moves_only_when_the_candidates_lower_bound_beats_its_success_rate(dep):
    dep.creator.create(short_spec("ranked"))
    manager, tracker = WorkloadManager(dep), dep.tracker
    v1 = register(tracker, "ranked", 1)
    evaluate(tracker, "ranked", 1, success_rate=0.25, success_ci_low=0.05)
    assert manager.promote("ranked", v1, measure=False)["promoted"]
    # A higher mean from few episodes: its interval still reaches below the champion's rate.
    v2 = register(tracker, "ranked", 2)
    evaluate(tracker, "ranked", 2, success_rate=0.5, success_ci_low=0.15)
    decision = manager.promote("ranked", v2, measure=False)
    assert not decision["promoted"] and decision["metric"] == SUCCESS_CI_LOW_METRIC
    assert "eval/success_rate 0.25" in decision["reason"]
    assert tracker.alias_version("ranked", CHAMPION_ALIAS) == v1
    v3 = register(tracker, "ranked", 3)
    evaluate(tracker, "ranked", 3, success_rate=0.6, success_ci_low=0.3)
    decision = manager.promote("ranked", v3, measure=False)
    assert decision["promoted"] and decision["champion_value"] == 0.25
    assert tracker.alias_version("ranked", CHAMPION_ALIAS) == v3
