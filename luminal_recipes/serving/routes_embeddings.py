"""Encoder pipelines: ``POST /v1/embeddings`` (``input``: a text or a list of texts; ``encoding_format`` float or
base64), each text embedded as ``luminal-recipe run RECIPE --prompt TEXT`` embeds it."""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..errors import LuminalError
from .errors import APIError, from_luminal


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


def router(state) -> APIRouter:
    api = APIRouter()
    backend = state.backend

    @api.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        if body.model is not None and body.model not in (state.model_id, backend.name):
            raise APIError(404, f"`model` {body.model!r}: this server serves {state.model_id!r} only", "model",
                           "model_not_found")
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        if not texts:
            raise APIError(400, "`input` is an empty list; pass at least one text", "input")
        if len(texts) > state.limits.max_inputs:
            raise APIError(400, f"`input` holds {len(texts)} texts; at most {state.limits.max_inputs} per request "
                                f"(serve --max-inputs)", "input")

        def job(handle):
            out = []
            for text in texts:
                if handle.cancelled():
                    from .backends import Cancelled

                    raise Cancelled
                out.append(backend.run(text))
            return out

        with state.admitting():
            handle = state.scheduler.submit(job)
        try:
            results = await handle.wait()
        except LuminalError as exc:
            raise from_luminal(exc) from None
        data = []
        for k, (vector, _) in enumerate(results):
            if body.dimensions is not None and body.dimensions != len(vector):
                raise APIError(400, f"`dimensions` {body.dimensions}: this model's embeddings have {len(vector)}",
                               "dimensions")
            value = vector if body.encoding_format == "float" else \
                base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": k, "embedding": value})
        tokens = sum(t for _, t in results)
        state.metrics.prompt_tokens.inc(tokens)
        return JSONResponse({"object": "list", "data": data, "model": state.model_id,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    return api
