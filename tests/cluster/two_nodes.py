"""A 2-node Ray cluster on this host for tests and benchmarks: `ray start --head` with the custom
resource {"joynexus_head": 1} and a worker node (`ray start --address ...`) with
{"joynexus_worker": 1}, each on its own free ports and started with `--block` in a session of its
own, so it is stopped by PID (never `ray stop`, which would kill every Ray on the host)."""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from joynexus.ops.deployment_state import ManagedProcess
from joynexus.ops.supervisor import free_port, spawn_process, stop_process

HOST = "127.0.0.1"


def _node_ports() -> list[str]:
    # Every port a node opens, distinct per node: two nodes on one host would otherwise collide
    # on the defaults (the dashboard agent's 52365 above all).
    names = (
        "node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
        "metrics-export-port", "runtime-env-agent-port",
    )  # fmt: skip
    return [f"--{name}={free_port(HOST)}" for name in names]


def ray_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        HF_HUB_OFFLINE="1",
        MLFLOW_DISABLE_TELEMETRY="true",
    )
    env.update(extra)
    return env


@dataclass
class TwoNodeCluster:
    gcs_address: str
    client_address: str  # ray://host:port: how a pod outside the cluster connects
    dashboard_url: str
    temp_dir: Path
    nodes: list[ManagedProcess] = field(default_factory=list)

    def node_ids(self) -> dict[str, str]:
        """{"head" | "worker": node id}, told apart by their custom resources."""
        from ray.util.state import list_nodes

        found = {}
        for node in list_nodes(address=self.dashboard_url, detail=True):
            total = node.resources_total or {}
            if node.state != "ALIVE":
                continue
            if "joynexus_head" in total:
                found["head"] = node.node_id
            elif "joynexus_worker" in total:
                found["worker"] = node.node_id
        return found

    def actors(self) -> list[dict[str, Any]]:
        """Alive actors with their name, class and node id (Ray's state API through the dashboard)."""
        from ray.util.state import list_actors

        return [
            {"name": a.name, "class_name": a.class_name, "node_id": a.node_id}
            for a in list_actors(address=self.dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)
        ]

    def stop(self) -> None:
        for node in reversed(self.nodes):  # the worker first, then the head
            stop_process(node, grace_s=15.0)


def _wait_port(port: int, node: ManagedProcess, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((HOST, port)) == 0:
                return
        if not node.alive():
            raise RuntimeError(f"{what} exited: {Path(node.log).read_text()[-2000:]}")
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not open port {port} in {timeout_s:.0f} s")


def _wait_nodes(cluster: TwoNodeCluster, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if len(cluster.node_ids()) >= count:
                return
        except Exception:  # the dashboard is still starting
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the cluster did not show {count} nodes in {timeout_s:.0f} s")


def start_two_nodes(
    log_dir: Path,
    *,
    head_cpus: int = 2,
    worker_cpus: int = 3,
    with_worker: bool = True,
    head_gpus: int = 0,
    worker_gpus: int = 0,
) -> TwoNodeCluster:
    """Start the head (and the worker node); returns once every node is registered. `*_gpus`:
    GPUs each node declares to Ray's scheduler (CPU processes here: placement, not devices)."""
    ray = str(Path(sys.executable).parent / "ray")  # the ray of this interpreter's environment
    gcs, client, dashboard = free_port(HOST), free_port(HOST), free_port(HOST)
    temp_dir = Path(tempfile.gettempdir()) / f"jnx-2n-{uuid.uuid4().hex[:6]}"  # short: unix socket paths
    cluster = TwoNodeCluster(f"{HOST}:{gcs}", f"ray://{HOST}:{client}", f"http://{HOST}:{dashboard}", temp_dir)
    head = [
        ray, "start", "--head", "--block", f"--port={gcs}", f"--node-ip-address={HOST}",
        f"--ray-client-server-port={client}", "--include-dashboard=true", f"--dashboard-host={HOST}",
        f"--dashboard-port={dashboard}", f"--num-cpus={head_cpus}", f"--num-gpus={head_gpus}",
        f"--resources={json.dumps({'joynexus_head': 1})}", f"--temp-dir={temp_dir}", "--disable-usage-stats",
        *_node_ports(),
    ]  # fmt: skip
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        cluster.nodes.append(spawn_process("ray-head", head, ray_env(), log_dir))
        _wait_port(gcs, cluster.nodes[0], "the Ray head")
        _wait_port(client, cluster.nodes[0], "the Ray Client server")
        if with_worker:
            worker = [
                ray, "start", "--block", f"--address={HOST}:{gcs}", f"--node-ip-address={HOST}",
                f"--num-cpus={worker_cpus}", f"--num-gpus={worker_gpus}",
                f"--resources={json.dumps({'joynexus_worker': 1})}",
                "--disable-usage-stats", *_node_ports(),
            ]  # fmt: skip
            cluster.nodes.append(spawn_process("ray-worker", worker, ray_env(), log_dir))
        _wait_nodes(cluster, 2 if with_worker else 1)
    except BaseException:
        cluster.stop()
        raise
    return cluster
