"""Prefect flows over the JoyNexus library: recipes, not logic.

* `tenant_lifecycle`: create the tenant from its spec (validates the dataset) → train (the Master
  registers, measures and promotes the new version) → read the Master's promotion decision.
* `periodic_evaluation`: for each tenant with a `candidate`, promote it by the Master's rule, resolve
  its `champion` once, measure that version by the tenant's metric and append the result to the
  tenant's evaluation history in MLflow.

Promotion has ONE rule, the Master's (`joynexus.master.workloads.promotion`); flows call it.

Both are clients of the deployment's ONE Master Service through `joynexus.connect.shared()`: the
named actors of a running deployment (`joynexus up`, or `JOYNEXUS_RAY_ADDRESS`), else an in-process
deployment. Flow runs never drive training themselves, so any number of them run at once.
Deployments of both flows are declared in `prefect.yaml` at the repository root.
"""
