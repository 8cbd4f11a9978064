"""Image pipelines (FLUX.2): ``POST /v1/images/generations`` (JSON) and ``POST /v1/images/edits`` (multipart,
repeated ``image[]`` reference images), as OpenAI's API and the extensions sglang / vllm-omni accept (``seed``,
``num_inference_steps``, ``guidance_scale``). Only ``response_format: b64_json``: the server writes no file, and
no request field names one. Image ``k`` of ``n`` uses ``seed + k``; each is the PNG ``luminal-recipe run --prompt
... --seed S --steps N --guidance G --width W --height H`` writes: its pixels and text chunks, but for ``command``,
which names the server and the request (``backends.ImageBackend``). Runs are queued (FIFO) and made one at a
time."""

from __future__ import annotations

import base64
import re
import time
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..errors import LuminalError
from .backends import Cancelled, ImageRequest
from .errors import APIError, from_luminal


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(1, ge=1)
    size: str | None = None
    response_format: Literal["b64_json"] = "b64_json"
    seed: int | None = Field(None, ge=0, lt=2**63)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = None
    quality: str | None = None
    style: str | None = None
    user: str | None = None


def parse_size(size: str | None, limits) -> tuple[int | None, int | None]:
    if size is None or size == "auto":
        return None, None
    match = re.fullmatch(r"(\d{1,5})x(\d{1,5})", size)
    if not match:
        raise APIError(400, f"`size` {size!r}: expected WIDTHxHEIGHT, e.g. 1024x1024", "size")
    width, height = int(match[1]), int(match[2])
    limits.check_size(width, height)
    return width, height


def router(state) -> APIRouter:
    api = APIRouter()
    backend = state.backend

    def check_model(name):
        if name is not None and name not in (state.model_id, backend.name):
            raise APIError(404, f"`model` {name!r}: this server serves {state.model_id!r} only", "model",
                           "model_not_found")

    async def make(request: Request, body: GenerationRequest, images: list[bytes], route: str):
        check_model(body.model)
        state.limits.check_n(body.n)
        if body.quality not in (None, "auto", "standard") or body.style is not None:
            raise APIError(400, "`quality` and `style` are not supported by this server", "quality")
        width, height = parse_size(body.size, state.limits)
        base_seed = body.seed if body.seed is not None else None

        def job(handle):
            out = []
            for k in range(body.n):
                if handle.cancelled():
                    raise Cancelled
                seed = None if base_seed is None else base_seed + k
                if seed is None and body.n > 1:
                    seed = int(backend.params.get("seed", 0)) + k
                out.append(backend.run(ImageRequest(body.prompt, width, height, seed, body.num_inference_steps,
                                                    body.guidance_scale, images)))
            return out

        with state.admitting():
            handle = state.scheduler.submit(job)
        import asyncio

        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(0.2)
            handle.cancel()

        watcher = asyncio.create_task(watch())
        try:
            pngs = await handle.wait()
        except LuminalError as exc:
            raise from_luminal(exc) from None
        finally:
            watcher.cancel()
        return JSONResponse({"created": int(time.time()),
                             "data": [{"b64_json": base64.b64encode(png).decode(), "revised_prompt": None}
                                      for png in pngs]})

    @api.post("/v1/images/generations")
    async def generations(body: GenerationRequest, request: Request):
        return await make(request, body, [], "/v1/images/generations")

    @api.post("/v1/images/edits")
    async def edits(request: Request):
        if not backend.takes_images:
            raise APIError(404, f"pipeline {backend.name!r} takes no reference images; use /v1/images/generations")
        form = await request.form(max_files=state.limits.max_images + 1, max_fields=64)
        files = [v for key in ("image[]", "image") for v in form.getlist(key)]
        fields = {key: value for key, value in form.multi_items() if key not in ("image[]", "image")}
        if not files:
            raise APIError(400, "no reference image: send one or more `image[]` files (multipart/form-data)",
                           "image")
        if len(files) > state.limits.max_images:
            raise APIError(400, f"{len(files)} reference images; this server takes at most "
                                f"{state.limits.max_images} (serve --max-images)", "image")
        images = []
        for k, f in enumerate(files):
            if isinstance(f, str):
                raise APIError(400, f"`image[]` {k} is a text field; send the image as a file", "image")
            images.append(await f.read())
        for name in ("mask",):
            if name in fields:
                raise APIError(400, "`mask` is not supported: FLUX.2 edits follow the prompt over the whole image",
                               name)
        numbers = {"n": int, "seed": int, "num_inference_steps": int, "guidance_scale": float}
        values = {}
        for key, value in fields.items():
            if not isinstance(value, str):
                raise APIError(400, f"`{key}` is a file; only `image[]` takes files", key)
            try:
                values[key] = numbers[key](value) if key in numbers else value
            except ValueError:
                raise APIError(422, f"`{key}` {value!r} is not a number", key) from None
        try:
            body = GenerationRequest(**values)
        except Exception as exc:  # pydantic's ValidationError: the same answer as a JSON body's
            from pydantic import ValidationError

            if not isinstance(exc, ValidationError):
                raise
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(422, f"{param}: {first['msg']}", param) from None
        return await make(request, body, images, "/v1/images/edits")

    return api
