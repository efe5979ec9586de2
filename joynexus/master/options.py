"""The Master Service's limits (`MasterOptions`), apart from the service: the API's settings carry
them without importing the Master (its workloads, the services, torch)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from joynexus.master.health import HealthOptions
from joynexus.settings import _env_int

__all__ = ["MasterOptions"]


class MasterOptions(BaseModel):
    """Admission and retry limits of the Master Service."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The deployment sizes it (deployments/config.yaml, written by infra/scripts/render-deployment):
    # the workloads running at once (the rest wait in FIFO order). Read where the options are made:
    # `joynexus up`. Rollouts at once are the producer replicas' (JOYNEXUS_PRODUCER_CONCURRENT_ROLLOUTS).
    max_running_workloads: int = Field(
        default_factory=lambda: _env_int("JOYNEXUS_MAX_RUNNING_WORKLOADS", 8), ge=1, validate_default=True
    )
    max_failures_per_workload: int = Field(default=3, ge=1)
    max_job_attempts: int = Field(default=3, ge=1, description="re-queues of a job whose lease owner died")
    default_max_device_seconds: float | None = Field(default=None, ge=0)
    default_max_queued_workloads: int | None = Field(default=8, ge=0)
    max_wait_s: float = Field(default=30.0, gt=0, description="longest single wait_workload call")
    default_max_storage_bytes: int | None = Field(
        default=None, ge=0, description="checkpoint bytes per tenant; None: no quota"
    )
    # Forks one tenant may own (forks of its forks count against it too): each is a tenant with a
    # checkpoint copy and a training slot, made in a fraction of a second (issue 41.3).
    max_forks_per_tenant: int = Field(default=16, ge=0)
    health: HealthOptions = Field(default_factory=HealthOptions)
    # Housekeeping (joynexus.master.tenant_lifecycle): checkpoint crash leftovers older than the
    # grace are swept at start and then this often; unhealthy tenants' slots are retried this often.
    leftover_sweep_interval_s: float = Field(default=3600.0, gt=0)
    leftover_grace_s: float = Field(default=3600.0, ge=0)
    unhealthy_retry_interval_s: float = Field(default=30.0, gt=0)
