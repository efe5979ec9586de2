"""Write a synthetic LeRobot dataset that matches an SFT spec, at the spec's `dataset.root`.

The dataset holds learnable demonstrations of the spec's interface (its cameras at its image
size, its state and action dims; `joynexus.data.lerobot_dataset.write_synthetic_dataset`), in
image mode or, with --video, with every camera as an mp4 video (lerobot's `use_videos=True`;
decoding needs torchcodec and FFmpeg, which scripts/bootstrap installs). A relative root is
relative to the current directory: run this where `joynexus serve` runs.

    .venv/bin/python examples/specs/write_dataset.py examples/specs/sft.yaml [--video]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from joynexus.spec import SpecError, WorkloadSpec, parse_workload_spec


def write_dataset_for(spec: WorkloadSpec, *, video: bool = False, episodes: int = 8, length: int = 40) -> Path:
    """Write the dataset `spec.dataset` names (it must not exist yet) and return its root."""
    from joynexus.data.lerobot_dataset import write_synthetic_dataset

    if spec.dataset is None:
        raise ValueError(f"tenant {spec.tenant!r} is a {spec.task.value!r} tenant: its spec names no dataset")
    obs = spec.observation
    return write_synthetic_dataset(
        spec.dataset.root,
        spec.dataset.repo_id,
        cameras=obs.cameras,
        image_size=obs.image_size,
        state_dim=obs.state_dim,
        action_dim=obs.action_dim,
        num_episodes=episodes,
        episode_length=length,
        task=obs.instruction or "move the arm to the target",
        video=video,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", type=Path, help="an SFT workload spec (YAML or JSON)")
    parser.add_argument("--video", action="store_true", help="store the cameras as mp4 videos")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--length", type=int, default=40, help="frames per episode")
    args = parser.parse_args()
    try:
        spec = parse_workload_spec(args.spec)
    except SpecError as error:
        print(error, file=sys.stderr)
        return 2
    root = Path(spec.dataset.root) if spec.dataset is not None else None
    if root is not None and root.exists():
        print(f"{root} exists already: nothing written (delete it to write it again)")
        return 0
    try:
        root = write_dataset_for(spec, video=args.video, episodes=args.episodes, length=args.length)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    mode = "video (mp4)" if args.video else "image"
    print(f"wrote {root}: {args.episodes} episodes x {args.length} frames, {mode} mode, repo_id {spec.dataset.repo_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
