"""The operations endpoints: GET /health (the process answers), /readiness (a healthy decode
server, a prefill server unless decode servers may prefill, and every router worker started: 503
otherwise), /metrics (the router's Prometheus series, router/metrics.py) and /v1/models (the one
served model, OpenAI's list). None of them needs an API key.

`router` is the app's Router (router/app.py); this module does not import it, since app.py imports
this one.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST


def operations_routes(router) -> APIRouter:
    """GET /health, /readiness, /metrics and /v1/models, served by `router`."""
    routes = APIRouter()

    @routes.get("/health")
    async def health():
        return {"status": "ok"}

    @routes.get("/readiness")
    async def readiness():
        ready = router.serving() and router.started()
        body = {"ready": ready, "router_started": router.started(), **router.ready()}
        return JSONResponse(body, status_code=200 if ready else 503)

    @routes.get("/metrics")
    async def metrics():
        router.metrics.update(router.inflight)
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @routes.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": router.model, "object": "model", "created": 0, "owned_by": "pdserve"}],
        }

    return routes
