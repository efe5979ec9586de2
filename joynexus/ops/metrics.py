"""Prometheus metrics of a deployment, for `GET /metrics` of the tenant API server.

A prometheus_client `CollectorRegistry` of its own (never the process-global one, so several apps
in one process, e.g. tests, do not collide) holds `JoyNexusCollector`, which asks at scrape time:

- the Master Service (`metrics_snapshot`: store aggregates — jobs, leases, workloads, admission
  waits, metered device-seconds — and the per-tenant learning signals of `learning_signals`);
- the Inference Model Service (`stats`: queue depth, batches, batch sizes, request latencies,
  busy seconds, its memory);
- the Training Queue (`partitions`).

One call per source per scrape, each in a worker thread with a short timeout: a source that fails
or does not answer in time counts in `joynexus_scrape_errors_total{source}` and its metrics are left
out of that scrape; the scrape itself never fails. A source whose previous call is still running is
not called again (so a hung service never piles up threads). The Training Model Service is not
called: it is often busy in a training step for seconds, and its busy time is in the store already
(completed jobs' results, metered API calls). Results younger than `min_interval_s` are reused, so
several Prometheus replicas scraping at once cost the services one round.

Metric names (the Grafana dashboard in deployments/grafana uses these):

control   joynexus_training_queue_partitions{tenant}, joynexus_inference_queue_depth,
          joynexus_training_jobs{tenant,state}, joynexus_training_leases_held{tenant,state},
          joynexus_training_oldest_lease_age_seconds{state}, joynexus_workloads{tenant,task,state},
          joynexus_workloads_running, joynexus_admission_queued_workloads{tenant},
          joynexus_admission_oldest_wait_seconds{tenant}, joynexus_tenants{status},
          joynexus_master_start_time_seconds{incarnation}
learning  joynexus_train_loss{tenant}, joynexus_train_optimizer_steps{tenant}, joynexus_policy_version{tenant},
          joynexus_rl_approx_kl{tenant}, joynexus_rl_clip_fraction{tenant}, joynexus_rl_entropy{tenant},
          joynexus_rl_value_loss{tenant}, joynexus_rl_mean_return{tenant}, joynexus_rl_success_rate{tenant},
          joynexus_rl_mean_episode_length{tenant}, joynexus_eval_success_rate{tenant},
          joynexus_eval_mean_return{tenant}, joynexus_eval_mean_episode_length{tenant},
          joynexus_eval_policy_version{tenant}, joynexus_learning_last_update_timestamp_seconds{tenant}
system    joynexus_inference_batches_total, joynexus_inference_requests_total,
          joynexus_inference_samples_total, joynexus_inference_failed_requests_total,
          joynexus_inference_mean_batch_samples, joynexus_inference_batch_samples (histogram),
          joynexus_inference_request_latency_seconds (histogram), joynexus_device_busy_seconds_total{service},
          joynexus_device_seconds_total{tenant,category}, joynexus_samples_total{tenant,category},
          joynexus_env_steps_total{tenant}, joynexus_process_resident_memory_bytes{role},
          joynexus_device_memory_allocated_bytes{role}, process_* (the API process)
scrape    joynexus_scrape_errors_total{source}, joynexus_scrape_duration_seconds{source}
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

SOURCES = ("master", "inference", "training_queue")
LEASED_STATES = ("leased", "computing_actor_forward", "computing_advantages")
# learning_signals() key -> (metric name, help)
LEARNING_METRICS: dict[str, tuple[str, str]] = {
    "loss": ("joynexus_train_loss", "Latest training loss of the tenant (SFT loss or PPO total loss)"),
    "optimizer_steps": ("joynexus_train_optimizer_steps", "Optimizer steps of the tenant's latest workload"),
    "policy_version": ("joynexus_policy_version", "Latest policy version the tenant's training produced"),
    "approx_kl": ("joynexus_rl_approx_kl", "Approximate KL(old || new) of the latest PPO update"),
    "clip_fraction": ("joynexus_rl_clip_fraction", "Fraction of samples clipped in the latest PPO update"),
    "entropy": ("joynexus_rl_entropy", "Policy entropy in the latest PPO update"),
    "value_loss": ("joynexus_rl_value_loss", "Critic loss of the latest PPO update (GAE tenants)"),
    "mean_return": ("joynexus_rl_mean_return", "Mean episode return of the rollouts behind the latest RL update"),
    "success_rate": ("joynexus_rl_success_rate", "Episode success rate of the rollouts behind the latest RL update"),
    "mean_episode_length": ("joynexus_rl_mean_episode_length", "Mean episode length of those rollouts"),
    "eval_success_rate": ("joynexus_eval_success_rate", "Success rate of the tenant's latest evaluation"),
    "eval_mean_return": ("joynexus_eval_mean_return", "Mean episode return of the tenant's latest evaluation"),
    "eval_mean_episode_length": ("joynexus_eval_mean_episode_length", "Mean episode length of that evaluation"),
    "eval_policy_version": ("joynexus_eval_policy_version", "Policy version the latest evaluation ran"),
    "updated_at": ("joynexus_learning_last_update_timestamp_seconds", "Unix time of the tenant's latest signal"),
}


def _rss_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None


class JoyNexusCollector(Collector):
    """Builds every joynexus_* metric from one round of calls to the sources (see the module doc).
    `cluster`: anything with `master`, `inference` and `queue` handles (a `joynexus.connect.Cluster`)."""

    def __init__(self, cluster: Any, *, timeout_s: float = 3.0, min_interval_s: float = 1.0):
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.min_interval_s = min_interval_s
        self._inflight: dict[str, Future] = {}
        self._errors = dict.fromkeys(SOURCES, 0)
        self._durations: dict[str, float] = {}
        self._last: tuple[float, dict[str, Any]] | None = None
        self._lock = threading.Lock()  # scrapes take turns: one round of calls at a time

    def _calls(self) -> dict[str, Callable[[], Any]]:
        c = self.cluster
        return {
            "master": lambda: c.master.metrics_snapshot(),
            "inference": lambda: c.inference.stats(),
            "training_queue": lambda: c.queue.partitions(),
        }

    def _start(self, source: str, call: Callable[[], Any]) -> Future:
        """Run `call` in a daemon thread (one that hangs never holds up the process's exit)."""
        future: Future = Future()

        def run() -> None:
            started = time.perf_counter()
            try:
                result = call()
            except BaseException as error:  # handed to the scrape, which counts it
                self._durations[source] = time.perf_counter() - started
                future.set_exception(error)
                return
            self._durations[source] = time.perf_counter() - started
            future.set_result(result)

        threading.Thread(target=run, name=f"metrics-{source}", daemon=True).start()
        return future

    def fetch(self) -> dict[str, Any]:
        """{source: its answer} for the sources that answered in time (errors counted)."""
        with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < self.min_interval_s:
                return self._last[1]
            started: dict[str, Future] = {}
            for source, call in self._calls().items():
                previous = self._inflight.get(source)
                if previous is not None and not previous.done():
                    self._errors[source] += 1  # still hung from an earlier scrape: do not pile up
                    continue
                started[source] = self._inflight[source] = self._start(source, call)
            results: dict[str, Any] = {}
            deadline = time.monotonic() + self.timeout_s
            for source, future in started.items():
                try:
                    results[source] = future.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    self._errors[source] += 1
                    log.warning("metrics: %s did not answer within %.1fs", source, self.timeout_s)
                except Exception as error:
                    self._errors[source] += 1
                    log.warning("metrics: %s failed: %s: %s", source, type(error).__name__, error)
            self._last = (time.monotonic(), results)
            return results

    def collect(self) -> Iterator[Metric]:
        results = self.fetch()
        if "master" in results:
            yield from _master_metrics(results["master"])
        if "inference" in results:
            yield from _inference_metrics(results["inference"])
        if "training_queue" in results:
            yield from _queue_metrics(results["training_queue"])
        yield from self._system_metrics(results)

    def _system_metrics(self, results: dict[str, Any]) -> Iterator[Metric]:
        busy = CounterMetricFamily(
            "joynexus_device_busy_seconds",
            "Seconds the shared backbone services computed (training: completed jobs and API calls, from the "
            "store; inference: shared forwards since the service started)",
            labels=["service"],
        )
        if "master" in results:
            snap = results["master"]
            training = sum(secs for _, category, secs, _, _ in snap.get("usage", []) if category == "training")
            training += sum(snap.get("training_job_seconds", {}).values())
            busy.add_metric(["training"], training)
        if "busy_seconds" in (results.get("inference") or {}):
            busy.add_metric(["inference"], float(results["inference"]["busy_seconds"]))
        yield busy
        rss = GaugeMetricFamily(
            "joynexus_process_resident_memory_bytes",
            "Resident memory of a JoyNexus process by role (in process, the roles share one process)",
            labels=["role"],
        )
        for role, value in (
            ("api", _rss_bytes()),
            ("master", (results.get("master") or {}).get("rss_bytes")),
            ("inference", (results.get("inference") or {}).get("rss_bytes")),
        ):
            if value is not None:
                rss.add_metric([role], float(value))
        yield rss
        device = GaugeMetricFamily(
            "joynexus_device_memory_allocated_bytes",
            "Accelerator memory torch holds allocated, by role (absent without CUDA)",
            labels=["role"],
        )
        value = (results.get("inference") or {}).get("device_memory_bytes")
        if value is not None:
            device.add_metric(["inference"], float(value))
        yield device
        errors = CounterMetricFamily(
            "joynexus_scrape_errors", "Sources that failed or timed out while serving /metrics", labels=["source"]
        )
        durations = GaugeMetricFamily(
            "joynexus_scrape_duration_seconds", "How long the last call to each source took", labels=["source"]
        )
        for source in SOURCES:
            errors.add_metric([source], float(self._errors[source]))
            if source in self._durations:
                durations.add_metric([source], self._durations[source])
        yield errors
        yield durations


def _master_metrics(snap: dict[str, Any]) -> Iterator[Metric]:
    yield from _job_metrics(snap)
    yield from _workload_metrics(snap)
    yield from _tenant_metrics(snap)
    yield from _usage_metrics(snap)


def _job_metrics(snap: dict[str, Any]) -> Iterator[Metric]:
    """Training jobs and the leases on them (Training Scheduler)."""
    jobs = GaugeMetricFamily(
        "joynexus_training_jobs", "Training jobs by tenant and state (Training Scheduler)", labels=["tenant", "state"]
    )
    leases = GaugeMetricFamily(
        "joynexus_training_leases_held",
        "Jobs under a lease (actor: leased; stages: computing_*)",
        labels=["tenant", "state"],
    )
    for tenant, state, n in snap.get("jobs", []):
        jobs.add_metric([tenant, state], n)
        if state in LEASED_STATES:
            leases.add_metric([tenant, state], n)
    yield jobs
    yield leases
    lease_age = GaugeMetricFamily(
        "joynexus_training_oldest_lease_age_seconds", "Age of the oldest lease held, by state", labels=["state"]
    )
    for state, age in snap.get("oldest_lease_age_seconds", {}).items():
        lease_age.add_metric([state], age)
    yield lease_age


def _workload_metrics(snap: dict[str, Any]) -> Iterator[Metric]:
    """Workloads by state and the admission queue."""
    workloads = GaugeMetricFamily(
        "joynexus_workloads", "Workloads by tenant, task and state", labels=["tenant", "task", "state"]
    )
    queued = GaugeMetricFamily(
        "joynexus_admission_queued_workloads", "Workloads waiting in the admission queue", labels=["tenant"]
    )
    queued_by_tenant: dict[str, int] = {}
    for tenant, task, state, n in snap.get("workloads", []):
        workloads.add_metric([tenant, task, state], n)
        if state == "queued":
            queued_by_tenant[tenant] = queued_by_tenant.get(tenant, 0) + n
    for tenant, n in queued_by_tenant.items():
        queued.add_metric([tenant], n)
    yield workloads
    yield queued
    wait = GaugeMetricFamily(
        "joynexus_admission_oldest_wait_seconds",
        "How long the tenant's oldest queued workload has waited for admission",
        labels=["tenant"],
    )
    for tenant, seconds in snap.get("oldest_queued_wait_seconds", {}).items():
        wait.add_metric([tenant], seconds)
    yield wait
    yield GaugeMetricFamily(
        "joynexus_workloads_running", "Workloads the Master Service runs now", value=snap.get("running_workloads", 0)
    )


def _tenant_metrics(snap: dict[str, Any]) -> Iterator[Metric]:
    """Tenants by status, the serving Master's start, and the per-tenant learning signals."""
    tenants = GaugeMetricFamily("joynexus_tenants", "Tenants by status", labels=["status"])
    by_status: dict[str, int] = {}
    for status in snap.get("tenants", {}).values():
        by_status[status] = by_status.get(status, 0) + 1
    for status, n in by_status.items():
        tenants.add_metric([status], n)
    yield tenants
    start = GaugeMetricFamily(
        "joynexus_master_start_time_seconds", "Unix time the serving Master Service started", labels=["incarnation"]
    )
    if snap.get("started_at") is not None:
        start.add_metric([str(snap.get("incarnation", ""))], snap["started_at"])
    yield start

    # learning signals, per tenant
    families = {key: GaugeMetricFamily(name, doc, labels=["tenant"]) for key, (name, doc) in LEARNING_METRICS.items()}
    for tenant, signals in snap.get("learning", {}).items():
        for key, value in signals.items():
            if key in families and value is not None and math.isfinite(value):
                families[key].add_metric([tenant], value)
    yield from families.values()


def _usage_metrics(snap: dict[str, Any]) -> Iterator[Metric]:
    """Metered usage: the store's view (survives service restarts)."""
    seconds = CounterMetricFamily(
        "joynexus_device_seconds",
        "Metered device-seconds by tenant and category (training: jobs and API calls; inference; environment)",
        labels=["tenant", "category"],
    )
    samples = CounterMetricFamily(
        "joynexus_samples", "Samples trained / predicted by tenant and category", labels=["tenant", "category"]
    )
    steps = CounterMetricFamily("joynexus_env_steps", "Environment steps metered per tenant", labels=["tenant"])
    totals: dict[tuple[str, str], list[float]] = {}
    env_steps: dict[str, int] = {}
    for tenant, category, secs, n, env in snap.get("usage", []):
        entry = totals.setdefault((tenant, category), [0.0, 0])
        entry[0] += secs
        entry[1] += n
        env_steps[tenant] = env_steps.get(tenant, 0) + env
    for tenant, secs in snap.get("training_job_seconds", {}).items():
        entry = totals.setdefault((tenant, "training"), [0.0, 0])
        entry[0] += secs
        entry[1] += snap.get("training_job_samples", {}).get(tenant, 0)
    for (tenant, category), (secs, n) in sorted(totals.items()):
        seconds.add_metric([tenant, category], secs)
        samples.add_metric([tenant, category], n)
    for tenant, n in env_steps.items():
        steps.add_metric([tenant], n)
    yield seconds
    yield samples
    yield steps


def _inference_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "joynexus_inference_queue_depth", "Requests waiting in the Inference Queue", value=stats.get("queue_depth", 0)
    )
    for key, name, doc in (
        ("batches", "joynexus_inference_batches", "Shared backbone forwards (physical batches) served"),
        ("requests", "joynexus_inference_requests", "Inference requests served in those batches"),
        ("samples", "joynexus_inference_samples", "Observations served in those batches"),
        ("failed_requests", "joynexus_inference_failed_requests", "Requests whose tenant decode failed"),
    ):
        yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))
    yield GaugeMetricFamily(
        "joynexus_inference_mean_batch_samples",
        "Mean observations per physical batch since the service started",
        value=float(stats.get("mean_batch_samples", 0.0)),
    )
    for key, name, doc in (
        ("latency_seconds", "joynexus_inference_request_latency_seconds", "Inference request latency (queue + batch)"),
        ("batch_samples", "joynexus_inference_batch_samples", "Observations per physical batch"),
    ):
        snapshot = stats.get(key)
        if snapshot:
            buckets = [(b if isinstance(b, str) else floatToGoString(b), float(n)) for b, n in snapshot["buckets"]]
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(snapshot["sum"]))


def _queue_metrics(partitions: list[str]) -> Iterator[Metric]:
    family = GaugeMetricFamily(
        "joynexus_training_queue_partitions", "Partitions held in the Training Queue, by tenant", labels=["tenant"]
    )
    counts: dict[str, int] = {}
    for partition in partitions:
        parts = str(partition).split("/")
        tenant = parts[1] if len(parts) >= 3 else ""  # <domain>/<tenant>/<task>/<job>
        counts[tenant] = counts.get(tenant, 0) + 1
    for tenant, n in sorted(counts.items()):
        family.add_metric([tenant], n)
    yield family


class MetricsEndpoint:
    """A registry of its own with the JoyNexus collector (and the API process's process_* metrics);
    `render()` gives the body and content type of `GET /metrics`."""

    def __init__(self, cluster: Any, *, timeout_s: float = 3.0, process_metrics: bool = True):
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = JoyNexusCollector(cluster, timeout_s=timeout_s)
        self.registry.register(self.collector)
        if process_metrics:
            ProcessCollector(registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
