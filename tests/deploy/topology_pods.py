"""What the topology test runs, read from the kustomize-rendered manifests: one `PodPlan` per pod
(a Deployment or Job's pod, the RayCluster's head and one worker of each group), with the container's
own command, args and environment resolved the way the kubelet does (image ENV, Service links,
envFrom, env with configMapKeyRef / secretKeyRef, `$(VAR)` expansion), its securityContext, memory
limit and volumes. For the RayCluster pods, the `ray start` command and environment KubeRay (v1.4)
generates from `rayStartParams` and `gcsFaultToleranceOptions`.

Only what a cluster would add on its own is added here, each named in `PLATFORM_ENV` / the
callers: the Pod Identity credentials (keys for the S3 stand-in instead of the agent's endpoint)
and the S3 endpoint of that stand-in."""

from __future__ import annotations

import re
import shlex
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

NAMESPACE = "joynexus"
HEAD_SVC = "joynexus-head-svc"  # KubeRay: <cluster>-head-svc
KUBERAY_DASHBOARD_AGENT_PORT = "52365"
KUBERAY_METRICS_PORT = "8080"
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity_bytes(value: str | int) -> int:
    text = str(value)
    for suffix, factor in _UNITS.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def cpu_cores(value: str | int | float) -> float:
    text = str(value)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


@dataclass
class PodPlan:
    name: str  # the pod's name (hostname)
    workload: str  # Kind/name of the manifest it comes from
    argv: list[str]
    env: dict[str, str]
    uid: int
    gid: int
    groups: list[int]
    memory_limit: int
    cpu_request: float
    cwd: str
    read_only_root: bool
    no_new_privs: bool
    volumes: list[dict] = field(default_factory=list)  # {"target", "kind": emptyDir|memory|pvc, "size", "read_only"}
    service_account: str = ""
    probe: dict | None = None  # the startup or readiness probe's httpGet, if any
    ports: dict[str, int] = field(default_factory=dict)
    restart: str = "Always"  # the pod's restartPolicy
    backoff_limit: int = 6  # a Job's


def image_env(dockerfile: Path) -> dict[str, str]:
    """The ENV of the Dockerfile (its last stage inherits them all), over the base image's PATH."""
    env = {"PATH": "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"}  # python:3.11-slim
    text = dockerfile.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line.startswith("ENV "):
            for key, value in re.findall(r"(\w+)=(\S+)", line[4:]):
                env[key] = value.replace("$PATH", env.get("PATH", ""))
    return env


def image_workdir(dockerfile: Path) -> str:
    workdirs = [line.split()[1] for line in dockerfile.read_text().splitlines() if line.startswith("WORKDIR ")]
    return workdirs[-1] if workdirs else "/"


def service_link_env(services: dict[str, tuple[str, dict[str, int]]]) -> dict[str, str]:
    """The kubelet's Docker-links variables (enableServiceLinks defaults to true) for every Service
    of the namespace: NAME_SERVICE_HOST, NAME_PORT=tcp://..., ..."""
    env: dict[str, str] = {}
    for name, (ip, ports) in services.items():
        prefix = name.upper().replace("-", "_")
        first = next(iter(ports.values()))
        env[f"{prefix}_SERVICE_HOST"] = ip
        env[f"{prefix}_SERVICE_PORT"] = str(first)
        env[f"{prefix}_PORT"] = f"tcp://{ip}:{first}"
        for port_name, port in ports.items():
            env[f"{prefix}_SERVICE_PORT_{port_name.upper().replace('-', '_')}"] = str(port)
            base = f"{prefix}_PORT_{port}_TCP"
            env.update(
                {base: f"tcp://{ip}:{port}", f"{base}_PROTO": "tcp", f"{base}_PORT": str(port), f"{base}_ADDR": ip}
            )
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion in env values, command and args ($$ escapes)."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def container_env(container: dict, config_maps: dict, secrets: dict, base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(config_maps[source["configMapRef"]["name"]])
        else:
            env.update(secrets[source["secretRef"]["name"]])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = _expand(item["value"], env)
            continue
        ref = item["valueFrom"]
        if "configMapKeyRef" in ref:
            env[item["name"]] = config_maps[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in ref:
            env[item["name"]] = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        else:
            raise ValueError(f"env {item['name']}: unsupported valueFrom {sorted(ref)}")
    return env


def _volumes(pod_spec: dict, container: dict, secrets: dict, config_maps: dict) -> list[dict]:
    by_name = {v["name"]: v for v in pod_spec.get("volumes", [])}
    out = []
    for mount in container.get("volumeMounts", []):
        volume = by_name[mount["name"]]
        files = None
        if "emptyDir" in volume:
            kind = "memory" if volume["emptyDir"].get("medium") == "Memory" else "emptyDir"
            size = volume["emptyDir"].get("sizeLimit")
        elif "persistentVolumeClaim" in volume:
            kind, size = "pvc", None
        elif "secret" in volume:  # the kubelet writes each key as a file (or the listed items only)
            kind, size = "secret", None
            data = secrets[volume["secret"]["secretName"]]
            items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
            files = {item["path"]: data[item["key"]] for item in items}
        elif "configMap" in volume:  # likewise, world-readable
            kind, size = "configMap", None
            data = config_maps[volume["configMap"]["name"]]
            items = volume["configMap"].get("items") or [{"key": k, "path": k} for k in data]
            files = {item["path"]: data[item["key"]] for item in items}
        else:
            raise ValueError(f"volume {mount['name']}: unsupported source {sorted(volume)}")
        read_only = bool(mount.get("readOnly")) or kind in ("secret", "configMap")
        out.append({"target": mount["mountPath"], "kind": kind, "name": mount["name"], "size": size,
                    "read_only": read_only, "files": files})  # fmt: skip
    return out


def _template_field(fields: dict[str, str], match: re.Match) -> str:
    value = str(fields[match.group(1)])
    return urllib.parse.quote_plus(value) if match.group(2) else value


def external_secrets(docs: list[dict], remote: Callable[[str], Any]) -> dict[str, dict[str, str]]:
    """The Secrets the External Secrets Operator makes from the rendered ExternalSecrets:
    `remote(key)` is the Secrets Manager value (a JSON object's dict, or a string); `dataFrom.extract`
    takes every field, `data` one value per `secretKey`, and a template's `{{ .field }}` (and
    `{{ .field | urlquery }}`, Go's QueryEscape) renders over those fields."""
    out: dict[str, dict[str, str]] = {}
    for doc in docs:
        if doc["kind"] != "ExternalSecret":
            continue
        spec = doc["spec"]
        fields: dict[str, str] = {}
        for source in spec.get("dataFrom", []):
            fields.update(remote(source["extract"]["key"]))
        for item in spec.get("data", []):
            fields[item["secretKey"]] = remote(item["remoteRef"]["key"])
        template = spec.get("target", {}).get("template", {}).get("data")
        if template:
            render = partial(_template_field, dict(fields))
            fields = {k: re.sub(r"\{\{\s*\.(\w+)\s*(\|\s*urlquery\s*)?\}\}", render, v) for k, v in template.items()}
        out[spec["target"]["name"]] = {k: str(v) for k, v in fields.items()}
    return out


def bootstrap_config_maps(rds_ca_pem: str) -> list[dict]:
    """The ConfigMaps infra/scripts/bootstrap-cluster makes outside the manifests: joynexus-rds-ca,
    the RDS CA bundle (`rds_ca_pem`) the Job joynexus-db-users verifies the database against."""
    meta = {"name": "joynexus-rds-ca", "namespace": NAMESPACE}
    return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"global-bundle.pem": rds_ca_pem}}]


def _probe(container: dict) -> dict | None:
    for key in ("startupProbe", "readinessProbe"):
        if "httpGet" in container.get(key, {}):
            return container[key]["httpGet"]
    return None


def plan_container(
    name: str, workload: str, pod_spec: dict, container: dict, env: dict[str, str], workdir: str,
    secrets: dict | None = None, config_maps: dict | None = None,
) -> PodPlan:
    pod_sc, sc = pod_spec.get("securityContext", {}), container.get("securityContext", {})
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup", uid))
    if uid is None or uid == 0:
        raise ValueError(f"{workload}: no non-root runAsUser")
    argv = [_expand(a, env) for a in container.get("command", []) + container.get("args", [])]
    limit = container.get("resources", {}).get("limits", {}).get("memory")
    if limit is None:
        raise ValueError(f"{workload}: container {container['name']} has no memory limit")
    ports = {p.get("name", str(p["containerPort"])): p["containerPort"] for p in container.get("ports", [])}
    return PodPlan(
        name=name, workload=workload, argv=argv, env=env, uid=uid, gid=gid,
        groups=sorted({gid, pod_sc.get("fsGroup", gid)}), memory_limit=quantity_bytes(limit),
        cpu_request=cpu_cores(container.get("resources", {}).get("requests", {}).get("cpu", "0")),
        cwd=container.get("workingDir", workdir), read_only_root=bool(sc.get("readOnlyRootFilesystem")),
        no_new_privs=sc.get("allowPrivilegeEscalation") is False,
        volumes=_volumes(pod_spec, container, secrets or {}, config_maps or {}),
        service_account=pod_spec.get("serviceAccountName", "default"), probe=_probe(container), ports=ports,
    )  # fmt: skip


def _ray_start(cluster: dict, group: dict | None, container: dict) -> tuple[list[str], dict[str, str]]:
    """KubeRay's generated `ray start` (no `ulimit -n` shell prefix: exec'd directly) and the env it adds."""
    params = dict((group or cluster["spec"]["headGroupSpec"]).get("rayStartParams", {}))
    limits = container.get("resources", {}).get("limits", {})
    env = {"RAY_CLUSTER_NAME": cluster["metadata"]["name"], "RAY_USAGE_STATS_KUBERAY_IN_USE": "1",
           "RAY_PORT": "6379", "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1"}  # fmt: skip
    head_fqdn = f"{HEAD_SVC}.{NAMESPACE}.svc.cluster.local"
    ft = cluster["spec"].get("gcsFaultToleranceOptions")
    if group is None:
        argv = ["ray", "start", "--head"]
        env["RAY_ADDRESS"] = "127.0.0.1:6379"
        env["RAY_NODE_TYPE_NAME"] = "headgroup"
        if cluster["spec"].get("enableInTreeAutoscaling"):
            params.setdefault("no-monitor", "true")  # the autoscaler runs as the head's sidecar
        if ft:
            env["RAY_REDIS_ADDRESS"] = ft["redisAddress"]
            env["RAY_external_storage_namespace"] = cluster["metadata"].get("uid", cluster["metadata"]["name"])
            if "redisPassword" in ft:
                params["redis-password"] = "$REDIS_PASSWORD"  # expanded by KubeRay's bash -lc
    else:
        argv = ["ray", "start", f"--address={head_fqdn}:6379"]
        env.update({"RAY_ADDRESS": f"{head_fqdn}:6379", "FQ_RAY_IP": head_fqdn, "RAY_IP": HEAD_SVC,
                    "RAY_NODE_TYPE_NAME": group["groupName"]})  # fmt: skip
        if ft:
            env["RAY_gcs_rpc_server_reconnect_timeout_s"] = "600"  # workers outlive a head restart
    if "memory" in limits:
        params.setdefault("memory", str(quantity_bytes(limits["memory"])))
    if "nvidia.com/gpu" in limits:
        params.setdefault("num-gpus", str(limits["nvidia.com/gpu"]))
    params.setdefault("metrics-export-port", KUBERAY_METRICS_PORT)
    params.setdefault("dashboard-agent-listen-port", KUBERAY_DASHBOARD_AGENT_PORT)
    params.setdefault("block", "true")
    for key, value in params.items():
        if value[:1] in ("'", '"'):  # KubeRay's bash -lc removes the quotes of a quoted value (resources' JSON)
            value = shlex.split(value)[0]
        argv.append(f"--{key}" if key in ("block", "no-monitor") and value == "true" else f"--{key}={value}")
    return argv, env


def plan_pods(docs: list[dict], secrets: dict, dockerfile: Path, service_ips: dict[str, str],
              platform_env: dict[str, dict[str, str]]) -> list[PodPlan]:  # fmt: skip
    """One PodPlan per pod the manifests make (Deployments: one replica), in manifest order.
    `service_ips`: Service name -> the address its (one) pod answers at; `platform_env`:
    service account -> env the platform injects (Pod Identity)."""
    config_maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    services = {d["metadata"]["name"]: {p.get("name", str(p["port"])): p["port"] for p in d["spec"]["ports"]}
                for d in docs if d["kind"] == "Service"}  # fmt: skip
    services[HEAD_SVC] = {"gcs": 6379, "dashboard": 8265, "client": 10001}
    links = service_link_env({n: (service_ips[n], ports) for n, ports in services.items() if n in service_ips})
    image = image_env(dockerfile)
    workdir = image_workdir(dockerfile)
    plans = []
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind in ("Deployment", "Job"):
            spec = doc["spec"]["template"]["spec"]
            base = {**image, **links} if spec.get("enableServiceLinks", True) else image
            for container in spec["containers"]:
                env = {**base, **platform_env.get(spec.get("serviceAccountName", ""), {}), "HOSTNAME": name}
                env = container_env(container, config_maps, secrets, env)
                plan = plan_container(name, f"{kind}/{name}", spec, container, env, workdir, secrets, config_maps)
                plan.restart = spec.get("restartPolicy", "Always")
                plan.backoff_limit = doc["spec"].get("backoffLimit", 6) if kind == "Job" else 0
                plans.append(plan)
        elif kind == "RayCluster":
            groups = [(None, doc["spec"]["headGroupSpec"])] + [(g, g) for g in doc["spec"].get("workerGroupSpecs", [])]
            for group, holder in groups:
                spec = holder["template"]["spec"]
                base = {**image, **links} if spec.get("enableServiceLinks", True) else image
                container = spec["containers"][0]
                pod_name = f"{name}-head" if group is None else f"{name}-{group['groupName']}-worker"
                argv, kuberay_env = _ray_start(doc, group, container)
                env = {**base, **platform_env.get(spec.get("serviceAccountName", ""), {}), "HOSTNAME": pod_name,
                       "RAY_CLOUD_INSTANCE_ID": pod_name}  # fmt: skip
                env = container_env(container, config_maps, secrets, {**env, **kuberay_env})
                if group is None and doc["spec"].get("gcsFaultToleranceOptions", {}).get("redisPassword"):
                    ref = doc["spec"]["gcsFaultToleranceOptions"]["redisPassword"]["valueFrom"]["secretKeyRef"]
                    env["REDIS_PASSWORD"] = secrets[ref["name"]][ref["key"]]
                argv = [a.replace("$REDIS_PASSWORD", env.get("REDIS_PASSWORD", "")) for a in argv]
                plan = plan_container(pod_name, f"RayCluster/{name}/{'head' if group is None else group['groupName']}",
                                      spec, {**container, "command": argv}, env, workdir, secrets,
                                      config_maps)  # fmt: skip
                plans.append(plan)
    return plans
