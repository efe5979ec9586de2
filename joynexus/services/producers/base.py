"""The loop every producer runs on its replica: produce jobs until the tenant's completion target is covered."""

from __future__ import annotations

import threading
from typing import ClassVar

from joynexus.core.tenants import TenantBackendConfig
from joynexus.scheduling.training_scheduler import CHANGE_POLL_S, TrainingJob, TrainingScheduler


class Producer:
    """A producer of one tenant's training jobs (SFT demonstrations, RL rollouts). Subclasses make
    one job per `produce_once`; the shared `run` loop launches the next one as soon as the tenant
    has capacity (no cross-tenant barrier) and stops at the policy's completion target."""

    task_type: ClassVar[str]  # the training policy's task type: "sft" or "rl"
    config: TenantBackendConfig
    scheduler: TrainingScheduler

    def produce_once(self) -> TrainingJob | None:
        """Reserve and write one job; None when the scheduler refuses (in-flight bound, target)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what producing holds (environment sessions); nothing by default."""

    def run(self, stop: threading.Event, idle_wait_s: float = CHANGE_POLL_S) -> int:
        """Produce until the completion target is covered or `stop` is set; returns jobs produced."""
        produced = 0
        try:
            while not stop.is_set():
                seen = self.scheduler.generation
                if self.produce_once() is not None:
                    produced += 1
                    continue
                if self.target_reached():
                    break
                # In-flight bound reached: woken when a job finishes (it frees the slot), not by polling.
                self.scheduler.wait_for_change(seen, idle_wait_s)
        finally:
            self.close()
        return produced

    def target_reached(self) -> bool:
        policy = self.scheduler.policy(self.config.tenant_id, self.task_type)
        if policy.completion_target is None:
            return False
        return self.scheduler.counts(self.config.tenant_id).get("completed", 0) >= policy.completion_target
