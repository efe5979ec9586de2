"""LeRobot v3.0 dataset writer / inspector / chunked demo source (lerobot 0.4.4, image mode)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before lerobot / huggingface_hub are imported

import numpy as np
import pandas as pd
import pytest

from joynexus.data.lerobot_dataset import (
    ACTION_KEY,
    CAMERA_KEY_PREFIX,
    STATE_KEY,
    LeRobotDemoSource,
    NotALeRobotDatasetError,
    VideoDatasetNotSupportedError,
    inspect_dataset,
    write_synthetic_dataset,
)

REPO = "tenant/demo"
CAMS = ("front", "wrist")
H, W = 24, 32
STATE_DIM, ACTION_DIM = 4, 3
EPISODES, LENGTH, FPS = 4, 12, 10
TASK = "pick up the red cube"
CHUNK = 5


@pytest.fixture(scope="module")
def ds_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lerobot") / "demo"
    out = write_synthetic_dataset(
        root,
        REPO,
        cameras=CAMS,
        image_size=(H, W),
        state_dim=STATE_DIM,
        action_dim=ACTION_DIM,
        num_episodes=EPISODES,
        episode_length=LENGTH,
        fps=FPS,
        task=TASK,
        seed=3,
    )
    assert out == root
    return root


@pytest.fixture(scope="module")
def raw_frames(ds_root: Path) -> pd.DataFrame:
    """The recorded frames straight from the parquet files (no lerobot involved)."""
    files = sorted((ds_root / "data").rglob("*.parquet"))
    cols = ["index", "episode_index", "frame_index", STATE_KEY, ACTION_KEY]
    df = pd.concat([pd.read_parquet(f, columns=cols) for f in files], ignore_index=True)
    return df.set_index("index").sort_index()


@pytest.fixture(scope="module")
def source(ds_root: Path) -> LeRobotDemoSource:
    return LeRobotDemoSource(ds_root, REPO, cameras=CAMS, action_chunk=CHUNK, seed=0)


def test_write_then_inspect(ds_root: Path) -> None:
    info = inspect_dataset(ds_root, REPO)
    assert info.repo_id == REPO
    assert info.root == ds_root
    assert info.fps == FPS
    assert info.num_episodes == EPISODES
    assert info.num_frames == EPISODES * LENGTH
    assert info.cameras == CAMS
    assert info.image_shapes == {c: (3, H, W) for c in CAMS}  # (C, H, W), like the tensors lerobot returns
    assert info.state_dim == STATE_DIM
    assert info.action_dim == ACTION_DIM
    assert info.undecodable_video_cameras == ()
    assert info.tasks == (TASK,)
    # repo_id is optional for inspection
    assert inspect_dataset(str(ds_root)).num_frames == EPISODES * LENGTH


def test_saved_dataset_reloads_in_fresh_lerobot_dataset(ds_root: Path) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset(REPO, root=ds_root, video_backend="pyav")
    assert len(ds) == EPISODES * LENGTH
    assert ds.meta.total_episodes == EPISODES
    item = ds[LENGTH + 2]
    assert item["episode_index"].item() == 1
    assert item["frame_index"].item() == 2
    assert item["task"] == TASK
    for cam in CAMS:
        img = item[CAMERA_KEY_PREFIX + cam]
        assert tuple(img.shape) == (3, H, W)
    assert tuple(item[STATE_KEY].shape) == (STATE_DIM,)
    assert tuple(item[ACTION_KEY].shape) == (ACTION_DIM,)
    assert item["timestamp"].item() == pytest.approx(2 / FPS)


@pytest.mark.parametrize(
    "override, arg",
    [
        ({"state_dim": 0}, "state_dim"),
        ({"action_dim": 0}, "action_dim"),
        ({"cameras": ["a.b"]}, "cameras"),  # [] is allowed: a state-only dataset
        ({"image_size": (0, 8)}, "image_size"),
        ({"num_episodes": 0}, "num_episodes"),
        ({"episode_length": 0}, "episode_length"),
    ],
)
def test_write_validates_arguments(tmp_path: Path, override: dict, arg: str) -> None:
    kwargs = dict(cameras=["c"], image_size=(8, 8), state_dim=2, action_dim=2, num_episodes=1, episode_length=2)
    kwargs.update(override)
    with pytest.raises(ValueError, match=arg):
        write_synthetic_dataset(tmp_path / "x", "t/x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_write_refuses_existing_root(ds_root: Path) -> None:
    with pytest.raises(FileExistsError, match=re.escape(str(ds_root))):
        write_synthetic_dataset(
            ds_root,
            REPO,
            cameras=["c"],
            image_size=(8, 8),
            state_dim=2,
            action_dim=2,
            num_episodes=1,
            episode_length=2,
        )


def test_inspect_rejects_missing_and_non_dataset_dirs(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(NotALeRobotDatasetError, match="does not exist") as exc:
        inspect_dataset(missing, "t/nope")
    assert str(missing) in str(exc.value)
    assert not missing.exists()  # lerobot would mkdir it and try the hub; we stop first
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "readme.txt").write_text("hello")
    with pytest.raises(NotALeRobotDatasetError, match="not a LeRobot dataset") as exc:
        inspect_dataset(plain)
    assert str(plain) in str(exc.value)


def test_demo_source_shapes_and_dtypes(source: LeRobotDemoSource) -> None:
    assert len(source) == EPISODES * LENGTH
    b = source.sample(8)
    assert b["images"].shape == (8, len(CAMS), 3, H, W) and b["images"].dtype == np.float32
    assert b["state"].shape == (8, STATE_DIM) and b["state"].dtype == np.float32
    assert b["action"].shape == (8, CHUNK, ACTION_DIM) and b["action"].dtype == np.float32
    assert b["action_is_pad"].shape == (8, CHUNK) and b["action_is_pad"].dtype == np.bool_
    assert b["task"] == [TASK] * 8
    assert 0.0 <= b["images"].min() and b["images"].max() <= 1.0
    assert b["images"].std() > 0.01  # images carry content, not a constant


def test_chunks_equal_next_recorded_actions(source: LeRobotDemoSource, raw_frames: pd.DataFrame) -> None:
    ep_end = raw_frames.reset_index().groupby("episode_index")["index"].max()
    seen = 0
    saw_pad = False
    for batch in source.iterate(batch_size=16):
        for row, idx in enumerate(batch["index"]):
            ep = raw_frames.loc[idx, "episode_index"]
            np.testing.assert_allclose(batch["state"][row], raw_frames.loc[idx, STATE_KEY], rtol=0, atol=0)
            for k in range(CHUNK):
                target = idx + k
                pad = target > ep_end[ep]
                assert batch["action_is_pad"][row, k] == pad
                saw_pad |= pad
                # lerobot repeats the episode's last action past its end (flagged by action_is_pad)
                expected = raw_frames.loc[min(target, ep_end[ep]), ACTION_KEY]
                np.testing.assert_allclose(batch["action"][row, k], expected, rtol=0, atol=0)
        seen += len(batch["index"])
    assert seen == len(source)  # one full epoch
    assert saw_pad


def test_iterate_is_one_shuffled_epoch(ds_root: Path) -> None:
    src = LeRobotDemoSource(ds_root, REPO, cameras=["front"], action_chunk=2, seed=1)
    idx = np.concatenate([b["index"] for b in src.iterate(batch_size=7)])
    assert sorted(idx.tolist()) == list(range(len(src)))
    assert idx.tolist() != list(range(len(src)))


def test_sampling_is_deterministic_with_seed(ds_root: Path) -> None:
    a = LeRobotDemoSource(ds_root, REPO, cameras=CAMS, action_chunk=CHUNK, seed=7).sample(6)
    b = LeRobotDemoSource(ds_root, REPO, cameras=CAMS, action_chunk=CHUNK, seed=7).sample(6)
    c = LeRobotDemoSource(ds_root, REPO, cameras=CAMS, action_chunk=CHUNK, seed=8).sample(6)
    np.testing.assert_array_equal(a["index"], b["index"])
    np.testing.assert_array_equal(a["images"], b["images"])
    np.testing.assert_array_equal(a["action"], b["action"])
    assert not np.array_equal(a["index"], c["index"])


def test_camera_order_is_respected(ds_root: Path) -> None:
    fw = LeRobotDemoSource(ds_root, REPO, cameras=["front", "wrist"], action_chunk=1, seed=2).sample(4)
    wf = LeRobotDemoSource(ds_root, REPO, cameras=["wrist", "front"], action_chunk=1, seed=2).sample(4)
    assert not np.array_equal(fw["images"][:, 0], fw["images"][:, 1])  # cameras see different things
    np.testing.assert_array_equal(fw["images"][:, 0], wf["images"][:, 1])
    np.testing.assert_array_equal(fw["images"][:, 1], wf["images"][:, 0])


def test_unknown_camera_is_named(ds_root: Path) -> None:
    with pytest.raises(ValueError, match="top"):
        LeRobotDemoSource(ds_root, REPO, cameras=["front", "top"], action_chunk=2)


def test_video_dataset_is_rejected_clearly_without_torchcodec(
    ds_root: Path, tmp_path: Path, without_torchcodec
) -> None:
    # Re-label one camera as video in the metadata: enough for the check, no encoder needed.
    # (Where torchcodec loads, video datasets are read: tests/data/test_video_dataset.py.)
    root = tmp_path / "video"
    shutil.copytree(ds_root, root)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"][CAMERA_KEY_PREFIX + "wrist"]["dtype"] = "video"
    info_path.write_text(json.dumps(info))
    described = inspect_dataset(root, REPO)
    assert described.undecodable_video_cameras == ("wrist",) == described.stored_as_video
    with pytest.raises(VideoDatasetNotSupportedError, match="torchcodec") as exc:
        LeRobotDemoSource(root, REPO, cameras=["front"], action_chunk=2)
    assert "wrist" in str(exc.value) and "FFmpeg" in str(exc.value)


def test_data_is_learnable(tmp_path: Path) -> None:
    """Least squares from state_t to the flattened action chunk generalises to held-out episodes."""
    root = write_synthetic_dataset(
        tmp_path / "learn",
        "t/learn",
        cameras=["c"],
        image_size=(8, 8),
        state_dim=4,
        action_dim=3,
        num_episodes=10,
        episode_length=24,
        seed=11,
    )
    chunk = 4
    src = LeRobotDemoSource(root, "t/learn", cameras=["c"], action_chunk=chunk)
    batch = next(src.iterate(batch_size=len(src)))
    full = ~batch["action_is_pad"].any(axis=1)  # padded chunks repeat the last action: not a target
    x = np.c_[batch["state"][full], np.ones(full.sum())]
    y = batch["action"][full].reshape(full.sum(), -1)
    episode = batch["index"][full] // 24
    train, test = episode < 7, episode >= 7
    coef, *_ = np.linalg.lstsq(x[train], y[train], rcond=None)
    pred = x[test] @ coef
    rel_err = np.linalg.norm(pred - y[test]) / np.linalg.norm(y[test] - y[train].mean(axis=0))
    assert rel_err < 0.2, rel_err
    # ...and the chunk is not trivially constant: the mean predictor is far worse.
    assert y.std(axis=0).min() > 0.05
    # Images depend on the state (the blob moves): different states give different pictures.
    assert not np.array_equal(batch["images"][0], batch["images"][len(batch["images"]) // 2])
