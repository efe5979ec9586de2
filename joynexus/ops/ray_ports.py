"""Every port of the Ray head `joynexus up` starts, chosen together and checked before anything starts.

Ray listens on more than its GCS port: the node manager, object manager, Ray Client server, dashboard
agent (gRPC and HTTP), metrics export and runtime-env agent ports default to fixed numbers (10001,
52365, ...) or random ones, the dashboard head and the autoscaler monitor serve their metrics on
fixed ports (44227, 44217; set only through environment variables), and its workers bind ports in a
range (10002-19999 by default). Two deployments on one host then collide (the second head's metrics
servers fail to bind, and a scrape of the fixed port reads the other deployment), and a GCS port
inside the worker range fails deep in Ray. Here the head's ports are one block, `JOYNEXUS_RAY_PORT`
and the 9 above it, the worker range is
`JOYNEXUS_RAY_WORKER_PORTS`, and a block that overlaps the range, another service of the deployment
or a port in use is refused naming the setting to change.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from joynexus.ops.deployment_state import DeployError
from joynexus.settings import Settings

# The head's ports in block order: JOYNEXUS_RAY_PORT + index.
RAY_PORT_ROLES = (
    ("port", "GCS"),
    ("node-manager-port", "node manager"),
    ("object-manager-port", "object manager"),
    ("ray-client-server-port", "Ray Client server"),
    ("dashboard-agent-grpc-port", "dashboard agent gRPC"),
    ("dashboard-agent-listen-port", "dashboard agent HTTP"),
    ("metrics-export-port", "metrics export"),
    ("runtime-env-agent-port", "runtime-env agent"),
)
# Then the ports Ray's head takes from its environment: JOYNEXUS_RAY_PORT + len(RAY_PORT_ROLES) + index.
RAY_ENV_PORT_ROLES = (
    ("DASHBOARD_METRIC_PORT", "dashboard metrics"),
    ("AUTOSCALER_METRIC_PORT", "autoscaler metrics"),
)
BLOCK_SIZE = len(RAY_PORT_ROLES) + len(RAY_ENV_PORT_ROLES)


@dataclass(frozen=True)
class RayPorts:
    """The head's port block and its workers' port range."""

    base: int
    worker_min: int
    worker_max: int

    @property
    def ports(self) -> dict[str, int]:
        """`ray start` option -> port."""
        return {option: self.base + i for i, (option, _) in enumerate(RAY_PORT_ROLES)}

    @property
    def env(self) -> dict[str, str]:
        """Environment variable -> port, for the `ray start` process (its dashboard head and monitor)."""
        first = self.base + len(RAY_PORT_ROLES)
        return {variable: str(first + i) for i, (variable, _) in enumerate(RAY_ENV_PORT_ROLES)}

    def argv(self) -> list[str]:
        """The `ray start` options that pin every port."""
        return [f"--{option}={port}" for option, port in self.ports.items()] + [
            f"--min-worker-port={self.worker_min}",
            f"--max-worker-port={self.worker_max}",
        ]

    def busy(self, host: str) -> list[tuple[str, int]]:
        """(role, port) of the block's ports something on `host` already listens on."""
        taken = []
        roles = [role for _, role in (*RAY_PORT_ROLES, *RAY_ENV_PORT_ROLES)]
        for role, port in zip(roles, range(self.base, self.base + BLOCK_SIZE), strict=True):
            with socket.socket() as sock:
                sock.settimeout(0.2)
                if sock.connect_ex((host, port)) == 0:
                    taken.append((role, port))
        return taken


def ray_ports(settings: Settings) -> RayPorts:
    """The Ray head's ports for `settings`, checked against Ray's ranges and the deployment's other
    services; DeployError naming the setting otherwise."""
    text = settings.ray_worker_ports.strip()
    low, sep, high = text.partition("-")
    if not (sep and low.strip().isdigit() and high.strip().isdigit()):
        raise DeployError(f"JOYNEXUS_RAY_WORKER_PORTS: expected 'min-max' (e.g. 10002-19999), got {text!r}")
    worker_min, worker_max = int(low), int(high)
    if not 1024 <= worker_min <= worker_max <= 65535:
        raise DeployError(f"JOYNEXUS_RAY_WORKER_PORTS: {text!r} must lie within 1024-65535 with min <= max")
    block = RayPorts(settings.ray_port, worker_min, worker_max)
    first, last = block.base, block.base + BLOCK_SIZE - 1
    if last > 65535:
        raise DeployError(
            f"JOYNEXUS_RAY_PORT={first}: the Ray head takes it and the {BLOCK_SIZE - 1} ports above it "
            f"({first}-{last}), past 65535; choose a lower port"
        )
    if first <= worker_max and worker_min <= last:
        raise DeployError(
            f"JOYNEXUS_RAY_PORT={first}: the Ray head's ports {first}-{last} fall inside Ray's worker port range "
            f"{worker_min}-{worker_max} (JOYNEXUS_RAY_WORKER_PORTS); choose a JOYNEXUS_RAY_PORT outside it "
            f"(e.g. 6379, or {worker_max + 1} and above) or move the worker range"
        )
    for port, variable, given in (
        (settings.prefect_port, "JOYNEXUS_PREFECT_PORT", settings.prefect_api_url),
        (settings.mlflow_port, "JOYNEXUS_MLFLOW_PORT", settings.mlflow_tracking_uri),
    ):
        if not given and (first <= port <= last or worker_min <= port <= worker_max):
            raise DeployError(
                f"{variable}={port} lies among the Ray head's ports {first}-{last} or its worker ports "
                f"{worker_min}-{worker_max}; choose another {variable} or JOYNEXUS_RAY_PORT"
            )
    return block
