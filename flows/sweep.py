"""`sweep`: fork a tenant into N variants (learning rate / seed / module size), train them side by
side on the one backbone, score each, log one comparison to MLflow and promote the best.

    .venv/bin/python -m flows.sweep my-tenant --grid '{"learning_rate": [1e-3, 3e-3], "seed": [0, 1]}' --jobs 2

Thin over `joynexus.master.sweeps`: the variants are real tenants (forks of the source version, or
new tenants from its spec for another module size) and train through the service's queues, so the
actor loop groups their jobs. Promotion: when the best variant is a fork (same module as the
source), its weights are installed as the source's next version (checked, checkpointed, served,
registered with the sweep as provenance) and the source's own promotion rule decides whether its
champion moves; a best variant with another module size is promoted in its own registered model.
"""

from __future__ import annotations

import hashlib
import json
import sys
import uuid
from typing import Annotated, Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import Field

from flows.tasks import artifact_key, shared_tracker
from joynexus.connect import shared
from joynexus.master import sweeps


@task(name="create-variants", cache_policy=NO_CACHE)
def create_variants(
    source_id: str, version: int | None, variants: list[sweeps.SweepVariant], sweep_id: str
) -> list[dict[str, Any]]:
    """Every variant's tenant, or none: a variant that cannot be made removes the ones made before it."""
    master = shared().master
    created: list[dict[str, Any]] = []
    try:
        for index, variant in enumerate(variants):
            tenant_id = sweeps.variant_tenant_id(source_id, sweep_id, index)
            created.append(sweeps.create_variant(master, source_id, version, variant, tenant_id))
    except BaseException:
        for made in created:
            master.delete_tenant(made["tenant_id"], delete_artifacts=True)
        raise
    return created


@task(name="train-variants", cache_policy=NO_CACHE)
def train_variants(tenant_ids: list[str], jobs: int | None, timeout_s: float) -> list[Any]:
    """All variants' workloads at once (grouped on the shared backbone); their final statuses."""
    cluster = shared()
    return sweeps.train_side_by_side(cluster.master, cluster.wait_workload, tenant_ids, jobs, timeout_s)


@task(name="log-sweep", retries=2, retry_delay_seconds=5, cache_policy=NO_CACHE)
def log_comparison(sweep_id: str, source_id: str, rows: list[dict[str, Any]], best: int | None) -> str:
    return sweeps.log_sweep(shared_tracker(), sweep_id, source_id, rows, best)


@task(name="promote-best", cache_policy=NO_CACHE)
def promote_best(source_id: str, sweep_id: str, row: dict[str, Any], adopt: bool) -> dict[str, Any]:
    """Adopt a forked best into the source (install its weights, then the source's promotion rule),
    or promote a new-module best in its own registered model."""
    cluster = shared()
    if adopt:
        weights = cluster.training.export_params(row["tenant_id"])
        provenance = f"sweep {sweep_id}: {row['tenant_id']} v{row['version']} ({row['variant']})"
        # As the API's install does: the Master admits, the weights go to the Training Model Service
        # (never through the Master), the tenant's producer replica serves and registers the version.
        cluster.master.admit_weights_install(source_id, source=provenance)
        manifest = cluster.training.install_weights(source_id, weights)
        installed = cluster.master.publish_installed_weights(
            source_id, int(manifest["policy_version"]), source=provenance,
            sha256=hashlib.sha256(weights).hexdigest(), installed_by="sweep",
        )  # fmt: skip
        decision = cluster.master.promote(source_id, installed["registered_version"])
        return {"tenant_id": source_id, "adopted": True, "installed_version": installed["version"], **decision}
    decision = cluster.master.promote(row["tenant_id"], row["registered_version"])
    return {"tenant_id": row["tenant_id"], "adopted": False, **decision}


@flow(name="sweep", log_prints=True)
def sweep(
    tenant_id: str,
    grid: dict[str, list[Any]] | None = None,
    variants: list[dict[str, Any]] | None = None,
    version: Annotated[int, Field(ge=0)] | None = None,
    jobs: Annotated[int, Field(ge=1)] | None = None,
    adopt_best: bool = True,
    train_timeout_s: Annotated[float, Field(gt=0)] = 21600.0,
) -> dict[str, Any]:
    """Fork `tenant_id`'s `version` (None: its current one) into the variants of `grid` or
    `variants`, train them side by side, compare them in MLflow and promote the best.

    Args:
        tenant_id: The source tenant.
        grid: Field -> values (learning_rate, seed, module_size); every combination is a variant.
        variants: Or an explicit list of variants (dicts of those fields).
        version: A kept checkpoint version of the source; None: its current training version.
        jobs: Training jobs per variant; default: the spec's completion target.
        adopt_best: Install the best forked variant's weights into the source and run its promotion rule.
        train_timeout_s: Seconds all variants together may train; then unfinished ones are cancelled.
    """
    log = get_run_logger()
    chosen = sweeps.expand_variants(grid, variants)
    sweep_id = uuid.uuid4().hex[:8]
    created = create_variants(tenant_id, version, chosen, sweep_id)
    log.info("sweep %s: %d variants of %s: %s", sweep_id, len(created), tenant_id, [c["tenant_id"] for c in created])
    finals = train_variants([c["tenant_id"] for c in created], jobs, train_timeout_s)
    rows = sweeps.comparison_rows(created, chosen, finals)
    best = sweeps.pick_best(rows)
    run_id = log_comparison(sweep_id, tenant_id, rows, best)
    promotion = None
    if best is not None:
        forked = created[best]["forked_from"] is not None
        promotion = promote_best(tenant_id, sweep_id, rows[best], adopt_best and forked)
    result = {"sweep_id": sweep_id, "run_id": run_id, "rows": rows, "best": best, "promotion": promotion}
    create_markdown_artifact(key=artifact_key("sweep", tenant_id, sweep_id), markdown=_summary(result))
    return result


def _summary(result: dict[str, Any]) -> str:
    lines = ["| variant | tenant | state | metric | value | wall s |", "|---|---|---|---|---|---|"]
    for i, row in enumerate(result["rows"]):
        mark = " **best**" if i == result["best"] else ""
        value = "-" if row["value"] is None else f"{row['value']:.4g}"
        lines.append(
            f"| {row['variant']}{mark} | `{row['tenant_id']}` | {row['state']} | {row['metric']} | {value} "
            f"| {row['wall_seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=sweep.description)
    parser.add_argument("tenant", help="the source tenant")
    parser.add_argument("--grid", type=json.loads, default=None, help='JSON, e.g. {"learning_rate": [1e-3, 3e-3]}')
    parser.add_argument("--variants", type=json.loads, default=None, help='JSON list, e.g. [{"seed": 1}]')
    parser.add_argument("--version", type=int, default=None)
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    result = sweep(args.tenant, grid=args.grid, variants=args.variants, version=args.version, jobs=args.jobs)
    print(_summary(result))


if __name__ == "__main__":
    main(sys.argv[1:])
