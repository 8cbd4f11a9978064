"""Language models: ``POST /v1/chat/completions`` and ``POST /v1/completions``, as OpenAI's API defines them
(and its Python client parses them): ``stream`` as server-sent events (``data: {chunk}`` lines, ``data: [DONE]``),
``n`` choices, ``usage``, ``finish_reason``.

Extensions (as vLLM's): ``top_k`` and ``repetition_penalty``. Defaults follow OpenAI where it has one
(``temperature`` 1, ``top_p`` 1, ``n`` 1; ``max_tokens`` 16 for completions, the room the context leaves for
chat), except ``seed``: omitted, it is 0 (`run`'s default), so a request is reproducible. Choice ``k`` of
``n`` samples with ``seed + k``. The same ids, settings and seed give the same tokens as ``luminal-recipe run``
(``--temperature --top-p --top-k --repetition-penalty --seed --stop --max-new-tokens``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..errors import LuminalError
from .backends import Cancelled, TextBackend, TextJob, TextResult
from .errors import APIError, from_luminal


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = Field(0, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool | int | None = None
    # extensions vLLM and llama.cpp's server accept too (`run`'s --top-k and --repetition-penalty)
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


def _unsupported(body: _Sampling) -> None:
    for name, value, default in (("frequency_penalty", body.frequency_penalty, 0.0),
                                 ("presence_penalty", body.presence_penalty, 0.0)):
        if value != default:
            raise APIError(400, f"`{name}` is not supported by this server (leave it 0)", name)
    if body.logprobs not in (None, False, 0):
        raise APIError(400, "`logprobs` is not supported by this server", "logprobs")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise APIError(400, "`echo` is not supported by this server", "echo")
        if body.suffix:
            raise APIError(400, "`suffix` is not supported by this server", "suffix")
        if body.best_of not in (None, 1, body.n):
            raise APIError(400, "`best_of` other than `n` is not supported by this server", "best_of")


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4:
        raise APIError(400, f"`stop` has {len(stops)} strings; at most 4 (as OpenAI's API)", "stop")
    if any(not s for s in stops):
        raise APIError(400, "`stop` holds an empty string; every stop string needs at least one character", "stop")
    return stops


def _content(message: Message, k: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def router(state) -> APIRouter:
    """The text routes of a server whose ``state`` holds the backend, scheduler, limits and metrics."""
    api = APIRouter()
    backend: TextBackend = state.backend

    def check_model(name: str | None) -> None:
        if name is not None and name not in (state.model_id, backend.name):
            raise APIError(404, f"`model` {name!r}: this server serves {state.model_id!r} only (GET /v1/models)",
                           "model", "model_not_found")

    async def encode(fn, *args) -> list[int]:
        try:
            return await asyncio.to_thread(fn, *args)
        except LuminalError as exc:
            raise from_luminal(exc) from None

    def submit(ids: list[int], max_tokens: int, body: _Sampling, k: int, stops: list[str]):
        metrics = state.metrics

        def job(handle):
            metrics.running.inc()
            counted = [0]

            def on_token(token: int) -> None:
                counted[0] += 1
                if counted[0] == 1:
                    handle.first_token = time.perf_counter()
                metrics.tokens(1)

            try:
                return backend.run(ids, max_tokens, temperature=body.temperature, top_p=body.top_p,
                                   top_k=body.top_k, repetition_penalty=body.repetition_penalty,
                                   seed=body.seed + k, stop=stops, on_text=handle.emit, cancelled=handle.cancelled,
                                   on_token=on_token)
            finally:
                metrics.running.dec()

        try:
            with state.admitting():
                if hasattr(state.scheduler, "submit_text"):  # continuous batching (serve --max-batch > 1)
                    from ..tasks.generation.sampling import SamplingSettings

                    settings = SamplingSettings(body.temperature, body.top_k, body.top_p, body.repetition_penalty,
                                                body.seed + k)
                    return state.scheduler.submit_text(TextJob(ids, max_tokens, settings, stops))
                return state.scheduler.submit(job)
        except LuminalError as exc:
            raise from_luminal(exc) from None

    def submit_all(prompts: list[list[int]], max_tokens: list[int], body: _Sampling, stops: list[str]):
        handles = []
        try:
            for p, ids in enumerate(prompts):
                for k in range(body.n):
                    handles.append(submit(ids, max_tokens[p], body, k, stops))
        except APIError:
            for h in handles:
                h.cancel()
            raise
        return handles

    async def results(request: Request, handles, received: float) -> list[TextResult]:
        """Every handle's result; the client leaving cancels them all."""
        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(0.2)
            for h in handles:
                h.cancel()

        watcher = asyncio.create_task(watch())
        try:
            out = await asyncio.gather(*(h.wait() for h in handles))
        except LuminalError as exc:
            raise from_luminal(exc) from None
        finally:
            watcher.cancel()
            for h in handles:
                h.cancel()  # one failed: the others stop
        _observe(state, handles, received)
        return out

    def stream(handles, received: float, make_chunk, final_chunk, usage_chunk, include_usage: bool,
               first_chunks=(), route: str = "/v1/chat/completions"):
        async def events():
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(k: int, handle):
                try:
                    async for pieces in handle.batches():
                        await queue.put((k, "text", pieces))
                    await queue.put((k, "done", handle.result))
                except BaseException as exc:  # noqa: BLE001 - reported to the client as an error event
                    await queue.put((k, "error", exc))

            tasks = [asyncio.create_task(pump(k, h)) for k, h in enumerate(handles)]
            done, results = 0, {}
            try:
                for chunk in first_chunks:
                    yield _sse(chunk)
                while done < len(handles):
                    k, kind, value = await queue.get()
                    if kind == "text":  # the pieces emitted since the last write: one event each, one write
                        yield "".join(_sse(make_chunk(k, piece)) for piece in value)
                    elif kind == "done":
                        done += 1
                        results[k] = value
                        yield _sse(final_chunk(k, value))
                    else:
                        for h in handles:
                            h.cancel()
                        if isinstance(value, Cancelled):
                            return
                        err = from_luminal(value) if isinstance(value, LuminalError) else \
                            APIError(500, f"internal error ({type(value).__name__}); the server log has the details")
                        if not isinstance(value, LuminalError):
                            from .errors import log

                            log.error("unexpected error while streaming", exc_info=value)
                        yield _sse({"error": {"message": err.message, "type": "server_error" if err.status >= 500
                                              else "invalid_request_error", "param": err.param, "code": err.code}})
                        return
                _observe(state, handles, received, route)
                if include_usage:
                    yield _sse(usage_chunk([results[k] for k in range(len(handles))]))
                yield "data: [DONE]\n\n"
            finally:  # the client left (the response was cancelled) or the stream ended
                for h in handles:
                    h.cancel()
                for t in tasks:
                    t.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def usage(res: list[TextResult], prompts: list[list[int]]) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(len(r.ids) for r in res)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    @api.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        received = time.perf_counter()
        check_model(body.model)
        _unsupported(body)
        state.limits.check_n(body.n)
        stops = _stops(body.stop)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": _content(m, k)}
                    for k, m in enumerate(body.messages)]
        ids = await encode(backend.chat_ids, messages)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        asked = body.max_completion_tokens or body.max_tokens
        room = backend.context - len(ids)
        max_tokens = state.limits.check_max_tokens(asked if asked is not None else
                                                   max(1, min(room, state.limits.max_tokens)), field, len(ids),
                                                   backend.context)
        state.metrics.prompt_tokens.inc(len(ids))
        handles = submit_all([ids], [max_tokens], body, stops)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_id,
                "system_fingerprint": state.fingerprint}
        if body.stream:
            first = [{**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]} for k in range(len(handles))]
            include = bool(body.stream_options and body.stream_options.include_usage)

            def piece(k, text):
                return {**head, "choices": [{"index": k, "delta": {"content": text}, "logprobs": None,
                                             "finish_reason": None}]}

            def final(k, res: TextResult):
                return {**head, "choices": [{"index": k, "delta": {}, "logprobs": None,
                                             "finish_reason": res.finish_reason}]}

            def usage_chunk(res):
                return {**head, "choices": [], "usage": usage(res, [ids])}

            return stream(handles, received, piece, final, usage_chunk, include, first)
        res = await results(request, handles, received)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": state.model_id,
            "system_fingerprint": state.fingerprint,
            "choices": [{"index": k, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
                         "finish_reason": r.finish_reason} for k, r in enumerate(res)],
            "usage": usage(res, [ids])})

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        received = time.perf_counter()
        check_model(body.model)
        _unsupported(body)
        stops = _stops(body.stop)
        given = body.prompt
        if isinstance(given, str) or (given and all(isinstance(i, int) for i in given)):
            given = [given]
        if not given:
            raise APIError(400, "`prompt` is empty; pass a text or a list of token ids", "prompt")
        state.limits.check_n(body.n * len(given))
        prompts = [await encode(backend.prompt_ids, p) for p in given]
        max_tokens = [state.limits.check_max_tokens(body.max_tokens or 16, "max_tokens", len(ids), backend.context)
                      for ids in prompts]
        state.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        handles = submit_all(prompts, max_tokens, body, stops)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_id,
                "system_fingerprint": state.fingerprint}
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)

            def piece(k, text):
                return {**head, "choices": [{"index": k, "text": text, "logprobs": None, "finish_reason": None}]}

            def final(k, res: TextResult):
                return {**head, "choices": [{"index": k, "text": "", "logprobs": None,
                                             "finish_reason": res.finish_reason}]}

            def usage_chunk(res):
                return {**head, "choices": [], "usage": usage(res, prompts)}

            return stream(handles, received, piece, final, usage_chunk, include, route="/v1/completions")
        res = await results(request, handles, received)
        return JSONResponse({**head, "choices": [{"index": k, "text": r.text, "logprobs": None,
                                                  "finish_reason": r.finish_reason} for k, r in enumerate(res)],
                             "usage": usage(res, prompts)})

    return api


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _observe(state, handles, received: float, route: str | None = None) -> None:
    if route is not None:
        state.metrics.latency.labels(route).observe(time.perf_counter() - received)
    for h in handles:
        first = getattr(h, "first_token", None)
        if first is not None:
            state.metrics.ttft.observe(first - received)
