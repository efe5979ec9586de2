"""`periodic_evaluation`: evaluate each tenant's `champion` and keep its history in MLflow.

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
    resolve_alias,
)
from joynexus.connect import shared
from joynexus.registry import CHAMPION_ALIAS


@flow(name="periodic-evaluation", log_prints=True)
def periodic_evaluation(
    tenants: list[str] | None = None,
    episodes: Annotated[int, Field(ge=1, le=256)] = 4,
    alias: str = CHAMPION_ALIAS,
    eval_timeout_s: Annotated[float, Field(gt=0)] = 3600.0,
) -> dict[str, dict[str, Any]]:
    """Evaluate the version each tenant's alias names and log it to the tenant's MLflow history.

    For each tenant the alias is resolved ONCE to a registry version; that version's payload is
    fetched from the registry (digest-checked), served by the Inference Model Service and evaluated
    in the tenant's environment; the metrics are appended to the tenant's evaluation-history run and
    tagged on the version. Tenants without an environment or without the alias are skipped; a tenant
    whose evaluation fails does not stop the others (the flow run fails at the end).

    Args:
        tenants: Tenant ids to evaluate; default: every tenant that declares an environment.
        episodes: Evaluation episodes per tenant.
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
        if tenant.backend_config.environment is None:
            if tenants is not None:
                logger.warning("tenant %s declares no environment; skipped", tenant_id)
            results[tenant_id] = {"status": "skipped", "reason": "no environment"}
            continue
        pinned = resolve_alias(tenant_id, alias)
        if pinned is None:
            logger.info("tenant %s has no %r version yet; skipped", tenant_id, alias)
            results[tenant_id] = {"status": "skipped", "reason": f"no {alias} alias"}
            continue
        try:
            served = load_registered_version(tenant_id, pinned["registry_version"])
            evaluation = evaluate_version.with_options(timeout_seconds=eval_timeout_s)(
                tenant_id, served, episodes, eval_timeout_s
            )
            history_run = log_evaluation_history(tenant_id, pinned["registry_version"], evaluation)
        except Exception as error:  # one tenant's failure does not stop the others' evaluations
            logger.error("tenant %s: evaluation of %s v%s failed: %s", tenant_id, alias, pinned, error)
            failures.append(tenant_id)
            results[tenant_id] = {"status": "failed", "reason": f"{type(error).__name__}: {error}", **pinned}
            continue
        results[tenant_id] = {"status": "evaluated", **pinned, "evaluation": evaluation, "history_run": history_run}

    create_table_artifact(
        key=artifact_key("periodic-evaluation", alias),
        table=[_row(tenant_id, entry) for tenant_id, entry in results.items()],
        description=f"evaluation of each tenant's {alias!r} version",
    )
    if failures:
        raise RuntimeError(f"evaluation failed for tenants {failures}; see the task runs")
    return results


def _row(tenant_id: str, entry: dict[str, Any]) -> dict[str, Any]:
    evaluation = entry.get("evaluation") or {}
    return {
        "tenant": tenant_id,
        "status": entry["status"],
        "registry version": entry.get("registry_version", "-"),
        "policy version": entry.get("policy_version", "-"),
        "success rate": evaluation.get("success_rate", "-"),
        "mean return": evaluation.get("mean_return", "-"),
        "note": entry.get("reason", ""),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(periodic_evaluation(tenants=sys.argv[1:] or None), indent=2, default=str))
