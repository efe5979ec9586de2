"""SFT producer (paper Fig. 7, Appendix A.4): turns a tenant's LeRobot demonstrations into
Training Queue partitions, one reserved training job at a time, bounded by the tenant's
in-flight limit and completion target. It never touches the model."""

from __future__ import annotations

from typing import Any

import numpy as np

from joynexus.core.tenants import TenantBackendConfig
from joynexus.data.normalization import Normalizer
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import READY, TrainingJob, TrainingScheduler
from joynexus.services.producers.base import Producer


class SFTProducer(Producer):
    task_type = "sft"

    def __init__(
        self,
        config: TenantBackendConfig,
        scheduler: TrainingScheduler,
        queue: TrainingQueue,
        source: Any,  # joynexus.data.lerobot_dataset.LeRobotDemoSource or anything with .sample(n)
        job_metadata: dict[str, Any] | None = None,  # e.g. the workload id, carried on every job
    ):
        self.job_metadata = dict(job_metadata or {})
        self.config = config
        self.scheduler = scheduler
        self.queue = queue
        self.source = source
        # The tenant's normalizer (compiled from its dataset's statistics): the module learns, and the
        # Inference Model Service un-normalizes, in its units. None: raw units.
        self.normalizer = Normalizer.from_dict(config.normalization)

    @classmethod
    def from_dataset(
        cls,
        config: TenantBackendConfig,
        scheduler: TrainingScheduler,
        queue: TrainingQueue,
        root: str,
        repo_id: str,
        job_metadata: dict[str, Any] | None = None,
        validation_episodes: int = 0,
    ) -> SFTProducer:
        from joynexus.data.lerobot_dataset import LeRobotDemoSource

        source = LeRobotDemoSource(
            root,
            repo_id,
            cameras=list(config.cameras),
            action_chunk=config.action_chunk,
            seed=config.seed,
            validation_episodes=validation_episodes,  # held out: promotion measures on them
        )
        return cls(config, scheduler, queue, source, job_metadata)

    def produce_once(self) -> TrainingJob | None:
        """Reserve one job and write its demonstration partition; None when admission refuses."""
        cfg = self.config
        job = self.scheduler.reserve(
            tenant_id=cfg.tenant_id,
            task_type="sft",
            sample_count=cfg.samples_per_job,
            producer_role="sft",
            consumer_role="actor",
            metadata={**self.job_metadata, "schema_signature": cfg.schema_signature},
        )
        if job is None:
            return None
        try:
            self.queue.put(
                job.partition_id,
                self._partition_data(job.sample_count),
                annotations={"tenant_id": cfg.tenant_id, "schema_signature": cfg.schema_signature},
            )
        except Exception as error:
            self.queue.clear(job.partition_id)
            self.scheduler.fail(job.job_id, f"producer: {type(error).__name__}: {error}")
            raise
        return self.scheduler.mark(job.job_id, READY)

    def _partition_data(self, n: int) -> dict[str, Any]:
        cfg = self.config
        batch = self.source.sample(n)
        state = np.asarray(batch["state"], dtype=np.float32)
        action = np.asarray(batch["action"], dtype=np.float32)
        if cfg.state_dim == 0:
            state = np.zeros((n, 0), dtype=np.float32)
        if self.normalizer is not None:
            state, action = self.normalizer.normalize_state(state), self.normalizer.normalize_action(action)
        return {
            "images": np.asarray(batch["images"], dtype=np.float32),
            "state": state,
            "action": action,
            "action_is_pad": np.asarray(batch["action_is_pad"], dtype=bool),
            "task": [str(t) or cfg.instruction for t in batch["task"]],
            # Every model-facing sample carries its tenant and schema (paper A.4).
            "tenant_id": [cfg.tenant_id] * n,
            "schema_signature": [cfg.schema_signature] * n,
        }
