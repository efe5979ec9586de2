"""Every pod of the rendered manifests fits a node of the node group it is scheduled on, for every
instance type that group may use (infra/terraform/variables.tf), after the kubelet's reservations
(the EKS AMI's formulas) and a DaemonSet budget; and the system pool's pods fit on its min_size nodes."""

from __future__ import annotations

import re

from tests.deploy.render import TERRAFORM, by_key, pod_specs, rendered

GI = 1024**3
MI = 1024**2
# vCPU, memory GiB, GPUs, max pods (EKS eni-max-pods) of the instance types a pool may be given.
INSTANCES = {
    "m6i.large": (2, 8, 0, 29), "m6i.xlarge": (4, 16, 0, 58), "m6i.2xlarge": (8, 32, 0, 58),
    "m6i.4xlarge": (16, 64, 0, 234), "m7i.xlarge": (4, 16, 0, 58), "m7i.2xlarge": (8, 32, 0, 58),
    "g5.xlarge": (4, 16, 1, 58), "g5.2xlarge": (8, 32, 1, 58), "g5.4xlarge": (16, 64, 1, 234),
    "g5.8xlarge": (32, 128, 1, 234), "g5.12xlarge": (48, 192, 4, 737), "g6.xlarge": (4, 16, 1, 58),
    "g6.2xlarge": (8, 32, 1, 58), "g6.4xlarge": (16, 64, 1, 234), "g6e.xlarge": (4, 32, 1, 58),
    "g6e.2xlarge": (8, 64, 1, 58),
}  # fmt: skip
# Per node: aws-node + network policy agent, kube-proxy, EBS / EFS CSI node, Pod Identity agent,
# NVIDIA device plugin (GPU nodes): what the add-ons request, rounded up.
DAEMONSET_CPU_M, DAEMONSET_MEMORY = 400, 1 * GI


def quantity(value) -> float:
    """CPU in millicores or memory in bytes from a Kubernetes quantity."""
    text = str(value)
    units = {"m": 1e-3, "Ki": 1024, "Mi": MI, "Gi": GI, "Ti": 1024**4, "k": 1e3, "M": 1e6, "G": 1e9}
    for suffix, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def cpu_m(value) -> float:
    text = str(value)
    return float(text[:-1]) if text.endswith("m") else float(text) * 1000


def allocatable(instance: str) -> tuple[float, float, int]:
    vcpu, memory_gib, gpus, max_pods = INSTANCES[instance]
    reserved_m = 60 + (10 if vcpu > 1 else 0) + 5 * min(max(vcpu - 2, 0), 2) + 2.5 * max(vcpu - 4, 0)
    reserved_memory = (255 + 11 * max_pods) * MI + 100 * MI  # kube-reserved + eviction threshold
    return (vcpu * 1000 - reserved_m - DAEMONSET_CPU_M, memory_gib * GI - reserved_memory - DAEMONSET_MEMORY, gpus)


def pools() -> dict[str, dict]:
    text = (TERRAFORM / "variables.tf").read_text()
    found = {}
    for pool in ("system", "gpu", "cpu"):
        block = re.search(rf"{pool} = optional\(object\(\{{(.*?)\}}\), \{{\}}\)", text, re.S).group(1)
        types = re.search(r"instance_types\s*=.*", block).group(0)
        found[pool] = {"instance_types": re.findall(r'"([a-z0-9]+\.[a-z0-9]+)"', types)}
        for key in ("min_size", "max_size"):
            found[pool][key] = int(re.search(rf"{key}\s*= optional\(number, (\d+)\)", block).group(1))
    return found


def pod_requests() -> list[tuple[str, str, float, float, int, int]]:
    """(label, pool, cpu m, memory bytes, gpus, replicas) of every pod, the Ray head with its sidecar."""
    out = []
    for doc in by_key(rendered()).values():
        for label, pod in pod_specs(doc):
            containers = list(pod["containers"])
            if doc["kind"] == "RayCluster" and label.endswith("/head") and doc["spec"].get("enableInTreeAutoscaling"):
                containers.append({"resources": doc["spec"]["autoscalerOptions"]["resources"]})
            requests = [c["resources"].get("requests", {}) for c in containers]
            cpu = sum(cpu_m(r.get("cpu", 0)) for r in requests)
            memory = sum(quantity(r.get("memory", 0)) for r in requests)
            gpus = sum(int(r.get("nvidia.com/gpu", 0)) for r in requests)
            memory_volumes = sum(quantity(v["emptyDir"].get("sizeLimit", 0)) for v in pod.get("volumes", [])
                                 if v.get("emptyDir", {}).get("medium") == "Memory")  # fmt: skip
            limits = sum(quantity(c["resources"].get("limits", {}).get("memory", 0)) for c in containers)
            assert memory_volumes < limits, f"{label}: /dev/shm ({memory_volumes}) must fit in the memory limit"
            if doc["kind"] == "RayCluster" and not label.endswith("/head"):
                group = next(g for g in doc["spec"]["workerGroupSpecs"] if label.endswith(g["groupName"]))
                replicas = group["minReplicas"]
            else:
                replicas = doc["spec"].get("replicas", 1) if doc["kind"] == "Deployment" else 1
            out.append((label, pod["nodeSelector"]["joynexus.io/node-pool"], cpu, memory, gpus, replicas))
    return out


def test_every_pod_fits_every_instance_type_of_its_pool():
    node_pools = pools()
    assert node_pools["gpu"]["instance_types"] and node_pools["system"]["instance_types"]
    for label, pool, cpu, memory, gpus, _ in pod_requests():
        for instance in node_pools[pool]["instance_types"]:
            cpu_a, memory_a, gpus_a = allocatable(instance)
            assert cpu <= cpu_a, f"{label}: requests {cpu:.0f}m CPU, a {instance} has {cpu_a:.0f}m allocatable"
            assert memory <= memory_a, (
                f"{label}: requests {memory / GI:.1f} GiB, a {instance} has {memory_a / GI:.1f} GiB"
            )
            assert gpus <= gpus_a, f"{label}: requests {gpus} GPUs, a {instance} has {gpus_a}"


def test_the_system_pool_holds_its_pods_on_min_size_nodes_and_ray_scales_within_its_pools():
    node_pools = pools()
    system = node_pools["system"]
    instance = min(system["instance_types"], key=lambda i: INSTANCES[i][:2])
    cpu_a, memory_a, _ = allocatable(instance)
    nodes = [[cpu_a, memory_a] for _ in range(system["min_size"])]
    pods = sorted(
        ((c, m) for _, pool, c, m, _, n in pod_requests() if pool == "system" for _ in range(n)), reverse=True
    )
    pods += [(100, 512 * MI), (100, 70 * MI), (100, 70 * MI)]  # KubeRay operator, CoreDNS x2
    for cpu, memory in sorted(pods, reverse=True):  # first fit decreasing
        node = next((n for n in nodes if n[0] >= cpu and n[1] >= memory), None)
        assert node is not None, f"system pool: {system['min_size']} x {instance} cannot hold all its pods"
        node[0] -= cpu
        node[1] -= memory
    cluster = by_key(rendered())[("RayCluster", "joynexus")]["spec"]
    by_pool: dict[str, list[dict]] = {}
    for group in cluster["workerGroupSpecs"]:  # one Ray worker per node: a pool's groups share its nodes
        by_pool.setdefault(group["template"]["spec"]["nodeSelector"]["joynexus.io/node-pool"], []).append(group)
    assert set(by_pool) == {"gpu", "cpu"}
    for pool, groups in by_pool.items():
        assert sum(g["maxReplicas"] for g in groups) <= node_pools[pool]["max_size"], pool
        assert sum(g["minReplicas"] for g in groups) <= node_pools[pool]["min_size"], pool


def test_the_fit_check_fails_for_the_old_worker_size():
    cpu_a, memory_a, _ = allocatable("g5.2xlarge")
    assert not (8000 <= cpu_a and 48 * GI <= memory_a)  # the shipped 8 CPU / 48Gi never scheduled
