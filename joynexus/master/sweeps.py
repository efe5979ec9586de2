"""Hyperparameter sweeps over one tenant (issue 28.5): the library the `sweep` Prefect flow and
`benchmarks/sweep.py` are thin over.

A sweep turns a source tenant's version into N variants — a grid (every combination) or a list of
learning rate / seed / module size — each a tenant of its own: a fork of the source version
(`state_control.fork_tenant`) when only the learning rate or seed changes, a new tenant from the
source's spec when the module size changes (other weights shapes: nothing to fork). All variants
train side by side: their workloads are submitted together, so the actor loop leases their jobs as
one group and steps them through ONE shared backbone forward per round (`train_jobs`). Each is then
scored by its promotion metric (held-out loss or simulator success rate, measured by the Master as
it registers the version; the last training loss when the tenant declares no metric), the
comparison goes to MLflow as one parent run with a child run per variant, and the best is promoted.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from joynexus.registry import ExperimentTracker
from joynexus.spec import MAX_TRAINING_SEED, SpecError, parse_workload_spec

__all__ = [
    "MAX_SWEEP_VARIANTS",
    "SweepVariant",
    "create_variant",
    "comparison_rows",
    "expand_variants",
    "log_sweep",
    "pick_best",
    "score",
    "train_side_by_side",
    "variant_tenant_id",
    "wall_seconds",
]

MAX_SWEEP_VARIANTS = 64
SWEEP_TASK_TAG = "sweep"
SWEEP_TABLE_FILE = "sweep_comparison.json"
# Promotion metric -> (MLflow name, higher is better); the fallback when a tenant declares none.
METRICS = {"success_rate": ("eval/success_rate", True), "heldout_loss": ("eval/heldout_loss", False)}
FALLBACK_METRIC = ("train/last_loss", False)


class SweepVariant(BaseModel):
    """One variant's changes to its source (None: the source's)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    learning_rate: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_TRAINING_SEED)
    module_size: str | None = Field(default=None, min_length=1, max_length=32)  # checked by the tenant creator

    def label(self) -> str:
        parts = [f"{k}={v}" for k, v in self.model_dump(exclude_none=True).items()]
        return ",".join(parts) or "source"


def expand_variants(
    grid: dict[str, list[Any]] | None = None, variants: list[dict[str, Any]] | None = None
) -> list[SweepVariant]:
    """The variants of a `grid` (every combination of its value lists, in order) or a `variants`
    list; exactly one of the two. ValueError names the field (`grid.<name>`, `variants[i].<name>`)."""
    if (grid is None) == (variants is None):
        raise ValueError("grid: give either grid (field -> list of values) or variants (a list), not both or neither")
    fields = tuple(SweepVariant.model_fields)
    if grid is not None:
        if not isinstance(grid, dict) or not grid:
            raise ValueError(f"grid: {grid!r} must map some of {list(fields)} to lists of values")
        for name, values in grid.items():
            if name not in fields:
                raise ValueError(f"grid.{name}: not a sweep field (one of {list(fields)})")
            if not isinstance(values, list | tuple) or not values:
                raise ValueError(f"grid.{name}: {values!r} must be a non-empty list of values")
        names = list(grid)
        variants = [dict(zip(names, combo, strict=True)) for combo in itertools.product(*grid.values())]
        where = "grid"
    else:
        if not isinstance(variants, list) or not variants:
            raise ValueError(f"variants: {variants!r} must be a non-empty list of variants")
        where = "variants"
    if len(variants) > MAX_SWEEP_VARIANTS:
        raise ValueError(f"{where}: {len(variants)} variants, at most {MAX_SWEEP_VARIANTS}")
    out: list[SweepVariant] = []
    for i, item in enumerate(variants):
        try:
            variant = SweepVariant.model_validate(item)
        except ValidationError as error:
            first = error.errors()[0]
            name = ".".join(str(p) for p in first["loc"])
            field = f"grid.{name}" if where == "grid" else f"variants[{i}].{name}"
            raise ValueError(f"{field}: {first['msg']} (got {first.get('input')!r})") from None
        if variant in out:
            raise ValueError(f"{where}: variant {variant.label()} appears twice")
        out.append(variant)
    return out


def variant_tenant_id(source: str, sweep_id: str, index: int) -> str:
    """A variant's tenant id: the source's (shortened to fit the id pattern), the sweep, the index."""
    suffix = f"-sw{sweep_id[:8]}-{index}"
    return source[: 63 - len(suffix)].rstrip("-._") + suffix


def create_variant(master: Any, source_id: str, version: int | None, variant: SweepVariant, tenant_id: str) -> dict:
    """The variant's tenant: a fork of `source_id`'s `version` (learning rate / seed), or with a
    module size a new tenant from the source's spec (trained from its seed, no weights copied)."""
    overrides = variant.model_dump(exclude_none=True, exclude={"module_size"})
    if variant.module_size is None:
        forked = master.fork_tenant(source_id, tenant_id, version=version, overrides=overrides)
        return {"tenant_id": tenant_id, "forked_from": forked["forked_from"], "variant": variant.label()}
    spec = master.get_tenant(source_id).spec.model_dump(mode="json")
    spec["tenant"] = tenant_id
    spec["action_module"] = {**spec["action_module"], "size": variant.module_size}
    spec["training"] = {**spec["training"], **overrides}
    try:
        master.create_tenant(parse_workload_spec(spec))
    except SpecError as error:
        renamed = {"action_module.size": "module_size", "training.learning_rate": "learning_rate"}
        raise SpecError([(renamed.get(f, f), r) for f, r in error.problems]) from None
    return {"tenant_id": tenant_id, "forked_from": None, "variant": variant.label()}


def train_side_by_side(
    master: Any, wait: Callable[[str, float], Any], tenant_ids: list[str], jobs: int | None, timeout_s: float
) -> list[Any]:
    """Submit every variant's training workload, then wait for each: the actor loop sees all their
    jobs at once and trains them grouped. Returns the final WorkloadInfo of each, in order; a
    workload that did not finish in `timeout_s` is cancelled."""
    submitted = [master.submit_workload(tenant_id, jobs=jobs) for tenant_id in tenant_ids]
    deadline = time.monotonic() + timeout_s
    finals = []
    for status in submitted:
        final = wait(status.workload_id, max(1.0, deadline - time.monotonic()))
        if not final.done:
            master.cancel_workload(status.workload_id)
        finals.append(final)
    return finals


def score(status: Any) -> dict[str, Any]:
    """A variant's score from its training workload: the promotion metric the Master measured when it
    registered the version, else the last training loss. {metric, value, higher_is_better}."""
    decision = (status.result or {}).get("promotion") or {}
    metric, value = decision.get("metric"), decision.get("value")
    for name, (mlflow_name, higher) in METRICS.items():
        if value is not None and metric in (name, mlflow_name):
            return {"metric": mlflow_name, "value": float(value), "higher_is_better": higher}
    name, higher = FALLBACK_METRIC
    return {"metric": name, "value": status.last_loss, "higher_is_better": higher}


def pick_best(rows: list[dict[str, Any]]) -> int | None:
    """Index of the best completed, scored row (by its metric's direction); None if none is."""
    scored = [(i, r) for i, r in enumerate(rows) if r.get("state") == "completed" and r.get("value") is not None]
    if not scored:
        return None
    if len({r["metric"] for _, r in scored}) > 1:
        raise ValueError(f"variants were scored by different metrics: {sorted({r['metric'] for _, r in scored})}")
    sign = 1.0 if scored[0][1]["higher_is_better"] else -1.0
    return max(scored, key=lambda item: sign * float(item[1]["value"]))[0]


def log_sweep(
    tracker: ExperimentTracker, sweep_id: str, source_id: str, rows: list[dict[str, Any]], best: int | None
) -> str:
    """One parent run (the comparison table as an artifact, the best variant as tags) and a child
    run per variant (its changes as params, its score and wall time as metrics). Returns the
    parent's run id."""
    client = tracker.client
    tags = {"task": SWEEP_TASK_TAG, "sweep_id": sweep_id, "tenant_id": source_id}
    if best is not None:
        tags.update(best_tenant=rows[best]["tenant_id"], best_variant=rows[best]["variant"])
    parent = client.create_run(tracker.experiment_id, tags=tags, run_name=f"sweep-{sweep_id}").info.run_id
    client.log_param(parent, "variants", len(rows))
    for i, row in enumerate(rows):
        child_tags = {
            "mlflow.parentRunId": parent, "task": SWEEP_TASK_TAG, "sweep_id": sweep_id,
            "tenant_id": row["tenant_id"], "best": str(i == best).lower(),
        }  # fmt: skip
        child = client.create_run(tracker.experiment_id, tags=child_tags, run_name=row["tenant_id"]).info.run_id
        for key, value in row["changes"].items():
            client.log_param(child, key, value)
        client.log_param(child, "state", row["state"])
        metrics = {"wall_seconds": row["wall_seconds"]}
        if row.get("value") is not None:
            metrics[row["metric"]] = float(row["value"])
        tracker.log_metrics(child, metrics, step=0)
        client.set_terminated(child, status="FINISHED" if row["state"] == "completed" else "FAILED")
    table = [{k: json.dumps(v) if isinstance(v, dict) else v for k, v in row.items()} for row in rows]
    columns = sorted({key for row in table for key in row})
    client.log_table(parent, data={k: [row.get(k) for row in table] for k in columns}, artifact_file=SWEEP_TABLE_FILE)
    client.set_terminated(parent, status="FINISHED")
    return parent


def wall_seconds(status: Any) -> float | None:
    """Seconds from a workload's start to its end (None if it never started or ended)."""
    from datetime import datetime

    if not status.started_at or not status.finished_at:
        return None
    return (datetime.fromisoformat(status.finished_at) - datetime.fromisoformat(status.started_at)).total_seconds()


def comparison_rows(created: list[dict[str, Any]], variants: list[SweepVariant], finals: list[Any]) -> list[dict]:
    """One row per variant: its tenant, changes, workload outcome, version and score."""
    rows = []
    for made, variant, final in zip(created, variants, finals, strict=True):
        rows.append(
            {
                "tenant_id": made["tenant_id"], "variant": variant.label(),
                "changes": variant.model_dump(exclude_none=True), "state": final.state,
                "workload_id": final.workload_id, "version": final.version,
                "registered_version": final.registered_version, "last_loss": final.last_loss,
                "wall_seconds": wall_seconds(final) or 0.0, "error": final.error,
                **(score(final) if final.state == "completed" else {"metric": None, "value": None}),
            }
        )  # fmt: skip
    return rows
