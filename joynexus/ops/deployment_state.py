"""The record of a deployment `joynexus up` started on this host, kept in ``<data_dir>/run``.

``services.json`` holds the processes started (session leader PID, session id, start time) and the
endpoints; ``env.sh`` exports those endpoints for a shell. `joynexus.ops.supervisor` writes and reads
the record; `joynexus.connect` reads it (`effective_settings`) to find a running deployment. This
module imports neither of them, so the two do not import each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from joynexus.ops.ray_access import ray_access_env
from joynexus.settings import Settings

__all__ = [
    "ENV_FILE",
    "STATE_FILE",
    "DeployError",
    "DeploymentState",
    "ManagedProcess",
    "effective_settings",
    "http_ok",
    "port_answers",
    "ray_access",
    "read_state",
    "run_dir",
    "session_members",
    "tail",
    "write_state",
]

STATE_FILE = "services.json"
ENV_FILE = "env.sh"


class DeployError(RuntimeError):
    """A service did not come up (the message carries the tail of its log) or the state is unusable."""


@dataclass
class ManagedProcess:
    name: str
    pid: int  # session leader; every process it spawns shares its session id (= pid)
    create_time: float  # guards against PID reuse: a different process with the same PID is not ours
    argv: list[str]
    log: str
    url: str | None = None
    members: list[int] = field(default_factory=list)  # session members seen when `up` finished

    def session_pids(self) -> list[int]:
        """PIDs alive now in this process's session (the leader included), started after it."""
        return session_members(self.pid, self.create_time)

    def alive(self) -> bool:
        return bool(self.session_pids())


def session_members(sid: int, not_before: float) -> list[int]:
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "create_time", "status"]):
        try:
            if os.getsid(proc.pid) != sid or proc.info["create_time"] < not_before - 1.0:
                continue
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue  # exited; only its parent's wait is missing
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
        found.append(proc.pid)
    return sorted(found)


@dataclass
class DeploymentState:
    data_dir: str
    ray_address: str
    prefect_api_url: str
    mlflow_tracking_uri: str
    namespace: str
    processes: list[ManagedProcess]
    started_at: float
    # The Ray head this deployment started (none: it uses JOYNEXUS_RAY_ADDRESS's): its token file
    # and the address it listens on (joynexus.ops.ray_access). Empty in records made before them.
    ray_auth_token_path: str = ""
    ray_bind: str = ""

    def process(self, name: str) -> ManagedProcess | None:
        return next((p for p in self.processes if p.name == name), None)

    def exports(self) -> dict[str, str]:
        """What a shell (a flow, a worker, the CLI) exports to use this deployment."""
        return {
            "JOYNEXUS_DATA_DIR": self.data_dir,
            "JOYNEXUS_RAY_ADDRESS": self.ray_address,
            "JOYNEXUS_MLFLOW_TRACKING_URI": self.mlflow_tracking_uri,
            "PREFECT_API_URL": self.prefect_api_url,
            **self.ray_env(),
        }

    def ray_env(self) -> dict[str, str]:
        """What a process exports to reach this deployment's Ray head: its token's file (never the
        token) when `up` started the head; an external cluster's access is its operator's business."""
        if self.ray_auth_token_path:
            return ray_access_env(self.ray_auth_token_path, self.ray_bind)
        return {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> DeploymentState:
        raw = json.loads(text)
        raw["processes"] = [ManagedProcess(**p) for p in raw["processes"]]
        return cls(**raw)


def run_dir(settings: Settings) -> Path:
    return settings.data_dir / "run"


def read_state(settings: Settings) -> DeploymentState | None:
    path = run_dir(settings) / STATE_FILE
    try:
        return DeploymentState.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as exc:
        raise DeployError(f"{path} is not a deployment record ({exc}); remove it if nothing runs") from exc


def write_state(settings: Settings, state: DeploymentState) -> None:
    folder = run_dir(settings)
    tmp = folder / f".{STATE_FILE}.tmp"
    tmp.write_text(state.to_json())
    os.replace(tmp, folder / STATE_FILE)
    lines = [f"export {k}={json.dumps(v)}" for k, v in state.exports().items()]
    header = "# source this file to use the deployment `joynexus up` started\n"
    (folder / ENV_FILE).write_text(header + "\n".join(lines) + "\n")


def ray_access(settings: Settings) -> dict[str, str]:
    """The environment a process on this host needs to reach the Ray head this data dir's `up`
    started ({} when it started none, or `settings` name another cluster): `joynexus.connect` sets it
    before Ray connects, over an inherited RAY_AUTH_MODE (the recorded head refuses any other)."""
    state = read_state(settings)
    if state is None or not state.ray_auth_token_path:
        return {}
    if settings.ray_address and settings.ray_address != state.ray_address:
        return {}
    return state.ray_env()


def effective_settings(settings: Settings | None = None) -> Settings:
    """Settings, completed with the endpoints `up` recorded in the data dir for the fields the
    environment leaves unset (so a flow or CLI on this host finds the running deployment)."""
    settings = settings or Settings()
    state = read_state(settings)
    if state is None:
        return settings
    update: dict[str, Any] = {}
    if not settings.ray_address:
        update["ray_address"] = state.ray_address
    if not settings.mlflow_tracking_uri:
        update["mlflow_tracking_uri"] = state.mlflow_tracking_uri
    if not settings.prefect_api_url:
        update["prefect_api_url"] = state.prefect_api_url
    return settings.model_copy(update=update)


# -- probes of what a deployment runs: `up`'s supervisor, its services driver and the API's role
# follower share them.
def port_answers(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on (host, port) within half a second."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether `url` answers a GET with a 2xx status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: str | Path, lines: int = 15) -> str:
    """The last `lines` lines of a log file, or '(no log)'."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
