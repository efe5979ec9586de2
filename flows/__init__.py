"""Prefect flows over the JoyNexus library: recipes, not logic.

* `tenant_lifecycle`: create the tenant from its spec (validates the dataset) → train → evaluate
  → read the registered version → promote (`joynexus.registry.promote`).
* `periodic_evaluation`: for each tenant, resolve its `champion` once, evaluate that version and
  append the result to the tenant's evaluation history in MLflow.

Both are clients of the deployment's ONE Master Service through `joynexus.connect.shared()`: the
named actors of a running deployment (`joynexus up`, or `JOYNEXUS_RAY_ADDRESS`), else an in-process
deployment. Flow runs never drive training themselves, so any number of them run at once.
Deployments of both flows are declared in `prefect.yaml` at the repository root.
"""
