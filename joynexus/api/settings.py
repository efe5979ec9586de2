"""Settings of the tenant API server (`create_app`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from joynexus.api.gateway import ApiLimits
from joynexus.api.rate_limits import RateLimitSettings
from joynexus.api.streaming import StreamSettings
from joynexus.data.archive_unpacking import DEFAULT_MAX_COMPRESSION_RATIO, DEFAULT_MAX_FILES
from joynexus.master.options import MasterOptions


def _master_default(name: str) -> Any:
    """The Master's default of a quota field: the API's admission checks on lower-layer calls and
    the Master's own use the same defaults, so one change there changes both."""
    return MasterOptions.model_fields[name].default


class ApiSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=0, le=65535)
    max_body_bytes: int = Field(default=64 << 20, ge=1024)
    # POST /v1/datasets: an archive is at most max_body_bytes; it may unpack to at most this many.
    max_dataset_unpacked_bytes: int = Field(default=4 << 30, ge=1024)
    # ... and hold at most this many files and folders, and expand at most this many times the
    # compressed bytes read so far: both checked as the archive is read (issue 41.5: a 674 KB
    # archive of 99k files, a 6.4 KB bz2 of 8 GiB; joynexus.data.archive_unpacking).
    max_dataset_files: int = Field(default=DEFAULT_MAX_FILES, ge=1)
    max_dataset_compression_ratio: float = Field(default=DEFAULT_MAX_COMPRESSION_RATIO, gt=1)
    # Unpacked bytes of all of one tenant's uploads (None: no bound); refused as the archive is read
    # once it would pass it. Apart from the storage quota (checkpoints and uploads, none by default):
    # uploads are the storage a tenant fills fastest and cheapest.
    max_dataset_bytes_per_tenant: int | None = Field(default=16 << 30, ge=0)
    # Quota defaults of tenants without their own quota row: the Master's (`MasterOptions`).
    default_max_device_seconds: float | None = Field(default=_master_default("default_max_device_seconds"), ge=0)
    default_max_queued_workloads: int | None = Field(default=_master_default("default_max_queued_workloads"), ge=0)
    default_max_storage_bytes: int | None = Field(  # checkpoint bytes per tenant
        default=_master_default("default_max_storage_bytes"), ge=0
    )
    stream_poll_s: float = Field(default=0.25, gt=0)
    stream_heartbeat_s: float = Field(default=15.0, gt=0)
    # Open Server-Sent Event streams per tenant: each polls the Master, so one tenant's thousands
    # of idle streams must not crowd out everyone else's calls.
    max_streams_per_tenant: int = Field(default=8, ge=1)
    limits: ApiLimits = Field(default_factory=ApiLimits)
    policy_stream: StreamSettings = Field(default_factory=StreamSettings)  # /v1/stream (websocket)
    # GET /metrics (Prometheus text format) lists every tenant's loss, versions, steps and
    # device-seconds, so it needs the operator (admin) key by default: Prometheus sends it as a bearer
    # token from a Secret (deployments/grafana/). A tenant sees its own figures on GET /v1/usage.
    # True: anyone who reaches the server may read it (issue 26: the Ingress exposed it).
    metrics_public: bool = False
    metrics_timeout_s: float = Field(default=3.0, gt=0, description="per-source limit of one scrape")
    # Per-tenant token buckets (requests/s, samples/s) and in-flight bound of lower-layer calls and
    # robot-stream observations, with per-tenant overrides (joynexus.api.rate_limits); the
    # environment variable JOYNEXUS_RATE_LIMITS_JSON sets them for `joynexus serve`.
    rate_limits: RateLimitSettings = Field(default_factory=RateLimitSettings.from_env)
    # Lower-layer training calls at once from this server to the Training Model Service; the waiting
    # ones pass by tenant priority (spec scheduling.priority), first come first served within one.
    training_call_slots: int = Field(default=2, ge=1, le=256)
