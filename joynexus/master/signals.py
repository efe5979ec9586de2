"""What the Master Service tells a metrics scrape (`joynexus.ops.metrics`): control and learning
signals read from the control-plane store in a few aggregate queries, as plain JSON-able data (it
travels back from the Ray actor).

- control: training jobs by tenant and state (the Training Scheduler's counts), the age of the
  oldest held lease per leased state, workloads by tenant, task and state, the oldest queued
  workload's wait per tenant (admission wait), metered device-seconds by tenant and category
  (usage rows of the Inference Model and Environment Services and the tenant API, plus the stored
  results of completed training jobs);
- learning: per tenant, the latest loss, PPO statistics and rollout returns, from the newest
  `step`, `rl_update` and `job_completed` workload events (one query over a bounded window of the
  most recent events: the events table only grows, a scrape must not scan all of it).

The same learning signals go to MLflow as the workload runs (`TrainingWorkloads.on_outcome`); these
are their latest values for dashboards and alerts.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from sqlalchemy import func, select

from joynexus.core.store import (
    ControlPlaneStore,
    TrainingJobRecord,
    UsageRecord,
    WorkloadEventRecord,
    WorkloadRecord,
)
from joynexus.scheduling.training_scheduler import COMPLETED, LEASED_STATES

# How far back (in events, across all tenants) the learning signals look.
EVENT_WINDOW = 100_000
LEARNING_KINDS = ("step", "rl_update", "job_completed", "evaluated")
# Event field -> learning signal name.
_STEP_FIELDS = {"loss": "loss", "step": "optimizer_steps"}
_RL_FIELDS = {
    "rl/approx_kl": "approx_kl",
    "rl/clip_fraction": "clip_fraction",
    "rl/entropy": "entropy",
    "rl/value_loss": "value_loss",
    "rollout/mean_return": "mean_return",
    "rollout/success_rate": "success_rate",
    "rollout/mean_length": "mean_episode_length",
}
_JOB_FIELDS = {"version": "policy_version"}
_EVAL_FIELDS = {
    "eval/success_rate": "eval_success_rate",
    "eval/mean_return": "eval_mean_return",
    "eval/mean_length": "eval_mean_episode_length",
    "version": "eval_policy_version",
}
_FIELDS = {"step": _STEP_FIELDS, "rl_update": _RL_FIELDS, "job_completed": _JOB_FIELDS, "evaluated": _EVAL_FIELDS}


def learning_signals(store: ControlPlaneStore, *, window: int = EVENT_WINDOW) -> dict[str, dict[str, float]]:
    """Per tenant: its latest `loss` (and `optimizer_steps`), the PPO statistics of its latest RL
    update (`approx_kl`, `clip_fraction`, `entropy`, `value_loss` where the algorithm has a critic),
    the rollout episodes of that update (`mean_return`, `success_rate`, `mean_episode_length`, when
    episodes finished since the one before), `policy_version`, the latest evaluation's
    `eval_success_rate`, `eval_mean_return`, `eval_mean_episode_length` and `eval_policy_version`
    (deterministic actions, fixed episodes: comparable across versions), and `updated_at` (unix time of the
    newest of those events). Tenants with no such event in the last `window` events are absent."""
    floor = select(func.max(WorkloadEventRecord.seq)).scalar_subquery() - window
    latest = (
        select(func.max(WorkloadEventRecord.seq).label("seq"))
        .where(WorkloadEventRecord.kind.in_(LEARNING_KINDS), WorkloadEventRecord.seq > floor)
        .group_by(WorkloadEventRecord.tenant_id, WorkloadEventRecord.kind)
        .subquery()
    )
    query = (
        select(WorkloadEventRecord)
        .join(latest, WorkloadEventRecord.seq == latest.c.seq)
        .order_by(WorkloadEventRecord.seq)
    )
    signals: dict[str, dict[str, float]] = {}
    with _read(store) as s:
        for event in s.scalars(query):
            out = signals.setdefault(event.tenant_id, {})
            for field, name in _FIELDS[event.kind].items():
                value = (event.data or {}).get(field)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    out[name] = float(value)  # ordered by seq: a later event's value wins
            out["updated_at"] = max(out.get("updated_at", 0.0), float(event.time))
    return signals


def control_signals(store: ControlPlaneStore, *, now: float | None = None) -> dict[str, Any]:
    """Jobs, leases, workloads, admission waits and metered device-seconds (see the module doc)."""
    now = time.time() if now is None else now
    jobs_q = select(TrainingJobRecord.tenant_id, TrainingJobRecord.state, func.count()).group_by(
        TrainingJobRecord.tenant_id, TrainingJobRecord.state
    )
    leases_q = (
        select(TrainingJobRecord.state, func.min(TrainingJobRecord.leased_at))
        .where(TrainingJobRecord.state.in_(list(LEASED_STATES)))
        .group_by(TrainingJobRecord.state)
    )
    workloads_q = select(
        WorkloadRecord.tenant_id, WorkloadRecord.task, WorkloadRecord.state, func.count(),
        func.min(WorkloadRecord.created_at),
    ).group_by(WorkloadRecord.tenant_id, WorkloadRecord.task, WorkloadRecord.state)  # fmt: skip
    usage_q = select(
        UsageRecord.tenant_id, UsageRecord.category, func.sum(UsageRecord.device_seconds),
        func.sum(UsageRecord.samples), func.sum(UsageRecord.env_steps),
    ).group_by(UsageRecord.tenant_id, UsageRecord.category)  # fmt: skip
    # Completed jobs' results hold their training time (what the ledger charges); small JSON rows.
    trained_q = select(TrainingJobRecord.tenant_id, TrainingJobRecord.result).where(
        TrainingJobRecord.state == COMPLETED
    )
    oldest_queued: dict[str, float] = {}
    workloads: list[list[Any]] = []
    training_seconds: dict[str, float] = {}
    training_samples: dict[str, int] = {}
    with _read(store) as s:
        jobs = [[tenant, state, int(n)] for tenant, state, n in s.execute(jobs_q)]
        lease_ages = {
            state: max(0.0, now - _unix(oldest)) for state, oldest in s.execute(leases_q) if oldest is not None
        }
        for tenant, task, state, n, oldest in s.execute(workloads_q):
            workloads.append([tenant, task, state, int(n)])
            if state == "queued" and oldest is not None:
                wait = max(0.0, now - _unix(oldest))
                oldest_queued[tenant] = max(oldest_queued.get(tenant, 0.0), wait)
        usage = [
            [tenant, category, float(seconds or 0.0), int(samples or 0), int(steps or 0)]
            for tenant, category, seconds, samples, steps in s.execute(usage_q)
        ]
        for tenant, result in s.execute(trained_q):
            if isinstance(result, dict):
                training_seconds[tenant] = training_seconds.get(tenant, 0.0) + float(result.get("seconds") or 0.0)
                training_samples[tenant] = training_samples.get(tenant, 0) + int(result.get("samples") or 0)
    return {
        "time": now,
        "jobs": jobs,
        "oldest_lease_age_seconds": lease_ages,
        "workloads": workloads,
        "oldest_queued_wait_seconds": oldest_queued,
        "usage": usage,
        "training_job_seconds": training_seconds,
        "training_job_samples": training_samples,
    }


def _read(store: ControlPlaneStore) -> Any:
    """A read-only transaction where the store has one (SQLite: no write lock, so a scrape neither
    waits for nor blocks the scheduler's writers), else an ordinary one."""
    read = getattr(store, "read", None)
    return read() if read is not None else store.transaction()


def _unix(value: dt.datetime) -> float:
    """SQLite gives naive datetimes back (stored as UTC); PostgreSQL aware ones."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.timestamp()
