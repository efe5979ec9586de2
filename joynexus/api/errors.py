"""API errors and the handlers that turn every failure into a JSON `ErrorBody`.

Handlers never send a traceback: a 4xx says which field was wrong, what was received and what is
accepted; an unexpected failure is a 500 with a reference id that points into the server log.
Another tenant's resource and a missing one raise the same `NotFound`, so answers never reveal
what exists outside the caller's tenant.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from joynexus.actors import role_unavailable_errors
from joynexus.protocol.schemas import ErrorBody, Problem
from joynexus.protocol.wire import WireError

log = logging.getLogger("joynexus.api")


class ApiError(Exception):
    status_code = 400
    code = "bad_request"

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.problems = problems or []
        self.headers = headers

    def with_status(self, status_code: int, code: str) -> ApiError:
        """The same error with another HTTP status and code (for one-off errors)."""
        self.status_code, self.code = status_code, code
        return self

    def body(self) -> ErrorBody:
        return ErrorBody(
            code=self.code,
            message=self.message,
            problems=[Problem(field=field, reason=reason) for field, reason in self.problems],
        )


class InvalidInput(ApiError):
    status_code = 422
    code = "invalid_input"

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}", [(field, reason)])


class NotFound(ApiError):
    """Missing, or someone else's: the two are indistinguishable by design."""

    status_code = 404
    code = "not_found"

    def __init__(self, what: str, identifier: Any, field: str):
        reason = f"no {what} {identifier!r} in your tenant"
        super().__init__(reason, [(field, reason)])


class Unauthenticated(ApiError):
    status_code = 401
    code = "unauthenticated"

    def __init__(self, message: str):
        super().__init__(message, [("authorization", message)], headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ApiError):
    """Only for role mismatches (a tenant key on an admin endpoint), never for resource ids."""

    status_code = 403
    code = "forbidden"


class Conflict(ApiError):
    status_code = 409
    code = "conflict"


class QuotaExceeded(ApiError):
    status_code = 429
    code = "quota_exceeded"


RETRY_AFTER_S = 2  # what a 503 tells a client to wait: a role restarting in place is back in seconds


class ServiceUnavailable(ApiError):
    """A role is away (restarting, or a new deployment coming up): retry after `Retry-After`."""

    status_code = 503
    code = "unavailable"

    def __init__(
        self, message: str, problems: list[tuple[str, str]] | None = None, retry_after_s: float = RETRY_AFTER_S
    ):
        super().__init__(message, problems, headers={"Retry-After": str(max(1, round(retry_after_s)))})


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body().model_dump(), status_code=error.status_code, headers=error.headers)


def validation_problems(errors: list[dict[str, Any]], drop_prefix: tuple[str, ...] = ("body",)) -> list[Problem]:
    problems = []
    for item in errors:
        loc = [str(part) for part in item.get("loc", ())]
        while loc and loc[0] in drop_prefix:
            loc = loc[1:]
        field = ".".join(loc) or "body"
        reason = str(item.get("msg", "invalid"))
        value = item.get("input")
        if isinstance(value, str | int | float | bool) and len(repr(value)) <= 80:
            reason += f" (got {value!r})"
        problems.append(Problem(field=field, reason=reason))
    return problems


def role_away(error: BaseException, follower: Any = None) -> ServiceUnavailable:
    """The answer to a call that met a role away (HTTP 503, or a stream's `unavailable` frame)
    with its retry delay; the role follower (if any) looks the roles up again now (a new
    deployment, a replaced actor)."""
    if follower is not None:
        follower.check_now()
    role = getattr(error, "role", None) or "a service"
    message = getattr(error, "client_message", None) or f"{role} is restarting; retry shortly"
    return ServiceUnavailable(message, retry_after_s=getattr(error, "retry_after_s", RETRY_AFTER_S))


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _request_invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        problems = validation_problems(list(error.errors()), drop_prefix=("body", "query", "path", "header"))
        return _invalid(problems)

    @app.exception_handler(ValidationError)
    async def _model_invalid(_request: Request, error: ValidationError) -> JSONResponse:
        return _invalid(validation_problems(list(error.errors())))

    @app.exception_handler(WireError)
    async def _wire_invalid(_request: Request, error: WireError) -> JSONResponse:
        return _invalid([Problem(field=error.field, reason=error.reason)])

    async def _role_away(request: Request, error: Exception) -> JSONResponse:
        # A handler by class (not the catch-all below): the answer keeps the connection alive.
        log.warning("%s %s: a role is away: %s", request.method, request.url.path, error)
        return error_response(role_away(error, getattr(request.app.state, "role_follower", None)))

    for unavailable in role_unavailable_errors():
        app.add_exception_handler(unavailable, _role_away)

    from joynexus.services.training.errors import UnknownTenant

    @app.exception_handler(UnknownTenant)
    async def _slot_away(request: Request, error: Exception) -> JSONResponse:
        # The caller's tenant exists (its key authenticated it): the Training Model Service restarted
        # and its slot is being restored from the last checkpoint.
        log.warning("%s %s: %s", request.method, request.url.path, error)
        return error_response(ServiceUnavailable("the Training Model Service is restoring your tenant's slot"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(error.status_code, "error")
        message = error.detail if isinstance(error.detail, str) else "request failed"
        body = ErrorBody(code=code, message=message)
        return JSONResponse(body.model_dump(), status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        reference = uuid.uuid4().hex[:12]
        log.error("unhandled error %s on %s %s", reference, request.method, request.url.path, exc_info=error)
        body = ErrorBody(code="internal", message=f"internal server error (reference {reference} in the server log)")
        return JSONResponse(body.model_dump(), status_code=500)


def _invalid(problems: list[Problem]) -> JSONResponse:
    message = "; ".join(f"{p.field}: {p.reason}" for p in problems[:5]) or "invalid request"
    body = ErrorBody(code="invalid_input", message=message, problems=problems)
    return JSONResponse(body.model_dump(), status_code=422)
