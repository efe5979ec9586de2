"""Keep a long-lived client of a Ray deployment (the tenant API server) on its roles (issue 26.6).

The API server's typed handles point at named actors of one Ray session. Two things break them:
- an actor replaced under its name (removed and created again): its old handle is dead for good;
- a new deployment (`joynexus down` + `up`, or the whole Ray restarted and brought up again): the
  server's Ray session itself is gone.

`RoleFollower` runs a thread that, every `interval_s` or at once when a call met a role that was
away (`check_now`, from the API's 503 handler): compares `joynexus up`'s record in the data dir with
the one it connected under, and on a new deployment closes the handles' gate (calls answer
`RoleUnavailable`, a 503 with Retry-After), reconnects this process to the new Ray, looks every
role up again by name and retargets the handles in place (every holder follows), then opens the
gate; otherwise it looks the roles up again by name and retargets any that changed. It never calls
Ray while the head's port is closed (a call to a dead GCS would block).

A third thing breaks a Ray Client (`ray://`) session alone: the head restarting (KubeRay's new head
pod with GCS fault tolerance). The detached actors live on, but the session's server process on the
old head is gone, and with it every handle this process got through it; Ray Client gives up its
reconnect ("Ray Client is not connected"). The gate then refuses calls (503), and the follower
connects a new session once the head's client port answers, looks every role up again and retargets
every handle, and runs the `on_reconnect` callbacks (handles held elsewhere are dropped there).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from joynexus.actors import RoleUnavailable, handle_of, init_ray
from joynexus.connect import Cluster
from joynexus.ops.deployment_state import DeployError, DeploymentState, port_answers, read_state

log = logging.getLogger(__name__)

# Cluster attribute -> the named actor of that role.
ROLE_ACTORS = {
    "master": "joynexus.master",
    "queue": "joynexus.training_queue",
    "training": "joynexus.training_service",
    "inference": "joynexus.inference_service",
    "environment": "joynexus.environment_service",
}
# A driver whose Ray head is gone longer than Ray's GCS reconnect timeout (60 s) exits; the API
# server must outlive a `down` + `up` instead, so it waits as long as that takes (set before Ray starts).
GCS_RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
GCS_RECONNECT_S = "86400"
CLIENT_SESSION_LOST = "the Ray Client session ended (the Ray head restarted?); reconnecting"


def outlive_ray_restarts() -> None:
    """Let this process's Ray driver wait out a head that is down (call before Ray is initialized)."""
    os.environ.setdefault(GCS_RECONNECT_ENV, GCS_RECONNECT_S)


class RoleFollower:
    def __init__(self, cluster: Cluster, *, interval_s: float = 1.0, retry_after_s: float = 2.0):
        self.cluster = cluster
        self.on_reconnect: list[Callable[[], None]] = []  # after every new Ray session
        self.interval_s = interval_s
        self.retry_after_s = retry_after_s
        self._deployment = _deployment_key(self._record())
        self._address = cluster.settings.ray_address
        self._away: str | None = None  # why calls are refused now (None: they go through)
        self._lock = threading.Lock()  # one round at a time
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reconnects = 0
        self.relookups = 0
        for attr in ROLE_ACTORS:
            handle_of(getattr(cluster, attr)).set_gate(self._gate)

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> RoleFollower:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="role-follower", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._thread = None

    def check_now(self) -> None:
        """A call met a role that was away: look the roles up again at once."""
        self._wake.set()

    @property
    def away(self) -> str | None:
        return self._away

    def _gate(self) -> None:
        if self._away is None and _client_session_lost(self._address):
            self._away = CLIENT_SESSION_LOST
            self._wake.set()
        reason = self._away
        if reason is not None:
            raise RoleUnavailable("the deployment", reason, self.retry_after_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            woken = self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.follow(relookup=woken)
            except Exception as error:  # the follower outlives a bad round; the next one retries
                log.warning("following the deployment's roles failed: %s: %s", type(error).__name__, error)

    # -- one round ----------------------------------------------------------------------------------
    def follow(self, *, relookup: bool = True) -> None:
        """Reconnect to a new deployment, or look the roles up again (`relookup`)."""
        with self._lock:
            state = self._record()
            key = _deployment_key(state)
            if self._deployment is not None and key != self._deployment:
                if state is None or not all(p.alive() for p in state.processes):
                    self._away = "the deployment is down; waiting for it to come up again"
                    return
                self._reconnect(state.ray_address)
                self._deployment = key
                return
            if _client_session_lost(self._address):
                self._away = CLIENT_SESSION_LOST
                if _port_open(self._address):
                    self._reconnect(self._address)
                return
            if relookup or self._away is not None:
                if not _port_open(self._address):
                    self._away = "the Ray cluster does not answer"
                    return
                self._look_up_roles()
                self._away = None

    def _reconnect(self, address: str) -> None:
        """A new Ray session at `address` (a new deployment, or a Ray Client session that ended):
        every role looked up again and every handle retargeted (the old session's handles are void)."""
        import ray

        if self._away != CLIENT_SESSION_LOST:
            self._away = "reconnecting to a new deployment"
        log.warning("reconnecting this server's Ray session to %s (%s)", address, self._away)
        time.sleep(0.2)  # calls that passed the gate a moment ago finish or fail first
        _end_session()
        init_ray(address)
        self._address = address
        self._look_up_roles(every=True)
        # The Master has reconciled and started (its raw actor: the handles' gate is still closed).
        ray.get(handle_of(self.cluster.master).target.ping.remote(), timeout=600)
        for callback in self.on_reconnect:
            callback()
        self.reconnects += 1
        self._away = None

    def _look_up_roles(self, *, every: bool = False) -> None:
        """Every role by name; retarget each handle whose actor changed (`every`: all of them)."""
        import ray

        namespace = self.cluster.settings.ray_namespace
        for attr, name in ROLE_ACTORS.items():
            handle = handle_of(getattr(self.cluster, attr))
            actor = ray.get_actor(name, namespace=namespace)
            changed = _actor_id(actor) != _actor_id(handle.target)
            if every or changed:
                handle.retarget(actor)
                self.relookups += 1
                why = "a new actor under its name" if changed else "the same actor, through the new session"
                log.warning("role %s looked up again: %s", name, why)

    def _record(self) -> DeploymentState | None:
        try:
            return read_state(self.cluster.settings)
        except DeployError:
            return None


def _deployment_key(state: DeploymentState | None) -> tuple[str, float] | None:
    return None if state is None else (state.ray_address, state.started_at)


def _actor_id(actor: Any) -> Any:
    return getattr(actor, "_actor_id", None)


def _client_session_lost(address: str | None) -> bool:
    """Whether this process's Ray Client session (a `ray://` address) has ended."""
    if not address or not address.startswith("ray://"):
        return False
    from ray.util.client import ray as client

    worker = client.get_context().client_worker
    if worker is None or not worker.is_connected():
        return True
    # A data channel that gave up reconnecting (the new head's proxy no longer knows the session) shuts
    # down alone: the worker still says connected while every call raises ConnectionError (Ray 2.60).
    return bool(getattr(getattr(worker, "data_client", None), "_in_shutdown", False))


def _end_session() -> None:
    """Leave this process's Ray session; an ended Ray Client session is only disconnected (ray.shutdown
    would call into it and raise "Ray Client is not connected")."""
    import ray
    from ray.util.client import ray as client

    if client.get_context().client_worker is not None:
        client.disconnect()
    else:
        ray.shutdown()


def _port_open(address: str | None) -> bool:
    """Whether the Ray head's port (a `ray://` address: its client server's) accepts connections
    (no address: a local Ray of this process)."""
    if address and address.startswith("ray://"):
        address = address[len("ray://") :].split("/", 1)[0]
    if not address or ":" not in address:
        return True
    host, port = address.rsplit(":", 1)
    return port.isdigit() and port_answers(host, int(port))
