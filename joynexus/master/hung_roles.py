"""Hung roles (paper 4.4): a service that is alive but whose heartbeat is late past its bound is
killed and restarted in place, within a restart budget and with backoff, then escalated.

A dead actor comes back by itself (Ray's `max_restarts`); a hung one never dies, so the Health
Manager has to kill it: `ServiceHandle.kill(restart=True)` (`ray.kill(actor, no_restart=False)`) ends the
process and lets Ray's `max_restarts` start it again under the same name, with the same arguments. The new incarnation
answers heartbeats and the Master restores what the old life held (`HealthManager.on_restart`).

`RestartPolicy` is the decision alone (no Ray, a clock you can pass), per role:
- the role is hung when it has not answered for `hung_after_s`, counted from its last answer or
  from its last restart, whichever is later (a restarting role gets the full bound to come up);
- a hung role is restarted if fewer than `budget` restarts happened in the last `window_s` and its
  backoff (`backoff_s`, doubling with each restart in the window, capped) has passed; else it waits;
- when the budget is spent it is escalated: reported unhealthy, and the Master pauses admission
  until it answers again.

`hang_heartbeat` is the debug hook the tests use: it occupies the actor's one-thread `health`
concurrency group, so its heartbeats queue behind it exactly as a wedged heartbeat would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from joynexus.actors import HEALTH_GROUP

Action = Literal["ok", "wait", "restart", "escalate"]


class HungRoleOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    hung_after_s: float = Field(default=30.0, gt=0, description="a service silent this long is hung and restarted")
    restart_budget: int = Field(default=3, ge=0, description="restarts of one role allowed per window")
    restart_window_s: float = Field(default=600.0, gt=0, description="the window the budget counts restarts in")
    backoff_s: float = Field(default=5.0, ge=0, description="wait after a restart before the next one, doubling")
    max_backoff_s: float = Field(default=300.0, ge=0, description="the longest backoff")


@dataclass
class _RoleRestarts:
    restarts: list[float] = field(default_factory=list)  # clock times of the restarts in the window
    last_restart: float | None = None
    last_restarting: float | None = None  # when it was last seen (re)starting: not hung while it builds
    escalated: bool = False


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str
    silent_for_s: float


class RestartPolicy:
    """When a silent role is restarted, waited for, or escalated (see the module docstring)."""

    def __init__(self, options: HungRoleOptions | None = None, clock: Callable[[], float] = time.monotonic):
        self.options = options or HungRoleOptions()
        self.clock = clock
        self._roles: dict[str, _RoleRestarts] = {}

    def _role(self, role: str) -> _RoleRestarts:
        return self._roles.setdefault(role, _RoleRestarts())

    def decide(self, role: str, last_ok: float | None, since: float) -> Verdict:
        """The verdict for `role` now, given the clock time of its last answer (None: never
        answered; then counted from `since`, when watching began)."""
        o, state, now = self.options, self._role(role), self.clock()
        state.restarts = [t for t in state.restarts if now - t < o.restart_window_s]
        silent = now - max(t for t in (last_ok, state.last_restart, state.last_restarting, since) if t is not None)
        if silent <= o.hung_after_s:
            started = [t for t in (state.last_restart, state.last_restarting) if t is not None]
            if last_ok is not None and last_ok >= max(started, default=last_ok):
                state.escalated = False  # it answers again: a spent budget no longer pauses admission
                return Verdict("ok", "answering", silent)
            return Verdict("wait", f"not answered for {silent:.1f} s (bound {o.hung_after_s:g} s)", silent)
        if len(state.restarts) >= o.restart_budget:
            state.escalated = True
            return Verdict(
                "escalate",
                f"hung: silent {silent:.0f} s and its restart budget is spent "
                f"({len(state.restarts)} restarts in {o.restart_window_s:g} s)",
                silent,
            )
        if state.last_restart is not None:
            ready_at = state.last_restart + self.backoff_after(len(state.restarts))
            if now < ready_at:
                return Verdict("wait", f"hung; backoff until {ready_at - now:.1f} s from now", silent)
        return Verdict("restart", f"hung: silent {silent:.0f} s (bound {o.hung_after_s:g} s)", silent)

    def backoff_after(self, restarts: int) -> float:
        """The wait after the `restarts`-th restart in the window: backoff_s, doubling, capped."""
        o = self.options
        return min(o.max_backoff_s, o.backoff_s * 2 ** max(0, restarts - 1))

    def record_restart(self, role: str) -> int:
        """Count a restart of `role` now; returns the restarts in the window, this one included."""
        state, now = self._role(role), self.clock()
        state.restarts.append(now)
        state.last_restart = now
        return len(state.restarts)

    def restarting(self, role: str) -> None:
        """`role` is being (re)started (its constructor runs, e.g. loading a backbone): silence
        counts from now, so a slow start is never mistaken for a hang."""
        self._role(role).last_restarting = self.clock()

    def escalated(self) -> list[str]:
        return sorted(role for role, state in self._roles.items() if state.escalated)

    def restarts_in_window(self, role: str) -> int:
        return len(self._role(role).restarts)


def hang_heartbeat(actor: Any, seconds: float) -> Any:
    """Debug hook: make a Ray actor's heartbeat hang for `seconds` (its health concurrency group,
    one thread, is held by a sleep; heartbeats queue behind it). Returns the sleep's ObjectRef."""
    return actor.__ray_call__.options(concurrency_group=HEALTH_GROUP).remote(_sleep, seconds)


def _sleep(_instance: Any, seconds: float) -> float:
    time.sleep(seconds)
    return seconds
