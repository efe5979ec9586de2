"""The Environment Service's errors; each pickles with its own arguments, so they cross Ray intact."""

from __future__ import annotations

from typing import Any

__all__ = [
    "EnvironmentServiceError",
    "SessionFailed",
    "SessionLimitExceeded",
    "SimulatorError",
    "UnknownSession",
    "error_entry",
]


class EnvironmentServiceError(RuntimeError):
    pass


class UnknownSession(EnvironmentServiceError, KeyError):
    """No such session for this tenant. Deliberately the same for another tenant's id."""

    def __init__(self, session_id: str, closed: bool = False) -> None:
        self.session_id, self.closed = session_id, closed
        msg = f"session {session_id!r} was closed" if closed else f"unknown session {session_id!r}"
        super().__init__(msg)

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.session_id, self.closed))


class SessionFailed(EnvironmentServiceError):
    """The session's worker died or hung; the session is gone, its slot freed."""

    def __init__(self, session_id: str, reason: str) -> None:
        self.session_id, self.reason = session_id, reason
        super().__init__(f"session {session_id!r} failed: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.session_id, self.reason))


class SessionLimitExceeded(EnvironmentServiceError):
    pass


class SimulatorError(EnvironmentServiceError):
    """The simulator raised during reset/step; the worker is alive and the session still usable."""


def error_entry(exc: BaseException) -> dict[str, Any]:
    """A failed session's entry in a `batch_step` answer (the other sessions still answer)."""
    return {"error": str(exc), "error_type": type(exc).__name__}
