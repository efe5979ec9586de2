"""Health Manager (paper sections 4.4-4.5): heartbeats from every role, restarts in place, the truth
per role.

Two kinds of role:
- services: the Training Queue and the Training / Inference Model and Environment Services. Each
  answers `heartbeat()` with its incarnation (a fresh id per life) in a concurrency group of its own,
  so a long training call does not hide a live service. When one dies, Ray restarts it in place (the
  actors are created with `max_restarts=-1`, `actors.named_actor`); the Health Manager sees the new
  incarnation and has the Master restore what the old life held (`on_restart`: tenant slots from the
  last checkpoint, served weights, jobs whose data was lost). A service that does not answer for
  `service_stale_after_s` is reported down.
- the Master's own threads: actor loop, advantage stage, admission (and the producers of running
  workloads). They beat on every iteration; `WorkloadManager.check_roles` restarts one that died or
  stopped beating.

`report()` is what `/v1/health` and `joynexus status` show: one entry per role with healthy,
incarnation, seconds since the last beat, restarts and a detail.

A service that is alive but hung (its heartbeat late past `hung.hung_after_s`) is killed and restarted
in place by Ray, within a restart budget and with backoff (hung_roles.py); when the budget is spent
it is escalated: reported unhealthy, and `escalated()` names it (the Master pauses admission).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from joynexus.actors import ServiceHandle, handle_of
from joynexus.master.hung_roles import HungRoleOptions, RestartPolicy

log = logging.getLogger(__name__)


class HealthOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    interval_s: float = Field(default=1.0, gt=0, description="seconds between heartbeat rounds")
    probe_timeout_s: float = Field(default=5.0, gt=0, description="longest wait for one heartbeat")
    service_stale_after_s: float = Field(default=10.0, gt=0, description="a service silent this long is down")
    role_stale_after_s: float = Field(
        default=600.0, gt=0, description="a Master thread silent this long is replaced (one job may train long)"
    )
    hung: HungRoleOptions = Field(default_factory=HungRoleOptions, description="restarts of hung services")


@dataclass
class ServiceHealth:
    role: str
    incarnation: str | None = None
    started_at: float | None = None
    last_ok: float | None = None  # monotonic
    restarts: int = 0
    restoring: bool = False
    last_error: str | None = None
    last_restore: str | None = None
    beat: dict[str, Any] = field(default_factory=dict)
    hung_restarts: int = 0  # kills of this role for a late heartbeat
    escalated: str | None = None  # why it is escalated (its restart budget is spent), None if not


class HealthManager:
    def __init__(
        self,
        services: dict[str, Any],
        *,
        check_roles: Callable[[float], dict[str, dict[str, Any]]],
        on_restart: Callable[[str, dict[str, Any], dict[str, Any]], str],
        options: HealthOptions | None = None,
        kill: Callable[[str, Any], None] | None = None,
        on_round: Callable[[], None] | None = None,
    ):
        """`services`: role name -> service (a typed handle or a raw Ray actor / local object);
        `check_roles(stale_after_s)`: the Master's own roles, restarted when dead or silent;
        `on_restart(role, previous_beat, new_beat)`: restore what the role's previous life held,
        returning a one-line account; `kill(role, handle)`: end a hung service so it restarts in
        place (default: `ray.kill(no_restart=False)` for a Ray actor; an in-process one is only reported);
        `on_round()`: called after every round (the deployment's Master publishes the report there)."""
        self.options = options or HealthOptions()
        self._handles = {name: handle_of(service) for name, service in services.items()}
        self._services = {name: ServiceHealth(name) for name in services}
        self._check_roles = check_roles
        self._on_restart = on_restart
        self._kill = kill
        self._on_round = on_round
        self.restart_policy = RestartPolicy(self.options.hung)
        self._watching_since = time.monotonic()
        self._roles: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> HealthManager:
        if self._thread is None:
            self._stop.clear()
            self.check()  # the first report exists before anyone asks
            self._thread = threading.Thread(target=self._run, name="health-manager", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._thread = None

    def check_now(self, reason: str = "") -> None:
        """Run a round at once (a caller just saw a service fail) instead of at the next tick."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.options.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.check()
            except Exception:  # the Health Manager itself must outlive a bad round
                log.exception("health round failed")

    # -- one round ----------------------------------------------------------------------------------
    def check(self) -> None:
        for name, handle in self._handles.items():
            self._check_service(name, handle)
        roles = self._check_roles(self.options.role_stale_after_s)
        with self._lock:
            self._roles = roles
            self.rounds += 1
        if self._on_round is not None:
            try:
                self._on_round()
            except Exception:  # publishing is best effort: `joynexus status` then asks the actors
                log.warning("publishing the health report failed", exc_info=True)

    def _check_service(self, name: str, handle: ServiceHandle) -> None:
        state = self._services[name]
        try:
            beat = dict(handle.probe("heartbeat", self.options.probe_timeout_s))
        except Exception as error:
            with self._lock:
                state.last_error = f"{type(error).__name__}: {error}"[:300]
            self._on_silent(name, handle, state)
            return
        previous = state.beat
        restarted = state.incarnation is not None and beat.get("incarnation") != state.incarnation
        with self._lock:
            if restarted:
                state.restarts += 1
                state.restoring = True
            state.incarnation, state.started_at = beat.get("incarnation"), beat.get("started_at")
            state.last_ok, state.last_error, state.beat = time.monotonic(), None, beat
            if self.restart_policy.decide(name, state.last_ok, self._watching_since).action == "ok":
                state.escalated = None
        if restarted:
            log.warning("role %s restarted in place (incarnation %s); restoring", name, state.incarnation)
            try:
                account = self._on_restart(name, previous, beat)
            except Exception as error:  # reported; the next restart or an operator retries
                account = f"restore failed: {type(error).__name__}: {error}"
                log.exception("restoring role %s failed", name)
            with self._lock:
                state.restoring, state.last_restore = False, account

    def _on_silent(self, name: str, handle: ServiceHandle, state: ServiceHealth) -> None:
        """A probe failed: restart the role if it is hung and its budget allows, else escalate."""
        if handle.restarting():
            self.restart_policy.restarting(name)  # Ray is (re)building it: slow, not hung
            return
        verdict = self.restart_policy.decide(name, state.last_ok, self._watching_since)
        if verdict.action == "escalate":
            if state.escalated is None:
                log.error("role %s escalated: %s", name, verdict.reason)
            with self._lock:
                state.escalated = verdict.reason
            return
        if verdict.action != "restart":
            return
        kill = self._kill
        if kill is None:
            if not handle.restartable_in_place:
                return  # an in-process service cannot be restarted alone; reported as down
            kill = lambda _role, _target: handle.kill(restart=True)  # noqa: E731
        count = self.restart_policy.record_restart(name)
        log.warning("role %s is %s; restarting it in place (%d in the window)", name, verdict.reason, count)
        try:
            kill(name, handle.target)
        except Exception as error:  # reported; the next round tries again after the backoff
            log.exception("restarting hung role %s failed", name)
            with self._lock:
                state.last_error = f"restart failed: {type(error).__name__}: {error}"[:300]
            return
        with self._lock:
            state.hung_restarts += 1
            state.last_error = f"{verdict.reason}; killed for a restart in place ({count} in the window)"

    def escalated(self) -> dict[str, str]:
        """Roles whose restart budget is spent (role -> reason): the Master pauses admission."""
        with self._lock:
            return {name: state.escalated for name, state in self._services.items() if state.escalated}

    # -- the truth per role -------------------------------------------------------------------------
    def report(self) -> dict[str, dict[str, Any]]:
        """{role: {healthy, incarnation, last_beat_s, restarts, detail}} for every role."""
        now = time.monotonic()
        stale = self.options.service_stale_after_s
        with self._lock:
            report: dict[str, dict[str, Any]] = {}
            for name, state in self._services.items():
                age = None if state.last_ok is None else now - state.last_ok
                healthy = age is not None and age <= stale and not state.restoring and state.last_error is None
                detail = state.last_error or ("restoring" if state.restoring else state.last_restore) or "ok"
                if state.escalated is not None:
                    healthy, detail = False, f"escalated: {state.escalated}"
                members = _members(state.beat)
                if members is not None:  # replicas / pool workers behind the role's front
                    serving, summary = members
                    healthy = healthy and serving
                    detail = f"{detail}; {summary}"
                report[name] = {
                    "healthy": healthy,
                    "incarnation": state.incarnation,
                    "last_beat_s": None if age is None else round(age, 3),
                    "restarts": state.restarts,
                    "hung_restarts": state.hung_restarts,
                    "detail": detail,
                }
            for name, entry in self._roles.items():
                report[name] = {"incarnation": None, **entry}
        return report

    def last_beat(self, role: str) -> dict[str, Any]:
        """The last heartbeat a service answered (its pid, incarnation, tenants, ...)."""
        with self._lock:
            return dict(self._services[role].beat)

    def healthy(self) -> bool:
        return all(entry["healthy"] for entry in self.report().values())


def _members(beat: dict[str, Any]) -> tuple[bool, str] | None:
    """(any member serving, a one-line summary) of the replicas (Inference Model Service replica
    set) or workers (Environment Service pool) a front reports in its beat; None if it has none.
    A replica Ray restarted is restored by its set (weights loaded again) before it serves."""
    replicas = beat.get("replicas")
    if isinstance(replicas, list):
        states: dict[str, int] = {}
        for replica in replicas:
            states[replica.get("state", "?")] = states.get(replica.get("state", "?"), 0) + 1
        restarts = sum(int(r.get("restarts", 0)) for r in replicas)
        summary = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
        return states.get("active", 0) > 0, f"replicas: {summary or 'none'}; {restarts} replica restarts"
    workers = beat.get("workers")
    if isinstance(workers, list):
        return bool(workers), f"{len(workers)} workers, {beat.get('sessions', 0)} sessions"
    return None
