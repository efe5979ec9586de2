"""Errors the Inference Model Service (and its replica set) raise to callers."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from joynexus.actors import role_unavailable
from joynexus.scheduling.inference_queue import InferenceQueueClosed


class InferenceError(RuntimeError):
    pass


class UnknownPolicyVersion(InferenceError, KeyError):
    def __init__(self, tenant_id: str, version: int | None, available: list[int]):
        what = "no serving state" if not available else f"no version {version} (loaded: {available})"
        super().__init__(f"tenant {tenant_id!r} has {what} in this Inference Model Service")
        self.tenant_id, self.version, self.available = tenant_id, version, list(available)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its own fields: the default (cls(*args)) fails on the one message argument,
        # and Ray then hands callers an UnserializableException instead of this error.
        return (type(self), (self.tenant_id, self.version, self.available))


def cause_of(error: BaseException | None) -> BaseException | None:
    """The service's own exception inside a Ray task error (as a local call would raise it)."""
    if error is None:
        return None
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, Exception) else error


def replica_gone(error: BaseException) -> bool:
    """The replica died, was stopped or closed its queue: the request itself was fine."""
    return role_unavailable(error) or isinstance(error, InferenceQueueClosed | concurrent.futures.CancelledError)
