"""`luminal-recipe serve RECIPE --ray --replicas N`: the same server scaled out on Ray Serve (the `ray` extra). Each
replica loads and compiles the model once (``command.build_server``, the app `serve` runs under uvicorn) and Ray
Serve's HTTP proxy spreads the requests over the replicas; one GPU per replica with ``--runtime cuda``.

From Python (docs/serving.md)::

    from ray import serve
    from luminal_recipes.serving.ray_serve import app
    serve.run(app("recipes/llama.yaml", weights="path/to/llama", replicas=2), route_prefix="/")

Every response carries ``x-luminal-replica``: the Ray Serve replica that answered it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from ray import serve

from ..errors import InputError, LuminalError
from .backends import ModelOptions
from .limits import Limits

REPLICA_HEADER = b"x-luminal-replica"


class ReplicaStartError(LuminalError):
    """The replicas could not load the model (the replica's own error is in the message)."""


class _NameReplica:
    """ASGI middleware: adds ``x-luminal-replica: ID`` to every HTTP response."""

    def __init__(self, app, replica: str):
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named_send(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, self.replica)]}
            await send(message)

        await self.app(scope, receive, named_send)


@serve.ingress()  # late-bound: the app is the one `serve` runs, built around the model this replica loaded
class LuminalRecipeServer:
    """A Ray Serve replica holding one compiled model."""

    async def __init__(self, options: ModelOptions, limits: Limits, api_key: str | None, model_name: str | None,
                       max_batch: int, max_tokens: int):
        from .command import build_server

        try:
            replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (a unit test calling the class): the process id
            replica = f"pid{os.getpid()}"
        # off the replica's event loop: the load compiles for a while, and Ray's health checks keep running
        asgi, self.backend = await asyncio.to_thread(build_server, options, limits, api_key, model_name, max_batch,
                                                     max_tokens)
        self._asgi = _NameReplica(asgi, replica)

    def __serve_build_asgi_app__(self):
        return self._asgi


class ProxyErrors:
    """ASGI middleware in Ray Serve's HTTP proxy (``proxy_middlewares``): the proxy's own failures - a replica that
    died with the request (the proxy answers nothing, and uvicorn a plain-text 500) - become OpenAI-style JSON
    errors, 503 with Retry-After: the request can be sent again, another replica or the replacement answers it.
    Replies the replicas made (JSON errors included) pass unchanged; a stream already started is only cut."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = swallowing = False

        async def checked_send(message):
            nonlocal started, swallowing
            if message["type"] == "http.response.start":
                started = True
                headers = dict(message.get("headers") or ())
                if message["status"] >= 500 and not headers.get(b"content-type", b"").startswith(b"application/json"):
                    swallowing = True
                    return await _unavailable(send)
            elif swallowing:
                return None
            await send(message)

        try:
            await self.app(scope, receive, checked_send)
        except Exception:  # noqa: BLE001 - the proxy failed before answering: the client still gets an error object
            if started:
                raise
        if not started:  # the proxy gave up without answering (uvicorn would send a plain-text 500)
            await _unavailable(send)


async def _unavailable(send) -> None:
    import json

    from .errors import error_body

    body = json.dumps(error_body(503, "the replica serving this request stopped before answering (Ray Serve is "
                                      "replacing it); send the request again", code="replica_unavailable")).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list:
    """Ray Serve's proxy callback: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=PROXY_CALLBACK in the environment of
    the processes that start Ray (``ray start``, or the driver's ``ray.init`` for a local cluster)."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyErrors)]


PROXY_CALLBACK = "luminal_recipes.serving.ray_serve:proxy_middlewares"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"


def app(recipe: str | Path, *, weights: str | None = None, replicas: int = 1, num_cpus: float = 1.0,
        num_gpus: float | None = None, runtime: str = "numpy", sets: tuple[str, ...] = (), compile: bool = True,
        context: int | None = None, compute_dtype: str | None = None, loras: tuple[str, ...] = (),
        max_memory: int | None = None, max_host_memory: int | None = None, allow_nonfinite: bool = False,
        api_key: str | None = None, model_name: str | None = None, max_batch: int = 8, limits: Limits | None = None,
        options: ModelOptions | None = None):
    """The Ray Serve application serving ``recipe`` on ``replicas`` replicas (``serve.run(app(...))``), with
    ``num_cpus`` CPUs reserved for each and ``num_gpus`` GPUs (default: 1 with ``runtime="cuda"``, else 0).
    Local paths are made absolute here: on a multi-node cluster they must exist at that path on every node."""
    if replicas < 1:
        raise InputError(f"--replicas {replicas}: must be at least 1")
    if options is None:
        options = ModelOptions(Path(recipe), weights, tuple(sets), runtime, max_memory, max_host_memory,
                               compute_dtype, compile, context, tuple(loras), allow_nonfinite)
    options = _absolute(options)
    limits = limits or Limits()
    if num_gpus is None:
        num_gpus = 1 if options.runtime == "cuda" else 0
    deployment = serve.deployment(
        LuminalRecipeServer, name="luminal-recipe", num_replicas=replicas,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        # what one replica takes at once: its batch plus its queue (past that the replica answers 429 itself)
        max_ongoing_requests=max_batch + limits.max_queue,
        # a replica's first load compiles the model: give its start-up and health checks room
        health_check_timeout_s=120, graceful_shutdown_timeout_s=60)
    return deployment.bind(options, limits, api_key, model_name, max_batch, limits.max_tokens)


def _absolute(options: ModelOptions) -> ModelOptions:
    from dataclasses import replace

    weights = options.weights
    if weights is not None and "://" not in weights and Path(weights).exists():
        weights = str(Path(weights).resolve())
    loras = tuple(_absolute_lora(spec) for spec in options.loras)
    return replace(options, recipe=Path(options.recipe).resolve(), weights=weights, loras=loras)


def _absolute_lora(spec: str) -> str:
    """PATH[:SCALE] with PATH made absolute when it names a file here."""
    if Path(spec).exists():
        return str(Path(spec).resolve())
    path, sep, scale = spec.rpartition(":")
    return str(Path(path).resolve()) + sep + scale if sep and Path(path).exists() else spec


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run_cli(options: ModelOptions, limits: Limits, api_key: str | None, model_name: str | None, max_batch: int,
            max_tokens: int, host: str, port: int, replicas: int, ray_address: str | None, num_cpus: float,
            log_level: str) -> None:
    """`serve --ray`: join (or start) a Ray cluster, deploy the replicas behind Ray Serve's proxy on HOST:PORT, wait
    for SIGTERM/SIGINT, then shut the application down (Serve drains the replicas' requests)."""
    import logging

    import ray

    from .backends import recipe_kind

    recipe_kind(options.recipe)  # a bad recipe fails here, located, before any replica starts
    port = port or _free_port(host)
    # a local Ray started here passes its environment on to Serve's proxy (a `ray start` cluster: docs/serving.md)
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    ray.init(address=ray_address, logging_level=getattr(logging, log_level.upper(), logging.INFO),
             log_to_driver=log_level == "debug")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": host, "port": port})
        print(f"luminal-recipe serve: deploying {replicas} replica(s) of {options.recipe} on Ray Serve "
              f"({ray.get_runtime_context().gcs_address})...", file=sys.stderr, flush=True)
        application = app(options.recipe, options=options, replicas=replicas, num_cpus=num_cpus, api_key=api_key,
                          model_name=model_name, max_batch=max_batch, limits=limits)
        try:
            serve.run(application, name="luminal-recipe", route_prefix="/", blocking=False)
        except Exception as exc:  # noqa: BLE001 - the replica's error, shown to the user as one paragraph
            first = str(exc).strip().splitlines()
            raise ReplicaStartError(f"serve --ray: the replicas of {options.recipe} did not start: "
                                    f"{' '.join(first[-3:]) if first else type(exc).__name__} (the replica logs "
                                    f"are under /tmp/ray/session_latest/logs/serve/)") from None
        shown = f"[{host}]" if ":" in host else host
        print(f"luminal-recipe serve: {replicas} replica(s) on Ray Serve on http://{shown}:{port}"
              + (" (API key required)" if api_key else ""), file=sys.stderr, flush=True)
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    print("luminal-recipe serve: stopped", file=sys.stderr, flush=True)
