"""Video-mode LeRobot datasets: written by lerobot's own writer (mp4, `use_videos=True`), decoded
through lerobot's torchcodec backend over the system FFmpeg, validated, and trained on by an SFT
workload of the in-process deployment."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before lerobot / huggingface_hub are imported

import numpy as np
import pytest

from joynexus.data.lerobot_dataset import (
    CAMERA_KEY_PREFIX,
    VIDEO_CODEC,
    LeRobotDemoSource,
    VideoDatasetNotSupportedError,
    inspect_dataset,
    video_decoding_problem,
    write_synthetic_dataset,
)
from joynexus.data.validation import DatasetExpectation, DatasetValidationError, validate_dataset
from tests.helpers import sft_spec

CAMS = ("front", "wrist")
SHAPE = dict(cameras=CAMS, image_size=(24, 32), state_dim=4, action_dim=3)
EPISODES, LENGTH = 3, 12
EXPECT = DatasetExpectation(cameras=CAMS, image_size=(24, 32), state_dim=4, action_dim=3)


def _write(root: Path, repo_id: str, *, video: bool) -> Path:
    return write_synthetic_dataset(
        root,
        repo_id,
        **SHAPE,
        num_episodes=EPISODES,
        episode_length=LENGTH,
        task="pick up the cube",
        seed=5,
        video=video,
    )


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same synthetic demonstrations twice: cameras as mp4 videos, and as PNG images."""
    base = tmp_path_factory.mktemp("video")
    return {
        "video": _write(base / "video", "t/video", video=True),
        "image": _write(base / "image", "t/image", video=False),
    }


def test_this_build_decodes_video() -> None:
    # scripts/install-system-deps (Debian's ffmpeg) and the lock's torchcodec: both in place here.
    assert video_decoding_problem() is None
    assert shutil.which("ffprobe"), "Debian's ffmpeg package (scripts/install-system-deps) is not installed"


def test_lerobot_writes_mp4_videos(roots: dict[str, Path]) -> None:
    root = roots["video"]
    info = json.loads((root / "meta" / "info.json").read_text())
    for cam in CAMS:
        feature = info["features"][CAMERA_KEY_PREFIX + cam]
        assert feature["dtype"] == "video" and feature["info"]["video.codec"] == VIDEO_CODEC
    videos = sorted((root / "videos").rglob("*.mp4"))
    assert {p.relative_to(root / "videos").parts[0] for p in videos} == {CAMERA_KEY_PREFIX + c for c in CAMS}
    assert not list(root.rglob("*.png"))  # lerobot's temporary frames are gone: only the videos hold them
    # Every frame of every episode is in the video (FFmpeg's own prober, from Debian's ffmpeg).
    probe = subprocess.run(
        ["ffprobe", "-v", "error", "-count_frames", "-select_streams", "v:0", "-show_entries",
         "stream=codec_name,width,height,nb_read_frames", "-of", "json", str(videos[0])],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    stream = json.loads(probe.stdout)["streams"][0]
    assert (stream["codec_name"], stream["height"], stream["width"]) == ("h264", 24, 32)
    assert int(stream["nb_read_frames"]) == EPISODES * LENGTH

    described = inspect_dataset(root, "t/video")
    assert described.stored_as_video == CAMS and described.undecodable_video_cameras == ()  # decodable here
    assert described.image_shapes == {c: (3, 24, 32) for c in CAMS}
    assert described.num_frames == EPISODES * LENGTH


def test_decoded_frames_match_the_images_they_were_encoded_from(roots: dict[str, Path]) -> None:
    video = LeRobotDemoSource(roots["video"], "t/video", cameras=CAMS, action_chunk=3, seed=0)
    image = LeRobotDemoSource(roots["image"], "t/image", cameras=CAMS, action_chunk=3, seed=0)
    everything = np.arange(len(video))
    decoded, exact = video._collate(everything), image._collate(everything)
    assert decoded["images"].shape == exact["images"].shape == (EPISODES * LENGTH, 2, 3, 24, 32)
    assert decoded["images"].dtype == np.float32
    for key in ("state", "action", "action_is_pad"):
        np.testing.assert_array_equal(decoded[key], exact[key])
    # Lossy (H.264, yuv420p) but the same pictures: a small mean error per frame, smaller than to the
    # frame 3 steps away in the same episode (so no frame is shifted in time). (Frames of other
    # episodes can be near-copies: every episode follows the same orbit from another start.)
    distance = np.abs(decoded["images"][:, None] - exact["images"][None]).mean(axis=(2, 3, 4, 5))
    own = distance[everything, everything]
    assert own.max() < 0.03, own
    step = everything % LENGTH
    shifted = np.where(step + 3 < LENGTH, everything + 3, everything - 3)
    assert (own < distance[everything, shifted]).all()


def test_a_video_dataset_passes_validation(roots: dict[str, Path]) -> None:
    report = validate_dataset(roots["video"], "t/video", EXPECT)
    assert report.ok and report.checked_rows == EPISODES * LENGTH


def test_an_sft_workload_trains_on_a_video_dataset(roots: dict[str, Path], tmp_path: Path) -> None:
    from joynexus.connect import in_process
    from joynexus.settings import Settings

    spec = sft_spec("video-sft", roots["video"], **SHAPE, action_chunk=2, jobs=3, samples_per_job=16)
    spec["dataset"]["repo_id"] = "t/video"
    cluster = in_process(Settings(data_dir=tmp_path / "data", torch_threads=1))
    try:
        tenant = cluster.master.create_tenant(spec)  # validates the dataset: video cameras accepted
        assert tenant.tenant_id == "video-sft"
        status = cluster.master.submit_workload("video-sft", jobs=3)
        final = cluster.master.wait_workload(status.workload_id, timeout_s=240)
        losses = cluster.master.workload_losses(status.workload_id)
    finally:
        cluster.close()
    assert final.state == "completed", final.error
    assert (final.completed_jobs, final.version) == (3, 3)
    assert len(losses) == final.optimizer_steps == 6 and all(math.isfinite(x) for x in losses)


def test_a_missing_video_file_is_refused_with_its_reason(roots: dict[str, Path], tmp_path: Path) -> None:
    root = tmp_path / "broken"
    shutil.copytree(roots["video"], root)
    shutil.rmtree(root / "videos" / (CAMERA_KEY_PREFIX + "wrist"))
    with pytest.raises(VideoDatasetNotSupportedError, match="cannot decode the videos") as caught:
        LeRobotDemoSource(root, "t/video", cameras=["front"], action_chunk=2)
    assert "wrist" in str(caught.value)


def test_without_torchcodec_video_datasets_are_refused_saying_why(roots: dict[str, Path], without_torchcodec) -> None:
    assert "torchcodec" in (video_decoding_problem() or "")
    described = inspect_dataset(roots["video"], "t/video")
    assert described.undecodable_video_cameras == CAMS == described.stored_as_video
    with pytest.raises(VideoDatasetNotSupportedError, match="FFmpeg") as caught:
        LeRobotDemoSource(roots["video"], "t/video", cameras=["front"], action_chunk=2)
    assert "torchcodec cannot be loaded" in str(caught.value) and "install-system-deps" in str(caught.value)
    with pytest.raises(DatasetValidationError) as refused:
        validate_dataset(roots["video"], "t/video", EXPECT)
    assert refused.value.field == "dataset.video_cameras"


def test_video_mode_needs_even_image_sides(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="image_size: video mode needs an even height and width"):
        write_synthetic_dataset(
            tmp_path / "odd", "t/odd", cameras=["c"], image_size=(9, 16), state_dim=2, action_dim=2,
            num_episodes=1, episode_length=4, video=True,
        )  # fmt: skip
