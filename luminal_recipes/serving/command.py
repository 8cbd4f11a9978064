"""`luminal-recipe serve RECIPE`: load and compile once, then answer OpenAI-compatible HTTP requests (see
docs/serving.md). Only typer is imported here; FastAPI and uvicorn (the `serve` extra) when the command runs."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

import typer

from ..errors import InputError

API_KEY_ENV = "LUMINAL_RECIPES_API_KEY"


def serve(
    recipe: Path = typer.Argument(..., help="a language-model recipe (chat/completions), an encoder pipeline "
                                  "(embeddings) or a FLUX.2 pipeline (images)"),
    weights: str | None = typer.Option(None, help="checkpoint folder or hf://org/repo[@rev][/subfolder] (overrides "
                                       "the recipe's source)"),
    host: str = typer.Option("127.0.0.1", help="address to listen on (127.0.0.1: this machine only; 0.0.0.0: every "
                             "interface - set --api-key then)"),
    port: int = typer.Option(8000, help="TCP port (0: any free port, printed at start)"),
    set_: list[str] = typer.Option([], "--set", help="override a recipe parameter: --set name=value (repeatable)"),
    runtime: str = typer.Option("numpy", "--runtime", help="numpy (CPU), cuda or cuda-emu, as for `run`"),
    max_memory: str | None = typer.Option(None, help="memory budget, e.g. 24GiB (default: what the process may use)"),
    max_host_memory: str | None = typer.Option(None, "--max-host-memory", help="pipelines on a GPU runtime: pinned "
                                               "host staging for streamed weights, e.g. 2GiB"),
    compute_dtype: str | None = typer.Option(None, "--compute-dtype", help="pipelines: f32, bf16 or f16"),
    lora: list[str] = typer.Option([], "--lora", help="pipelines: a LoRA .safetensors PATH[:SCALE] applied at "
                                   "start-up (repeatable); requests cannot name files"),
    context: int | None = typer.Option(None, help="language models: plan the KV cache for this many tokens "
                                       "(default: the model's context)"),
    no_compile: bool = typer.Option(False, "--no-compile", help="run the naive primitive program (no search)"),
    allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help="answer even when the logits or a stage "
                                         "output hold NaN or infinity"),
    api_key: str | None = typer.Option(None, "--api-key", help=f"require `Authorization: Bearer KEY` on every route "
                                       f"but /health (default: ${API_KEY_ENV} when set)"),
    model_name: str | None = typer.Option(None, "--model-name", help="the model id clients send and /v1/models "
                                          "lists (default: the recipe's name)"),
    max_batch: int = typer.Option(8, "--max-batch", min=1, help="language models: sequences decoded together by "
                                  "one batched program (continuous batching; 1: one reply at a time)"),
    max_queue: int = typer.Option(64, "--max-queue", min=1, help="requests waiting; past it: 429 with Retry-After"),
    max_tokens: int = typer.Option(4096, "--max-tokens", min=1, help="most tokens one reply may ask for"),
    max_n: int = typer.Option(8, "--max-n", min=1, help="most choices (or images) per request"),
    max_body_bytes: int = typer.Option(16 << 20, "--max-body-bytes", min=1024, help="largest request body "
                                       "(uploads included); past it: 413"),
    max_image_pixels: int = typer.Option(2048 * 2048, "--max-image-pixels", min=1, help="images: largest "
                                         "width x height"),
    max_images: int = typer.Option(6, "--max-images", min=1, help="images: most reference images of an edit"),
    max_inputs: int = typer.Option(256, "--max-inputs", min=1, help="embeddings: most texts per request"),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level: critical, error, warning, "
                                  "info, debug"),
    ray: bool = typer.Option(False, "--ray", help="scale out on Ray Serve: --replicas copies of the compiled model "
                             "behind Ray's HTTP proxy, same API (needs luminal-recipes[ray]; docs/serving.md)"),
    replicas: int = typer.Option(1, "--replicas", min=1, help="with --ray: replicas, each holding the model (one "
                                 "GPU each with --runtime cuda)"),
    ray_address: str | None = typer.Option(None, "--ray-address", help="with --ray: the cluster to join, e.g. "
                                           "auto or HEAD:6379 (default: $RAY_ADDRESS, else a local Ray started "
                                           "here)"),
    ray_num_cpus: float = typer.Option(1.0, "--ray-num-cpus", min=0.0, help="with --ray: CPUs Ray reserves per "
                                       "replica"),
) -> None:
    """Serve a recipe over HTTP with OpenAI's API: /v1/chat/completions and /v1/completions (language models),
    /v1/embeddings (encoders), /v1/images/generations and /v1/images/edits (FLUX.2); /v1/models, /health and
    /metrics always. Loads and compiles once; SIGTERM stops accepting, finishes the requests in flight, exits."""
    try:
        import uvicorn

        from . import app as _app  # noqa: F401 - FastAPI present
    except ImportError as exc:
        raise InputError(f"`serve` needs FastAPI and uvicorn ({exc.name} is not installed): pip install "
                         f"'luminal-recipes[serve]'") from None
    if ray:
        try:
            import ray.serve  # noqa: F401
        except ImportError as exc:
            raise InputError(f"serve --ray needs Ray Serve ({exc.name} is not installed): pip install "
                             f"'luminal-recipes[ray]'") from None
    elif replicas != 1 or ray_address is not None:
        raise InputError(f"{'--replicas' if replicas != 1 else '--ray-address'} deploys on Ray Serve: add --ray "
                         f"(and pip install 'luminal-recipes[ray]')")
    from ..pipeline.generate import parse_size
    from .backends import ModelOptions
    from .limits import Limits

    if not 0 <= port <= 65535:
        raise InputError(f"--port {port}: must be in 0..65535")
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and not key.strip():
        raise InputError("--api-key is empty; pass a secret, or omit it")
    options = ModelOptions(recipe, weights, tuple(set_), runtime, parse_size(max_memory),
                           parse_size(max_host_memory, "--max-host-memory"), compute_dtype, not no_compile, context,
                           tuple(lora), allow_nonfinite)
    limits = Limits(max_body_bytes=max_body_bytes, max_tokens=max_tokens, max_n=max_n, max_queue=max_queue,
                    max_image_pixels=max_image_pixels, max_images=max_images,
                    max_inputs=max_inputs)
    if ray:
        from .ray_serve import run_cli

        return run_cli(options, limits, key, model_name, max_batch, max_tokens, host, port, replicas, ray_address,
                       ray_num_cpus, log_level)
    sock = _bind(host, port)  # before the slow load: a port in use fails at once
    print(f"luminal-recipe serve: loading and compiling {recipe}...", file=sys.stderr, flush=True)
    asgi, backend = build_server(options, limits, key, model_name, max_batch, max_tokens)
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    print(f"luminal-recipe serve: {backend.kind} model {model_name or backend.name!r} on http://{shown}:{bound[1]}"
          + (" (API key required)" if key else ""), file=sys.stderr, flush=True)
    config = uvicorn.Config(asgi, log_level=log_level, timeout_graceful_shutdown=None, lifespan="on",
                            access_log=log_level == "debug")
    server = uvicorn.Server(config)
    # SIGTERM/SIGINT: uvicorn stops accepting, finishes the requests in flight, then re-raises the signal
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])
    print("luminal-recipe serve: stopped", file=sys.stderr, flush=True)


def build_server(options, limits, key: str | None, model_name: str | None, max_batch: int, max_tokens: int):
    """Load and compile the model of ``options`` once, on the scheduler's worker thread, and return the ASGI app
    serving it with its backend: what `serve` runs under uvicorn and each Ray Serve replica (ray_serve.py) holds."""
    from .app import create_app
    from .backends import load_backend, recipe_kind
    from .batching import Scheduler, TextBatcher

    kind = recipe_kind(options.recipe)
    batching = kind == "text" and max_batch > 1
    scheduler = TextBatcher(limits.max_queue, max_batch) if batching else Scheduler(limits.max_queue, name=kind)

    def load():
        backend = load_backend(options)
        if backend.kind == "text":
            backend.prepare(max_tokens, max_batch)
            if batching:
                scheduler.engine, scheduler.lm = backend.batched, backend.model
        else:
            backend.prepare()
        return backend

    # loaded and compiled on the thread that will run every request (egglog's e-graphs stay on their thread)
    try:
        backend = scheduler.call(load)
    except BaseException:
        scheduler.stop()
        raise
    asgi, _ = create_app(backend, limits, key, model_name, scheduler)
    return asgi, backend


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InputError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); choose another "
                         f"port (0 picks a free one)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
