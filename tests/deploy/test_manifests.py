"""deployments/, rendered by kustomize: what the services need to actually work in a cluster, checked
against what the code does (Ray Client addresses, MLflow's Host check, the Prefect pull step), and
the security posture of every pod (no Secret where tenant code runs, restricted pods, probes, limits,
a network policy that really guards the Ray head)."""

from __future__ import annotations

import re
from urllib.parse import urlparse

import pytest
import yaml

from tests.deploy.render import ADDONS, CPU_IMAGE, DEPLOYMENTS, IMAGE, REPO, WORKLOAD_KINDS, by_key, pod_specs, rendered


def resources() -> dict[tuple[str, str], dict]:
    return by_key(rendered())


def config() -> dict[str, str]:
    return resources()[("ConfigMap", "joynexus-config")]["data"]


def test_the_kustomization_lists_every_manifest_and_every_object_lands_in_the_namespace():
    kustomization = yaml.safe_load((DEPLOYMENTS / "kustomization.yaml").read_text())
    listed = {DEPLOYMENTS / r for r in kustomization["resources"]}
    on_disk = {p for p in DEPLOYMENTS.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed == on_disk
    assert kustomization["images"] == [{"name": IMAGE, "newTag": "0.1.0"}, {"name": CPU_IMAGE, "newTag": "0.1.0"}]
    for (kind, name), doc in resources().items():
        if kind != "Namespace":
            assert doc["metadata"]["namespace"] == "joynexus", (kind, name)


def test_kinds():
    assert {
        ("Namespace", "joynexus"),
        ("ConfigMap", "joynexus-config"),
        ("RayCluster", "joynexus"),
        ("Job", "joynexus-services"),
        ("Job", "joynexus-prefect-register"),
        ("Deployment", "joynexus-api"),
        ("Service", "joynexus-api"),
        ("Ingress", "joynexus-api"),
        ("Deployment", "joynexus-mlflow"),
        ("Service", "joynexus-mlflow"),
        ("Deployment", "joynexus-prefect"),
        ("Service", "joynexus-prefect"),
        ("Deployment", "joynexus-prefect-worker"),
        ("PersistentVolumeClaim", "joynexus-shared"),
    } <= set(resources())
    assert resources()[("RayCluster", "joynexus")]["apiVersion"] == "ray.io/v1"


def test_clients_outside_the_ray_nodes_connect_through_the_ray_client_server():
    # ray.init("host:6379") only works inside a Ray node; the Ray Client form is ray://host:10001.
    res = resources()
    address = urlparse(config()["JOYNEXUS_RAY_ADDRESS"])
    assert address.scheme == "ray"
    head = res[("RayCluster", "joynexus")]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert address.port == ports["client"] == 10001
    assert address.hostname == "joynexus-head-svc"  # KubeRay names the head service <cluster>-head-svc


def test_mlflow_allows_the_host_its_clients_address():
    from mlflow.server.security_utils import is_allowed_host_header

    (_, pod), = pod_specs(resources()[("Deployment", "joynexus-mlflow")])  # fmt: skip
    command = " ".join(pod["containers"][0]["args"])
    match = re.search(r'--allowed-hosts "([^"]+)"', command)
    assert match, "mlflow server without --allowed-hosts answers 403 to joynexus-mlflow:5000"
    allowed = match.group(1).split(",")
    uri = urlparse(config()["JOYNEXUS_MLFLOW_TRACKING_URI"])
    assert is_allowed_host_header(allowed, uri.netloc)  # requests sends Host: joynexus-mlflow:5000
    assert is_allowed_host_header(allowed, "joynexus-mlflow.joynexus.svc.cluster.local:5000")
    assert not is_allowed_host_header(allowed, "evil.example.com")
    assert '--artifacts-destination "s3://$JOYNEXUS_S3_BUCKET/mlflow"' in command
    assert "--port 5000" in command


def test_every_pod_is_restricted_has_limits_probes_and_runs_the_image():
    for doc in resources().values():
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        for label, pod in pod_specs(doc):
            assert pod["securityContext"]["runAsNonRoot"] is True, label
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, label
            assert pod["securityContext"]["runAsUser"] >= 10000, label
            assert pod.get("serviceAccountName", "default") != "default", label
            assert "joynexus.io/node-pool" in pod.get("nodeSelector", {}), label
            for container in pod["containers"]:
                # the CUDA image only where a GPU is requested; the CPU image everywhere else
                wants_gpu = "nvidia.com/gpu" in container["resources"].get("limits", {})
                assert container["image"] == f"{IMAGE if wants_gpu else CPU_IMAGE}:0.1.0", label
                context = container["securityContext"]
                assert context["allowPrivilegeEscalation"] is False, label
                assert context["readOnlyRootFilesystem"] is True, label
                assert context["capabilities"] == {"drop": ["ALL"]}, label
                resources_ = container["resources"]
                for key in ("cpu", "memory"):
                    assert key in resources_["requests"] and key in resources_["limits"], (label, key)
                assert resources_["limits"]["memory"] == resources_["requests"]["memory"] or doc["kind"] != "RayCluster"
                if doc["kind"] == "Deployment":
                    assert "readinessProbe" in container and "livenessProbe" in container, label
                mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
                assert "/tmp" in mounts, label  # read-only root: everything writes to /tmp


def test_tenant_code_pods_get_only_the_control_plane_s_login_as_a_file_and_no_api_token():
    """The Ray pods (tenant code) get MLflow's login, which the Master needs to log runs, and the
    control plane's own database login as a mounted file, which the service actors read by name
    (issue 43.8: never as an actor argument); never another app's login or the master
    (docs/deployment.md says what that exposes)."""
    cluster = resources()[("RayCluster", "joynexus")]
    for label, pod in pod_specs(cluster):
        for container in pod["containers"]:
            assert not any("secretRef" in e for e in container.get("envFrom", [])), label
            secrets = {
                e["valueFrom"]["secretKeyRef"]["name"]
                for e in container.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})
            }
            assert secrets == {"joynexus-mlflow-auth"}, label
        mounted = [v["secret"] for v in pod.get("volumes", []) if "secret" in v]
        assert mounted == [
            {"secretName": "joynexus-db-control-plane", "defaultMode": 0o440,
             "items": [{"key": "JOYNEXUS_DATABASE_URL", "path": "JOYNEXUS_DATABASE_URL"}]}
        ], label  # fmt: skip
        shared = [m for c in pod["containers"] for m in c.get("volumeMounts", []) if m["name"] == "shared"]
        assert shared and all(m.get("readOnly") for m in shared), label
        if not label.endswith("/head"):  # the head's autoscaler sidecar needs its token
            assert pod["automountServiceAccountToken"] is False, label
    for (kind, _), doc in resources().items():
        if kind == "ServiceAccount":
            assert doc["automountServiceAccountToken"] is False
        for label, pod in pod_specs(doc):
            for container in pod["containers"]:
                assert not any("secretRef" in e for e in container.get("envFrom", [])), label  # key by key only


def test_every_ray_role_asks_for_cpu_so_none_lands_on_the_head():
    """The head starts with num-cpus 0, which keeps only CPU-asking actors off it; an actor of 0 CPUs
    may land there, and a head restart (GCS fault tolerance) then restarts it with its state lost:
    the topology test saw the call queue `joynexus.call_futures` there."""
    from joynexus.settings import ROLES, parse_role_resources

    config = resources()[("ConfigMap", "joynexus-config")]["data"]
    asked = parse_role_resources(config["JOYNEXUS_RESOURCES_JSON"])
    assert set(asked) == set(ROLES), set(ROLES) - set(asked)
    assert all((spec.num_cpus or 0) > 0 for spec in asked.values()), asked


def test_gpu_workers_and_ray_autoscaling():
    cluster = resources()[("RayCluster", "joynexus")]["spec"]
    assert cluster["rayVersion"] == "2.60.0"  # the Ray of pyproject.toml
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"training-workers", "inference-workers", "environment-workers"}  # one per role
    for name in ("training-workers", "inference-workers"):
        workers = groups[name]
        pod = workers["template"]["spec"]
        resources_ = pod["containers"][0]["resources"]
        assert resources_["requests"]["nvidia.com/gpu"] == resources_["limits"]["nvidia.com/gpu"] == 1
        assert workers["rayStartParams"]["num-gpus"] == "1"
        assert 1 <= workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["nodeSelector"] == {"joynexus.io/node-pool": "gpu"}  # the label node_groups.tf puts on GPU nodes
    environment = groups["environment-workers"]["template"]["spec"]
    assert "nvidia.com/gpu" not in environment["containers"][0]["resources"]["limits"]
    assert "tolerations" not in environment and environment["nodeSelector"] == {"joynexus.io/node-pool": "cpu"}
    node_groups = (REPO / "infra/terraform/modules/eks-gpu/node_groups.tf").read_text()
    assert '"joynexus.io/node-pool"          = "gpu"' in node_groups and 'key    = "nvidia.com/gpu"' in node_groups
    assert 'labels = { "joynexus.io/node-pool" = "cpu" }' in node_groups


def _group_resource(group: dict) -> dict[str, float]:
    """The custom resources a worker group's Ray nodes declare (rayStartParams `resources`, the JSON
    KubeRay passes to `ray start --resources` inside one more pair of quotes)."""
    import json

    text = group["rayStartParams"].get("resources")
    return json.loads(json.loads(text)) if text else {}


def test_each_role_s_worker_group_is_sized_by_the_settings_that_fill_it():
    """Issue 45.4: every role's actors ask for their group's custom resource (nowhere else has it),
    the GPU groups hold their roles' GPUs at the settings' minimum (minReplicas) and maximum
    (maxReplicas), and the environment group holds the simulator workers' CPUs."""
    from joynexus.settings import ScalingPolicy, parse_role_resources

    data = config()
    asked = parse_role_resources(data["JOYNEXUS_RESOURCES_JSON"])
    groups = {g["groupName"]: g for g in resources()[("RayCluster", "joynexus")]["spec"]["workerGroupSpecs"]}
    scaling = ScalingPolicy.model_validate_json(data["JOYNEXUS_INFERENCE_SCALING_JSON"])
    shards, workers = int(data["JOYNEXUS_TRAINING_SHARDS"]), int(data["JOYNEXUS_ENVIRONMENT_WORKERS"])
    shards *= int(data.get("JOYNEXUS_TRAINING_DATA_PARALLEL", "1"))  # a device per rank of every shard
    assert scaling.max_tenants_per_replica is not None  # tenant-affine replicas in the deployment
    for role, group, count_min, count_max in (
        ("training_service", "training-workers", shards, shards),
        ("inference_service", "inference-workers", scaling.min_replicas, scaling.max_replicas),
        ("environment_worker", "environment-workers", 0, workers),
        ("environment_service", "environment-workers", 1, 1),
    ):
        spec, g = asked[role], groups[group]
        (resource,) = spec.resources  # the group's own resource, which no other group declares
        assert resource in _group_resource(g), (role, resource)
        assert all(resource not in _group_resource(o) for n, o in groups.items() if n != group), resource
        per_node = float(g["rayStartParams"]["num-gpus"]) if spec.num_gpus else float(g["rayStartParams"]["num-cpus"])
        need = spec.num_gpus or spec.num_cpus
        fits = int(per_node // need)  # actors of the role one node of the group holds
        assert fits >= 1, (role, per_node, need)
        assert g["minReplicas"] * fits >= count_min or group == "environment-workers", (role, g["minReplicas"])
        assert g["maxReplicas"] * fits >= count_max, (role, g["maxReplicas"], count_max)
        assert _group_resource(g)[resource] >= fits * spec.resources[resource]  # the resource never binds first
    # The environment group's CPUs hold the service and all its workers on its maxReplicas nodes.
    env = groups["environment-workers"]
    cpus = asked["environment_service"].num_cpus + workers * asked["environment_worker"].num_cpus
    assert env["minReplicas"] >= 1 and env["maxReplicas"] * float(env["rayStartParams"]["num-cpus"]) >= cpus


def test_ports_services_and_settings_line_up():
    res = resources()
    for name, port, url_key, health in (
        ("joynexus-mlflow", 5000, "JOYNEXUS_MLFLOW_TRACKING_URI", "/health"),
        ("joynexus-prefect", 4200, "PREFECT_API_URL", "/api/health"),
        ("joynexus-api", 8765, None, "/openapi.json"),
    ):
        deployment, service = res[("Deployment", name)], res[("Service", name)]
        ((_, pod),) = pod_specs(deployment)
        (container,) = pod["containers"]
        assert container["ports"] == [{"name": "http", "containerPort": port}]
        assert container["readinessProbe"]["httpGet"] == {"path": health, "port": "http"}
        assert service["spec"]["ports"] == [{"name": "http", "port": port, "targetPort": "http"}]
        assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        if url_key:
            assert config()[url_key].startswith(f"http://{name}:{port}")
    ingress = res[("Ingress", "joynexus-api")]["spec"]
    backend = ingress["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "joynexus-api", "port": {"name": "http"}}
    assert config()["RAY_AUTH_MODE"] == "disabled"


def _allows(policy: dict, labels: dict[str, str], port: int) -> bool:
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports", [])  # a port, or a range port..endPort
        if ports and not any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports):
            continue
        sources = rule.get("from")
        if sources is None:
            return True
        for source in sources:
            if "ipBlock" in source:
                return True
            selector = source.get("podSelector")
            if selector is not None and "namespaceSelector" not in source:
                if selector.get("matchLabels", {}).items() <= labels.items():
                    return True
    return False


def test_network_policy_guards_the_ray_head():
    res = resources()
    policies = [d for (k, _), d in res.items() if k == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and p["spec"].get("ingress") is None for p in policies)  # deny all
    head_labels = {"ray.io/cluster": "joynexus", "ray.io/node-type": "head"}
    head_policies = [
        p
        for p in policies
        if p["spec"]["podSelector"] != {} and p["spec"]["podSelector"]["matchLabels"].items() <= head_labels.items()
    ]
    assert head_policies

    def reach(labels: dict[str, str], port: int) -> bool:
        return any(_allows(p, labels, port) for p in head_policies)

    ray_node = {"ray.io/cluster": "joynexus", "ray.io/node-type": "worker"}
    assert reach(ray_node, 6379) and reach(ray_node, 10001)
    # the GCS, raylet, object manager, agent and worker ports of the head, but not its dashboard:
    # the dashboard serves every head process's command line (the GCS's carries the Redis token) and
    # the actors' state; tenant code runs in the workers (issue 43.8)
    for port in (6379, 8076, 10002, 19999, 52365, 62000):
        assert reach(ray_node, port), port
    assert not reach(ray_node, 8265)
    for (kind, _name), doc in res.items():  # every pod that is not a Ray node: the client port at most
        for label, pod in pod_specs(doc):
            if kind == "RayCluster":
                continue
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert not reach(labels, 6379) and not reach(labels, 8265), label
            assert reach(labels, 10001) == (labels.get("joynexus.io/ray-client") == "true"), label
            uses_ray = any(
                c.get("command", [""])[0] == "joynexus" or c["name"] == "prefect-worker" for c in pod["containers"]
            )
            assert not uses_ray or reach(labels, 10001), label
    assert not reach({"app": "anything-else"}, 10001) and not reach({}, 6379)


def test_the_pull_step_is_an_absolute_path_fixed_at_deploy_time_and_runs_without_pwd(tmp_path, monkeypatch):
    """The worker execs flow runs without a shell (no PWD): Prefect's default pull step, which `prefect
    deploy` writes with the directory it ran in, must set the flow run's directory without PWD."""
    import asyncio
    import os

    from prefect.cli.deploy._actions import _generate_default_pull_action
    from prefect.deployments.steps.pull import set_working_directory
    from prefect.utilities.templating import apply_values
    from rich.console import Console

    prefect = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert prefect["pull"] is None  # no templated step: Prefect's deploy-time default is used
    assert "$PWD" not in (REPO / "prefect.yaml").read_text().split("deployments:")[1]
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    for deployment in prefect["deployments"]:
        steps = asyncio.run(
            _generate_default_pull_action(
                Console(quiet=True), deploy_config=deployment, actions={"build": None}, is_interactive=lambda: False
            )
        )
        (step,) = steps
        directory = step["prefect.deployments.steps.set_working_directory"]["directory"]
        assert directory == str(checkout.resolve()) and "{{" not in directory
        monkeypatch.chdir(tmp_path)
        monkeypatch.delenv("PWD", raising=False)  # as in the flow-run process the worker execs
        # what run_step does with a step's inputs at run time (minus the API lookups of blocks/variables)
        set_working_directory(**apply_values(step["prefect.deployments.steps.set_working_directory"], os.environ))
        assert os.getcwd() == str(checkout.resolve())
        monkeypatch.chdir(checkout)


def test_prefect_deployments_register_once():
    prefect = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert {d["work_pool"]["name"] for d in prefect["deployments"]} == {"joynexus-process"}
    res = resources()
    ((_, worker),) = pod_specs(res[("Deployment", "joynexus-prefect-worker")])
    command = " ".join(worker["containers"][0]["command"] + worker["containers"][0].get("args", []))
    assert "prefect worker start --pool joynexus-process --type process" in command
    assert "deploy" not in command  # registration is the Job's, not every worker start's
    assert worker["containers"][0]["workingDir"] == "/opt/joynexus"
    ((_, register),) = pod_specs(res[("Job", "joynexus-prefect-register")])
    container = register["containers"][0]
    assert container["workingDir"] == "/opt/joynexus"
    assert "prefect --no-prompt deploy --all" in " ".join(container["args"])


def test_cluster_addons_render_offline_and_the_remote_bases_are_pinned():
    docs = by_key(rendered(ADDONS))
    assert ("Deployment", "cluster-autoscaler") in docs and ("StorageClass", "gp3") in docs
    remote = yaml.safe_load((ADDONS.parent / "kustomization.yaml").read_text())["resources"]
    assert "addons" in remote
    for url in (r for r in remote if r.startswith("http")):
        assert re.search(r"(\?ref=v\d+\.\d+\.\d+$|/v\d+\.\d+\.\d+/)", url), url  # a release tag, never a branch


@pytest.mark.parametrize("step", [
    'install "torch==2.14.1" "torchvision==0.29.1"',
    'install -c requirements/lock.txt -e "$TARGET"',
    'install --no-deps "lerobot==0.4.4"',
])  # fmt: skip
def test_the_dockerfile_installs_the_stack_the_way_bootstrap_does(step):
    bootstrap = (REPO / "scripts" / "bootstrap").read_text()
    assert step in bootstrap  # the pinned steps the image inherits by running the script itself
    assert 'EXTRAS="${JOYNEXUS_EXTRAS-dev}"' in bootstrap  # laptops get the dev tools, the image none
    dockerfile = (REPO / "Dockerfile").read_text()
    instructions = [line.split(None, 1)[0] for line in dockerfile.splitlines() if line and line[0].isalpha()]
    assert instructions[0] in ("ARG", "FROM") and "FROM" in instructions and instructions.count("USER") == 1
    run = " ".join(line for line in dockerfile.splitlines())
    assert 'JOYNEXUS_EXTRAS="" JOYNEXUS_SKIP_SYSTEM_DEPS=1 scripts/bootstrap' in run
    assert re.search(r"^USER 10001", dockerfile, re.M)  # the manifests' runAsUser
    assert "ARG VARIANT=cuda" in dockerfile and 'PIP_EXTRA_INDEX_URL="$TORCH_CPU_INDEX"' in dockerfile
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11[\d.]*-slim-trixie$", dockerfile, re.M)  # Mesa 25 in main
    assert "*@sha256:*" in dockerfile  # a base without a digest is refused
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_the_image_layers_put_the_source_after_the_stack():
    """An edit of the source rebuilds only the last layer: the stack is installed from the files that
    pin it (and an empty package skeleton) before `COPY . ` brings the source."""
    dockerfile = (REPO / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+) AS (\w+)$", dockerfile, re.M)
    assert [name for _, name in stages] == ["system", "deps", "app"]
    deps = dockerfile.split("AS deps")[1].split("AS app")[0]
    copies = re.findall(r"^COPY (.+)$", deps, re.M)
    assert copies and all(" . " not in f" {c} " and not c.startswith(". ") for c in copies), copies
    copied = " ".join(copies)
    for pinned in (
        "pyproject.toml",
        "requirements/",
        "scripts/bootstrap",
        "plugins/lerobot_policy_joynexus/pyproject.toml",
    ):
        assert pinned in copied, pinned
    assert "scripts/bootstrap" in deps and "scripts/bootstrap" not in dockerfile.split("AS app")[1]
    assert re.search(r"^COPY \. /opt/joynexus$", dockerfile.split("AS app")[1], re.M)
    assert "bookworm" not in dockerfile.split("ARG PYTHON_IMAGE=")[1].split("\n")[0]
    build = (REPO / "scripts" / "build-images").read_text()
    assert "imagetools inspect" in build and 'base="${BASE_TAG}@${digest}"' in build
    assert "--build-arg VARIANT=cpu" in build and "--build-arg VARIANT=cuda" in build


def _env_names(container: dict, configmaps: dict[str, dict]) -> set[str]:
    names = {e["name"] for e in container.get("env", [])}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        if ref:
            names |= set(configmaps[ref["name"]].get("data", {}))
    return names


def test_every_aws_client_pod_has_a_region():
    """IMDSv2's hop limit of 1 keeps pods off the metadata service and Pod Identity injects no region,
    so every pod that gets AWS credentials (its service account has a Pod Identity role in iam.tf)
    names AWS_REGION itself, and bootstrap-cluster writes the deployment's region into it."""
    iam = (REPO / "infra" / "terraform" / "modules" / "eks-gpu" / "iam.tf").read_text()
    with_roles = set(re.findall(r'service_account = "([\w-]+)" \}', iam)) - {
        "ebs-csi-controller-sa",
        "efs-csi-controller-sa",
        "external-secrets",  # the operator's AWS calls take the SecretStore's region (checked below)
    }
    assert {"joynexus-ray", "joynexus-api", "joynexus-mlflow", "cluster-autoscaler"} <= with_roles
    checked = set()
    for folder in (DEPLOYMENTS, ADDONS):
        docs = rendered(folder)
        configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
        for doc in docs:
            if doc["kind"] not in WORKLOAD_KINDS:
                continue
            for label, pod in pod_specs(doc):
                if pod.get("serviceAccountName") not in with_roles:
                    continue
                for container in pod.get("initContainers", []) + pod["containers"]:
                    assert "AWS_REGION" in _env_names(container, configmaps), f"{label}/{container['name']}"
                checked.add(pod["serviceAccountName"])
    assert checked == with_roles  # every role's pods were found and checked
    stores = [d for d in rendered(DEPLOYMENTS) if d["kind"] == "SecretStore"]
    assert stores and all(s["spec"]["provider"]["aws"]["region"] for s in stores)
    bootstrap = (REPO / "infra" / "scripts" / "bootstrap-cluster").read_text() + (
        REPO / "infra" / "scripts" / "render-deployment"
    ).read_text()
    assert 'AWS_REGION: "${REGION}"' in bootstrap  # the ConfigMap patch
    assert "/name: AWS_REGION/{n;s#value: us-east-1#value: ${REGION}#}" in bootstrap  # the autoscaler's env
    autoscaler = (ADDONS / "cluster-autoscaler.yaml").read_text()
    assert re.search(r"- name: AWS_REGION\n\s+value: us-east-1\n", autoscaler)  # what the sed rewrites


def test_the_ray_head_survives_a_restart_gcs_fault_tolerance_and_disruption_budgets():
    """The resident services are detached actors in the head's GCS: with GCS fault tolerance (Redis,
    TLS + AUTH, from Terraform's cache.tf) a restarted head reloads them; disruption budgets keep
    drains from taking the API or more than one GPU worker (where the model services live) at once."""
    res = resources()
    cluster = res[("RayCluster", "joynexus")]["spec"]
    ft = cluster["gcsFaultToleranceOptions"]
    assert ft["redisAddress"].startswith("rediss://")  # TLS: the Redis has transit encryption on
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"] == {"name": "joynexus-ray-gcs", "key": "password"}
    module = (REPO / "infra" / "terraform" / "modules" / "eks-gpu" / "cache.tf").read_text()
    for setting in ("automatic_failover_enabled = true", "multi_az_enabled           = true",
                    "transit_encryption_enabled = true", "at_rest_encryption_enabled = true"):  # fmt: skip
        assert setting in module, setting
    bootstrap = (REPO / "infra" / "scripts" / "bootstrap-cluster").read_text() + (
        REPO / "infra" / "scripts" / "render-deployment"
    ).read_text()
    assert "tf gcs_redis_address" in bootstrap  # the token: the ExternalSecret joynexus-ray-gcs
    synced = res[("ExternalSecret", "joynexus-ray-gcs")]["spec"]
    assert synced["target"]["name"] == "joynexus-ray-gcs" and synced["data"][0]["secretKey"] == "password"
    assert 'spec: {gcsFaultToleranceOptions: {redisAddress: "${GCS_REDIS}"}}' in bootstrap
    budgets = {name: doc["spec"] for (kind, name), doc in res.items() if kind == "PodDisruptionBudget"}
    assert budgets["joynexus-api"]["minAvailable"] == 1 and res[("Deployment", "joynexus-api")]["spec"]["replicas"] > 1
    for group in ("training-workers", "inference-workers", "environment-workers"):
        workers = budgets[f"joynexus-ray-{group}"]
        assert workers["maxUnavailable"] == 1
        assert workers["selector"]["matchLabels"] == {"ray.io/cluster": "joynexus", "ray.io/group": group}
    assert budgets["joynexus-ray-head"]["selector"]["matchLabels"]["ray.io/node-type"] == "head"
    # a budget on a one-replica Deployment with minAvailable 1 would block every node drain
    for name, spec in budgets.items():
        labels = spec["selector"]["matchLabels"]
        for (kind, _), doc in res.items():
            if kind == "Deployment" and doc["spec"]["selector"]["matchLabels"] == labels:
                assert spec.get("minAvailable", 0) < doc["spec"]["replicas"], name


def _peak_rss_bytes(code: str) -> int:
    """Peak RSS of a fresh interpreter that runs `code`: VmHWM of its own address space (kB). Not
    ru_maxrss, which Linux carries over exec from the forked copy of this (large) test process."""
    import os
    import subprocess
    import sys

    hwm = "[int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:')][0]"
    probe = f"{code}\nprint({hwm})"
    # the pod's environment, not what earlier tests of this process set (Prefect settings load more)
    prefixes = ("PREFECT_", "JOYNEXUS_", "RAY_", "MLFLOW_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1]) * 1024


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


def test_the_prefect_worker_fits_its_flow_runs_in_its_memory_limit():
    """The process worker runs up to --limit flow runs as child processes in its own container: the
    measured import footprint of a flow run times that concurrency, plus the worker, stays under the
    container's memory limit (with 10% headroom), or the pod is OOM-killed under load."""
    ((_, worker),) = pod_specs(resources()[("Deployment", "joynexus-prefect-worker")])
    container = worker["containers"][0]
    command = container["command"]
    concurrency = int(command[command.index("--limit") + 1])
    limit = _bytes(container["resources"]["limits"]["memory"])
    flow_run = _peak_rss_bytes("import flows.tenant_lifecycle, flows.periodic_evaluation")
    worker_process = _peak_rss_bytes("import prefect.cli; from prefect.workers.process import ProcessWorker")
    budget = concurrency * flow_run + worker_process
    assert budget <= 0.9 * limit, (
        f"{concurrency} flow runs x {flow_run / 2**30:.2f} GiB + worker {worker_process / 2**30:.2f} GiB = "
        f"{budget / 2**30:.2f} GiB > 90% of the {limit / 2**30:.1f} GiB limit"
    )
