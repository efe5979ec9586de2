"""Held-out evaluation of a dataset-only tenant: the promotion metric when there is no simulator.

The tenant's spec holds its dataset's last `dataset.validation_episodes` episodes out of training
(the SFT producer never samples them); the held-out loss of ONE policy version is the mean squared
error between the actions it predicts (deterministically, through the Inference Model Service at
that pinned version, as any client would be served) and the demonstrated action chunks of every
frame of those episodes, padded chunk steps excluded. Lower is better.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from joynexus.core.tenants import Tenant
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.inference.endpoint import InferenceEndpoint
from joynexus.services.producers.evaluation_stats import HELDOUT_METRIC
from joynexus.services.producers.rollout import predict_many

__all__ = ["HELDOUT_METRIC", "HeldoutResult", "heldout_loss"]
_BATCH = 32  # observations in flight at once (one Inference Queue batch at most)


@dataclass(frozen=True)
class HeldoutResult:
    tenant_id: str
    policy_version: int
    episodes: int
    frames: int
    heldout_loss: float  # mean squared action error over the held-out frames' unpadded chunk steps

    def metrics(self) -> dict[str, float]:
        return {HELDOUT_METRIC: self.heldout_loss, "eval/heldout_frames": float(self.frames)}


def heldout_loss(tenant: Tenant, inference: InferenceEndpoint, policy_version: int) -> HeldoutResult:
    """The held-out loss of `policy_version` (which `inference` must serve) on the tenant's
    validation episodes; ValueError("dataset.validation_episodes: ...") if it holds none out."""
    from joynexus.data.lerobot_dataset import LeRobotDemoSource

    dataset, config = tenant.spec.dataset, tenant.backend_config
    if dataset is None or dataset.validation_episodes < 1:
        raise ValueError(
            f"dataset.validation_episodes: tenant {tenant.tenant_id!r} holds out no episodes to measure a "
            "held-out loss on"
        )
    source = LeRobotDemoSource(
        dataset.root, dataset.repo_id, cameras=list(config.cameras), action_chunk=config.action_chunk,
        validation_episodes=dataset.validation_episodes, split="validation",
    )  # fmt: skip
    squared, counted, frames = 0.0, 0, 0
    for batch in source.frames(_BATCH):
        observations = [
            Observation(
                images=tuple(np.asarray(batch["images"][i][c], dtype=np.float32) for c in range(len(config.cameras))),
                state=np.asarray(batch["state"][i], dtype=np.float32)[: config.state_dim],
                instruction=str(batch["task"][i]) or config.instruction,
            )
            for i in range(len(batch["task"]))
        ]
        preds = predict_many(
            inference, tenant.tenant_id, observations, policy_version=int(policy_version), sample=False,
            operation="evaluate",
        )  # fmt: skip
        for i, pred in enumerate(preds):
            predicted = np.asarray(pred["actions"][0], dtype=np.float64).reshape(config.action_chunk, -1)
            target = np.asarray(batch["action"][i], dtype=np.float64)[:, : config.action_dim]
            keep = ~np.asarray(batch["action_is_pad"][i], dtype=bool)
            error = (predicted[keep] - target[keep]) ** 2
            squared += float(error.sum())
            counted += int(error.size)
        frames += len(observations)
    if counted == 0:
        raise ValueError(f"dataset.validation_episodes: tenant {tenant.tenant_id!r}'s held-out frames have no actions")
    return HeldoutResult(
        tenant_id=tenant.tenant_id,
        policy_version=int(policy_version),
        episodes=dataset.validation_episodes,
        frames=frames,
        heldout_loss=squared / counted,
    )
