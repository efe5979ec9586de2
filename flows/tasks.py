"""The Prefect tasks both flows are made of: each is a thin call into the library.

Retries, timeouts and caching are Prefect's own (task options); nothing here loops on failure.
Only transient errors are retried: a spec or dataset that fails validation, an unknown tenant or a
workload that ended in `failed` would fail the same way again.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time
from datetime import timedelta
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE

from joynexus.connect import shared
from joynexus.spec import SpecError, WorkloadSpec

__all__ = [
    "create_tenant",
    "evaluate_version",
    "load_registered_version",
    "log_evaluation_history",
    "measure_version",
    "promote_version",
    "resolve_alias",
    "train",
]


class WorkloadError(RuntimeError):
    """A training or evaluation workload ended in a state other than `completed`."""


# Errors that name their reason and would repeat (bad spec, unknown tenant, failed workload): never
# retried, and a flow run from the command line prints only their message (flows/failures.py).
REFUSALS: tuple[type[Exception], ...] = (SpecError, KeyError, ValueError, WorkloadError)


def _transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry condition: not for errors that would repeat (bad spec, unknown tenant, failed workload)."""
    try:
        state.result()
    except REFUSALS:
        return False
    except Exception:
        return True
    return True


@functools.cache
def shared_tracker() -> Any:
    """This flow process's MLflow client for the deployment's tracking server (registry reads and
    promotion tags; the Master Service writes the training and evaluation runs)."""
    from joynexus.registry import ExperimentTracker

    settings = shared().settings
    return ExperimentTracker(settings.resolved_mlflow_uri())


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys take lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


_follower: Any = None
_follower_lock = threading.Lock()


def _cluster() -> Any:
    """The flow process's Cluster; on a Ray deployment with a `RoleFollower` that reconnects it when
    the Ray head restarts (a Ray Client session ends with its head) and retargets its handles."""
    global _follower
    cluster = shared()
    with _follower_lock:
        if _follower is None and cluster.mode == "ray":
            from joynexus.ops.role_follower import RoleFollower

            _follower = RoleFollower(cluster).start()
    return cluster


def _wait(workload_id: str, timeout_s: float) -> Any:
    """Wait for the workload to end, in bounded calls to the Master. A call that fails because the
    deployment is briefly away (the Ray head restarting: the workload runs on in the detached
    actors) is retried until the deadline while the follower reconnects; only the deadline, a
    refusal, Prefect's timeout or a cancel end the wait, and then the workload is cancelled."""
    cluster = _cluster()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                status = cluster.wait_workload(workload_id, timeout_s=max(0.0, min(left, 30.0)))
            except REFUSALS:
                raise
            except Exception as error:  # the head restarted, a role is away: the workload is not lost
                if time.monotonic() >= deadline:
                    raise
                get_run_logger().warning(
                    "waiting on workload %s: %s: %s; reconnecting", workload_id, type(error).__name__, error
                )
                if _follower is not None:
                    _follower.check_now()
                time.sleep(2.0)
                continue
            if status.state in ("completed", "failed", "cancelled") or time.monotonic() >= deadline:
                break
    except BaseException:  # Prefect's timeout (or a cancel) lands here: do not leave it running
        with contextlib.suppress(Exception):
            cluster.master.cancel_workload(workload_id)
        raise
    if status.state not in ("completed", "failed", "cancelled"):
        cluster.master.cancel_workload(workload_id)
        raise TimeoutError(f"workload {workload_id} still {status.state} after {timeout_s:.0f} s; cancelled")
    if status.state != "completed":
        raise WorkloadError(f"workload {workload_id} of tenant {status.tenant_id!r} {status.state}: {status.error}")
    return status


@task(
    name="create-tenant",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=_transient,
    # Same spec, same control-plane store: the tenant exists, skip the dataset validation.
    cache_policy=INPUTS + TASK_SOURCE,
    cache_expiration=timedelta(days=1),
)
def create_tenant(spec: WorkloadSpec, store: str) -> dict[str, Any]:
    """Create the tenant: the tenant creator checks the spec against the resident backbone and
    validates its dataset (Great Expectations) before writing it. A tenant that already exists with
    this very spec is reused; with another spec, it is an error. `store` (the control-plane
    database URL) only keys the cache."""
    from joynexus.master.tenant_creator import TenantExists

    master = shared().master
    try:
        tenant = master.create_tenant(spec)
    except TenantExists:
        tenant = master.get_tenant(spec.tenant)
        if tenant.spec.model_dump(mode="json") != spec.model_dump(mode="json"):
            raise ValueError(
                f"spec: tenant {spec.tenant!r} already exists with a different spec; choose another tenant name"
            ) from None
        get_run_logger().info("tenant %s exists with this spec; reusing it", spec.tenant)
    return {
        "tenant_id": tenant.tenant_id,
        "task": tenant.spec.task.value,
        "schema_signature": tenant.schema_signature,
        "has_environment": tenant.backend_config.environment is not None,
    }


@task(name="train", cache_policy=NO_CACHE)
def train(tenant_id: str, jobs: int | None, timeout_s: float) -> dict[str, Any]:
    """Run one training workload of the tenant's declared task (SFT or RL) to its end. The workload
    checkpoints, exports and registers the trained policy; its status names the registry version.
    The flow sets this task's Prefect timeout to `timeout_s`; on timeout the workload is cancelled."""
    submitted = shared().master.submit_workload(tenant_id, jobs=jobs)
    get_run_logger().info("workload %s: %s jobs of tenant %s", submitted.workload_id, submitted.target_jobs, tenant_id)
    status = _wait(submitted.workload_id, timeout_s)
    if status.registered_version is None:
        raise WorkloadError(f"workload {status.workload_id} completed but registered no policy version")
    return {**status.model_dump(), "run_id": status.run_id}  # run_id: the Master's, not on the API's wire


@task(name="evaluate", retries=1, retry_delay_seconds=10, retry_condition_fn=_transient, cache_policy=NO_CACHE)
def evaluate_version(tenant_id: str, policy_version: int, episodes: int, timeout_s: float) -> dict[str, Any]:
    """Evaluate ONE policy version in the tenant's environment (deterministic actions, no training
    job). The evaluation workload logs `eval/*` metrics to its own MLflow run."""
    submitted = shared().master.evaluate(tenant_id, version=policy_version, episodes=episodes)
    status = _wait(submitted.workload_id, timeout_s)
    result = dict(status.result or {})
    get_run_logger().info(
        "tenant %s v%s: success %.0f%%, mean return %.3f over %d episodes",
        tenant_id, policy_version, 100 * result.get("success_rate", 0.0), result.get("mean_return", 0.0), episodes,
    )  # fmt: skip
    return {"workload_id": status.workload_id, "run_id": status.run_id, "policy_version": policy_version, **result}


@task(name="promote", retries=2, retry_delay_seconds=5, retry_condition_fn=_transient, cache_policy=NO_CACHE)
def promote_version(tenant_id: str, registry_version: int) -> dict[str, Any]:
    """The Master's promotion rule (the tenant's declared metric, `spec.promotion`): `candidate`
    moves to the version; `champion` too if it beats the champion. The flow has no rule of its own."""
    decision = shared().master.promote(tenant_id, registry_version)
    get_run_logger().info(
        "tenant %s: candidate v%s, champion v%s (%s)", tenant_id, registry_version, decision["champion"],
        decision["reason"],
    )  # fmt: skip
    return decision


@task(name="measure", retries=1, retry_delay_seconds=10, retry_condition_fn=_transient, cache_policy=NO_CACHE)
def measure_version(tenant_id: str, registry_version: int) -> dict[str, float]:
    """Measure a registered version by the tenant's promotion metric in the Master (a dataset-only
    tenant: its held-out loss); the Master logs the metrics on the version."""
    return shared().master.measure_version(tenant_id, registry_version)


@task(name="resolve-alias", retries=2, retry_delay_seconds=5, retry_condition_fn=_transient, cache_policy=NO_CACHE)
def resolve_alias(tenant_id: str, alias: str) -> dict[str, Any] | None:
    """The registry version `alias` names now (None if unset), with its policy version: resolved
    once, so everything after it works on that pinned version even if the alias moves meanwhile."""
    tracker = shared_tracker()
    version = tracker.alias_version(tenant_id, alias)
    if version is None:
        return None
    tags = tracker.model_version_tags(tenant_id, version)
    return {
        "registry_version": version,
        "policy_version": int(tags["policy_version"]),
        "digest": tags["manifest_digest"],
    }


@task(
    name="load-registered-version",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=_transient,
    cache_policy=NO_CACHE,
)
def load_registered_version(tenant_id: str, registry_version: int) -> int:
    """Fetch the registered payload (verified against its digest tag) and serve it in the
    Inference Model Service; returns the policy version it serves as."""
    payload, manifest = shared_tracker().fetch_tenant_payload(tenant_id, version=registry_version)
    loaded = shared().inference.load_weights(payload)
    return int(loaded["version"])


@task(name="log-evaluation-history", retries=2, retry_delay_seconds=5, cache_policy=NO_CACHE)
def log_evaluation_history(tenant_id: str, registry_version: int, metrics: dict[str, float]) -> str:
    """Append the evaluation's `eval/*` metrics to the tenant's history run and tag the version with them."""
    tracker = shared_tracker()
    run_id = tracker.log_evaluation_history(tenant_id, registry_version, metrics)
    tracker.set_version_tags(tenant_id, registry_version, metrics)
    return run_id


def simulator_metrics(evaluation: dict[str, Any]) -> dict[str, float]:
    """The `eval/*` metrics of an evaluation workload's result."""
    return {f"eval/{k}": float(evaluation[k]) for k in ("success_rate", "mean_return", "mean_length")}
