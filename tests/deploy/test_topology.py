"""The deployment as its manifests say, run (slow; root; `kubectl` for kustomize): every Deployment /
Job container's own command, args and env, exec'd without a shell as uid 10001 in a memory cgroup
with its container's limit, each pod in a network namespace of its own (its own address; the Service
names in its /etc/hosts) and a mount namespace with its volumes and a read-only root; the RayCluster
as KubeRay starts it (`ray start` from rayStartParams, GCS fault tolerance in Redis) with one worker
declaring the GPU group's resources. Against PostgreSQL with SSL only, Redis with TLS and AUTH, and
moto's S3 (tests/deploy/topology.py). Then: a tenant created through the API, a lifecycle flow run
by the Prefect worker to Completed, its MLflow run and S3 objects, and the Ray head killed and
restarted with the services and their state intact.

    .venv/bin/python -m pytest -m slow tests/deploy/test_topology.py -s
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.deploy.topology import BUCKET
from tests.helpers import sft_spec, wait_for, write_dataset_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

HEAD = "joynexus-head"
# One Ray worker pod per role's group (issue 45.4): each role's actors need their group's resource.
WORKERS = tuple(f"joynexus-{role}-workers-worker" for role in ("training", "inference", "environment"))


def _require_host() -> None:
    if os.geteuid() != 0:
        pytest.skip("the topology test makes namespaces and cgroups: run it as root")
    if shutil.which("kubectl") is None or shutil.which("ip") is None or shutil.which("redis-server") is None:
        pytest.skip("needs kubectl (kustomize), iproute2 and redis-server")


class Timeline:
    def __init__(self):
        self.start = time.monotonic()
        self.marks: list[tuple[str, float]] = []

    def mark(self, what: str) -> None:
        self.marks.append((what, time.monotonic() - self.start))
        print(f"[topology {self.marks[-1][1]:7.1f}s] {what}", flush=True)


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    _require_host()
    from tests.deploy.topology import Topology

    base = Path("/var/tmp") / f"joynexus-topology-{os.getpid()}"  # not under /tmp: the pods mount their own
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    topology = Topology(base)
    topology.timeline = Timeline()
    try:
        topology.up_cloud()
        topology.plan()
        topology.timeline.mark("cloud stand-ins up, manifests rendered")
        _bring_up(topology)
        yield topology
    finally:
        _report(topology)
        topology.close()
        if os.environ.get("JOYNEXUS_TOPOLOGY_KEEP") != "1":
            shutil.rmtree(base, ignore_errors=True)


def _bring_up(t) -> None:
    """`kubectl apply -k`: every pod at once (the Prefect worker and its register Job: in the flow
    test), each readiness as its probe says, the db-users and services Jobs to completion. The apps
    restart until the db-users Job has made their database logins, as they would on a cluster."""
    pods, mark = t.pods, t.timeline.mark
    for pod in ("joynexus-db-users", HEAD, *WORKERS, "joynexus-services", "joynexus-api", "joynexus-mlflow",
                "joynexus-prefect"):  # fmt: skip
        t.start(pod)
    pods.wait_job("joynexus-db-users", 300)
    mark("db-users Job completed")
    _wait_ray_ready(t, HEAD)
    mark("Ray head ready")
    for worker in WORKERS:
        _wait_ray_ready(t, worker)
        mark(f"Ray worker {worker} ready")
    for pod in ("joynexus-mlflow", "joynexus-prefect"):
        pods.wait_http(pod, 900)
        mark(f"{pod} ready")
    pods.wait_job("joynexus-services", 1500)
    mark("services Job completed")
    pods.wait_http("joynexus-api", 900)
    mark("joynexus-api ready")


def _wait_ray_ready(t, pod: str, timeout_s: float = 600) -> None:
    """KubeRay's readiness probe: the raylet's health through the dashboard agent, and on the
    head the GCS's through the dashboard."""
    import urllib.request

    urls = [f"http://{t.pods.ips[pod]}:52365/api/local_raylet_healthz"]
    if pod == HEAD:
        urls.append(f"http://{t.pods.ips[pod]}:8265/api/gcs_healthz")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if all(b"success" in urllib.request.urlopen(url, timeout=2).read() for url in urls):
                return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"{pod}: not ready in {timeout_s}s (exits {t.pods.exits.get(pod)}):\n{t.pods.log(pod)}")


def _report(t) -> None:
    if not hasattr(t, "cgroups"):
        return
    wall, peak = time.monotonic() - t.timeline.start, t.cgroups.peak() / 2**30
    print(f"\n[topology] wall time {wall:.1f}s; peak memory of all pods together {peak:.2f} GiB")
    for pod in getattr(t, "plans", {}):
        if pod in t.pods.plans:
            print(f"[topology]   {pod}: peak {t.cgroups.peak(pod) / 2**30:.2f} GiB of "
                  f"{t.plans[pod].memory_limit / 2**30:.1f} GiB, OOM kills {t.cgroups.oom_kills(pod)}, "
                  f"exits {t.pods.exits.get(pod, [])}")  # fmt: skip


def _client(t, api_key: str):
    from joynexus.client import JoyNexusClient

    return JoyNexusClient(f"http://{t.pods.ips['joynexus-api']}:8765", api_key, timeout_s=300)


def _dataset_spec(t, tenant: str) -> dict:
    """An SFT spec whose dataset lies on the shared volume (/mnt/shared in the Ray pods)."""
    host_root = t.shared / "datasets" / tenant
    spec = sft_spec(tenant, host_root, jobs=2, samples_per_job=8, microbatch_size=8)
    write_dataset_for(spec, episodes=2, length=8)
    for path in [host_root.parent, *host_root.rglob("*"), host_root]:
        os.chown(path, 10001, 10001)
    spec["dataset"]["root"] = f"/mnt/shared/datasets/{tenant}"
    return spec


def _create_tenant(t, admin, tenant: str):
    """POST /v1/admin/tenants. A 503 means a role was away (a Ray actor call failed as unavailable:
    seen once with the host's load average at 150) and asks the caller to retry: retried, said."""
    from joynexus.client.errors import ServerError

    deadline = time.monotonic() + 300
    while True:
        try:
            return admin.create_tenant(_dataset_spec(t, tenant))
        except ServerError as error:
            if error.status_code != 503 or time.monotonic() > deadline:
                raise
            print(f"[topology] creating {tenant}: {error}; retried as the 503 asks", flush=True)
            time.sleep(5)


def test_a_tenant_created_through_the_api(topo):
    with _client(topo, topo.admin_key) as admin:
        created = _create_tenant(topo, admin, "topo-api")
        tenants = {t.tenant_id for t in admin.tenants()}
    assert created.tenant.tenant_id in tenants
    topo.api_tenant = created
    topo.timeline.mark(f"tenant {created.tenant.tenant_id} created through the API")


def test_an_upload_through_the_api_replica_is_trained_on_by_the_master(topo):
    """Issue 43.3: the API pod keeps an upload on its own volume, the Master (a Ray pod) resolves
    `dataset.id` on another: the upload reaches it through the tenant's prefix in the artifact store."""
    created = topo.api_tenant
    local = topo.base / "upload-src" / "arm"
    spec = sft_spec(created.tenant.tenant_id, local, jobs=2, samples_per_job=8, microbatch_size=8)  # as created
    write_dataset_for(spec, episodes=2, length=8)
    with _client(topo, created.key.api_key) as tenant:
        uploaded = tenant.upload_dataset(local, repo_id="topology/upload")
        keys = [o["Key"] for page in topo.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
                for o in page.get("Contents", [])]  # fmt: skip
        prefix = f"datasets/{created.tenant.tenant_id}/uploads/{uploaded.dataset_id}"
        assert f"{prefix}.json" in keys, f"{keys[:20]}\n--- api ---\n{topo.pods.log('joynexus-api')[-4000:]}"
        workload = {**spec, "dataset": {"id": uploaded.dataset_id, "repo_id": "topology/upload"}}
        done = tenant.submit(workload, jobs=1).result(timeout=900)
    assert done.state == "completed", done
    assert done.dataset_id == uploaded.dataset_id
    topo.upload_workload = workload  # trained on again after the upgrade
    master_copies = list((topo.base / "volumes").glob(f"joynexus-*-workers-worker/**/{uploaded.dataset_id}"))
    api_copies = list((topo.base / "volumes").glob(f"joynexus-api/**/{uploaded.dataset_id}"))
    assert api_copies, "the API kept the upload on its own volume"
    copies = f"{len(master_copies)} copies on the Ray worker's volumes"
    topo.timeline.mark(f"upload {uploaded.dataset_id[:12]} through the API trained on by the Master ({copies})")


def _prefect(t, method: str, path: str, body: dict | None = None) -> dict | list:
    import httpx

    url = f"http://{t.pods.ips['joynexus-prefect']}:4200/api{path}"
    response = httpx.request(method, url, json=body, timeout=60)
    assert response.status_code < 400, f"{method} {path}: {response.status_code} {response.text[:500]}"
    return response.json()


def test_a_lifecycle_flow_run_by_the_prefect_worker_completes(topo):
    topo.start("joynexus-prefect-register")  # once the server answers, as the Job's retries would wait
    topo.pods.wait_job("joynexus-prefect-register", 600)
    topo.timeline.mark("Prefect register Job completed")
    topo.start("joynexus-prefect-worker")
    topo.pods.wait_http("joynexus-prefect-worker", 600)
    topo.timeline.mark("Prefect worker ready")
    spec = _dataset_spec(topo, "topo-flow")
    deployment = _prefect(topo, "GET", "/deployments/name/tenant-lifecycle/on-demand")
    failures = []
    for _attempt in range(2):  # a second run only after a Ray Client start failure (see below)
        run_id, state, tail = _run_flow(topo, deployment["id"], spec)
        if state["type"] == "COMPLETED":
            break
        failures.append(f"flow run {run_id}: {state['message']}\n{tail}")
        # On this 2-core host shared with other work (load average 30-50), the head's Ray Client
        # proxy has seen a SpecificServer exit at start once; anything else fails at once.
        if "Starting Ray client server failed" not in state["message"]:
            break
    assert state["type"] == "COMPLETED", (
        "\n\n".join(failures) + f"\n--- worker ---\n{topo.pods.log('joynexus-prefect-worker')}"
    )
    if failures:
        print(f"[topology] the flow completed on a second run; the first: {failures[0][:2000]}")
    artifacts = _prefect(topo, "POST", "/artifacts/filter", {"artifacts": {"key": {"any_": ["lifecycle-topo-flow"]}}})
    assert artifacts, "the flow left no lifecycle artifact"
    topo.flow_summary = artifacts[0]["data"]
    topo.timeline.mark(f"flow run {run_id} Completed")


def _run_flow(t, deployment_id: str, spec: dict, *, jobs: int = 1, during=None) -> tuple[str, dict, str]:
    """Run the lifecycle flow to a final state; `during(run_id)` is called once while it runs."""
    run = _prefect(t, "POST", f"/deployments/{deployment_id}/create_flow_run",
                   {"parameters": {"spec": spec, "jobs": jobs, "train_timeout_s": 900.0}})  # fmt: skip
    deadline, state = time.monotonic() + 1200, {"type": "PENDING", "message": "not finished in 1200s"}
    while time.monotonic() < deadline:
        if during is not None and during(run["id"]):
            during = None
        state = _prefect(t, "GET", f"/flow_runs/{run['id']}")["state"]
        if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        time.sleep(5)
    logs = _prefect(t, "POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}, "limit": 50})
    tail = "\n".join(entry["message"][:400] for entry in logs[-20:])
    return run["id"], state, tail


def _mlflow(t, path: str, body: dict | None = None) -> dict:
    import httpx

    url = f"http://{t.pods.ips['joynexus-mlflow']}:5000/api/2.0/mlflow{path}"
    # the Host the in-cluster clients send (--allowed-hosts); an IP Host would be refused
    headers = {"Host": "joynexus-mlflow:5000"}
    login = t.secret_data["joynexus-mlflow-auth"]  # the clients' basic-auth login (mlflow/mlflow.yaml)
    auth = (login["MLFLOW_TRACKING_USERNAME"], login["MLFLOW_TRACKING_PASSWORD"])
    response = (
        httpx.post(url, json=body, headers=headers, auth=auth, timeout=60)
        if body is not None
        else httpx.get(url, headers=headers, auth=auth, timeout=60)
    )
    assert response.status_code == 200, f"{path}: {response.status_code} {response.text[:500]}"
    return response.json()


def test_the_flow_s_mlflow_run_and_s3_objects_are_there(topo):
    import re

    from tests.deploy.topology import BUCKET

    summary = getattr(topo, "flow_summary", None)
    if summary is None:
        pytest.skip("the flow did not complete")
    run_id = re.search(r"MLflow run `([0-9a-f]+)`", summary).group(1)
    run = _mlflow(topo, f"/runs/get?run_id={run_id}")["run"]
    assert run["info"]["status"] == "FINISHED", run["info"]
    # the experiment's location is the bucket itself (the Master writes there with its own role)
    assert run["info"]["artifact_uri"].startswith(f"s3://{BUCKET}/mlflow/"), run["info"]["artifact_uri"]
    models = _mlflow(topo, "/registered-models/search?max_results=100")["registered_models"]
    assert any("topo-flow" in m["name"] for m in models), [m["name"] for m in models]
    keys = [o["Key"] for page in topo.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for o in page.get("Contents", [])]  # fmt: skip
    artifacts = [k for k in keys if k.startswith("mlflow/") and run_id in k]
    checkpoints = [k for k in keys if "topo-flow" in k and not k.startswith("mlflow/")]
    assert artifacts, f"no MLflow artifact of run {run_id} in s3://{BUCKET}/mlflow: {keys[:20]}"
    assert checkpoints, f"no checkpoint of tenant topo-flow in s3://{BUCKET}: {keys[:20]}"
    topo.timeline.mark(f"MLflow run {run_id}: {len(artifacts)} artifacts; {len(checkpoints)} checkpoint objects in S3")


def _actors(t) -> dict[str, tuple[str, int]]:
    """Named ALIVE actors -> (actor id, pid), from the head's dashboard (GCS state)."""
    import httpx

    url = f"http://{t.pods.ips[HEAD]}:8265/api/v0/actors?limit=1000&detail=true"
    rows = httpx.get(url, timeout=60).json()["data"]["result"]["result"]
    return {r["name"]: (r["actor_id"], r["pid"]) for r in rows if r.get("name") and r["state"] == "ALIVE"}


def _restart_diagnosis(t, before: dict[str, tuple[str, int]]) -> str:
    """What is true after a head restart, not only what the dashboard lists: each actor looked up by
    name through the Ray Client server, whether its process lives, the API's health, the logs."""
    import httpx

    lines = []
    for name, (_, pid) in before.items():
        try:
            os.kill(pid, 0)
            lines.append(f"{name}: pid {pid} alive")
        except ProcessLookupError:
            lines.append(f"{name}: pid {pid} gone")
    try:
        rows = httpx.get(f"http://{t.pods.ips[HEAD]}:8265/api/v0/actors?limit=1000&detail=true", timeout=60)
        lines.append(f"dashboard actors: {rows.text[:3000]}")
    except Exception as e:  # noqa: BLE001 - a diagnosis goes on
        lines.append(f"dashboard actors: {e!r}")
    try:
        health = httpx.get(f"http://{t.pods.ips['joynexus-api']}:8765/v1/health", timeout=60)
        lines.append(f"API health {health.status_code}: {health.text[:2000]}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"API health: {e!r}")
    logs = t.base / "volumes"
    for pod, name in ((HEAD, "gcs_server.out"), (HEAD, "raylet.out"), *((w, "raylet.out") for w in WORKERS)):
        for path in sorted(logs.glob(f"{pod}/tmp/ray/session_*/logs/{name}")):
            lines.append(f"--- {path} ---\n{path.read_text(errors='replace')[-3000:]}")
    lines.append(f"--- head pod log ---\n{t.pods.log(HEAD)}")
    return "\n".join(lines)


def test_the_services_survive_a_ray_head_restart(topo):
    before = _actors(topo)
    assert any("master" in name.lower() for name in before), before
    with _client(topo, topo.admin_key) as admin:
        tenants_before = {t.tenant_id for t in admin.tenants()}
    topo.pods.recreate(HEAD)  # KubeRay makes a new head pod: new /tmp, same GCS state in Redis
    topo.timeline.mark("Ray head killed and recreated")
    _wait_ray_ready(topo, HEAD)
    topo.timeline.mark("Ray head ready again")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and _actors(topo) != before:
        time.sleep(3)
    after = _actors(topo)
    # the same actors (ids and processes): nothing was recreated
    assert after == before, f"before {before}\nafter {after}\n{_restart_diagnosis(topo, before)}"
    deadline, error = time.monotonic() + 300, None
    while time.monotonic() < deadline:  # the API's Ray Client connection comes back
        try:
            with _client(topo, topo.admin_key) as admin:
                assert {t.tenant_id for t in admin.tenants()} == tenants_before
                created = admin.create_tenant(_dataset_spec(topo, "topo-after-restart"))
            break
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            error = e
            time.sleep(5)
    else:
        raise AssertionError(
            f"the API did not serve again after the head restart: {error!r}\n{topo.pods.log('joynexus-api')}"
        )
    assert created.tenant.tenant_id == "topo-after-restart"
    topo.timeline.mark("API serves again; tenants and services intact")


def test_a_flow_run_survives_a_head_restart_mid_workload(topo):
    """Issue 43.7: the Ray head restarts while the flow's train task waits on a running workload.
    The workload runs on in the detached actors; the flow's wait reconnects (a new Ray Client
    session through the follower) instead of cancelling it, and the flow run completes."""
    spec = _dataset_spec(topo, "topo-midflow")
    deployment = _prefect(topo, "GET", "/deployments/name/tenant-lifecycle/on-demand")
    restarted: list[str] = []

    def restart_once_training(run_id: str) -> bool:
        tasks = _prefect(topo, "POST", "/task_runs/filter", {"task_runs": {"flow_run_id": {"any_": [run_id]}}})
        train = [r for r in tasks if r["name"].startswith("train") and r["state"]["type"] == "RUNNING"]
        if not train:
            return False
        time.sleep(3)  # the workload is submitted and the task is in its wait
        topo.pods.recreate(HEAD)
        topo.timeline.mark("Ray head recreated while the flow's train task waits on its workload")
        _wait_ray_ready(topo, HEAD)
        restarted.append(run_id)
        return True

    # enough jobs that the train task is still waiting when a 5 s poll sees it (6 ended between two
    # polls once the producer replicas stopped landing on the head)
    run_id, state, tail = _run_flow(topo, deployment["id"], spec, jobs=24, during=restart_once_training)
    assert restarted == [run_id], "the head was not restarted while the train task ran"
    assert state["type"] == "COMPLETED", f"{state}\n{tail}\n--- worker ---\n{topo.pods.log('joynexus-prefect-worker')}"
    topo.timeline.mark(f"flow run {run_id} Completed through a head restart mid-workload")


def _job_log(t) -> str:
    """The services Job's whole log as one line of words (its console wraps and tags long lines)."""
    import re

    text = t.pods.log("joynexus-services", tail=10**8)
    return " ".join(re.sub(r"\s+supervisor\.py:\d+", " ", text).split())


def test_an_image_upgrade_drains_and_replaces_the_services_with_no_version_lost(topo):
    """Issue 43.6, as bootstrap-cluster runs an upgrade: the new release's template (JOYNEXUS_RELEASE,
    what render-deployment writes with the new tag), the services Job of it drains the old Master
    and kills the named actors; the Ray pods are deleted once it says so, KubeRay makes them anew,
    and the Job creates the actors again, which restore each tenant from its checkpoint. A workload
    is in flight when the upgrade begins: the new Master resumes it to completion."""
    import re

    from joynexus.ops.upgrade import OLD_ACTORS_GONE

    created = topo.api_tenant
    with _client(topo, created.key.api_key) as tenant:
        before = tenant.versions()
        in_flight = tenant.submit(topo.upload_workload, jobs=48)  # still training when the drain begins
        wait_for(lambda: tenant.workload(in_flight.workload_id).state != "queued", "the workload runs", 300, 1.0)
    assert before.training_version is not None and before.checkpoints, before
    actors_before = _actors(topo)
    release = "topology-upgrade-2"
    for pod in (HEAD, *WORKERS, "joynexus-services"):
        topo.plans[pod].env["JOYNEXUS_RELEASE"] = release  # the new template (bootstrap-cluster's render)
    # bootstrap-cluster deleted the finished Job and applied the new one: a new pod (fresh emptyDirs)
    topo.pods.recreate("joynexus-services")
    topo.pods.succeeded.discard("joynexus-services")  # after the new process is in: the kubelet then follows it
    deadline = time.monotonic() + 900
    while OLD_ACTORS_GONE not in _job_log(topo):
        assert time.monotonic() < deadline, f"no drain in 900 s:\n{topo.pods.log('joynexus-services')}"
        time.sleep(2)
    topo.timeline.mark("the services Job drained the old release and killed its actors")
    for pod in (HEAD, *WORKERS):  # `kubectl delete pod -l ray.io/cluster=joynexus`: KubeRay makes them anew
        topo.pods.recreate(pod)
    for pod in (HEAD, *WORKERS):
        _wait_ray_ready(topo, pod)
    topo.pods.wait_job("joynexus-services", 1500)
    topo.timeline.mark("Ray pods of the new release up, services Job completed")
    after_actors = _actors(topo)
    for name, (actor_id, _) in actors_before.items():  # every service is a new actor (new code)
        if name in after_actors:
            assert after_actors[name][0] != actor_id, name
    assert "joynexus.master" in after_actors, after_actors
    log = _job_log(topo)
    assert f"draining the Master of release 0.1.0 for release {release}" in log, log
    drained = log[log.index(OLD_ACTORS_GONE) :].split(" (driver", 1)[0]
    found = re.search(rf"'checkpointed': {{[^}}]*'{created.tenant.tenant_id}': (\d+)", drained)
    assert found and int(found.group(1)) >= before.training_version, drained
    at_drain = int(found.group(1))
    assert "'running_workloads': 1" in drained, f"the workload was not in flight at the drain: {drained}"
    topo.timeline.mark(drained)
    deadline, error = time.monotonic() + 600, None
    while time.monotonic() < deadline:  # the API's Ray Client session comes back on the new head
        try:
            with _client(topo, created.key.api_key) as tenant:
                after = tenant.versions()
                assert after.training_version >= at_drain  # restored from its checkpoint (then trained on)
                assert {c.version for c in before.checkpoints} <= {c.version for c in after.checkpoints}
                resumed = tenant.handle(in_flight.workload_id).result(timeout=900)
                done = tenant.submit(topo.upload_workload, jobs=1).result(timeout=900)
                trained = tenant.versions()
            break
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            error = e
            time.sleep(5)
    else:
        raise AssertionError(f"no service after the upgrade: {error!r}\n{topo.pods.log('joynexus-api')[-4000:]}")
    assert resumed.state == "completed" and done.state == "completed", (resumed, done)
    assert trained.training_version > at_drain  # trains on from the version it had
    topo.timeline.mark(f"upgraded to {release}: version {at_drain} at the drain kept, the in-flight workload "
                       f"resumed to completion, trained to {trained.training_version}")  # fmt: skip
