"""`EnvironmentService`: sessions of simulators, each in its own worker process (`worker.py`),
owned by (tenant, rollout); `services.configs.EnvironmentServiceConfig.actor` runs one as the named Ray actor. See
`joynexus.services.environment.service` for the failure and tenant isolation it gives.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
import psutil

from joynexus.core.metering import UsageMeter, build_meter
from joynexus.core.service_metrics import service_metrics, timed
from joynexus.envs.base import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGE_SIDE,
    MAX_OBSERVATION_BYTES,
    SIMULATORS,
    AssetDownloadRefused,
    SimulatorConfig,
    SimulatorUnavailable,
    image_size_problem,
    validate_action,
)
from joynexus.services.environment.errors import (
    SessionFailed,
    SessionLimitExceeded,
    SimulatorError,
    UnknownSession,
    error_entry,
)
from joynexus.services.environment.worker import pack_message, unpack_message, worker_main

__all__ = ["ENVIRONMENT_SERVICE_ACTOR_NAME", "EnvironmentService"]

ENVIRONMENT_SERVICE_ACTOR_NAME = "joynexus.environment_service"

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 5.0
DEFAULT_WARM_TTL_S = 300.0
DEFAULT_WARM_MEMORY_BYTES = 4 << 30
_MAX_TOMBSTONES = 4096  # closed / failed ids remembered so close() stays idempotent and failures explain themselves


@dataclass(eq=False)
class _WarmWorker:
    """A closed session's worker process, kept with its simulator built for the next session of
    the same tenant and the same config (see `EnvironmentService`, warm workers)."""

    tenant_id: str
    config_key: str
    process: Any
    conn: Connection
    spec: dict[str, Any]
    pid: int
    rss: int  # resident bytes when it was parked
    parked_at: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Session:
    session_id: str
    tenant_id: str
    rollout_id: str
    config: SimulatorConfig
    created_at: float = field(default_factory=time.time)
    process: Any = None
    conn: Connection | None = None
    spec: dict[str, Any] | None = None
    pid: int | None = None
    state: str = "starting"  # starting -> ready -> closed | failed
    reason: str | None = None
    needs_reset: bool = True
    steps: int = 0
    episodes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def config_key(self) -> str:
        """What a warm worker must match to serve this session: the whole simulator config."""
        return self.config.model_dump_json()

    def describe(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "rollout_id": self.rollout_id,
            "simulator": self.config.simulator,
            "task": self.config.task,
            "state": self.state,
            "reason": self.reason,
            "pid": self.pid if self.state == "ready" else None,
            "steps": self.steps,
            "episodes": self.episodes,
            "created_at": self.created_at,
        }


class EnvironmentService:
    """Sessions of simulators, one worker process each, owned by (tenant, rollout).

    Warm workers (`warm_workers` > 0): a session closed in good health leaves its worker process
    running, simulator built, for the next session that the SAME tenant opens with the SAME config
    (every field, so the same task, cameras, image size and number of environments); a worker is
    never handed to another tenant. Starting a worker is a process spawn, the simulator's import and
    its scenes built: 5.5 CPU s for a ManiSkill worker of 8 PushCube environments here (13-16 on a
    slower host), paid by every workload and every evaluation that opened fresh sessions. The new
    session starts as a fresh one does (it must `reset` before it steps; `reset(seed)` sets the
    episode as on a new worker). At most `warm_workers` wait at once, together at most
    `warm_memory_bytes` resident (the oldest stopped first), none longer than `warm_ttl_s`, and they
    give way to live sessions (`max_sessions` counts both; a full service stops a warm one first).
    Closing a tenant's sessions, or all of them, stops the warm workers too."""

    def __init__(
        self,
        *,
        step_timeout_s: float = 30.0,
        reset_timeout_s: float = 120.0,
        startup_timeout_s: float = 600.0,
        max_sessions: int = 16,
        max_sessions_per_tenant: int = 8,
        start_method: str = "spawn",
        meter: UsageMeter | None = None,
        database_url: str | None = None,
        max_image_side: int = MAX_IMAGE_SIDE,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        max_observation_bytes: int = MAX_OBSERVATION_BYTES,
        warm_workers: int = 0,
        warm_ttl_s: float = DEFAULT_WARM_TTL_S,
        warm_memory_bytes: int = DEFAULT_WARM_MEMORY_BYTES,
    ) -> None:
        """`meter` (or `database_url`, from which a Ray actor builds its own) records every step as
        environment usage of the session's tenant; without either nothing is recorded.
        `max_image_side` / `max_image_pixels` (per camera) and `max_observation_bytes` (all cameras
        of one observation, float32) bound the image sizes a session may ask for."""
        # Who this is, for heartbeats: a restarted service answers with a new incarnation.
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        service_metrics()  # this process's signals endpoint (JOYNEXUS_METRICS_PORT)
        if step_timeout_s <= 0 or reset_timeout_s <= 0 or startup_timeout_s <= 0:
            raise ValueError("step_timeout_s, reset_timeout_s and startup_timeout_s must be > 0")
        if max_sessions < 1 or max_sessions_per_tenant < 1:
            raise ValueError("max_sessions and max_sessions_per_tenant must be >= 1")
        for name, limit in (
            ("max_image_side", max_image_side),
            ("max_image_pixels", max_image_pixels),
            ("max_observation_bytes", max_observation_bytes),
        ):
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ValueError(f"{name} must be an int >= 1, got {limit!r}")
        for name, limit in (("warm_workers", warm_workers), ("warm_memory_bytes", warm_memory_bytes)):
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"{name} must be an int >= 0, got {limit!r}")
        if not warm_ttl_s > 0:
            raise ValueError(f"warm_ttl_s must be > 0, got {warm_ttl_s!r}")
        if start_method not in ("spawn", "forkserver"):
            # fork would copy the service's threads and locks (and the other sessions' pipes).
            raise ValueError(f"start_method={start_method!r}: use 'spawn' or 'forkserver'")
        self.step_timeout_s = float(step_timeout_s)
        self.reset_timeout_s = float(reset_timeout_s)
        # A worker's startup is a process spawn, the simulator's import and its scenes built: 8
        # ManiSkill scenes in one worker took over 120 s on a 2-core host at load ~10 (the main job's
        # PushCube evaluations failed so). A worker that hangs at startup is still killed, later.
        self.startup_timeout_s = float(startup_timeout_s)
        self.max_sessions = int(max_sessions)
        self.max_sessions_per_tenant = int(max_sessions_per_tenant)
        self.image_limits = {
            "max_image_side": max_image_side,
            "max_image_pixels": max_image_pixels,
            "max_observation_bytes": max_observation_bytes,
        }
        self._ctx = mp.get_context(start_method)
        self._lock = threading.Lock()  # guards _sessions and _tombstones, never held across IPC
        self._sessions: dict[str, _Session] = {}
        self._tombstones: OrderedDict[str, _Session] = OrderedDict()
        self.warm_workers, self.warm_ttl_s = int(warm_workers), float(warm_ttl_s)
        self.warm_memory_bytes = int(warm_memory_bytes)
        self._warm: list[_WarmWorker] = []  # oldest first; guarded by _lock
        # Sessions opened on a fresh worker process vs on a warm one (guarded by _lock): what a warm
        # limit below the sessions tenants keep open at once costs shows here as fresh starts.
        self._opened = {"fresh": 0, "warm": 0}
        self.meter, self._owns_meter = build_meter(meter, database_url)  # last: nothing to undo if a check fails

    # -- lifecycle ---------------------------------------------------------------------------- #
    def open_session(self, tenant_id: str, rollout_id: str, config: SimulatorConfig | dict[str, Any]) -> str:
        """Start a worker for `config`; returns the session id once the simulator is built."""
        for name, value in (("tenant_id", tenant_id), ("rollout_id", rollout_id)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
        if not isinstance(config, SimulatorConfig):
            config = SimulatorConfig.model_validate(config)  # unknown simulator -> ValueError here
        adapter_cls = SIMULATORS.get(config.simulator)
        if adapter_cls is None:  # only reachable for configs built with model_construct()
            raise ValueError(f"simulator={config.simulator!r} is not a registered simulator")
        # Refused before a worker starts: an oversized render would cost memory there and on every pipe.
        problem = image_size_problem(config.image_size, len(config.cameras), **self.image_limits)
        if problem is not None:
            raise ValueError(f"config.image_size: {problem}")
        adapter_module = adapter_cls.__module__
        session = _Session(
            session_id=f"env-{uuid.uuid4().hex}", tenant_id=tenant_id, rollout_id=rollout_id, config=config
        )
        with self._lock:  # reserve the slot before the (slow) start, so limits hold under concurrency
            live = list(self._sessions.values())
            if len(live) >= self.max_sessions:
                raise SessionLimitExceeded(
                    f"the Environment Service is full: {len(live)} of max_sessions={self.max_sessions} sessions open"
                )
            mine = sum(s.tenant_id == tenant_id for s in live)
            if mine >= self.max_sessions_per_tenant:
                raise SessionLimitExceeded(
                    f"tenant {tenant_id!r} already has {mine} sessions open "
                    f"(max_sessions_per_tenant={self.max_sessions_per_tenant}); close one first"
                )
            self._sessions[session.session_id] = session
            warm, stopped = self._take_warm(tenant_id, session.config_key())
        for worker in stopped:
            self._stop_worker(worker.process, worker.conn)
        if warm is not None and not self._renew(warm):
            self._stop_worker(warm.process, warm.conn)
            warm = None  # a fresh worker below
        if warm is not None:
            session.process, session.conn = warm.process, warm.conn
            session.spec, session.pid, session.state = warm.spec, warm.pid, "ready"
            with self._lock:
                self._opened["warm"] += 1
            return session.session_id
        try:
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            process = self._ctx.Process(
                target=worker_main,
                args=(child_conn, adapter_module, config.model_dump_json()),
                name=f"joynexus-env-{session.session_id[4:16]}",
                daemon=True,  # never outlive the service process
            )
            process.start()
            child_conn.close()  # so the worker's death shows up as EOF here
            session.process, session.conn = process, parent_conn
            with session.lock:
                ready = self._request(session, None, self.startup_timeout_s, "simulator startup")
        except BaseException:
            with self._lock:
                self._sessions.pop(session.session_id, None)
            self._reap(session, grace_s=2.0)  # a worker that reported an error exits by itself
            raise
        session.spec, session.pid, session.state = ready["spec"], ready["pid"], "ready"
        with self._lock:
            self._opened["fresh"] += 1
        return session.session_id

    def close(self, tenant_id: str, session_id: str) -> None:
        """Stop the session's worker. Idempotent for the owner; another tenant's id -> UnknownSession.
        An id "<session>#<slot>" closes its whole vectorized session."""
        session_id = _split_slot(session_id)[0]
        with self._lock:
            gone = self._tombstones.get(session_id)
            if gone is not None and gone.tenant_id == tenant_id:
                gone.state, gone.reason = "closed", None  # a failed session, once closed, is forgotten
                return
            session = self._sessions.get(session_id)
            if session is None or session.tenant_id != tenant_id or session.state != "ready":
                raise UnknownSession(session_id)
            session.state = "closed"
            self._forget(session)
        with session.lock:  # waits for an in-flight call (bounded by its timeout)
            if session.process.is_alive() and self._park(session):
                return
            self._stop_worker(session.process, session.conn)

    def _park(self, session: _Session) -> bool:
        """Keep a closed session's worker warm for its tenant (True), within `warm_workers`."""
        if self.warm_workers == 0:
            return False
        try:
            rss = psutil.Process(session.pid).memory_info().rss
        except psutil.Error:  # gone meanwhile
            return False
        if rss > self.warm_memory_bytes:
            return False
        worker = _WarmWorker(
            session.tenant_id, session.config_key(), session.process, session.conn, session.spec, session.pid, rss
        )
        with self._lock:
            self._warm.append(worker)
            stopped = self._expire_warm()
            while len(self._warm) > self.warm_workers or sum(w.rss for w in self._warm) > self.warm_memory_bytes:
                stopped.append(self._warm.pop(0))
        for old in stopped:
            self._stop_worker(old.process, old.conn)
        return True

    def _renew(self, worker: _WarmWorker) -> bool:
        """Ready a warm worker's simulator for a new session (reset first; the config's seed for
        its first unseeded reset, as on a fresh worker); False if the worker does not answer."""
        try:
            worker.conn.send_bytes(pack_message({"cmd": "renew"}))
            if not worker.conn.poll(self.reset_timeout_s):
                return False
            return bool(unpack_message(worker.conn.recv_bytes()).get("ok"))
        except (OSError, EOFError):
            return False

    def _take_warm(self, tenant_id: str, config_key: str) -> tuple[_WarmWorker | None, list[_WarmWorker]]:
        """(The newest live warm worker of this tenant and config, taken; the warm workers to stop:
        expired, found dead, or, when none was found, the oldest while the live sessions (this new
        one counted) and the warm workers exceed `max_sessions`). Caller holds self._lock."""
        stopped = self._expire_warm()
        found = None
        matches = [w for w in reversed(self._warm) if (w.tenant_id, w.config_key) == (tenant_id, config_key)]
        for worker in matches:  # the newest first; a copy, as the list shrinks
            self._warm.remove(worker)
            if worker.process.is_alive():
                found = worker
                break
            stopped.append(worker)  # died while it waited: nothing to reuse
        if found is None:
            while self._warm and len(self._sessions) + len(self._warm) > self.max_sessions:
                stopped.append(self._warm.pop(0))
        return found, stopped

    def _expire_warm(self) -> list[_WarmWorker]:
        """Take the warm workers that waited longer than `warm_ttl_s`. Caller holds self._lock."""
        cutoff = time.monotonic() - self.warm_ttl_s
        expired = [worker for worker in self._warm if worker.parked_at < cutoff]
        self._warm = [worker for worker in self._warm if worker.parked_at >= cutoff]
        return expired

    def _stop_warm(self, tenant_id: str | None = None) -> int:
        """Stop the warm workers of one tenant (None: all of them); returns how many."""
        with self._lock:
            stopped = [w for w in self._warm if tenant_id in (None, w.tenant_id)]
            self._warm = [w for w in self._warm if tenant_id not in (None, w.tenant_id)]
        for worker in stopped:
            self._stop_worker(worker.process, worker.conn)
        return len(stopped)

    @staticmethod
    def _stop_worker(process: Any, conn: Connection) -> None:
        """Ask a worker to exit, then reap it (killed if it does not go within the grace)."""
        try:
            conn.send_bytes(pack_message({"cmd": "close"}))
            if conn.poll(_CLOSE_TIMEOUT_S):
                conn.recv_bytes()
        except (OSError, EOFError):
            pass
        EnvironmentService._reap_process(process, conn, grace_s=_CLOSE_TIMEOUT_S)

    def flush_usage(self) -> bool:
        """Write the metered usage now (a usage read right after the work sees all of it)."""
        return self.meter.try_flush() if self.meter is not None else True

    def close_tenant(self, tenant_id: str) -> int:
        """Close every session of one tenant (tenant deletion) and forget its failed ones."""
        with self._lock:
            sessions = [s for s in self._sessions.values() if s.tenant_id == tenant_id and s.state == "ready"]
            for gone in [k for k, t in self._tombstones.items() if t.tenant_id == tenant_id]:
                del self._tombstones[gone]
        for session in sessions:
            try:
                self.close(tenant_id, session.session_id)
            except UnknownSession:
                pass
        self._stop_warm(tenant_id)  # parked by the closes above, or before
        return len(sessions)

    def close_all(self) -> None:
        """Close every session of every tenant (service shutdown) and write the metered steps."""
        with self._lock:
            sessions = [s for s in self._sessions.values() if s.state == "ready"]
        for session in sessions:
            try:
                self.close(session.tenant_id, session.session_id)
            except UnknownSession:
                pass
        self._stop_warm()
        if self.meter is not None:  # flushed, not closed: the service may still be used after this
            self.meter.try_flush()

    # -- queries ------------------------------------------------------------------------------ #
    def spec(self, tenant_id: str, session_id: str) -> dict[str, Any]:
        return dict(self._get(tenant_id, _split_slot(session_id)[0]).spec)

    def sessions(self, tenant_id: str) -> list[dict[str, Any]]:
        """This tenant's open sessions, then its failed ones (not yet closed) with their reason."""
        with self._lock:
            live = [s.describe() for s in self._sessions.values() if s.tenant_id == tenant_id and s.state == "ready"]
            failed = [
                s.describe() for s in self._tombstones.values() if s.tenant_id == tenant_id and s.state == "failed"
            ]
        return live + failed

    def heartbeat(self) -> dict[str, Any]:
        """A liveness probe: who this is and what it holds, cheaply. Takes only the session table's
        lock, which is never held across a simulator call, so it answers while steps run."""
        with self._lock:
            live = list(self._sessions.values())
            expired = self._expire_warm()  # the Health Manager's beats stop idle warm workers on time
            warm = len(self._warm)
            opened = dict(self._opened)
        for worker in expired:
            self._stop_worker(worker.process, worker.conn)
        return {
            "role": "environment",
            "incarnation": self.incarnation,
            "started_at": self.started_at,
            "pid": os.getpid(),
            "tenants": sorted({s.tenant_id for s in live}),
            "sessions": len(live),
            "warm_workers": warm,
            "sessions_opened": opened,  # since this service started: on a fresh worker process / a warm one
        }

    # -- interaction -------------------------------------------------------------------------- #
    def reset(self, tenant_id: str, session_id: str, seed: int | None = None) -> dict[str, Any]:
        """{"images": {camera: float32 (3, H, W)}, "state": float32 (state_dim,), "instruction": str}"""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0):
            raise ValueError(f"seed: expected a non-negative int or None, got {seed!r}")
        base, slot = _split_slot(session_id)
        session = self._get(tenant_id, base)
        _check_slot(session, slot)
        with session.lock:
            self._check_usable(session)
            seed = None if seed is None else int(seed)
            message = {"cmd": "reset", "seed": seed, **({} if slot is None else {"slot": slot})}
            obs = self._request(session, message, self.reset_timeout_s, "reset")
            session.needs_reset = False
            session.episodes += 1
        return obs

    @timed("env_step_seconds")
    def step(self, tenant_id: str, session_id: str, action: Any) -> dict[str, Any]:
        """{"observation": {...}, "reward", "terminated", "truncated", "success", "info"}"""
        if "#" in session_id:  # one environment of a vectorized session: its worker steps slots
            result = self.batch_step(tenant_id, {session_id: action})[session_id]
            if "error" in result:
                raise SimulatorError(f"session {session_id!r}: {result['error']}")
            return result
        session = self._get(tenant_id, session_id)
        act = self._validate(session, action)
        with session.lock:
            self._check_usable(session)
            result = self._request(session, {"cmd": "step", "action": act}, self.step_timeout_s, "step")
            session.steps += 1
        self._meter_steps(tenant_id, 1)
        return result

    @timed("env_step_seconds")
    def batch_step(self, tenant_id: str, actions: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Step several of this tenant's sessions in parallel: send every action, then collect every
        reply under one deadline. A failing session's entry is {"error": message, "error_type": name};
        the others still return their step result. An id "<session>#<slot>" names one environment
        of a vectorized session (`envs.vector`): all of a session's slots go to its worker as ONE
        message, answered by one reply."""
        results: dict[str, dict[str, Any]] = {}
        # Per session: (session, the message to its worker, the callers' (id, slot) it answers).
        ready: dict[str, tuple[_Session, dict[str, Any], list[tuple[str, int | None]]]] = {}
        for session_id, action in actions.items():
            try:
                base, slot = _split_slot(session_id)
                session = self._get(tenant_id, base)
                _check_slot(session, slot)
                act = self._validate(session, action)
            except Exception as exc:
                results[session_id] = error_entry(exc)
                continue
            message = {"cmd": "step"} if slot is None else {"cmd": "step_many", "actions": {}}
            _, message, callers = ready.setdefault(base, (session, message, []))
            if slot is None:
                message["action"] = act
            else:
                message["actions"][str(slot)] = act
            callers.append((session_id, slot))
        held: list[_Session] = []
        stepped = 0  # steps that ran, for metering
        try:
            pending: dict[Connection, tuple[_Session, list[tuple[str, int | None]]]] = {}
            for base in sorted(ready):  # one lock order for every caller: no deadlock
                session, message, callers = ready[base]
                session.lock.acquire()
                held.append(session)
                try:
                    self._check_usable(session)
                    self._send(session, message)
                    pending[session.conn] = (session, callers)
                except Exception as exc:
                    results.update({sid: error_entry(exc) for sid, _ in callers})
            deadline = time.monotonic() + self.step_timeout_s
            while pending:
                remaining = deadline - time.monotonic()
                readable = wait(list(pending), timeout=max(remaining, 0)) if remaining > 0 else []
                if not readable:
                    for session, callers in pending.values():
                        exc = self._fail(session, f"step timed out after {self.step_timeout_s:g} s")
                        results.update({sid: error_entry(exc) for sid, _ in callers})
                    break
                for conn in readable:
                    session, callers = pending.pop(conn)
                    try:
                        reply = self._receive(session)
                    except Exception as exc:
                        results.update({sid: error_entry(exc) for sid, _ in callers})
                        continue
                    for sid, slot in callers:
                        results[sid] = reply if slot is None else reply[str(slot)]
                    session.steps += len(callers)
                    stepped += len(callers)
        finally:
            for session in held:
                session.lock.release()
        self._meter_steps(tenant_id, stepped)
        return {sid: results[sid] for sid in actions}  # the caller's order

    # -- internals ---------------------------------------------------------------------------- #
    def _meter_steps(self, tenant_id: str, steps: int) -> None:
        if self.meter is None or steps <= 0:
            return
        try:
            self.meter.record(tenant_id, "environment", "env_step", env_steps=steps)
        except Exception as error:  # metering never fails a step that ran
            log.warning("environment usage of tenant %r not recorded: %s", tenant_id, error)

    def _get(self, tenant_id: str, session_id: str) -> _Session:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and session.tenant_id == tenant_id and session.state == "ready":
                return session
            gone = self._tombstones.get(session_id)
        if gone is not None and gone.tenant_id == tenant_id:
            if gone.state == "failed":
                raise SessionFailed(session_id, gone.reason or "failed")
            raise UnknownSession(session_id, closed=True)
        raise UnknownSession(session_id)  # missing, starting, or someone else's: one answer for all

    @staticmethod
    def _validate(session: _Session, action: Any) -> np.ndarray:
        if session.needs_reset:
            raise RuntimeError(f"session {session.session_id!r}: call reset() before step()")
        return validate_action(action, int(session.spec["action_dim"]))

    @staticmethod
    def _check_usable(session: _Session) -> None:
        # Re-checked under the session lock: a concurrent close/failure may have won the race.
        if session.state == "failed":
            raise SessionFailed(session.session_id, session.reason or "failed")
        if session.state == "closed":
            raise UnknownSession(session.session_id, closed=True)

    def _request(self, session: _Session, msg: dict[str, Any] | None, timeout_s: float, what: str) -> Any:
        """Send `msg` (None: only wait, for the startup report) and return the worker's result.
        Caller holds session.lock."""
        if msg is not None:
            self._send(session, msg)
        if not session.conn.poll(timeout_s):
            raise self._fail(session, f"{what} timed out after {timeout_s:g} s")
        return self._receive(session)

    def _send(self, session: _Session, msg: dict[str, Any]) -> None:
        try:
            session.conn.send_bytes(pack_message(msg))
        except OSError:  # broken pipe: the worker is gone
            raise self._fail(session, self._exit_reason(session)) from None

    def _receive(self, session: _Session) -> Any:
        try:
            reply = unpack_message(session.conn.recv_bytes())
        except (EOFError, OSError):
            raise self._fail(session, self._exit_reason(session)) from None
        if reply.get("ok"):
            return reply["result"]
        raise self._remote_error(session, reply)

    @staticmethod
    def _remote_error(session: _Session, reply: dict[str, Any]) -> Exception:
        kind, message = reply.get("type"), reply.get("message", "")
        if kind == "AssetDownloadRefused" and "asset" in reply:
            a = reply["asset"]
            return AssetDownloadRefused(a["simulator"], a["task"], a["missing"], a.get("hint", ""))
        if kind == "ValueError":
            return ValueError(message)
        if kind == "SimulatorUnavailable":
            return SimulatorUnavailable(message)
        return SimulatorError(f"session {session.session_id!r}: simulator raised {kind}: {message}")

    @staticmethod
    def _exit_reason(session: _Session) -> str:
        process = session.process
        process.join(timeout=2.0)  # EOF arrives a moment before the exit status
        code = process.exitcode
        if code is None:
            return "simulator worker closed its pipe but is still running"
        name = ""
        if code < 0:
            try:
                name = f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        return f"simulator worker exited with code {code}{name}"

    def _fail(self, session: _Session, reason: str) -> SessionFailed:
        """Kill and reap the worker, free the slot, remember why; returns the error to raise."""
        self._reap(session)
        with self._lock:
            if session.state in ("ready", "starting"):
                session.state, session.reason = "failed", reason
                if session.session_id in self._sessions and session.spec is not None:
                    self._forget(session)
                else:  # failed during startup: the id was never handed out
                    self._sessions.pop(session.session_id, None)
        return SessionFailed(session.session_id, reason)

    def _forget(self, session: _Session) -> None:
        """Move a session from the live table to the tombstones (caller holds self._lock)."""
        self._sessions.pop(session.session_id, None)
        self._tombstones[session.session_id] = session
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    @staticmethod
    def _reap(session: _Session, grace_s: float = 0.0) -> None:
        EnvironmentService._reap_process(session.process, session.conn, grace_s)

    @staticmethod
    def _reap_process(process: Any, conn: Connection | None, grace_s: float = 0.0) -> None:
        if process is not None:
            if grace_s > 0:
                process.join(timeout=grace_s)
            if process.is_alive():
                process.kill()
            process.join(timeout=10.0)
        if conn is not None:
            conn.close()

    def __enter__(self) -> EnvironmentService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_all()




def _split_slot(session_id: str) -> tuple[str, int | None]:
    """"<session>#<slot>" -> (session, slot); a plain session id -> (id, None)."""
    if not isinstance(session_id, str) or "#" not in session_id:
        return session_id, None
    base, _, slot = session_id.partition("#")
    if not slot.isdigit():
        raise ValueError(f"session_id: {session_id!r} names no environment slot (expected '<session>#<slot>')")
    return base, int(slot)


def _check_slot(session: _Session, slot: int | None) -> None:
    """A vectorized session is addressed by slot, a plain one never."""
    count = session.config.num_envs
    if slot is None and count > 1:
        raise ValueError(
            f"session_id: {session.session_id!r} holds {count} environments; "
            f"address one as '{session.session_id}#<slot>'"
        )
    if slot is not None and not slot < count:
        raise ValueError(f"session_id: slot {slot} of {session.session_id!r}, which holds slots 0..{count - 1}")
