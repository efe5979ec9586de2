"""Builders shared by tests: tenant specs and datasets that match them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TINY_MODEL_ID = "joynexus/tiny-smolvlm"


def sft_spec(
    tenant: str,
    dataset_root: Path | str,
    *,
    base_model: str = TINY_MODEL_ID,
    cameras: tuple[str, ...] = ("front",),
    image_size: tuple[int, int] = (32, 32),
    state_dim: int = 4,
    action_dim: int = 3,
    action_chunk: int = 2,
    module: str = "oft_mlp",
    jobs: int | None = 4,
    samples_per_job: int = 16,
    microbatch_size: int = 8,
    lr: float = 3e-3,
    max_in_flight: int = 2,
) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "base_model": base_model,
        "task": "sft",
        "action_module": {"kind": module, "size": "tiny"},
        "observation": {
            "cameras": list(cameras),
            "image_size": list(image_size),
            "state_dim": state_dim,
            "action_dim": action_dim,
            "action_chunk": action_chunk,
            "instruction": "pick up the cube",
        },
        "dataset": {"root": str(dataset_root), "repo_id": f"test/{tenant}"},
        "scheduling": {"max_in_flight_jobs": max_in_flight, "completion_target": jobs},
        "training": {"samples_per_job": samples_per_job, "microbatch_size": microbatch_size, "learning_rate": lr},
    }


def write_dataset_for(spec: dict[str, Any], *, episodes: int = 3, length: int = 20, seed: int = 0) -> Path:
    from joynexus.data.lerobot_dataset import write_synthetic_dataset

    obs = spec["observation"]
    return write_synthetic_dataset(
        spec["dataset"]["root"],
        spec["dataset"]["repo_id"],
        cameras=obs["cameras"],
        image_size=tuple(obs["image_size"]),
        state_dim=obs["state_dim"],
        action_dim=obs["action_dim"],
        num_episodes=episodes,
        episode_length=length,
        task=obs["instruction"],
        seed=seed,
    )


def compiled_config(tenant: str, capabilities: Any, **shape: Any) -> Any:
    """A TenantBackendConfig compiled by the real spec compiler, without a dataset or a store."""
    from joynexus.core.tenants import BackendCapabilities
    from joynexus.master.tenant_creator import SpecCompiler
    from joynexus.spec import parse_workload_spec

    spec = sft_spec(tenant, "/unused", base_model=capabilities.model_id, **shape)
    spec["task"] = "eval"  # evaluation tenants need no dataset: compile checks only the interface
    spec["dataset"] = None
    return SpecCompiler(BackendCapabilities.single(capabilities)).compile(parse_workload_spec(spec))


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 60.0, poll_s: float = 0.05) -> Any:
    """Poll `predicate` until it returns something truthy (returned); fail naming `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)
