"""Record demonstrations from a simulator into a LeRobot dataset (image mode).

A scripted (or any) policy acts in a session of the Environment Service; every frame's camera
images, state, unit-range action ([-1, 1] per dimension, the action space JoyNexus policies use)
and instruction are written through lerobot's own `LeRobotDataset`, so the result is an ordinary
dataset an SFT tenant can declare."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from joynexus.data.lerobot_dataset import (
    ACTION_KEY,
    CAMERA_KEY_PREFIX,
    STATE_KEY,
    create_image_dataset,
    dataset_features,
    quiet_datasets,
)
from joynexus.envs.base import unit_to_bounds

ScriptedPolicy = Callable[[dict[str, Any], np.random.Generator], np.ndarray]


def record_demonstrations(
    environment: Any,  # EnvironmentService or its Ray actor handle
    simulator_config: dict[str, Any],
    policy: ScriptedPolicy,
    root: str | Path,
    repo_id: str,
    *,
    episodes: int,
    fps: int = 10,
    seed: int = 0,
    tenant_id: str = "joynexus-recorder",
) -> dict[str, Any]:
    """Run `episodes` episodes of `policy` and write them as a LeRobot dataset at `root`.
    Returns {"root", "episodes", "frames", "mean_return", "success_rate"}."""
    if episodes < 1:
        raise ValueError(f"episodes: expected >= 1, got {episodes}")
    rng = np.random.default_rng(seed)
    session = environment.open_session(tenant_id, f"record-{repo_id}", simulator_config)
    returns, successes, frames = [], [], 0
    try:
        spec = environment.spec(tenant_id, session)
        low = np.asarray(spec["action_low"], dtype=np.float32)
        high = np.asarray(spec["action_high"], dtype=np.float32)
        cameras = list(spec["cameras"])
        features = dataset_features(cameras, tuple(spec["image_size"]), spec["state_dim"], spec["action_dim"])
        dataset = create_image_dataset(root, repo_id, fps, features, robot_type=spec["simulator"])
        with quiet_datasets(), contextlib.ExitStack() as stack:
            stack.callback(dataset.finalize)
            for episode in range(episodes):
                obs = environment.reset(tenant_id, session, seed + episode)
                total, success = 0.0, False
                while True:
                    unit = np.clip(np.asarray(policy(obs, rng), dtype=np.float32), -1.0, 1.0)
                    frame: dict[str, Any] = {
                        STATE_KEY: np.asarray(obs["state"], dtype=np.float32),
                        ACTION_KEY: unit,
                        "task": obs["instruction"],
                    }
                    for cam in cameras:  # CHW float [0, 1] -> HWC uint8, as LeRobot stores images
                        image = np.asarray(obs["images"][cam], dtype=np.float32)
                        frame[CAMERA_KEY_PREFIX + cam] = (image.transpose(1, 2, 0) * 255).round().astype(np.uint8)
                    dataset.add_frame(frame)
                    frames += 1
                    result = environment.step(tenant_id, session, unit_to_bounds(unit, low, high))
                    total += float(result["reward"])
                    success = success or bool(result["success"])
                    obs = result["observation"]
                    if result["terminated"] or result["truncated"]:
                        break
                dataset.save_episode()
                returns.append(total)
                successes.append(success)
    finally:
        environment.close(tenant_id, session)
    return {
        "root": str(root),
        "episodes": episodes,
        "frames": frames,
        "mean_return": float(np.mean(returns)),
        "success_rate": float(np.mean(successes)),
    }
