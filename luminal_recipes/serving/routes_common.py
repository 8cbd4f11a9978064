"""The routes every server has: ``GET /v1/models`` (the one model served), ``GET /health`` (no API key: for load
balancers) and ``GET /metrics`` (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response


def router(state) -> APIRouter:
    api = APIRouter()

    def card() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "luminal-recipes",
                "kind": state.backend.kind}

    @api.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [card()]})

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        from .errors import APIError

        if model_id != state.model_id:
            raise APIError(404, f"model {model_id!r} is not served here; this server serves {state.model_id!r}",
                           "model", "model_not_found")
        return JSONResponse(card())

    @api.get("/health")
    async def health():
        ok = not state.closing
        return JSONResponse({"status": "ok" if ok else "shutting_down", "model": state.model_id,
                             "queue_depth": state.scheduler.depth}, status_code=200 if ok else 503)

    @api.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    return api
