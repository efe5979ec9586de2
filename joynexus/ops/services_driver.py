"""The short-lived driver `joynexus up` runs to create the resident services, and how `up` watches it.

`up` spawns the driver at once, beside the Ray head and the servers, so the slow parts overlap: the
driver imports the service classes (torch, transformers) while the head starts, waits for the head's
GCS port, registers the four execution-plane actors, waits for MLflow (the Master opens its
experiment when it is built), registers the Master and the futures call queue, then waits until
the Master and the Inference Model Service answer (both backbones loaded, the Master reconciled):
`up` returns a deployment that answers. Each phase is a line ``stage: ...`` in the driver's log,
``<data_dir>/run/services.log``, which `up` relays with the seconds since it began.

Meanwhile `up` watches the processes it started: a Ray head that exits (a raylet or GCS server that
crashed at start: `ray start --block` then stops the rest and exits) or a server that exits fails
`up` at once, naming the logs to read, instead of waiting out its timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from joynexus.ops.deployment_state import DeployError, ManagedProcess, http_ok, port_answers, tail

DRIVER_LOG = "services.log"
DRIVER_NICENESS = 10
STAGE = "stage: "
AGENT_TIMEOUT = "Timed out waiting for file"  # raylet.out when the dashboard agent missed its window


def leader_alive(process: ManagedProcess) -> bool:
    """Whether the process `up` spawned (its session's leader) still runs: `ray start --block` exits
    when a Ray subprocess dies, though some of its children may linger a moment."""
    import psutil

    try:
        leader = psutil.Process(process.pid)
        return abs(leader.create_time() - process.create_time) < 1.0 and leader.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def exit_report(process: ManagedProcess, ray_logs: Path | None = None) -> str:
    """Why `up` stops: which process exited, the logs to read and the last lines of its own log."""
    where = f"its log: {process.log}"
    if ray_logs is not None:
        where += f"; Ray's logs: {ray_logs} (raylet.out, gcs_server.out, raylet.err, gcs_server.err)"
        if AGENT_TIMEOUT in tail(ray_logs / "raylet.out", 200):
            where += (
                "; the raylet gave up waiting for its dashboard agent (Ray allows it 15 s to start): the host "
                "was too busy to start Ray's helper processes in time; run `joynexus up` again when it is quieter"
            )
    return f"{process.name} exited while the deployment was starting; {where}\nlast lines of {process.log}:\n" + tail(
        process.log
    )


def run_driver(
    env: dict[str, str],
    folder: Path,
    *,
    watched: list[ManagedProcess],
    ray_logs: Path | None,
    wait_gcs: str | None,
    mlflow_health: str | None,
    timeout_s: float,
    on_stage: Callable[[str], None],
) -> None:
    """Run the driver to completion, relaying its stages; DeployError as soon as it fails, a watched
    process exits or `timeout_s` passes (the driver is then killed)."""
    log = folder / DRIVER_LOG
    argv = [sys.executable, "-m", "joynexus.ops.services_driver", "--timeout", str(timeout_s)]
    argv += [*(["--wait-gcs", wait_gcs] if wait_gcs else []), *(["--mlflow", mlflow_health] if mlflow_health else [])]
    with open(log, "ab") as out:
        offset = out.tell()
        driver = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    # Its imports yield to the Ray head's: the raylet gives its dashboard agent 15 s to start and
    # aborts past that (Ray 2.60, not configurable). The actors' processes are the raylet's, not its.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, driver.pid, DRIVER_NICENESS)
    deadline = time.monotonic() + timeout_s
    try:
        while driver.poll() is None:
            offset = _relay(log, offset, on_stage)
            for process in watched:
                if not leader_alive(process):
                    raise DeployError(exit_report(process, ray_logs if process.name == "ray" else None))
            if time.monotonic() > deadline:
                raise DeployError(f"creating the resident services took more than {timeout_s:.0f} s; its log: {log}")
            time.sleep(0.2)
        _relay(log, offset, on_stage)
        if driver.returncode != 0:
            raise DeployError(f"creating the resident services failed; its log: {log}\n{tail(log, 30)}")
    finally:
        if driver.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()


def _relay(log: Path, offset: int, on_stage: Callable[[str], None]) -> int:
    """Pass the driver's new complete `stage:` lines to `on_stage`; returns the new offset."""
    with open(log, "rb") as read:
        read.seek(offset)
        text = read.read()
    done = text.rfind(b"\n") + 1
    for line in text[:done].decode(errors="replace").splitlines():
        if line.startswith(STAGE):
            on_stage(line.removeprefix(STAGE))
    return offset + done


# --------------------------------------------------------------------------------------------
# The driver: python -m joynexus.ops.services_driver
# --------------------------------------------------------------------------------------------


def create_services(wait_gcs: str | None, mlflow_health: str | None, timeout_s: float) -> None:
    """Create the deployment's detached actors (idempotent: running ones are kept) and wait until
    each has been built. Settings come from the environment `up` gave this process."""
    started = time.monotonic()
    deadline = started + timeout_s

    def stage(message: str) -> None:
        print(f"{STAGE}{message} (driver +{time.monotonic() - started:.1f} s)", flush=True)

    stage("importing the service classes")
    # The execution plane's classes (torch, transformers): `create_service_actors` needs them to
    # create the actors (a process that finds them running, as the Master does, never imports
    # them); imported here so the import overlaps the Ray head's start.
    import joynexus.services.configs  # noqa: F401
    from joynexus.master.deployment import create_service_actors
    from joynexus.master.service import master_service_actor
    from joynexus.services.call_futures import call_futures_actor
    from joynexus.settings import Settings

    settings = Settings()
    if wait_gcs:
        stage(f"waiting for the Ray head's GCS port {wait_gcs}")
        host, port = wait_gcs.rsplit(":", 1)
        _wait(lambda: port_answers(host, int(port)), "the Ray head's GCS port", deadline)
    from joynexus.actors import init_ray
    from joynexus.ops.upgrade import replace_older_release

    if settings.ray_address:  # a cluster that may run an older release (a local Ray starts new below)
        init_ray(settings.ray_address)
        # A Master of another release is drained and its actors killed, and the actors wait for Ray
        # nodes of this release: `get_if_exists` would keep the old code running (ops/upgrade.py).
        replace_older_release(settings.release, settings.ray_namespace, deadline, stage)
    stage("registering the Training Queue, Training, Inference and Environment services")
    _, training, inference, _ = create_service_actors(settings, detached=True)
    if mlflow_health:
        stage("waiting for the MLflow server (the Master opens its experiment)")
        _wait(lambda: http_ok(mlflow_health), "the MLflow server", deadline)
    stage("registering the Master Service and the futures call queue")
    master = master_service_actor(settings, detached=True)
    # The lower layer's call queue every API replica shares: made here too, never by an API client.
    call_futures_actor(
        training, inference, database_url=settings.resolved_database_url(), namespace=settings.ray_namespace
    )
    stage("waiting for the services to be built (backbones loaded) and the Master to reconcile")
    # The Master answers once it has assembled the deployment over the Training Model Service's
    # capabilities (that backbone loaded); the Inference Model Service once its backbone is loaded.
    # The queue, the environment and the call queue are light: their callers' first call waits.
    import ray

    ready = [master.ping.remote(), inference.stats.remote()]
    ray.get(ready, timeout=max(1.0, deadline - time.monotonic()))
    stage("every service answers")
    # The actors are detached: nothing of this driver's needs an orderly disconnect, which takes
    # seconds (`ray.shutdown`); the GCS marks the driver's job finished when its connection drops.
    sys.stdout.flush()
    os._exit(0)


def _wait(ready: Callable[[], bool], what: str, deadline: float) -> None:
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not answer in time")
        time.sleep(0.2)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="internal: the driver `joynexus up` runs to create the services")
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--wait-gcs", default=None, help="host:port of a Ray head that is starting")
    parser.add_argument("--mlflow", default=None, help="the health URL of an MLflow server that is starting")
    args = parser.parse_args()
    create_services(args.wait_gcs, args.mlflow, args.timeout)
