"""The spec a LeRobot dataset needs (issue 41.13): `joynexus spec from-dataset DIR` reads the
dataset's metadata (`meta/info.json`, through lerobot's own reader: no frame is decoded) and writes
an SFT workload spec whose `observation` block is the dataset's cameras, image size, state and
action dims and first task, and whose `dataset` names it, so a user does not work them out by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from joynexus.data.lerobot_dataset import inspect_dataset

__all__ = ["DatasetSpecError", "spec_from_dataset"]


class DatasetSpecError(ValueError):
    """The dataset cannot back a tenant as it is; the message says what to change."""


def spec_from_dataset(
    root: str | Path, *, tenant: str, base_model: str, repo_id: str | None = None, action_chunk: int = 4
) -> dict[str, Any]:
    """An SFT workload spec for the dataset at `root` (a mapping, ready to dump as YAML)."""
    info = inspect_dataset(Path(root), repo_id)
    if not info.action_dim:
        raise DatasetSpecError(f"{root}: the dataset has no 'action' feature: nothing to train a policy on")
    sizes = {camera: tuple(info.image_shapes[camera][1:]) for camera in info.cameras}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{camera} {list(size)}" for camera, size in sizes.items())
        raise DatasetSpecError(
            f"{root}: the cameras have different image sizes ({listed}); a tenant's cameras share one "
            "observation.image_size: resize them to one size, or write the spec by hand with the cameras of one size"
        )
    image_size = list(next(iter(sizes.values()))) if sizes else [32, 32]
    return {
        "tenant": tenant,
        "base_model": base_model,
        "task": "sft",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {
            "cameras": list(info.cameras),
            "image_size": image_size,
            "state_dim": int(info.state_dim or 0),
            "action_dim": int(info.action_dim),
            "action_chunk": action_chunk,
            "instruction": info.tasks[0] if info.tasks else "",
        },
        "dataset": {"root": str(Path(root).resolve()), "repo_id": info.repo_id},
    }
