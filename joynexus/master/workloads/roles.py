"""The supervisor of the Master's own roles: the shared actor loop, the producer follower
(follower.py: it follows the producer replicas' work, moves the work of a replica that died, and
records what they report) and the admission tick, each a thread that beats on every iteration and
is restarted in place when it dies or stops beating (`check_roles`, called by the Health Manager)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from joynexus.actors import handle_of
from joynexus.master.loops.actor_loop import ActorLoop
from joynexus.master.loops.shard_loops import ShardLoops, is_shard_set
from joynexus.master.workloads.restarts import ServiceWaits
from joynexus.master.workloads.training import TrainingWorkloads

if TYPE_CHECKING:
    from joynexus.master.deployment import Deployment

log = logging.getLogger(__name__)

ROLE_NAMES = ("actor_loop", "producer_follower", "admission")
FOLLOW_INTERVAL_S = 0.25  # how often the follower asks the producer replicas


@dataclass(eq=False)
class _Role:
    """One of the Master's own roles: a thread that beats on every iteration."""

    name: str
    generation: int
    restarts: int
    stop: threading.Event
    last_reason: str | None = None
    owner: str = ""
    thread: threading.Thread = field(default_factory=threading.Thread)
    beat: float = field(default_factory=time.monotonic)
    error: str | None = None


class RoleSupervisor:
    """Runs the roles: the actor loop trains for `training` (its outcomes, its weight syncs), the
    follower role calls `follow()` (ProducerFollower.step), the admission tick `admit()`.
    `owner` prefixes the roles' lease owners; `producer_restarts()` is reported with the roles."""

    def __init__(
        self,
        deployment: Deployment,
        waits: ServiceWaits,
        *,
        training: TrainingWorkloads,
        follow: Callable[[], None],
        admit: Callable[[], None],
        producer_restarts: Callable[[], int],
        owner: str = "master",
        max_job_attempts: int = 3,
    ):
        self.deployment = deployment
        self._waits, self._training = waits, training
        self._follow, self._admit, self._producer_restarts = follow, admit, producer_restarts
        self.owner = owner
        self.max_job_attempts = max_job_attempts
        self._lock = threading.RLock()
        self._roles: dict[str, _Role] = {}  # restartable in place
        self._stop = threading.Event()

    @property
    def actor_owner(self) -> str:
        return f"{self.owner}/actor"

    def role(self, name: str) -> _Role:
        """The current generation of role `name` (ROLE_NAMES)."""
        with self._lock:
            return self._roles[name]

    def start(self) -> None:
        """Start the roles that do not run, each a thread that beats on every iteration;
        `check_roles` restarts one that died or stopped beating."""
        for name in ROLE_NAMES:
            with self._lock:
                running = name in self._roles and self._roles[name].thread.is_alive()
            if not running:
                self._start_role(name)

    def _start_role(self, name: str, *, reason: str | None = None) -> None:
        with self._lock:
            previous = self._roles.get(name)
            generation = previous.generation + 1 if previous is not None else 0
            restarts = previous.restarts + (1 if reason else 0) if previous is not None else 0
            role = _Role(name, generation, restarts, threading.Event(), last_reason=reason)
            role.owner = self._role_owner(name, generation)
            step = self._role_step(role)
            role.thread = threading.Thread(target=self._run_role, args=(role, step), name=name, daemon=True)
            self._roles[name] = role
        role.thread.start()

    def _role_step(self, role: _Role) -> Callable[[], Any]:
        """One iteration of the role's work."""
        deployment = self.deployment
        if role.name == "actor_loop":
            loop_options = dict(
                owner=role.owner, on_outcome=self._training.on_outcome, on_unavailable=self._waits.unavailable,
                max_attempts=self.max_job_attempts, service_restarting=self._waits.restarting, retired=role.stop,
                group_max=deployment.settings.training_group_max, on_trained=self._training.on_trained,
            )  # fmt: skip
            training = handle_of(deployment.training_service).target
            if is_shard_set(training):  # a loop per Training Model Service shard, stepped side by side
                shard_loops = ShardLoops(deployment.scheduler, training, **loop_options)
                return lambda: shard_loops.step_round(0.2)
            actor = ActorLoop(deployment.scheduler, deployment.training_service, **loop_options)
            return lambda: actor.step(0.2)
        if role.name == "producer_follower":

            def follow_step() -> None:
                self._follow()
                role.stop.wait(FOLLOW_INTERVAL_S)

            return follow_step

        def admission_step() -> None:
            try:
                self._admit()
            except Exception:  # a store hiccup: the next tick tries again
                log.exception("admission tick failed")
            # Admit on a timer too, not only on submit/finish: the queue is the store, so
            # work queued by another path (a restart, a raced finish) starts within a second.
            role.stop.wait(1.0)

        return admission_step

    def _role_owner(self, name: str, generation: int) -> str:
        base = {"actor_loop": self.actor_owner}.get(name, f"{self.owner}/{name}")
        return base if generation == 0 else f"{base}#{generation}"

    def _run_role(self, role: _Role, step: Callable[[], Any]) -> None:
        """A role's loop: beat, do one step. An exception ends the thread (the Health Manager sees it
        dead and restarts it in place); a role replaced while hung exits when it wakes up."""
        try:
            while not self._stop.is_set() and not role.stop.is_set():
                role.beat = time.monotonic()
                step()
        except Exception as error:
            role.error = f"{type(error).__name__}: {error}"
            log.exception("role %s died", role.name)

    def live_owners(self) -> set[str]:
        """The lease owners of this Master's current roles and of the producer replicas that answer."""
        with self._lock:
            owners = {role.owner for role in self._roles.values()}
        return owners | self.deployment.producers.live_owners()

    def recover_orphans(self) -> None:
        """Re-queue (or fail, bounded) the leases no live owner holds: a hung role replaced, a replica gone."""
        self.deployment.scheduler.recover_orphans(
            self.live_owners(), has_partition=self.deployment.queue.has_partition,
            max_attempts=self.max_job_attempts,
        )  # fmt: skip

    def check_roles(self, stale_after_s: float) -> dict[str, dict[str, Any]]:
        """Restart in place each role that died, or stopped beating for `stale_after_s` (a hung
        thread cannot be killed: a replacement with a new lease owner takes over, the hung one's
        leases are re-queued, and whatever it finishes later is refused as a lost lease). Returns
        each role's health, producers of running workloads included."""
        now = time.monotonic()
        restart: list[tuple[str, str]] = []
        with self._lock:
            if self._stop.is_set():
                return {}
            for name, role in self._roles.items():
                if not role.thread.is_alive():
                    restart.append((name, f"died: {role.error or 'the thread ended'}"))
                elif now - role.beat > stale_after_s:
                    restart.append((name, f"no heartbeat for {now - role.beat:.0f} s"))
        for name, reason in restart:
            log.warning("restarting role %s in place: %s", name, reason)
            with self._lock:
                self._roles[name].stop.set()
            self._start_role(name, reason=reason)
        if any("heartbeat" in reason for _, reason in restart):
            self.recover_orphans()
        report: dict[str, dict[str, Any]] = {}
        with self._lock:
            for name, role in self._roles.items():
                report[name] = {
                    "healthy": role.thread.is_alive() and now - role.beat <= stale_after_s,
                    "last_beat_s": round(now - role.beat, 3),
                    "restarts": role.restarts,
                    "detail": role.last_reason or f"owner {role.owner}",
                }
        # The producer replicas: healthy while one answers (a dead one's work moves to the others).
        # A producer that returned with its target covered, or one still launching, is not down.
        producers = self.deployment.producers.health()
        report["producers"] = {**producers, "restarts": producers["restarts"] + self._producer_restarts()}
        return report

    def stop(self) -> None:
        """Stop every role (a hung one is given 60 s to notice)."""
        self._stop.set()
        with self._lock:
            roles = list(self._roles.values())
        for role in roles:
            role.stop.set()
            if role.thread is not threading.current_thread():
                role.thread.join(timeout=60)
