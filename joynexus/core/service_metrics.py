"""Signals each service exports from its own process (paper's system and learning signals that
must exist without the API server): a prometheus_client registry per process and, when
JOYNEXUS_METRICS_PORT is set, an HTTP endpoint serving it.

Why prometheus_client and not Ray's `ray.util.metrics`: the same code path works in a Ray actor, in
an in-process deployment and in tests (Ray's metrics need the dashboard agent, which a bare
`ray.init` here does not run); a process registry of our own never collides with the API server's
(`ops.metrics` keeps its own registry too).

Port: JOYNEXUS_METRICS_PORT (0 or unset = no endpoint). Several services share a node (training,
inference replicas, environment services are separate Ray actor processes), so each process binds
the first free port of [port, port + METRICS_PORT_SPAN); `metrics_endpoint()` says which (and the
service logs it). Prometheus scrapes that range per node (deployments/grafana/README.md).

Metric names (the Grafana row "Service signals" uses these):

training     joynexus_training_step_seconds{mode} (histogram; one optimizer round: `serial` is one
             tenant's microbatch with its own forward, `grouped` several tenants' after one shared
             forward), joynexus_training_samples_total{tenant}, joynexus_training_jobs_total{tenant},
             joynexus_policy_staleness{tenant} (actor version - behavior version of the tenant's last
             trained RL job, eq. 1)
inference    joynexus_weight_sync_seconds (histogram; installing one tenant payload, `load_weights`)
environment  joynexus_env_step_seconds (histogram; one `step` or `batch_step` call)
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = [
    "METRICS_PORT_SPAN",
    "SERVICE_METRIC_NAMES",
    "ServiceMetrics",
    "metrics_endpoint",
    "metrics_port_from_env",
    "service_metrics",
    "timed",
]

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

METRICS_PORT_SPAN = 64
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SYNC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_ENV_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class ServiceMetrics:
    """The process's service signals, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.training_step_seconds = Histogram(
            "joynexus_training_step_seconds", "One optimizer round of the Training Model Service",
            ["mode"], buckets=_STEP_BUCKETS, registry=r,
        )  # fmt: skip
        self.training_samples = Counter(
            "joynexus_training_samples", "Samples trained by the Training Model Service", ["tenant"], registry=r
        )
        self.training_jobs = Counter(
            "joynexus_training_jobs", "Jobs trained by the Training Model Service", ["tenant"], registry=r
        )
        self.policy_staleness = Gauge(
            "joynexus_policy_staleness",
            "Actor version minus behavior version of the tenant's last trained RL job (eq. 1)",
            ["tenant"], registry=r,
        )  # fmt: skip
        self.weight_sync_seconds = Histogram(
            "joynexus_weight_sync_seconds", "Installing one tenant payload in the Inference Model Service",
            buckets=_SYNC_BUCKETS, registry=r,
        )  # fmt: skip
        self.env_step_seconds = Histogram(
            "joynexus_env_step_seconds", "One step or batch_step call of the Environment Service",
            buckets=_ENV_BUCKETS, registry=r,
        )  # fmt: skip
        self._serve_lock = threading.Lock()
        self.port: int | None = None

    def observe_job(self, job: Any, result: dict[str, Any], start_version: int) -> None:
        """A trained job's counters and, for an RL job, its staleness when its update started
        (`start_version`: the tenant's actor version then)."""
        tenant = str(result.get("tenant_id") or job.tenant_id)
        self.training_jobs.labels(tenant).inc()
        self.training_samples.labels(tenant).inc(int(result.get("samples") or 0))
        behavior = getattr(job, "behavior_policy_version", None)
        if getattr(job, "task_type", None) == "rl" and behavior is not None:
            self.policy_staleness.labels(tenant).set(int(start_version) - int(behavior))

    def serve(self, port: int) -> int | None:
        """Start the HTTP endpoint once per process, on the first free port of [port, port + span);
        the port bound (None: none free, logged). Idempotent."""
        with self._serve_lock:
            if self.port is not None:
                return self.port
            for candidate in range(port, port + METRICS_PORT_SPAN):
                try:
                    start_http_server(candidate, registry=self.registry)
                except OSError:
                    continue
                self.port = candidate
                log.info("service metrics of pid %d on port %d", os.getpid(), candidate)
                return candidate
            log.warning("no free metrics port in [%d, %d)", port, port + METRICS_PORT_SPAN)
            return None


SERVICE_METRIC_NAMES = frozenset(
    {
        "joynexus_training_step_seconds",
        "joynexus_training_samples_total",
        "joynexus_training_jobs_total",
        "joynexus_policy_staleness",
        "joynexus_weight_sync_seconds",
        "joynexus_env_step_seconds",
    }
)


def metrics_port_from_env() -> int:
    """JOYNEXUS_METRICS_PORT: 0 (default) = no endpoint."""
    text = os.environ.get("JOYNEXUS_METRICS_PORT", "").strip() or "0"
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"JOYNEXUS_METRICS_PORT must be a port number (0 = off), got {text!r}") from None
    if not 0 <= port <= 65535 - METRICS_PORT_SPAN:
        raise ValueError(f"JOYNEXUS_METRICS_PORT must be in 0..{65535 - METRICS_PORT_SPAN}, got {port}")
    return port


@functools.cache
def service_metrics() -> ServiceMetrics:
    """This process's service signals; the first call starts the endpoint if JOYNEXUS_METRICS_PORT
    asks for one (each service calls this when it is built)."""
    metrics = ServiceMetrics()
    port = metrics_port_from_env()
    if port:
        metrics.serve(port)
    return metrics


def metrics_endpoint() -> int | None:
    """The port this process serves its service signals on (None: no endpoint)."""
    return service_metrics().port


def timed(histogram: str) -> Callable[[F], F]:
    """Observe each call's wall time (raising or not) in this process's `histogram` (an attribute
    of ServiceMetrics, e.g. "env_step_seconds")."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                getattr(service_metrics(), histogram).observe(time.perf_counter() - started)

        return wrapper  # type: ignore[return-value]

    return decorate
