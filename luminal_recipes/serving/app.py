"""The FastAPI application of `luminal-recipe serve`: one loaded backend (backends.py), one scheduler
(batching.py), the routes of the backend's kind, the guards (API key, body size), OpenAI-style errors and
metrics. ``create_app`` builds it around an already loaded backend (tests and Ray replicas reuse it)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request

from . import errors, routes_common
from .batching import Closed, QueueFull, Scheduler
from .errors import APIError
from .limits import Limits
from .metrics import Metrics
from .security import Guard


@dataclass
class ServerState:
    backend: object
    limits: Limits
    model_id: str
    scheduler: Scheduler = None  # type: ignore[assignment]
    metrics: Metrics = None  # type: ignore[assignment]
    created: int = field(default_factory=lambda: int(time.time()))
    fingerprint: str = "luminal-recipes"
    closing: bool = False

    @contextlib.contextmanager
    def admitting(self):
        """Handing work to the scheduler, its refusals as the API's: a full queue is 429 (with Retry-After), a
        server that is shutting down 503 (every route submits inside this)."""
        try:
            yield
        except QueueFull:
            raise self.limits.queue_full() from None
        except Closed:
            raise APIError(503, "the server is shutting down; retry on another instance",
                           code="shutting_down") from None


def create_app(backend, limits: Limits | None = None, api_key: str | None = None, model_id: str | None = None,
               scheduler: Scheduler | None = None):
    """The ASGI app serving ``backend`` (prepared: compiled and loaded, on ``scheduler``'s worker thread when given:
    the thread that runs its requests)."""
    from .. import __version__

    limits = limits or Limits()
    state = ServerState(backend, limits, model_id or backend.name, fingerprint=f"luminal-recipes-{__version__}")
    state.metrics = Metrics(state.model_id)
    state.scheduler = scheduler or Scheduler(limits.max_queue, name=backend.kind)
    state.scheduler.metrics = state.metrics

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.scheduler.start()
        try:
            yield
        finally:  # uvicorn has stopped accepting and answered the requests in flight (SIGTERM)
            state.closing = True
            state.scheduler.stop()
            close = getattr(backend, "close", None)
            if close is not None:
                close()

    app = FastAPI(title=f"luminal-recipes: {state.model_id}", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    errors.install(app)
    app.include_router(routes_common.router(state))
    if backend.kind == "text":
        from . import routes_text

        app.include_router(routes_text.router(state))
    elif backend.kind == "embeddings":
        from . import routes_embeddings

        app.include_router(routes_embeddings.router(state))
    else:
        from . import routes_images

        app.include_router(routes_images.router(state))

    @app.middleware("http")
    async def count(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        state.metrics.requests.labels(path, str(response.status_code)).inc()
        if path.startswith("/v1/") and "text/event-stream" not in response.headers.get("content-type", ""):
            state.metrics.latency.labels(path).observe(time.perf_counter() - t0)
        return response

    return Guard(app, api_key, limits.max_body_bytes), app
