"""LeRobot v3.0 demonstration datasets: synthetic writer, inspection and chunked sampling.

Everything goes through lerobot 0.4.4's own ``LeRobotDataset`` / ``LeRobotDatasetMetadata``
so the on-disk format is exactly what tenants bring; we never parse the format by hand
except to give clear errors before lerobot would fall back to the (unreachable) hub.

Image-mode and video-mode datasets are both read. Video (mp4) is decoded by lerobot's
"torchcodec" backend: torchcodec (requirements/lock.txt) over the system FFmpeg libraries
(Debian's ``ffmpeg``, installed by scripts/install-system-deps). lerobot's other backend,
"pyav", calls a torchvision API that torchvision 0.29 removed, so it is never used for video.
Where torchcodec or FFmpeg cannot be loaded, video-mode datasets are refused with a message
saying what is missing (`video_decoding_problem`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# We never talk to the HF hub: a missing local file must fail, not trigger a download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CAMERA_KEY_PREFIX = "observation.images."
STATE_KEY = "observation.state"
ACTION_KEY = "action"

VIDEO_UNSUPPORTED_MSG = (
    "video-mode LeRobot datasets need torchcodec and the FFmpeg libraries, which cannot be loaded "
    "here: run scripts/install-system-deps (Debian's ffmpeg) and scripts/bootstrap (torchcodec), "
    "or re-export the dataset in image mode (use_videos=False)."
)
# Video frames are encoded as yuv420p H.264 (libx264, from PyAV's FFmpeg): it handles the small
# images tenants use, where lerobot's default SVT-AV1 encoder kills the process (SIGFPE) on some
# small frames (8x8, 9x9, 16x16 here). yuv420p halves the chroma resolution: both sides must be even.
VIDEO_CODEC = "h264"


class NotALeRobotDatasetError(FileNotFoundError):
    """The given root is missing or does not hold a LeRobot dataset (no meta/info.json)."""


class VideoDatasetNotSupportedError(RuntimeError):
    """The dataset stores cameras as video, which cannot be decoded here (no torchcodec / FFmpeg,
    or videos that are missing or unreadable)."""


@functools.cache
def video_decoding_problem() -> str | None:
    """Why video-mode datasets cannot be decoded in this process, or None when they can.

    Loading ``torchcodec.decoders`` loads torchcodec's core library, which links the FFmpeg
    libraries: an ImportError without torchcodec, a RuntimeError without (a supported) FFmpeg.
    """
    try:
        importlib.import_module("torchcodec")
        importlib.import_module("torchcodec.decoders")
    except Exception as exc:  # any failure to load means "cannot decode"
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"torchcodec cannot be loaded ({type(exc).__name__}: {first})"
    return None


# lerobot keeps one torchcodec decoder per video file for the whole process (a module-level cache);
# decoders are not thread-safe, so reads of one dataset's videos are serialized per dataset root.
_VIDEO_LOCKS: dict[Path, threading.Lock] = {}
_VIDEO_LOCKS_GUARD = threading.Lock()


def _video_lock(root: Path) -> threading.Lock:
    with _VIDEO_LOCKS_GUARD:
        return _VIDEO_LOCKS.setdefault(root.resolve(), threading.Lock())


def camera_feature_key(camera: str) -> str:
    """Feature key of a camera name: ``front`` -> ``observation.images.front``.

    Image features outside the ``observation.images.`` namespace (e.g. pusht's
    ``observation.image``) are reported under their full key, which maps to itself.
    """
    return camera if camera.startswith("observation.") else CAMERA_KEY_PREFIX + camera


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """Hide HF ``datasets`` "Map" progress bars that lerobot triggers, then restore the setting."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


@contextlib.contextmanager
def quiet_video_encoder() -> Iterator[None]:
    """Keep FFmpeg's per-video encoder report (libx264 statistics at INFO) off the terminal.

    lerobot hands PyAV's FFmpeg back its own log callback after each encode, which prints at
    FFmpeg's default INFO level; warnings and errors still print. Only PyAV's bundled FFmpeg (the
    encoder) is affected, not the system FFmpeg torchcodec decodes with.
    """
    import av

    av.logging.set_libav_level(av.logging.ERROR)
    try:
        yield
    finally:
        av.logging.set_libav_level(av.logging.INFO)  # FFmpeg's default


# --------------------------------------------------------------------------------------
# Synthetic dataset writer
# --------------------------------------------------------------------------------------


def _state_from_phase(theta: np.ndarray, state_dim: int) -> np.ndarray:
    """Map phases (T,) to states (T, state_dim): cos/sin harmonics of the phase.

    With a constant angular velocity, state_{t+k} is a fixed linear map (a rotation per
    harmonic pair) of state_t, so future states, and hence action chunks, are predictable
    from the current state. (With state_dim == 1 only cos(theta) is kept, which is ambiguous
    in the sign of sin(theta); use state_dim >= 2 for fully predictable chunks.)
    """
    cols = []
    for j in range(state_dim):
        harmonic = j // 2 + 1
        fn = np.cos if j % 2 == 0 else np.sin
        # Higher harmonics get smaller amplitude so the first pair dominates, like a real arm.
        cols.append(fn(harmonic * theta) / harmonic)
    return np.stack(cols, axis=-1).astype(np.float32)


def _render_camera(
    state: np.ndarray, cam_idx: int, height: int, width: int, yy: np.ndarray, xx: np.ndarray
) -> np.ndarray:
    """A bright blob whose position depends on the state, over a camera-specific gradient."""
    sx = float(state[0])
    sy = float(state[1]) if state.shape[0] > 1 else float(state[0]) ** 2 * 2 - 1
    # Different cameras see the blob from a different "viewpoint" (mirrored / swapped axes).
    if cam_idx % 2 == 1:
        sx, sy = sy, -sx
    cx = (0.5 + 0.35 * sx) * (width - 1)
    cy = (0.5 + 0.35 * sy) * (height - 1)
    sigma = max(1.5, 0.12 * min(height, width))
    blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * sigma**2))
    img = np.empty((height, width, 3), dtype=np.float32)
    base = 0.15 + 0.1 * (cam_idx % 3)
    img[..., 0] = base + 0.2 * xx / max(width - 1, 1)
    img[..., 1] = base + 0.2 * yy / max(height - 1, 1)
    img[..., 2] = base
    img[..., (cam_idx % 3)] += 0.7 * blob
    return (np.clip(img, 0.0, 1.0) * 255).astype(np.uint8)


def dataset_features(
    cameras: Sequence[str], image_size: tuple[int, int], state_dim: int, action_dim: int, *, video: bool = False
) -> dict[str, dict[str, Any]]:
    """LeRobot feature specs for camera images (HWC; image mode, or mp4 with ``video``), the state
    and the action."""
    height, width = int(image_size[0]), int(image_size[1])
    features: dict[str, dict[str, Any]] = {}
    for cam in cameras:
        features[CAMERA_KEY_PREFIX + cam] = {
            "dtype": "video" if video else "image",
            "shape": (height, width, 3),
            "names": ["height", "width", "channels"],
        }
    features[STATE_KEY] = {"dtype": "float32", "shape": (state_dim,), "names": [f"s{i}" for i in range(state_dim)]}
    features[ACTION_KEY] = {"dtype": "float32", "shape": (action_dim,), "names": [f"a{i}" for i in range(action_dim)]}
    return features


def create_image_dataset(
    root: str | Path, repo_id: str, fps: int, features: dict[str, dict[str, Any]], robot_type: str
) -> Any:
    """An empty image-mode v3.0 LeRobotDataset at `root` (call add_frame / save_episode / finalize)."""
    return create_dataset(root, repo_id, fps, features, robot_type)


def create_dataset(
    root: str | Path,
    repo_id: str,
    fps: int,
    features: dict[str, dict[str, Any]],
    robot_type: str,
) -> Any:
    """An empty v3.0 LeRobotDataset at `root` (call add_frame / save_episode / finalize), written by
    lerobot's own writer: PNG frames for "image" features; for "video" features mp4 files
    (`VIDEO_CODEC`, encoded through PyAV after each episode)."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    video = any(ft.get("dtype") == "video" for ft in features.values())
    if video:
        for key, ft in features.items():
            if ft.get("dtype") == "video":
                height, width = int(ft["shape"][0]), int(ft["shape"][1])
                if height % 2 or width % 2:
                    raise ValueError(
                        f"image_size: video mode needs an even height and width ({key} is {height}x{width}); "
                        "yuv420p video halves the chroma resolution"
                    )
    return LeRobotDataset.create(
        repo_id=repo_id,
        fps=fps,
        features=features,
        root=root,
        robot_type=robot_type,
        use_videos=video,
        image_writer_threads=0,
        image_writer_processes=0,
        vcodec=VIDEO_CODEC,
        # Decoding (this writer object is not read back): name a backend to skip lerobot's fallback warning.
        video_backend="torchcodec" if video and video_decoding_problem() is None else "pyav",
    )


def write_synthetic_dataset(
    root: str | Path,
    repo_id: str,
    *,
    cameras: Sequence[str],
    image_size: tuple[int, int],
    state_dim: int,
    action_dim: int,
    num_episodes: int,
    episode_length: int,
    fps: int = 10,
    task: str = "move the arm to the target",
    seed: int = 0,
    video: bool = False,
) -> Path:
    """Write a small, learnable LeRobot v3.0 dataset at ``root`` and return it: image mode, or with
    ``video`` the cameras as mp4 videos (lerobot's ``use_videos=True``; even image sides only).

    Per episode the state follows a phase oscillator ``theta_t = theta0 + omega * t`` (random
    theta0 per episode, shared omega) rendered as cos/sin harmonics; the action is
    ``tanh(W @ state_{t+1} + b)`` with a fixed random W, b. Images show a blob placed by the
    state. So an action chunk starting at t is a smooth deterministic function of state_t.
    ``root`` must not exist yet (lerobot refuses to overwrite).
    """
    cameras = tuple(cameras)  # () writes a state-only dataset (no image features)
    for cam in cameras:
        if not cam or "." in cam or "/" in cam:
            raise ValueError(f"cameras: invalid camera name {cam!r} (no dots or slashes)")
    if len(set(cameras)) != len(cameras):
        raise ValueError(f"cameras: duplicate camera names in {cameras}")
    if len(image_size) != 2 or min(image_size) < 1:
        raise ValueError(f"image_size: expected (height, width) >= 1, got {image_size!r}")
    if state_dim < 1:
        raise ValueError(f"state_dim: must be >= 1, got {state_dim}")
    if action_dim < 1:
        raise ValueError(f"action_dim: must be >= 1, got {action_dim}")
    if num_episodes < 1:
        raise ValueError(f"num_episodes: must be >= 1, got {num_episodes}")
    if episode_length < 1:
        raise ValueError(f"episode_length: must be >= 1, got {episode_length}")
    if fps < 1:
        raise ValueError(f"fps: must be >= 1, got {fps}")
    if not task:
        raise ValueError("task: must be a non-empty string")

    root = Path(root)
    if root.exists():
        raise FileExistsError(f"root: {root} already exists; LeRobot datasets are written to a new folder")

    height, width = int(image_size[0]), int(image_size[1])
    features = dataset_features(cameras, (height, width), state_dim, action_dim, video=video)

    rng = np.random.default_rng(seed)
    # Moderate gain keeps tanh in its near-linear range: smooth, learnable targets.
    weight = rng.normal(0.0, 1.0, size=(action_dim, state_dim)) * (0.8 / np.sqrt(state_dim))
    bias = rng.normal(0.0, 0.1, size=(action_dim,))
    omega = 2 * np.pi / max(8.0, 2.0 * fps)  # one revolution every ~2 s of demonstration

    ds = create_dataset(root, repo_id, fps, features, robot_type="synthetic")
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    with quiet_datasets(), quiet_video_encoder(), contextlib.ExitStack() as stack:
        # v3.0 keeps parquet writers open; finalize() flushes data + episode metadata.
        stack.callback(ds.finalize)
        for _ in range(num_episodes):
            theta0 = rng.uniform(0.0, 2 * np.pi)
            # One extra step: the action at t depends on state_{t+1}.
            theta = theta0 + omega * np.arange(episode_length + 1)
            states = _state_from_phase(theta, state_dim)
            actions = np.tanh(states[1:] @ weight.T + bias).astype(np.float32)
            for t in range(episode_length):
                frame: dict[str, Any] = {
                    STATE_KEY: states[t],
                    ACTION_KEY: actions[t],
                    "task": task,
                }
                for ci, cam in enumerate(cameras):
                    frame[CAMERA_KEY_PREFIX + cam] = _render_camera(states[t], ci, height, width, yy, xx)
                ds.add_frame(frame)
            ds.save_episode()
    return root


# --------------------------------------------------------------------------------------
# Inspection
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetInfo:
    repo_id: str
    root: Path
    fps: int
    num_episodes: int
    num_frames: int
    cameras: tuple[str, ...]  # camera names without the prefix, in the dataset's feature order
    image_shapes: dict[str, tuple[int, int, int]]  # camera -> (C, H, W), as LeRobot returns frames
    state_dim: int | None
    action_dim: int | None
    # Cameras stored as video that cannot be decoded here (torchcodec or FFmpeg missing; see
    # `video_decoding_problem`): empty when video decoding works. Consumers refuse these.
    undecodable_video_cameras: tuple[str, ...]
    tasks: tuple[str, ...]
    stored_as_video: tuple[str, ...] = ()  # every camera stored as video (mp4), decodable or not


def _check_dataset_root(root: Path) -> None:
    if not root.exists():
        raise NotALeRobotDatasetError(f"LeRobot dataset root {root} does not exist")
    if not root.is_dir():
        raise NotALeRobotDatasetError(f"LeRobot dataset root {root} is not a directory")
    if not (root / "meta" / "info.json").is_file():
        raise NotALeRobotDatasetError(f"{root} is not a LeRobot dataset: {root / 'meta' / 'info.json'} is missing")


def _repo_id_from_root(root: Path) -> str:
    # info.json does not store the repo id; use the folder layout <user>/<name> as a readable default.
    return f"{root.parent.name or 'local'}/{root.name}"


def _chw(feature: dict[str, Any]) -> tuple[int, int, int]:
    """LeRobot stores image/video shapes as written (usually (H, W, C) with names
    [height, width, channels]) but returns CHW tensors; normalize to (C, H, W)."""
    shape = tuple(int(x) for x in feature["shape"])
    names = [str(n).lower() for n in (feature.get("names") or [])]
    if len(shape) != 3:
        raise ValueError(f"unexpected image shape {shape}")
    if len(names) == 3 and names[0] in ("channel", "channels"):
        return shape  # already CHW
    if len(names) == 3 and names[2] in ("channel", "channels"):
        return (shape[2], shape[0], shape[1])
    # Unnamed: a leading 3/1 is channels-first, otherwise channels-last.
    if shape[0] in (1, 3) and shape[2] not in (1, 3):
        return shape
    return (shape[2], shape[0], shape[1])


def _load_metadata(root: Path, repo_id: str | None):  # -> LeRobotDatasetMetadata
    _check_dataset_root(root)
    from lerobot.datasets.lerobot_dataset import LeRobotDatasetMetadata

    info = root / "meta" / "info.json"
    try:  # named here: lerobot's own error says neither the file nor that it is not JSON
        json.loads(info.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise NotALeRobotDatasetError(f"{info} is not valid JSON: {exc}") from None

    try:
        return LeRobotDatasetMetadata(repo_id or _repo_id_from_root(root), root=root)
    except Exception as exc:  # lerobot raises assorted errors (or tries the hub) on broken metadata
        raise NotALeRobotDatasetError(f"{root} is not a readable LeRobot dataset: {exc}") from exc


def inspect_dataset(root: str | Path, repo_id: str | None = None) -> DatasetInfo:
    """Describe a local LeRobot dataset from its metadata (no frames are decoded)."""
    root = Path(root)
    meta = _load_metadata(root, repo_id)
    features = meta.features
    cameras: list[str] = []
    image_shapes: dict[str, tuple[int, int, int]] = {}
    stored_as_video: list[str] = []
    for key, ft in features.items():
        if ft.get("dtype") not in ("image", "video"):
            continue
        cam = key[len(CAMERA_KEY_PREFIX) :] if key.startswith(CAMERA_KEY_PREFIX) else key
        cameras.append(cam)
        image_shapes[cam] = _chw(ft)
        if ft["dtype"] == "video":
            stored_as_video.append(cam)

    def _dim(key: str) -> int | None:
        ft = features.get(key)
        return int(np.prod(ft["shape"])) if ft is not None else None

    tasks_df = meta.tasks  # DataFrame indexed by the task string, with a task_index column
    tasks: tuple[str, ...] = ()
    if tasks_df is not None and len(tasks_df):
        tasks = tuple(str(t) for t in tasks_df.sort_values("task_index").index)
    return DatasetInfo(
        repo_id=meta.repo_id,
        root=root,
        fps=int(meta.fps),
        num_episodes=int(meta.total_episodes),
        num_frames=int(meta.total_frames),
        cameras=tuple(cameras),
        image_shapes=image_shapes,
        state_dim=_dim(STATE_KEY),
        action_dim=_dim(ACTION_KEY),
        undecodable_video_cameras=tuple(stored_as_video) if video_decoding_problem() is not None else (),
        tasks=tasks,
        stored_as_video=tuple(stored_as_video),
    )


def _missing_videos(root: Path, repo_id: str) -> list[str]:
    """The video files (relative to `root`) the metadata names for some episode but that are absent."""
    meta = _load_metadata(root, repo_id)
    missing: set[str] = set()
    for episode in range(int(meta.total_episodes)):
        for key in meta.video_keys:
            relative = meta.get_video_file_path(episode, key)
            if not (root / relative).is_file():
                missing.add(str(relative))
    return sorted(missing)


# --------------------------------------------------------------------------------------
# Demonstration source with action chunks
# --------------------------------------------------------------------------------------


class LeRobotDemoSource:
    """Reads demonstrations with action chunks through
    ``LeRobotDataset(delta_timestamps={"action": [k / fps for k in range(chunk)]})``.

    Chunk padding past an episode end is lerobot's own: the last action is repeated and
    ``action_is_pad`` is True for those steps. Batches also carry ``"index"`` (int64, the
    frames' dataset indices) so callers can trace a sample back to its episode.

    Video-mode datasets are decoded through lerobot's torchcodec backend; the first frame is
    decoded at construction so a missing or unreadable video fails here, with its reason.
    """

    def __init__(
        self,
        root: str | Path,
        repo_id: str,
        *,
        cameras: Sequence[str],
        action_chunk: int,
        seed: int = 0,
        validation_episodes: int = 0,
        split: str = "train",
    ) -> None:
        """`validation_episodes`: the dataset's last N episodes are held out; `split` "train" reads
        the others, "validation" only those (the held-out loss of promotion)."""
        if split not in ("train", "validation"):
            raise ValueError(f"split: expected 'train' or 'validation', got {split!r}")
        if action_chunk < 1:
            raise ValueError(f"action_chunk: must be >= 1, got {action_chunk}")
        cameras = tuple(cameras)  # (): state-only samples, "images" is (B, 0, 3, 1, 1)
        self.root = Path(root)
        self.repo_id = repo_id
        self.info = inspect_dataset(self.root, repo_id)
        unknown = [c for c in cameras if c not in self.info.cameras]
        if unknown:
            raise ValueError(
                f"cameras: unknown camera(s) {unknown} in dataset {self.root}; available: {list(self.info.cameras)}"
            )
        if self.info.undecodable_video_cameras:
            # LeRobotDataset.__getitem__ decodes every video key, requested or not.
            raise VideoDatasetNotSupportedError(
                f"{self.root}: cameras {list(self.info.undecodable_video_cameras)} are stored as video; "
                f"{VIDEO_UNSUPPORTED_MSG} ({video_decoding_problem()})"
            )
        if self.info.num_frames == 0:
            raise ValueError(f"{self.root}: dataset has no frames")
        if self.info.state_dim is None or self.info.action_dim is None:
            raise ValueError(f"{self.root}: dataset needs both {STATE_KEY!r} and {ACTION_KEY!r} features")

        if self.info.stored_as_video:
            missing = _missing_videos(self.root, repo_id)
            if missing:  # lerobot would try to download them from the (unreachable) hub
                raise VideoDatasetNotSupportedError(
                    f"{self.root}: cannot decode the videos of cameras {list(self.info.stored_as_video)}: "
                    f"{len(missing)} video file(s) missing, e.g. {missing[0]}"
                )

        from lerobot.datasets.lerobot_dataset import LeRobotDataset

        self.cameras = cameras
        self.action_chunk = int(action_chunk)
        fps = self.info.fps
        self._video_lock = _video_lock(self.root) if self.info.stored_as_video else None
        with quiet_datasets():
            self._ds = LeRobotDataset(
                repo_id,
                root=self.root,
                delta_timestamps={ACTION_KEY: [k / fps for k in range(self.action_chunk)]},
                # "pyav" is unused in image mode; naming a backend avoids lerobot's fallback warning.
                video_backend="torchcodec" if self.info.stored_as_video else "pyav",
            )
        self._rng = np.random.default_rng(seed)
        self._frames = self._split_frames(int(validation_episodes), split)
        if self._video_lock is not None:
            try:
                self._item(0)
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [""])[0]
                raise VideoDatasetNotSupportedError(
                    f"{self.root}: cannot decode the videos of cameras {list(self.info.stored_as_video)}: "
                    f"{type(exc).__name__}: {first}"
                ) from exc

    def _item(self, index: int) -> dict[str, Any]:
        if self._video_lock is None:
            return self._ds[index]
        with self._video_lock:
            return self._ds[index]

    def _split_frames(self, validation_episodes: int, split: str) -> np.ndarray | None:
        """Dataset indices of the split's frames (None: every frame, nothing held out)."""
        if validation_episodes == 0:
            if split == "validation":
                raise ValueError("validation_episodes: 0 holds out nothing; the validation split is empty")
            return None
        total = self.info.num_episodes
        if validation_episodes >= total:
            raise ValueError(
                f"dataset.validation_episodes: {validation_episodes} of the dataset's {total} episodes "
                "leaves none to train on"
            )
        episodes = np.asarray(self._ds.hf_dataset["episode_index"], dtype=np.int64).reshape(-1)
        held_out = episodes >= total - validation_episodes
        return np.flatnonzero(held_out if split == "validation" else ~held_out)

    def __len__(self) -> int:
        return len(self._ds) if self._frames is None else len(self._frames)

    def _index(self, positions: np.ndarray) -> np.ndarray:
        return positions if self._frames is None else self._frames[positions]

    @property
    def state_dim(self) -> int:
        return int(self.info.state_dim or 0)

    @property
    def action_dim(self) -> int:
        return int(self.info.action_dim or 0)

    def _collate(self, indices: Sequence[int]) -> dict[str, Any]:
        images, states, actions, pads, tasks = [], [], [], [], []
        for i in indices:
            item = self._item(int(i))
            # LeRobot already returns images as float32 CHW in [0, 1].
            if self.cameras:
                images.append(np.stack([item[camera_feature_key(c)].numpy() for c in self.cameras]))
            else:
                images.append(np.zeros((0, 3, 1, 1), dtype=np.float32))
            states.append(item[STATE_KEY].numpy())
            actions.append(item[ACTION_KEY].numpy().reshape(self.action_chunk, -1))
            pads.append(item[f"{ACTION_KEY}_is_pad"].numpy())
            tasks.append(str(item["task"]))
        return {
            "images": np.stack(images).astype(np.float32, copy=False),
            "state": np.stack(states).astype(np.float32, copy=False),
            "action": np.stack(actions).astype(np.float32, copy=False),
            "action_is_pad": np.stack(pads).astype(bool, copy=False),
            "task": tasks,
            "index": np.asarray(indices, dtype=np.int64),
        }

    def sample(self, n: int) -> dict[str, Any]:
        """``n`` random frames (with replacement) from the seeded generator."""
        if n < 1:
            raise ValueError(f"n: must be >= 1, got {n}")
        return self._collate(self._index(self._rng.integers(0, len(self), size=n)))

    def iterate(self, batch_size: int) -> Iterator[dict[str, Any]]:
        """One shuffled epoch in batches (the last batch may be smaller)."""
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        order = self._index(self._rng.permutation(len(self)))
        for start in range(0, len(order), batch_size):
            yield self._collate(order[start : start + batch_size])

    def frames(self, batch_size: int) -> Iterator[dict[str, Any]]:
        """Every frame of the split once, in dataset order (a deterministic evaluation pass)."""
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        order = self._index(np.arange(len(self)))
        for start in range(0, len(order), batch_size):
            yield self._collate(order[start : start + batch_size])
