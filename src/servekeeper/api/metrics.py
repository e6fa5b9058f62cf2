"""`GET /metrics` (Prometheus text format), on the API app or on an app of its own."""

from __future__ import annotations

from fastapi import FastAPI, Response

from servekeeper.controller.metrics import CONTENT_TYPE, Metrics


def add_metrics_route(app: FastAPI, metrics: Metrics) -> None:
    """On the API app it is behind the token like every call there; `build_metrics_app` serves it
    alone without one (`up --metrics-port`, loopback)."""

    async def prometheus_metrics() -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE)

    app.add_api_route("/metrics", prometheus_metrics, methods=["GET"], include_in_schema=False)


def build_metrics_app(metrics: Metrics) -> FastAPI:
    app = FastAPI(title="servekeeper metrics", docs_url=None, redoc_url=None, openapi_url=None)
    add_metrics_route(app, metrics)
    return app
