"""Every error the tenant API client raises: a `JoyNexusError` and its kinds (see `joynexus.client`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from joynexus.protocol import schemas as s


def _body(code: str, message: str, problems: list[tuple[str, str]] | tuple[()] = ()) -> s.ErrorBody:
    return s.ErrorBody(code=code, message=message, problems=[s.Problem(field=f, reason=r) for f, r in problems])


class JoyNexusError(Exception):
    """Every error this client raises: the HTTP status of an error answer (None where there was no
    such answer), a machine-readable code, a message, and the field problems (`.field`, `.reason`)."""

    def __init__(self, status_code: int | None, body: s.ErrorBody):
        self.status_code = status_code
        self.code = body.code
        self.message = body.message
        self.problems = body.problems
        head = body.code if status_code is None else f"{status_code} {body.code}"
        super().__init__(f"{head}: {body.message}")

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (process pools, Ray, Prefect) whatever the subclass
        return (_restore_error, (type(self), self.args, self.__dict__))


def _restore_error(cls: type[JoyNexusError], args: tuple[Any, ...], state: dict[str, Any]) -> JoyNexusError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ApiRequestError(JoyNexusError):
    """4xx: the request was wrong (or refused); retrying the same request will not help."""


class RateLimited(ApiRequestError):
    """429 from a per-tenant rate limit (`code` "rate_limited", "too_many_in_flight" or
    "too_many_streams"; the problem's field names the setting): the same request succeeds later.
    `retry_after` is the server's Retry-After in seconds (None if it sent none). A quota refusal
    ("quota_exceeded") is a plain ApiRequestError: waiting does not lift it."""

    def __init__(self, status_code: int | None, body: s.ErrorBody, retry_after: float | None):
        super().__init__(status_code, body)
        self.retry_after = retry_after


class ServerError(JoyNexusError):
    """5xx (after the retries, for 502 / 503 / 504)."""


class ConnectionFailed(JoyNexusError):
    """No answer from the server, after the retries: refused, unreachable, timed out or dropped.
    `code` is "timeout" for a timeout, else "connection_failed"; `__cause__` is httpx's error."""

    def __init__(self, url: str, error: BaseException):
        code = "timeout" if isinstance(error, httpx.TimeoutException) else "connection_failed"
        detail = str(error) or "no detail"
        super().__init__(None, _body(code, f"no answer from {url} ({type(error).__name__}: {detail})"))
        self.url = url


class InvalidResponse(JoyNexusError):
    """An answer this client cannot read: not JSON / msgpack, or not the shape it expects."""

    def __init__(self, what: str, reason: str, status_code: int | None = None):
        super().__init__(status_code, _body("invalid_response", f"{what}: {reason}"))


class InvalidArgument(JoyNexusError, ValueError):
    """An argument refused before anything was sent; `problems` name the fields."""

    def __init__(self, problems: list[tuple[str, str]], message: str | None = None):
        message = message or "; ".join(f"{field}: {reason}" for field, reason in problems)
        super().__init__(None, _body("invalid_argument", message, problems))


class SpecFileError(InvalidArgument):
    """A workload spec file that cannot be read, does not parse (YAML or JSON), or holds no mapping.
    `line` and `column` (1-based) say where a syntax error is; None when not known."""

    def __init__(self, path: str | Path, reason: str, line: int | None = None, column: int | None = None):
        self.path, self.reason, self.line, self.column = str(path), reason, line, column
        where = self.path + "".join(f":{n}" for n in (line, column) if n is not None)
        super().__init__([("spec", f"{where}: {reason}")], message=f"{where}: {reason}")


class WorkloadFailed(JoyNexusError, RuntimeError):
    """A workload ended failed or cancelled; `.status` is its final `WorkloadInfo`."""

    def __init__(self, status: s.WorkloadInfo):
        self.status = status
        message = f"workload {status.workload_id} {status.state}: {status.error}"
        super().__init__(None, _body(f"workload_{status.state}", message))


class WorkloadTimeout(JoyNexusError, TimeoutError):
    """A workload handle's `result(timeout)` ran out of time; the workload goes on."""

    def __init__(self, status: s.WorkloadInfo, timeout: float | None):
        self.status = status
        message = f"workload {status.workload_id} is still {status.state} after {timeout} s"
        super().__init__(None, _body("workload_timeout", message))
