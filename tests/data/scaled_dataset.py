"""A LeRobot dataset whose action dimensions live on very different scales (a joint in radians
beside a gripper in 0..1000), written by lerobot's own writer: the normalization tests' data."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from joynexus.data.lerobot_dataset import ACTION_KEY, STATE_KEY, create_dataset, dataset_features, quiet_datasets

# Action dimension j is scale[j] * tanh(W state' + b)[j] + offset[j]: 1,000x apart.
SCALES = (1.0, 1000.0)
OFFSETS = (0.0, 500.0)


def write_scaled_dataset(
    root: str | Path,
    repo_id: str,
    *,
    state_dim: int = 4,
    scales: Sequence[float] = SCALES,
    offsets: Sequence[float] = OFFSETS,
    episodes: int = 4,
    length: int = 24,
    seed: int = 0,
    task: str = "move the arm",
) -> Path:
    """A state-only dataset: a phase oscillator's cos/sin state; the action a fixed smooth function
    of the next state per dimension, scaled by `scales` and shifted by `offsets`."""
    scales, offsets = np.asarray(scales, np.float32), np.asarray(offsets, np.float32)
    action_dim = len(scales)
    rng = np.random.default_rng(seed)
    weight = rng.normal(0.0, 1.0, size=(action_dim, state_dim)) * (0.8 / np.sqrt(state_dim))
    bias = rng.normal(0.0, 0.1, size=(action_dim,))
    features = dataset_features((), (8, 8), state_dim, action_dim)
    dataset = create_dataset(root, repo_id, 10, features, robot_type="synthetic")
    with quiet_datasets(), contextlib.ExitStack() as stack:
        stack.callback(dataset.finalize)
        for _ in range(episodes):
            theta = rng.uniform(0, 2 * np.pi) + 0.4 * np.arange(length + 1)
            harmonics = [(np.cos if j % 2 == 0 else np.sin)((j // 2 + 1) * theta) for j in range(state_dim)]
            states = np.stack(harmonics, axis=-1).astype(np.float32)
            actions = (np.tanh(states[1:] @ weight.T + bias) * scales + offsets).astype(np.float32)
            for t in range(length):
                dataset.add_frame({STATE_KEY: states[t], ACTION_KEY: actions[t], "task": task})
            dataset.save_episode()
    return Path(root)


def dataset_frames(root: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Every frame's (state, action) from the dataset's parquet files."""
    import pyarrow.parquet as pq

    states, actions = [], []
    for path in sorted((Path(root) / "data").rglob("*.parquet")):
        table = pq.read_table(path, columns=[STATE_KEY, ACTION_KEY])
        states.append(np.asarray(table.column(STATE_KEY).to_pylist(), np.float32))
        actions.append(np.asarray(table.column(ACTION_KEY).to_pylist(), np.float32))
    return np.concatenate(states), np.concatenate(actions)
