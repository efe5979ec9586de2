"""The Environment Service over N workers (issue 12): `EnvironmentPool`, and the two ways to make
its workers, `LocalEnvironmentWorkers` (objects of this process) and `RayEnvironmentWorkers`
(Ray actors spread over the nodes), both an `EnvironmentWorkerFactory`."""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from joynexus.actors import ServiceHandle, named_actor
from joynexus.envs.base import SimulatorConfig
from joynexus.services.environment.errors import SessionFailed, SessionLimitExceeded, UnknownSession, error_entry
from joynexus.services.environment.sessions import EnvironmentService
from joynexus.settings import RoleResources

__all__ = [
    "ENVIRONMENT_WORKER_ACTOR_PREFIX",
    "EnvironmentPool",
    "EnvironmentWorkerFactory",
    "LocalEnvironmentWorkers",
    "RayEnvironmentWorkers",
]

log = logging.getLogger(__name__)

ENVIRONMENT_WORKER_ACTOR_PREFIX = "joynexus.environment_worker"
R = TypeVar("R")
_WORKER_SEPARATOR = ":"  # a pool session id is "w<k>:<the worker's own id>" (SESSION_ID_PATTERN allows ':')


class EnvironmentWorkerFactory(Protocol):
    """Makes and stops a pool's workers; picklable, so the pool's Ray actor can hold one."""

    def create(self, name: str) -> Any: ...

    def destroy(self, target: Any) -> None: ...


@dataclass(frozen=True)
class LocalEnvironmentWorkers:
    """Pool workers as `EnvironmentService` objects of this process."""

    service_kwargs: dict[str, Any] = field(default_factory=dict)

    def create(self, name: str) -> EnvironmentService:
        return EnvironmentService(**self.service_kwargs)

    def destroy(self, target: Any) -> None:
        target.close_all()


@dataclass(frozen=True)
class RayEnvironmentWorkers:
    """Pool workers as Ray actors owned by the pool's actor, spread over the nodes that have the
    `environment_worker` role's resources."""

    namespace: str | None = None
    resources: Any = None  # settings.RoleResources; None: the role's defaults (no CPU: simulators run in processes)
    service_kwargs: dict[str, Any] = field(default_factory=dict)

    def create(self, name: str) -> Any:
        return named_actor(
            EnvironmentService,
            name,
            namespace=self.namespace,
            num_cpus=0,
            max_concurrency=32,
            ray_resources=self.resources or RoleResources(),
            get_if_exists=False,
            scheduling_strategy="SPREAD",
            **self.service_kwargs,
        )

    def destroy(self, target: Any) -> None:
        import ray

        try:
            ray.get(target.close_all.remote(), timeout=20)  # its simulator processes go first
        finally:
            ray.kill(target, no_restart=True)


class EnvironmentPool:
    """The Environment Service interface over N workers, each an `EnvironmentService` (a Ray actor
    in a deployment, so Ray schedules them across nodes). A session lives on one worker; its id
    names the worker (`w<k>:<id>`), so routing needs no table and survives a restart of the pool's
    front. New sessions go to the worker with the fewest open sessions. Limits per tenant and in
    total hold per worker."""

    def __init__(self, factory: EnvironmentWorkerFactory, *, workers: int):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers: expected an int >= 1, got {workers!r}")
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        self.factory = factory
        self._workers = [
            ServiceHandle(factory.create(f"{ENVIRONMENT_WORKER_ACTOR_PREFIX}.{self.incarnation}.{k}"))
            for k in range(workers)
        ]

    # -- routing ------------------------------------------------------------------------------ #
    def _route(self, session_id: str) -> tuple[Any, str]:
        head, sep, inner = str(session_id).partition(_WORKER_SEPARATOR)
        index = int(head[1:]) if sep and head[:1] == "w" and head[1:].isdigit() else -1
        if not 0 <= index < len(self._workers):
            raise UnknownSession(session_id)
        return self._workers[index], inner

    @staticmethod
    def _outer(index: int, inner: str) -> str:
        return f"w{index}{_WORKER_SEPARATOR}{inner}"

    def _call(self, session_id: str, method: Callable[..., R], tenant_id: str, *args: Any, **kwargs: Any) -> R:
        """`method` (an `EnvironmentService` function) on the session's worker, under its own id there."""
        worker, inner = self._route(session_id)
        try:
            return getattr(worker, method.__name__)(tenant_id, inner, *args, **kwargs)
        except UnknownSession as error:  # the caller's id, not the worker's
            raise UnknownSession(session_id, error.closed) from None
        except SessionFailed as error:
            raise SessionFailed(session_id, error.reason) from None

    def _each(self, method: Callable[..., R], *args: Any) -> list[R]:
        """`method` (an `EnvironmentService` function) on every worker, one after the other."""
        return [getattr(worker, method.__name__)(*args) for worker in self._workers]

    # -- the EnvironmentService interface ----------------------------------------------------- #
    def open_session(self, tenant_id: str, rollout_id: str, config: SimulatorConfig | dict[str, Any]) -> str:
        loads = [int(worker.probe("heartbeat", 10.0).get("sessions", 0)) for worker in self._workers]
        order = sorted(range(len(self._workers)), key=lambda k: (loads[k], k))
        last: Exception | None = None
        for index in order:  # a full worker passes the session on to the next one
            try:
                return self._outer(index, self._workers[index].open_session(tenant_id, rollout_id, config))
            except SessionLimitExceeded as error:
                last = error
        raise last if last is not None else SessionLimitExceeded("the Environment Service has no worker")

    def close(self, tenant_id: str, session_id: str) -> None:
        self._call(session_id, EnvironmentService.close, tenant_id)

    def spec(self, tenant_id: str, session_id: str) -> dict[str, Any]:
        return self._call(session_id, EnvironmentService.spec, tenant_id)

    def reset(self, tenant_id: str, session_id: str, seed: int | None = None) -> dict[str, Any]:
        return self._call(session_id, EnvironmentService.reset, tenant_id, seed)

    def step(self, tenant_id: str, session_id: str, action: Any) -> dict[str, Any]:
        return self._call(session_id, EnvironmentService.step, tenant_id, action)

    def batch_step(self, tenant_id: str, actions: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Each worker steps its sessions in parallel with the others (one call per worker)."""
        results: dict[str, dict[str, Any]] = {}
        per_worker: dict[int, dict[str, Any]] = {}
        names: dict[tuple[int, str], str] = {}
        for session_id, action in actions.items():
            try:
                worker, inner = self._route(session_id)
            except UnknownSession as error:
                results[session_id] = error_entry(error)
                continue
            index = self._workers.index(worker)
            per_worker.setdefault(index, {})[inner] = action
            names[(index, inner)] = session_id
        futures = {
            index: self._workers[index].start(EnvironmentService.batch_step, tenant_id, batch)
            for index, batch in per_worker.items()
        }
        for index, future in futures.items():
            try:
                answers = future.result()
            except Exception as error:  # the worker itself failed: every one of its sessions reports it
                cause = getattr(error, "cause", None) or error  # the worker's own error inside a Ray one
                answers = {inner: error_entry(cause) for inner in per_worker[index]}
            for inner, answer in answers.items():
                results[names[(index, inner)]] = answer
        return {sid: results[sid] for sid in actions}  # the caller's order

    def sessions(self, tenant_id: str) -> list[dict[str, Any]]:
        listed = []
        for index, worker in enumerate(self._workers):
            for entry in worker.sessions(tenant_id):
                listed.append({**entry, "session_id": self._outer(index, entry["session_id"]), "worker": index})
        return listed

    def close_tenant(self, tenant_id: str) -> int:
        return sum(self._each(EnvironmentService.close_tenant, tenant_id))

    def close_all(self) -> None:
        self._each(EnvironmentService.close_all)

    def flush_usage(self) -> bool:
        return all(self._each(EnvironmentService.flush_usage))

    def heartbeat(self) -> dict[str, Any]:
        """The pool's beat: its workers' beats in one. The incarnation changes when any worker's
        does (a worker restarted in place lost its sessions, as a restarted service would)."""
        beats = [worker.probe("heartbeat", 5.0) for worker in self._workers]
        lives = ",".join([self.incarnation, *(str(b.get("incarnation")) for b in beats)])
        return {
            "role": "environment",
            "incarnation": hashlib.sha256(lives.encode()).hexdigest()[:12],
            "started_at": self.started_at,
            "pid": os.getpid(),
            "tenants": sorted({t for b in beats for t in b.get("tenants", [])}),
            "sessions": sum(int(b.get("sessions", 0)) for b in beats),
            "sessions_opened": {
                how: sum(int(b.get("sessions_opened", {}).get(how, 0)) for b in beats) for how in ("fresh", "warm")
            },
            "workers": [{"worker": k, **b} for k, b in enumerate(beats)],
        }

    def shutdown(self) -> None:
        """Stop every worker (their simulator processes first)."""
        for worker in self._workers:
            try:
                self.factory.destroy(worker.target)
            except Exception as error:  # gone already
                log.warning("stopping an environment worker: %s", error)


