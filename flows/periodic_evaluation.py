"""`periodic_evaluation`: every tenant with a `candidate`: promote it by the Master's rule if it is
not the champion, evaluate the `champion` by the tenant's promotion metric, keep its history in MLflow.

Scheduled by the `periodic-evaluation/hourly` deployment of `prefect.yaml`; locally:

    .venv/bin/python -m flows.periodic_evaluation [tenant ...]
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import Field

from flows.tasks import (
    artifact_key,
    evaluate_version,
    load_registered_version,
    log_evaluation_history,
    measure_version,
    promote_version,
    resolve_alias,
    simulator_metrics,
)
from joynexus.connect import shared
from joynexus.registry import CANDIDATE_ALIAS, CHAMPION_ALIAS
from joynexus.spec import PromotionMetric


@flow(name="periodic-evaluation", log_prints=True)
def periodic_evaluation(
    tenants: list[str] | None = None,
    episodes: Annotated[int, Field(ge=1, le=256)] = 4,
    alias: str = CHAMPION_ALIAS,
    eval_timeout_s: Annotated[float, Field(gt=0)] = 3600.0,
) -> dict[str, dict[str, Any]]:
    """Evaluate the version each tenant's alias names and log it to the tenant's MLflow history.

    Every tenant with a `candidate` (whatever path trained it: API, main job, flow) is covered.
    When the alias is `champion` and the candidate is another version, the Master's promotion rule
    runs on the candidate first (its measurement may have failed at publish). Then the alias is
    resolved ONCE to a registry version and measured by the tenant's promotion metric: simulator
    success rate (the payload fetched from the registry, digest-checked, served and evaluated in
    the tenant's environment) or held-out loss (in the Master, on `dataset.validation_episodes`).
    The metrics are appended to the tenant's evaluation-history run and tagged on the version.
    Tenants without a candidate or without a measurable metric are skipped; a tenant whose
    evaluation fails does not stop the others (the flow run fails at the end).

    Args:
        tenants: Tenant ids to evaluate; default: every tenant.
        episodes: Evaluation episodes per tenant with a simulator.
        alias: The registry alias to evaluate (`champion`, or e.g. `candidate`).
        eval_timeout_s: Seconds each evaluation may take.
    """
    logger = get_run_logger()
    master = shared().master
    names = tenants if tenants is not None else [t.tenant_id for t in master.list_tenants()]
    results: dict[str, dict[str, Any]] = {}
    failures: list[str] = []
    for tenant_id in names:
        try:
            tenant = master.get_tenant(tenant_id)
        except KeyError:
            failures.append(tenant_id)
            results[tenant_id] = {"status": "failed", "reason": "no such tenant"}
            continue
        metric = tenant.spec.promotion_metric()
        candidate = resolve_alias(tenant_id, CANDIDATE_ALIAS)
        if candidate is None:
            logger.info("tenant %s has no %r version yet; skipped", tenant_id, CANDIDATE_ALIAS)
            results[tenant_id] = {"status": "skipped", "reason": f"no {CANDIDATE_ALIAS} alias"}
            continue
        if metric is None:
            reason = "no promotion metric (no environment, nothing held out)"
            results[tenant_id] = {"status": "skipped", "reason": reason}
            continue
        pinned = None
        try:
            if alias == CHAMPION_ALIAS and candidate["registry_version"] != _version(resolve_alias(tenant_id, alias)):
                promote_version(tenant_id, candidate["registry_version"])
            pinned = resolve_alias(tenant_id, alias)
            if pinned is None:
                results[tenant_id] = {"status": "skipped", "reason": f"no {alias} alias"}
                continue
            evaluation = None
            if metric is PromotionMetric.SUCCESS_RATE:
                served = load_registered_version(tenant_id, pinned["registry_version"])
                evaluation = evaluate_version.with_options(timeout_seconds=eval_timeout_s)(
                    tenant_id, served, episodes, eval_timeout_s
                )
                metrics = simulator_metrics(evaluation)
            else:
                metrics = measure_version(tenant_id, pinned["registry_version"])
            history_run = log_evaluation_history(tenant_id, pinned["registry_version"], metrics)
        except Exception as error:  # one tenant's failure does not stop the others' evaluations
            logger.error("tenant %s: evaluation of %s %s failed: %s", tenant_id, alias, pinned, error)
            failures.append(tenant_id)
            results[tenant_id] = {"status": "failed", "reason": f"{type(error).__name__}: {error}", **(pinned or {})}
            continue
        results[tenant_id] = {
            "status": "evaluated", **pinned, "metrics": metrics, "evaluation": evaluation, "history_run": history_run,
        }  # fmt: skip

    create_table_artifact(
        key=artifact_key("periodic-evaluation", alias),
        table=[_row(tenant_id, entry) for tenant_id, entry in results.items()],
        description=f"evaluation of each tenant's {alias!r} version",
    )
    if failures:
        raise RuntimeError(f"evaluation failed for tenants {failures}; see the task runs")
    return results


def _version(pinned: dict[str, Any] | None) -> int | None:
    return None if pinned is None else int(pinned["registry_version"])


def _row(tenant_id: str, entry: dict[str, Any]) -> dict[str, Any]:
    metrics = entry.get("metrics") or {}
    return {
        "tenant": tenant_id,
        "status": entry["status"],
        "registry version": entry.get("registry_version", "-"),
        "policy version": entry.get("policy_version", "-"),
        "success rate": metrics.get("eval/success_rate", "-"),
        "held-out loss": metrics.get("eval/heldout_loss", "-"),
        "note": entry.get("reason", ""),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(periodic_evaluation(tenants=sys.argv[1:] or None), indent=2, default=str))
