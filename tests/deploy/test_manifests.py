"""deployments/: every YAML parses; kinds, GPU requests, images, ports and cross-references agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENTS = REPO / "deployments"
IMAGE = "ghcr.io/joynexus/joynexus"


def documents() -> list[tuple[Path, dict]]:
    found = []
    for path in sorted(DEPLOYMENTS.rglob("*.yaml")) + sorted((REPO / "infra" / "terraform").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict), f"{path}: every document is a mapping"
            found.append((path, doc))
    return found


def resources() -> dict[tuple[str, str], dict]:
    return {
        (doc["kind"], doc["metadata"]["name"]): doc
        for path, doc in documents()
        if path.is_relative_to(DEPLOYMENTS) and "kind" in doc and doc["kind"] != "Kustomization"
    }


def containers(doc: dict) -> list[dict]:
    if doc["kind"] == "RayCluster":
        spec = doc["spec"]
        pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    else:
        pods = [doc["spec"]["template"]]
    return [c for pod in pods for c in pod["spec"]["containers"]]


def test_every_yaml_parses_and_the_kustomization_lists_every_manifest():
    docs = documents()
    assert len(docs) >= 10
    kustomization = yaml.safe_load((DEPLOYMENTS / "kustomization.yaml").read_text())
    listed = {DEPLOYMENTS / r for r in kustomization["resources"]}
    on_disk = {p for p in DEPLOYMENTS.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed == on_disk
    assert kustomization["images"] == [{"name": IMAGE, "newTag": "0.1.0"}]


def test_kinds():
    kinds = {key for key in resources()}
    assert {
        ("Namespace", "joynexus"),
        ("ConfigMap", "joynexus-config"),
        ("RayCluster", "joynexus"),
        ("Job", "joynexus-services"),
        ("Deployment", "joynexus-mlflow"),
        ("Service", "joynexus-mlflow"),
        ("Deployment", "joynexus-prefect"),
        ("Service", "joynexus-prefect"),
        ("Deployment", "joynexus-prefect-worker"),
    } == kinds
    assert resources()[("RayCluster", "joynexus")]["apiVersion"] == "ray.io/v1"


def test_gpu_workers_request_gpus_and_the_head_does_not():
    cluster = resources()[("RayCluster", "joynexus")]["spec"]
    assert cluster["rayVersion"] == "2.60.0"  # the Ray of pyproject.toml
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # actors go to the GPU workers
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    (workers,) = cluster["workerGroupSpecs"]
    pod = workers["template"]["spec"]
    resources_ = pod["containers"][0]["resources"]
    assert resources_["requests"]["nvidia.com/gpu"] == resources_["limits"]["nvidia.com/gpu"] == 1
    assert workers["rayStartParams"]["num-gpus"] == "1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"joynexus.io/node-pool": "gpu"}  # the label node_groups.tf puts on GPU nodes
    node_groups = (REPO / "infra/terraform/modules/eks-gpu/node_groups.tf").read_text()
    assert '"joynexus.io/node-pool"          = "gpu"' in node_groups and 'key    = "nvidia.com/gpu"' in node_groups


def test_every_container_runs_the_joynexus_image_with_the_shared_config():
    for (kind, name), doc in resources().items():
        if kind not in ("RayCluster", "Job", "Deployment"):
            continue
        for container in containers(doc):
            assert container["image"] == f"{IMAGE}:0.1.0", (kind, name)
            env_from = [e.get("configMapRef", {}).get("name") for e in container.get("envFrom", [])]
            env = {e["name"]: e for e in container.get("env", [])}
            assert "joynexus-config" in env_from or any(
                e.get("valueFrom", {}).get("configMapKeyRef", {}).get("name") == "joynexus-config" for e in env.values()
            ) or name == "joynexus-prefect", (kind, name)  # fmt: skip


def test_ports_services_and_settings_line_up():
    res = resources()
    config = res[("ConfigMap", "joynexus-config")]["data"]
    head = res[("RayCluster", "joynexus")]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in head["ports"]} == {"gcs": 6379, "dashboard": 8265, "client": 10001}
    assert config["JOYNEXUS_RAY_ADDRESS"] == "joynexus-head-svc:6379"  # KubeRay names the head service <name>-head-svc
    for name, port, url_key, health in (
        ("joynexus-mlflow", 5000, "JOYNEXUS_MLFLOW_TRACKING_URI", "/health"),
        ("joynexus-prefect", 4200, "PREFECT_API_URL", "/api/health"),
    ):
        deployment, service = res[("Deployment", name)], res[("Service", name)]
        (container,) = containers(deployment)
        assert container["ports"] == [{"name": "http", "containerPort": port}]
        assert container["readinessProbe"]["httpGet"] == {"path": health, "port": "http"}
        assert service["spec"]["ports"] == [{"name": "http", "port": port, "targetPort": "http"}]
        assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        assert deployment["spec"]["selector"]["matchLabels"].items() <= service["spec"]["selector"].items()
        assert config[url_key].startswith(f"http://{name}:{port}")
    assert config["RAY_AUTH_MODE"] == "disabled"


def test_mlflow_server_settings():
    (container,) = containers(resources()[("Deployment", "joynexus-mlflow")])
    env = {e["name"]: e for e in container["env"]}
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"]["value"] == "false"
    command = " ".join(container["args"])
    assert '--artifacts-destination "s3://$JOYNEXUS_S3_BUCKET/mlflow"' in command  # where JoyNexus writes too
    assert "--port 5000" in command


def test_worker_serves_the_prefect_yaml_pool():
    (container,) = containers(resources()[("Deployment", "joynexus-prefect-worker")])
    pools = {d["work_pool"]["name"] for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    assert pools == {"joynexus-process"}
    assert "prefect worker start --pool joynexus-process --type process" in " ".join(container["args"])


@pytest.mark.parametrize("values", ["kuberay-operator.yaml", "nvidia-device-plugin.yaml"])
def test_helm_values_sit_next_to_the_terraform(values):
    path = REPO / "infra" / "terraform" / "values" / values
    assert isinstance(yaml.safe_load(path.read_text()), dict)
    assert f'file("${{path.module}}/values/{values}")' in "".join(
        p.read_text() for p in (REPO / "infra" / "terraform").glob("*.tf")
    )
