"""Bring a JoyNexus deployment up and down on this host, and connect flows to it.

``up`` starts, on the embedded defaults, what a cluster would provide:

* a Ray head (``ray start --head --block``) with token authentication on and every port on 127.0.0.1
  unless ``JOYNEXUS_RAY_BIND`` names an address to expose (`joynexus.ops.ray_access`);
* the resident services as named, detached Ray actors (``Deployment.start(detached=True)``): Training
  Queue, Training Model Service, Inference Model Service, Environment Service;
* a Prefect server (SQLite under ``<data_dir>/prefect``) and an MLflow server (the SQLite store and
  artifact folder of the embedded default, ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``).

Every process it starts leads its own session (``setsid``); the leader's PID, session id and start
time are recorded in ``<data_dir>/run/services.json``. ``down`` removes the detached actors, then
stops exactly those sessions by PID (never ``ray stop``, which would kill every Ray on the host).

Production settings are environment variables (``Settings``): with ``JOYNEXUS_RAY_ADDRESS`` /
``PREFECT_API_URL`` / ``JOYNEXUS_MLFLOW_TRACKING_URI`` set, ``up`` starts no such process and uses
the given one; ``JOYNEXUS_DATABASE_URL`` and ``JOYNEXUS_S3_BUCKET`` pass through to the services.

Where a running deployment's services are and how to reach them is `joynexus.connect`'s business;
this module only starts, records and stops processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from joynexus.master.health_snapshot import health_snapshot_path
from joynexus.ops import services_driver
from joynexus.ops.deployment_state import (
    ENV_FILE,
    STATE_FILE,
    DeployError,
    DeploymentState,
    ManagedProcess,
    effective_settings,
    http_ok,
    ray_access,
    read_state,
    run_dir,
    write_state,
)
from joynexus.ops.deployment_state import port_answers as _port_open
from joynexus.ops.deployment_state import tail as _tail
from joynexus.ops.health_report import master_detail, published_health, replica_summary, role_entries
from joynexus.ops.ray_access import LOOPBACK, ensure_ray_token, ray_access_env, ray_bind_address
from joynexus.ops.ray_ports import BLOCK_SIZE, ray_ports
from joynexus.settings import Settings, local_artifact_location, local_tracking_uri

__all__ = [
    "ManagedProcess",
    "down",
    "free_port",
    "http_ok",
    "spawn_process",
    "status",
    "stop_process",
    "up",
    "wait_until",
]

SERVICE_ACTORS = (
    "joynexus.master",  # first: it stops leasing before the services it drives go away
    "joynexus.environment_service",  # first: its close_all stops simulator worker processes
    "joynexus.inference_service",
    "joynexus.training_service",
    "joynexus.training_queue",
)
HOST = "127.0.0.1"


# --------------------------------------------------------------------------------------------
# Processes we start: one session each, recorded by PID
# --------------------------------------------------------------------------------------------


def spawn_process(
    name: str, argv: list[str], env: dict[str, str], run_dir: Path, url: str | None = None
) -> ManagedProcess:
    import psutil

    log = run_dir / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return ManagedProcess(name, proc.pid, psutil.Process(proc.pid).create_time(), argv, str(log), url)


def stop_process(process: ManagedProcess, grace_s: float = 20.0) -> list[int]:
    """SIGTERM the leader, then its session, then SIGKILL what is left; returns the PIDs signalled."""
    members = process.session_pids()
    if not members:
        return []
    _signal_all([process.pid] if process.pid in members else members, signal.SIGTERM)
    if not _wait_gone(process, grace_s):
        _signal_all(process.session_pids(), signal.SIGTERM)
        if not _wait_gone(process, grace_s):
            _signal_all(process.session_pids(), signal.SIGKILL)
            _wait_gone(process, 10.0)
    return members


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_gone(process: ManagedProcess, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process.session_pids():
            return True
        time.sleep(0.2)
    return not process.session_pids()


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(ready: Callable[[], bool], process: ManagedProcess | None, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if process is not None and not process.alive():
            raise DeployError(f"{what} exited while starting; last lines of {process.log}:\n{_tail(process.log)}")
        time.sleep(0.25)
    where = f"; last lines of {process.log}:\n{_tail(process.log)}" if process is not None else ""
    raise DeployError(f"{what} was not ready after {timeout_s:.0f} s{where}")


def _executable(name: str) -> str:
    """A console script of this environment (beside the running interpreter), else from PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise DeployError(f"{name!r} is not installed in {Path(sys.executable).parent} nor on PATH")
    return found


# --------------------------------------------------------------------------------------------
# up / down / status
# --------------------------------------------------------------------------------------------


def _ray_temp_dir(settings: Settings) -> Path:
    # Ray puts unix sockets under its temp dir: keep the path short (108-byte limit), one per data dir.
    # Under RAY_TMPDIR when set (Ray's own variable for where its temp dirs go), else the system's.
    digest = hashlib.sha256(str(settings.data_dir).encode()).hexdigest()[:10]
    return Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / f"joynexus-ray-{digest}"


# Settings fields the processes `up` starts must see as this process does (a Settings object built
# in code, not from the environment, still reaches them; Ray actors inherit the head's environment).
_SETTINGS_ENV = {
    "data_dir": "JOYNEXUS_DATA_DIR",
    "database_url": "JOYNEXUS_DATABASE_URL",
    "backbone_preset": "JOYNEXUS_BACKBONE_PRESET",
    "backbone_path": "JOYNEXUS_BACKBONE_PATH",
    "backbone_image_size": "JOYNEXUS_BACKBONE_IMAGE_SIZE",
    "backbone_feature_layers": "JOYNEXUS_BACKBONE_FEATURE_LAYERS",
    "backbone_id": "JOYNEXUS_BACKBONE_ID",
    "ray_namespace": "JOYNEXUS_RAY_NAMESPACE",
    "torch_threads": "JOYNEXUS_TORCH_THREADS",
    "device": "JOYNEXUS_DEVICE",
    "dtype": "JOYNEXUS_DTYPE",
    "autocast": "JOYNEXUS_AUTOCAST",
    "s3_bucket": "JOYNEXUS_S3_BUCKET",
    "s3_prefix": "JOYNEXUS_S3_PREFIX",
    "s3_endpoint_url": "JOYNEXUS_S3_ENDPOINT_URL",
}


def _child_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true"})
    # The head this data dir's `up` started takes its token; another cluster, what the environment says.
    env.update(ray_access(settings) or {"RAY_AUTH_MODE": env.get("RAY_AUTH_MODE", "disabled")})
    env.setdefault("HF_HUB_OFFLINE", "1")
    for field_name, variable in _SETTINGS_ENV.items():
        value = getattr(settings, field_name)
        if value is None or value == "":
            env.pop(variable, None)
        else:
            env[variable] = str(value)
    env.update(extra)
    return env


def up(
    settings: Settings | None = None,
    *,
    timeout_s: float = 300.0,
    on_stage: Callable[[str], None] = lambda message: None,
) -> DeploymentState:
    """Start what the settings do not point at, then the resident services; record it all.
    Idempotent: if this data dir's deployment is already up, returns its record."""
    begun = time.monotonic()
    settings = settings or Settings()
    existing = read_state(settings)
    if existing is not None:
        if all(p.alive() for p in existing.processes):
            on_stage(f"already up (recorded in {run_dir(settings) / STATE_FILE})")
            return existing
        raise DeployError(
            f"{run_dir(settings) / STATE_FILE} records a deployment that is partly down; run `joynexus down` first"
        )
    folder = run_dir(settings)
    folder.mkdir(parents=True, exist_ok=True)
    _refuse_busy_ports(settings)
    access: dict[str, str] = {}  # how our processes and a shell reach the Ray head started here
    if not settings.ray_address:
        access = ray_access_env(ensure_ray_token(folder), _bind(settings))
    started: list[ManagedProcess] = []
    try:
        # Everything at once: the servers, the Ray head and the driver that creates the services
        # (it imports the service classes while the head starts; `services_driver`).
        mlflow_uri = settings.mlflow_tracking_uri or _start_mlflow(settings, folder, started, on_stage)
        prefect_url = settings.prefect_api_url or _start_prefect(settings, folder, started, on_stage)
        ray_address = settings.ray_address or _start_ray_head(settings, folder, started, on_stage, access)
        processes = {p.name: p for p in started}
        on_stage("creating the resident services (detached Ray actors) and loading the backbone")
        services_driver.run_driver(
            _child_env(settings, JOYNEXUS_RAY_ADDRESS=ray_address, JOYNEXUS_MLFLOW_TRACKING_URI=mlflow_uri, **access),
            folder,
            watched=started,
            ray_logs=_ray_temp_dir(settings) / "session_latest" / "logs" if "ray" in processes else None,
            wait_gcs=ray_address if "ray" in processes else None,
            mlflow_health=f"{mlflow_uri}/health" if "mlflow" in processes else None,
            timeout_s=timeout_s,
            on_stage=lambda message: on_stage(f"{message}; up +{time.monotonic() - begun:.1f} s"),
        )
        if "mlflow" in processes:
            wait_until(lambda: http_ok(f"{mlflow_uri}/health"), processes["mlflow"], "MLflow server", timeout_s)
        if "prefect" in processes:
            wait_until(lambda: http_ok(f"{prefect_url}/health"), processes["prefect"], "Prefect server", timeout_s)
        for process in started:
            process.members = process.session_pids()
        state = DeploymentState(
            data_dir=str(settings.data_dir),
            ray_address=ray_address,
            prefect_api_url=prefect_url,
            mlflow_tracking_uri=mlflow_uri,
            namespace=settings.ray_namespace,
            processes=started,
            started_at=time.time(),
            ray_auth_token_path=access.get("RAY_AUTH_TOKEN_PATH", ""),
            ray_bind=_bind(settings) if access else "",
        )
        write_state(settings, state)
        on_stage(f"up: recorded in {folder / STATE_FILE}")
        return state
    except BaseException:
        for process in reversed(started):
            stop_process(process)
        raise


def _refuse_busy_ports(settings: Settings) -> None:
    """Fail before starting anything when a port `up` would listen on is taken, or the Ray head's
    ports overlap Ray's worker range or the other services (`ray_ports`)."""
    _refuse_an_unreachable_ray_address(settings)
    block = None
    if not settings.ray_address:  # the settings themselves first: an overlap is refused even when free
        _bind(settings)
        _refuse_long_ray_temp_dir(settings)
        block = ray_ports(settings)
    for given, port, variable in (
        (settings.mlflow_tracking_uri, settings.mlflow_port, "JOYNEXUS_MLFLOW_PORT"),
        (settings.prefect_api_url, settings.prefect_port, "JOYNEXUS_PREFECT_PORT"),
    ):
        if not given and _port_open(HOST, port):
            raise DeployError(f"port {port} on {HOST} is in use (another service?); choose another with {variable}")
    taken = block.busy(HOST) if block is not None else []
    if taken:
        listed = ", ".join(f"{port} ({role})" for role, port in taken)
        raise DeployError(
            f"JOYNEXUS_RAY_PORT={settings.ray_port}: the Ray head needs ports {settings.ray_port}-"
            f"{settings.ray_port + BLOCK_SIZE - 1}; in use on {HOST}: {listed} (another deployment?); "
            "choose another JOYNEXUS_RAY_PORT"
        )


def _bind(settings: Settings) -> str:
    try:
        return ray_bind_address(settings)
    except ValueError as error:
        raise DeployError(str(error)) from None


def _refuse_an_unreachable_ray_address(settings: Settings) -> None:
    """A JOYNEXUS_RAY_ADDRESS nothing answers at is refused at once (issue 41.15): a shell that
    sourced an earlier deployment's env.sh keeps it after `down`, and `up` then started no head
    and waited out its timeout for the one named."""
    address = settings.ray_address
    if not address or "://" in address or address == "auto":
        return  # a Ray Client address, or Ray's own lookup: Ray says what it finds
    host, _, port = address.rpartition(":")
    if not port.isdigit() or _port_open(host or HOST, int(port)):
        return
    raise DeployError(
        f"JOYNEXUS_RAY_ADDRESS is {address!r} and nothing answers there (inherited from a shell that sourced "
        "the env.sh of a deployment since stopped?); unset it (`unset JOYNEXUS_RAY_ADDRESS`) to start a Ray "
        "head here, or point it at a running one"
    )


# What Ray puts under the head's temp dir: session_<date>_<time>_<microseconds>_<pid up to 7 digits>/
# sockets/plasma_store, its longest unix socket path; AF_UNIX allows 107 bytes.
_RAY_SOCKET_TAIL = "/session_2026-12-04_12-05-25_094518_4194304/sockets/plasma_store"
_AF_UNIX_MAX = 107


def _refuse_long_ray_temp_dir(settings: Settings) -> None:
    """Ray's head fails mid-start (a raw OSError) when its socket paths exceed the AF_UNIX limit."""
    temp_dir = _ray_temp_dir(settings)
    if len(str(temp_dir)) + len(_RAY_SOCKET_TAIL) > _AF_UNIX_MAX:
        fits = _AF_UNIX_MAX - len(_RAY_SOCKET_TAIL) - len(temp_dir.name) - 1
        raise DeployError(
            f"RAY_TMPDIR={os.environ.get('RAY_TMPDIR', '')!r}: the Ray head's socket paths under {temp_dir} would "
            f"exceed the {_AF_UNIX_MAX}-byte unix socket limit; choose a RAY_TMPDIR of at most {fits} characters"
        )


def _start_mlflow(
    settings: Settings, folder: Path, started: list[ManagedProcess], on_stage: Callable[[str], None]
) -> str:
    """Spawn the MLflow server on the embedded store (appended to `started`); returns its URI."""
    mlflow_uri = f"http://{HOST}:{settings.mlflow_port}"
    artifacts = settings.mlflow_artifact_location or _local_artifacts(settings)
    argv = [
        _executable("mlflow"), "server", "--backend-store-uri", local_tracking_uri(settings.data_dir),
        "--artifacts-destination", artifacts, "--host", HOST, "--port", str(settings.mlflow_port),
        "--workers", "1",
    ]  # fmt: skip
    env = _child_env(settings, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    if settings.s3_endpoint_url:
        env.setdefault("MLFLOW_S3_ENDPOINT_URL", settings.s3_endpoint_url)
    started.append(spawn_process("mlflow", argv, env, folder, url=mlflow_uri))
    on_stage(f"MLflow server starting on {mlflow_uri}")
    return mlflow_uri


def _start_prefect(
    settings: Settings, folder: Path, started: list[ManagedProcess], on_stage: Callable[[str], None]
) -> str:
    """Spawn the Prefect server on SQLite under the data dir (appended to `started`); returns its API URL."""
    prefect_url = f"http://{HOST}:{settings.prefect_port}/api"
    prefect_home = settings.data_dir / "prefect"
    prefect_home.mkdir(parents=True, exist_ok=True)
    argv = [_executable("prefect"), "server", "start", "--host", HOST, "--port", str(settings.prefect_port)]
    # The UI asks the API where PREFECT_UI_API_URL says; left unset, Prefect derives it from
    # PREFECT_SERVER_API_PORT (4200), not from --port: the UI of a server on another port could not
    # connect, or showed the deployment that holds 4200.
    env = _child_env(settings, PREFECT_HOME=str(prefect_home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env["PREFECT_UI_API_URL"] = prefect_url
    env.pop("PREFECT_API_URL", None)
    started.append(spawn_process("prefect", argv, env, folder, url=prefect_url))
    on_stage(f"Prefect server starting on {prefect_url.removesuffix('/api')}")
    return prefect_url


def ray_head_command(settings: Settings, access: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The `ray start` command line of the head `up` starts and its environment: token auth on
    (`access`: `ray_access.ray_access_env`), every port on JOYNEXUS_RAY_BIND, no dashboard."""
    bind = _bind(settings)
    argv = [
        _executable("ray"), "start", "--head", "--block", *ray_ports(settings).argv(),
        f"--node-ip-address={bind}", f"--num-cpus={max(4, os.cpu_count() or 1)}",
        "--include-dashboard=false", f"--temp-dir={_ray_temp_dir(settings)}", "--disable-usage-stats",
    ]  # fmt: skip
    # `down` removes the actors before it stops the head: no drain wait on SIGTERM.
    env = _child_env(settings, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", **ray_ports(settings).env, **access)
    if access.get("RAY_AUTH_MODE") != "token":
        raise DeployError("the Ray head `up` starts needs its token (RAY_AUTH_MODE=token); none was given")
    return argv, env


def _start_ray_head(
    settings: Settings,
    folder: Path,
    started: list[ManagedProcess],
    on_stage: Callable[[str], None],
    access: dict[str, str] | None = None,
) -> str:
    """Spawn a Ray head (appended to `started`); returns its address. The services driver waits for
    its GCS port, `up` for the head's leader (`services_driver.run_driver`). `access`: how it is
    reached (`ray_access.ray_access_env`; by default with the data dir's token)."""
    bind = _bind(settings)
    access = access or ray_access_env(ensure_ray_token(folder), bind)
    ray_address = f"{HOST if bind == LOOPBACK else bind}:{settings.ray_port}"
    argv, env = ray_head_command(settings, access)
    started.append(spawn_process("ray", argv, env, folder, url=ray_address))
    exposed = "" if bind == LOOPBACK else " (JOYNEXUS_RAY_BIND: on every interface of this host)"
    on_stage(f"Ray head starting on {ray_address}{exposed}, token authentication on")
    return ray_address


def _local_artifacts(settings: Settings) -> str:
    return local_artifact_location(settings.data_dir)


def down(
    settings: Settings | None = None, *, on_stage: Callable[[str], None] = lambda message: None
) -> dict[str, list[int]]:
    """Remove the detached service actors and stop the processes `up` recorded (by PID).
    Returns {process name: PIDs signalled}. A no-op when nothing is recorded."""
    settings = settings or Settings()
    state = read_state(settings)
    if state is None:
        on_stage(f"nothing recorded in {run_dir(settings) / STATE_FILE}")
        return {}
    ray_process = state.process("ray")
    # The servers (Prefect, MLflow) stop while the actors are removed; Ray's head only after them.
    # Each may take its grace period; all run at once.
    with ThreadPoolExecutor(max_workers=max(1, len(state.processes)), thread_name_prefix="stop") as pool:
        futures = {p.name: pool.submit(stop_process, p) for p in reversed(state.processes) if p is not ray_process}
        if ray_process is None or ray_process.alive():
            try:
                removed = _remove_actors(state)
                on_stage(f"removed detached actors: {', '.join(removed) or 'none found'}")
            except (DeployError, subprocess.TimeoutExpired) as error:  # still stop our processes
                on_stage(f"could not remove the detached actors: {error}")
        if ray_process is not None:
            futures = {"ray": pool.submit(stop_process, ray_process), **futures}
    stopped: dict[str, list[int]] = {}
    for name, future in futures.items():
        stopped[name] = future.result()
        on_stage(f"stopped {name} (pids {stopped[name] or 'already gone'})")
    (run_dir(settings) / STATE_FILE).unlink(missing_ok=True)
    (run_dir(settings) / ENV_FILE).unlink(missing_ok=True)
    health_snapshot_path(settings.data_dir, state.namespace).unlink(missing_ok=True)
    if ray_process is not None:
        shutil.rmtree(_ray_temp_dir(settings), ignore_errors=True)
    return stopped


def _remove_actors(state: DeploymentState, timeout_s: float = 60.0) -> list[str]:
    code = (
        "import json, sys\n"
        "from joynexus.ops.supervisor import _kill_actors\n"
        "print(json.dumps(_kill_actors(sys.argv[1], sys.argv[2])))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, state.ray_address, state.namespace],
        env=_child_env(Settings(data_dir=Path(state.data_dir))),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if result.returncode != 0:
        raise DeployError(f"removing the service actors failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _kill_actors(address: str, namespace: str) -> list[str]:
    import ray

    from joynexus.actors import init_ray

    init_ray(address)
    try:
        return remove_service_actors(namespace)
    finally:
        ray.shutdown()


def remove_service_actors(namespace: str) -> list[str]:
    """Kill a deployment's named actors in `namespace` from a driver already connected to Ray,
    the Master first; the Environment Service closes its simulator workers before it goes."""
    import ray

    removed = []
    # The lower layer's call queue (`services.call_futures`, detached, created with the services by
    # `up`) and the producer replicas (`joynexus.producers-<i>`, issue 40) go after the Master and
    # before the services their calls reach.
    try:
        named = sorted(
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == namespace
        )
    except Exception:  # listing is best effort: the replicas then go with their cluster
        named = []
    producers = [n for n in named if n.startswith("joynexus.producers-")]
    # Training shards (`joynexus.training_service.shard-<i>`, issue 45) go with the training role.
    shards = [n for n in named if n.startswith("joynexus.training_service.")]
    training = SERVICE_ACTORS.index("joynexus.training_service")
    ordered = (*SERVICE_ACTORS[1:training], *shards, *SERVICE_ACTORS[training:])
    for name in (*SERVICE_ACTORS[:1], "joynexus.call_futures", *producers, *ordered):
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue
        if name == "joynexus.environment_service":
            with contextlib.suppress(Exception):
                ray.get(handle.close_all.remote(), timeout=20)
        ray.kill(handle, no_restart=True)
        removed.append(name)
    # The device bundles the training shards / data-parallel ranks held (their actors gone now).
    from joynexus.services.configs import TrainingServiceConfig

    with contextlib.suppress(Exception):
        TrainingServiceConfig.remove_shard_group(namespace)
    return removed


def status(settings: Settings | None = None, *, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """Health of each service: {name: {"healthy": bool, "where": ..., "detail": ...}}."""
    settings = effective_settings(settings)
    state = read_state(settings)
    report: dict[str, dict[str, Any]] = {}
    processes = {p.name: p for p in state.processes} if state else {}

    def process_detail(name: str) -> str:
        process = processes.get(name)
        if process is None:
            return "external"
        pids = process.session_pids()
        return f"pid {process.pid} ({len(pids)} processes)" if pids else f"pid {process.pid}: not running"

    ray_address = settings.ray_address
    report["ray"] = {"healthy": False, "where": ray_address or "-", "detail": process_detail("ray")}
    if ray_address:
        if "://" in ray_address:  # a Ray Client address (ray://head:10001), as pods outside Ray use
            from urllib.parse import urlparse

            parsed = urlparse(ray_address)
            host, port = parsed.hostname or HOST, str(parsed.port or "")
        else:
            host, _, port = ray_address.rpartition(":")
        reachable = port.isdigit() and _port_open(host or HOST, int(port))
        report["ray"]["healthy"] = reachable
        if reachable:  # the Master's published health when fresh (no Ray driver), else ask the actors
            report.update(published_health(settings) or _actor_health(settings, ray_address, timeout_s))
    mlflow_uri = settings.mlflow_tracking_uri or ""
    healthy = http_ok(f"{mlflow_uri}/health") if mlflow_uri.startswith("http") else bool(mlflow_uri)
    report["mlflow"] = {"healthy": healthy, "where": mlflow_uri or "-", "detail": process_detail("mlflow")}
    prefect_url = settings.prefect_api_url or ""
    report["prefect"] = {
        "healthy": bool(prefect_url) and http_ok(f"{prefect_url}/health"),
        "where": prefect_url or "-",
        "detail": process_detail("prefect"),
    }
    return report


def _actor_health(settings: Settings, address: str, timeout_s: float) -> dict[str, dict[str, Any]]:
    namespace = settings.ray_namespace
    code = (
        "import json, sys\n"
        "from joynexus.ops.supervisor import _probe_actors\n"
        "print(json.dumps(_probe_actors(sys.argv[1], sys.argv[2], float(sys.argv[3]))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, address, namespace, str(timeout_s)],
        env=_child_env(settings),
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
    )
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {name: {"healthy": False, "where": address, "detail": reason} for name in SERVICE_ACTORS}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _probe_actors(address: str, namespace: str, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Ask each named actor a cheap question (runs in a short-lived driver)."""
    import ray

    from joynexus.actors import init_ray

    questions = {
        "joynexus.master": (
            "ping",
            master_detail,
        ),
        "joynexus.training_queue": ("partitions", lambda r: f"Training Queue depth: {len(r)} partitions"),
        "joynexus.training_service": ("tenants", lambda r: f"{len(r)} tenant slots"),
        "joynexus.inference_service": (
            "stats",
            lambda r: (
                f"Inference Queue depth: {r['queue_depth']} requests; {len(r['tenants'])} tenants served"
                + replica_summary(r.get("replicas"))
            ),
        ),
        "joynexus.environment_service": ("sessions", None),
    }
    init_ray(address)
    report = {}
    try:
        for name, (method, describe) in questions.items():
            entry: dict[str, Any] = {"healthy": False, "where": f"{namespace}/{name}"}
            try:
                handle = ray.get_actor(name, namespace=namespace)
                if describe is None:
                    entry["detail"] = "alive"
                    ray.get(handle.sessions.remote("joynexus-status"), timeout=timeout_s)
                else:
                    answer = ray.get(getattr(handle, method).remote(), timeout=timeout_s)
                    entry["detail"] = describe(answer)
                    if name == "joynexus.training_queue":
                        entry["depth"] = len(answer)
                    elif name == "joynexus.inference_service":
                        entry["depth"] = answer["queue_depth"]
                entry["healthy"] = True
            except ValueError:
                entry["detail"] = "no such actor"
            except Exception as error:  # report, do not fail the whole status
                entry["detail"] = f"{type(error).__name__}: {error}"
            report[name] = entry
        if report.get("joynexus.master", {}).get("healthy"):
            report.update(_role_health(ray.get_actor("joynexus.master", namespace=namespace), timeout_s))
    finally:
        ray.shutdown()
    return report


def _role_health(master: Any, timeout_s: float) -> dict[str, dict[str, Any]]:
    """The Master's Health Manager's truth per role: heartbeats, incarnations, restarts in place."""
    import ray

    try:
        roles = ray.get(master.health.remote(), timeout=timeout_s)
    except Exception as error:  # an older Master without a Health Manager, or one that is busy
        return {"roles": {"healthy": False, "where": "joynexus.master", "detail": f"{type(error).__name__}: {error}"}}
    return role_entries(roles)
