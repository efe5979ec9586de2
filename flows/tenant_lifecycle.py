"""`tenant_lifecycle`: create → validate → train → register → evaluate → promote, for one tenant.

Run it locally (an in-process deployment, or the one `joynexus up` started on this host):

    .venv/bin/python -m flows.tenant_lifecycle examples/specs/sft.yaml --jobs 2

or as the `tenant-lifecycle/on-demand` deployment of `prefect.yaml` through a Prefect worker.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import Field

from flows.tasks import artifact_key, create_tenant, promote_version, train
from joynexus.connect import shared
from joynexus.spec import WorkloadSpec


@flow(name="tenant-lifecycle", log_prints=True)
def tenant_lifecycle(
    spec: WorkloadSpec,
    jobs: Annotated[int, Field(ge=1)] | None = None,
    train_timeout_s: Annotated[float, Field(gt=0)] = 21600.0,
) -> dict[str, Any]:
    """Create the tenant from its spec, train it, register, evaluate and promote the new version.

    The tenant creator validates the spec against the resident backbone and the dataset (Great
    Expectations); the training workload (SFT or RL) checkpoints, exports and registers the trained
    policy in MLflow, and the Master's promotion rule runs on it (the same rule for every path:
    `candidate` moves to the new version; it is measured by the spec's `promotion.metric`,
    simulator success rate or held-out loss, the metrics logged on the version; `champion` moves if
    it wins). The flow reads that decision back from the Master.

    Args:
        spec: The tenant's workload spec (as `joynexus tenant create` takes it).
        jobs: Training jobs of this run; default: the spec's completion target.
        train_timeout_s: Seconds the training workload (with its promotion) may take; then it is cancelled.
    """
    store = shared().settings.resolved_database_url()
    tenant = create_tenant(spec, store)
    tenant_id = tenant["tenant_id"]
    if tenant["task"] not in ("sft", "rl"):
        raise ValueError(f"spec.task: tenant {tenant_id!r} is a {tenant['task']!r} tenant; only sft / rl train")

    trained = train.with_options(timeout_seconds=train_timeout_s)(tenant_id, jobs, train_timeout_s)
    registered = int(trained["registered_version"])  # the workload exported, registered and promoted it
    # The Master promoted the version as it published it (the same rule as every path); only if
    # that failed (the workload says so) does the flow ask the Master's rule again.
    decision = (trained.get("result") or {}).get("promotion") or promote_version(tenant_id, registered)
    evaluation = None
    if decision["value"] is not None:
        evaluation = {"metric": decision["metric"], "value": decision["value"], "policy_version": trained["version"]}
    else:
        get_run_logger().info("tenant %s: no measured promotion metric (%s)", tenant_id, decision["reason"])
    result = {"tenant": tenant, "training": trained, "evaluation": evaluation, "promotion": decision}
    create_markdown_artifact(
        key=artifact_key("lifecycle", tenant_id), markdown=_summary(result), description=f"tenant {tenant_id}"
    )
    return result


def _summary(result: dict[str, Any]) -> str:
    training, evaluation, decision = result["training"], result["evaluation"], result["promotion"]
    rows = [
        ("tenant", f"`{result['tenant']['tenant_id']}` ({result['tenant']['task']})"),
        ("workload", f"`{training['workload_id']}`: {training['completed_jobs']}/{training['target_jobs']} jobs, "
                     f"{training['optimizer_steps']} steps, last loss {training['last_loss']}"),
        ("policy version", str(training["version"])),
        ("registered model version", f"v{training['registered_version']} (MLflow run `{training['run_id']}`)"),
        ("evaluation", "-" if evaluation is None else f"{evaluation['metric']} {evaluation['value']:.4g}"),
        ("candidate", f"v{decision['version']}"),
        ("champion", f"v{decision['champion']} ({'moved' if decision['promoted'] else 'kept'}: {decision['reason']})"),
    ]  # fmt: skip
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from flows.failures import run_or_exit
    from joynexus.spec import SpecError, parse_workload_spec

    parser = argparse.ArgumentParser(description=tenant_lifecycle.description)
    parser.add_argument("spec", help="workload spec file (YAML or JSON)")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        spec = parse_workload_spec(args.spec)
    except SpecError as error:  # before any flow run: the spec's own refusal, field by field
        print(f"tenant-lifecycle: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    result = run_or_exit(lambda: tenant_lifecycle(spec, jobs=args.jobs, return_state=True), "tenant-lifecycle")
    print(_summary(result))


if __name__ == "__main__":
    main(sys.argv[1:])
