"""Service exceptions as the API errors a client can act on.

A service raises its own exceptions (behind Ray's RayTaskError wrapper when it is an actor); the
gateway turns them into `ApiError`s here, so every route answers with the documented error body.
Whatever an id of another tenant would reach raises the same `NotFound` as an id that does not exist.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from joynexus.api.errors import ApiError, Conflict, InvalidInput, NotFound, QuotaExceeded, ServiceUnavailable
from joynexus.envs.base import SimulatorUnavailable
from joynexus.scheduling.inference_queue import InferenceQueueClosed, TenantQueueFull
from joynexus.services.environment.errors import SessionFailed, SessionLimitExceeded, SimulatorError
from joynexus.services.inference.errors import UnknownPolicyVersion
from joynexus.services.training.errors import TenantSlotError, UnknownTenant

_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): (.+)$", re.S)


def cause_of(error: BaseException) -> BaseException:
    """The service's own exception, also behind Ray's RayTaskError wrapper."""
    return getattr(error, "cause", None) or error


def invalid_from(error: BaseException, default_field: str) -> InvalidInput:
    """An InvalidInput from a service message that starts with `field: reason` when it does."""
    text = str(error).strip() or type(error).__name__
    match = _FIELD_PREFIX.match(text)
    if match:
        return InvalidInput(match.group(1), match.group(2))
    return InvalidInput(default_field, text)


@contextmanager
def service_errors(field: str, not_found: tuple[str, Any, str] | None = None) -> Iterator[None]:
    """Turn a Training / Inference Model Service exception into the API error a client can act on."""
    try:
        yield
    except ApiError:
        raise
    except Exception as error:
        cause = cause_of(error)
        if isinstance(cause, UnknownPolicyVersion):
            if cause.version is None:
                raise ApiError(
                    "no serving weights for your tenant yet: load them with POST /v1/weights/load",
                    [("policy_version", "nothing is being served")],
                ).with_status(404, "not_found") from None
            raise NotFound("policy version", cause.version, "policy_version") from None
        if isinstance(cause, UnknownTenant):  # the tenant exists: its slot is being restored after a restart
            raise ServiceUnavailable("the Training Model Service is restoring your tenant's slot") from None
        if isinstance(cause, KeyError) and not_found is not None:
            raise NotFound(*not_found) from None
        if isinstance(cause, TenantSlotError):
            raise Conflict(str(cause), [(field, str(cause))]) from None
        if isinstance(cause, TenantQueueFull):  # the tenant's own backlog: its other calls still go
            raise QuotaExceeded(str(cause), [("max_queued_samples_per_tenant", str(cause))]) from None
        if isinstance(cause, InferenceQueueClosed):
            raise ServiceUnavailable("the Inference Model Service is shutting down") from None
        if isinstance(cause, TimeoutError):
            raise ApiError("the request did not finish within its timeout", [("timeout_s", "exceeded")]).with_status(
                504, "timeout"
            ) from None
        if isinstance(cause, ValueError):
            raise invalid_from(cause, field) from None
        raise


@contextmanager
def session_errors(session_id: str | None, field: str) -> Iterator[None]:
    """Environment Service exceptions as API errors; another tenant's session is a 404."""
    try:
        yield
    except ApiError:
        raise
    except Exception as error:
        cause = cause_of(error)
        if isinstance(cause, KeyError) and session_id is not None:  # UnknownSession: missing or not yours
            raise NotFound("session", session_id, "session_id") from None
        if isinstance(cause, SessionLimitExceeded):
            raise QuotaExceeded(str(cause), [("sessions", str(cause))]) from None
        if isinstance(cause, SessionFailed):
            raise ApiError(str(cause), [("session_id", cause.reason)]).with_status(409, "session_failed") from None
        if isinstance(cause, SimulatorError):
            raise ApiError(str(cause), [(field, str(cause))]).with_status(409, "simulator_error") from None
        if isinstance(cause, SimulatorUnavailable):
            raise InvalidInput("config.simulator", f"cannot run on this server: {cause}") from None
        if isinstance(cause, ValueError):
            raise invalid_from(cause, field) from None
        if type(cause) is RuntimeError:  # e.g. "call reset() before step()"
            raise Conflict(str(cause), [(field, str(cause))]) from None
        raise
