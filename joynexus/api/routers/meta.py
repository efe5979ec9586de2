"""Routes about the server itself: /v1/health (no key) and the Prometheus page /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from joynexus.api.errors import RETRY_AFTER_S
from joynexus.api.middleware import WireRoute
from joynexus.api.routers.dependencies import Gateway, admin_only
from joynexus.api.routers.responses import respond
from joynexus.protocol import schemas as s

router = APIRouter(prefix="/v1", route_class=WireRoute)


@router.get("/health", response_model=s.Health, tags=["meta"], responses={503: {"model": s.Health}})
def health(request: Request, gateway: Gateway) -> Response:
    """The truth per role (Master, its threads, every service): 200 when all are healthy, 503
    with the same body when one is down or restoring, or the Master does not answer."""
    report = gateway.health()
    response = respond(request, report, status_code=200 if report.status == "ok" else 503)
    if report.status != "ok":  # a role is away or restoring: ask again shortly
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def metrics_router(public: bool) -> APIRouter:
    """GET /metrics; `public` False (the default): only with the admin (operator) key, 401 without
    a key, 403 with a tenant's: the page holds every tenant's series."""
    router = APIRouter()

    @router.get(
        "/metrics",
        tags=["meta"],
        response_class=Response,
        dependencies=[] if public else [Depends(admin_only)],
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition format"}},
    )
    def prometheus_metrics(request: Request) -> Response:
        """Control, learning and system signals (joynexus.ops.metrics); sources that do not answer
        in time are left out and counted in joynexus_scrape_errors_total."""
        body, content_type = request.app.state.metrics.render()
        return Response(body, media_type=content_type)

    return router
