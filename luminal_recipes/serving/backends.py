"""The one adapter between the server and the product's model APIs: what `serve` loads for a recipe and how a
request becomes a run. Every other serving module talks to these classes only.

- ``TextBackend``: a language-model recipe (``LanguageModel``: prefill + decode programs sharing a KV cache, the
  checkpoint's tokenizer and chat template, host sampling, incremental detokenization).
- ``EmbeddingBackend``: an encoder pipeline with a text ``prompt`` input and an array output (recipes/minilm.yaml).
- ``ImageBackend``: a FLUX.2 pipeline (an image output; reference images through its ``images`` input), run by
  ``pipeline.generate.PipelineSession`` as ``luminal-recipe run`` and the Python API run it: the same parameters,
  the same PNG (pixels and text chunks, ``command`` naming the server and the request), bytes in memory.

Each is loaded and compiled once, at start-up; each ``run`` is called from one worker thread at a time.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, PipelineError


@dataclass
class ModelOptions:
    """The `serve` options that shape the model (those of `run`)."""

    recipe: Path
    weights: str | None = None
    sets: tuple[str, ...] = ()
    runtime: str = "numpy"
    max_memory: int | None = None
    max_host_memory: int | None = None
    compute_dtype: str | None = None
    compile: bool = True
    context: int | None = None
    loras: tuple[str, ...] = ()
    allow_nonfinite: bool = False
    chat_template: str | None = None


def recipe_kind(recipe: Path) -> str:
    """"text" (a model recipe with `generation:`), "embeddings" or "images" (a pipeline, by its outputs)."""
    from ..errors import RecipeError
    from ..recipe.loader import load_recipe
    from ..recipe.schema import ModelRecipe

    loaded = load_recipe(recipe)
    if isinstance(loaded.doc, ModelRecipe):
        from ..tasks.generation.contract import check_static

        check_static(loaded)  # a model recipe without `generation:` is refused, located
        return "text"
    types = {spec.type for spec in loaded.doc.outputs.values()}
    if "image" in types:
        return "images"
    if "prompt" in loaded.doc.inputs and types & {"array", None}:
        return "embeddings"
    raise RecipeError(f"{recipe}: `serve` serves language models (a model recipe with `generation:`), encoder "
                      f"pipelines (a `prompt` input and an array output: /v1/embeddings) and image pipelines (an "
                      f"image output: /v1/images); pipeline '{loaded.doc.name}' is none of these")


# ---- language models ----------------------------------------------------------------------------------------------
@dataclass
class TextResult:
    prompt_tokens: int
    ids: list[int]
    text: str
    finish_reason: str  # OpenAI's: "stop" (an EOS token or a stop string) or "length"


@dataclass
class TextJob:
    """A reply for the continuous batcher (``batching.TextBatcher``): prompt ids, tokens, sampling, stops."""

    ids: list[int]
    max_tokens: int
    settings: Any  # tasks.generation.sampling.SamplingSettings
    stop: Sequence[str]


class Cancelled(Exception):
    """Raised inside a run when its request was cancelled (the client went away)."""


class TextBackend:
    kind = "text"

    def __init__(self, options: ModelOptions):
        from ..tasks.generation.model import LanguageModel

        if options.loras or options.compute_dtype or options.max_host_memory:
            raise InputError("--lora, --compute-dtype and --max-host-memory apply to pipelines; a language model "
                             "recipe takes none of them")
        self.model = LanguageModel(options.recipe, weights=options.weights, sets=list(options.sets),
                                   runtime=options.runtime, max_memory=options.max_memory, compile=options.compile,
                                   context=options.context, chat_template=options.chat_template,
                                   allow_nonfinite=options.allow_nonfinite)
        self.name = self.model.name
        self.context = self.model.context or self.model.max_context
        self.options = options
        self.batched = None  # a BatchedDecoder, when requests are decoded together (prepare(max_batch > 1))

    def prepare(self, max_new_tokens: int, max_batch: int = 1) -> None:
        """Compile, plan and load once: for ``max_batch`` > 1 the batched program (``max_batch`` sequences of the
        whole context each, decoded together), else the single-sequence programs for the longest reply."""
        if max_batch > 1:
            from ..tasks.generation.batched import DEFAULT_SLOT_TOKENS, BatchedDecoder

            # each slot holds a whole sequence: --context, else the model's context up to DEFAULT_SLOT_TOKENS
            slot_len = self.model.context or min(self.model.max_context, DEFAULT_SLOT_TOKENS)
            self.batched = BatchedDecoder(self.model, self.options.recipe, self.options.weights,
                                          list(self.options.sets), slots=max_batch, slot_len=slot_len)
            self.batched.prepare(longest_prompt=64)
            self.context = self.batched.slot_len
        else:
            self.model.prepare(1, max(1, min(max_new_tokens, self.context - 1)))

    def close(self) -> None:
        if self.batched is not None:
            self.batched.close()
        self.model.release()

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The prompt ids of a conversation: the checkpoint's chat template, as transformers'
        ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``."""
        from ..text.chat_template import render_chat
        from ..text.check import check_text

        tok = self.model.tokenizer
        if tok.chat_template is None:
            raise InputError(f"{tok.folder}: the checkpoint has no chat template, so /v1/chat/completions cannot "
                             f"render messages; use /v1/completions with a plain prompt")
        for k, message in enumerate(messages):
            check_text(message["content"], f"messages[{k}].content", InputError)
        self.model._check_text_length(sum(len(m["content"]) for m in messages))
        text = render_chat(tok.chat_template, messages, tok.special_tokens, tok.template_source,
                           add_generation_prompt=True, refused_hint="check the roles and order of `messages`")
        return self._checked(tok.encode(text, add_special_tokens=False), "messages")

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt: text encoded as ``tokenizer(prompt)`` (no template), or token ids as given."""
        if isinstance(prompt, str):
            return self._checked(self.model.encode(prompt, chat=False), "prompt")
        return self.model.encode(list(prompt))

    def _checked(self, ids: list[int], field: str) -> list[int]:
        if not ids:
            raise InputError(f"`{field}` encodes to no tokens")
        self.model._check_vocab(ids, f"`{field}`")
        return ids

    def run(self, ids: list[int], max_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
            repetition_penalty: float = 1.0, seed: int = 0,
            stop: Sequence[str] = (), on_text: Callable[[str], None] = lambda text: None,
            cancelled: Callable[[], bool] = lambda: False,
            on_token: Callable[[int], None] | None = None) -> TextResult:
        """One reply, as `luminal-recipe run` gives it for the same ids and settings; ``on_text`` gets its text
        as decoded (never half a character, never part of a stop string), ``on_token`` each token id as chosen;
        ``Cancelled`` ends it once ``cancelled()``."""
        def each_token(token: int, piece: str) -> None:
            if on_token is not None:
                on_token(token)
            if cancelled():
                raise Cancelled

        result = self.model.generate(ids, max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                     repetition_penalty=repetition_penalty, seed=seed, stop=stop,
                                     on_text=on_text, on_token=each_token)
        return TextResult(len(result.prompt_ids), result.ids, result.text,
                          "length" if result.finish_reason == "length" else "stop")


# ---- encoders -----------------------------------------------------------------------------------------------------
class _PipelineBackend:
    def _pipeline(self, options: ModelOptions, sets: Sequence[str] = (), sources: Mapping[str, str] | None = None):
        from .. import memory_limits
        from ..pipeline.driver import Pipeline
        from ..pipeline.plan import check_host_budget
        from ..recipe.lora import parse_lora_flag
        from ..runtimes.registry import get_runtime

        runtime = get_runtime(options.runtime)
        budget = memory_limits.budget(runtime, options.max_memory)
        check_host_budget(runtime, options.max_host_memory)
        return Pipeline(options.recipe, weights=options.weights, sets=[*options.sets, *sets], budget_bytes=budget,
                        compile=options.compile, set_sources=dict(sources or {}),
                        allow_nonfinite=options.allow_nonfinite, runtime=runtime,
                        host_budget_bytes=options.max_host_memory, compute_dtype=options.compute_dtype,
                        loras=[parse_lora_flag(text) for text in options.loras])


class EmbeddingBackend(_PipelineBackend):
    kind = "embeddings"

    def __init__(self, options: ModelOptions):
        from ..pipeline.generate import _declared_outputs

        if options.context is not None:
            raise InputError("--context applies to language models; an encoder pipeline takes none")
        self.pipe = self._pipeline(options)
        self.name = self.pipe.doc.name
        declared = _declared_outputs(self.pipe)
        self.output = next(iter(declared.values()))
        self.max_length = int(self.pipe.params.get("max_length", 0)) or None

    def prepare(self) -> None:
        self.pipe.check_loras()
        self.pipe.prepare()

    def run(self, text: str) -> tuple[list[float], int]:
        """The embedding of ``text`` (as `run --prompt text --json` gives it) and the tokens it used."""
        from ..pipeline.generate import convert
        from ..text.check import check_text

        if not text:
            raise InputError("`input`: an empty string has no embedding; pass some text")
        check_text(text, "`input`", InputError)
        self.pipe.check_runs([{"prompt": text}], ["`input`"])
        report = self.pipe.run({"prompt": text}, keep_loaded=True)
        _, value = convert(self.output, self.pipe.output_value(self.output.name, report.values))
        mask = report.values.get("attention_mask")
        tokens = int(np.asarray(mask).sum()) if mask is not None else 0
        return np.asarray(value, dtype=np.float32).reshape(-1).tolist(), tokens


# ---- images -------------------------------------------------------------------------------------------------------
@dataclass
class ImageRequest:
    prompt: str
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    steps: int | None = None
    guidance: float | None = None
    images: Sequence[bytes] = ()  # reference images (edits), as uploaded


class ImageBackend:
    """A FLUX.2 pipeline, run through ``pipeline.generate.PipelineSession``: the one path `luminal-recipe run` and
    the Python API (``api.Pipeline``) take, so a request gives run's pixels and run's PNG text chunks (the
    plug-ins' settings and ``provenance.py``'s), except ``command``, which records the request served (``served``).
    The session is kept between requests and rebuilt only when what its plans depend on changes (``width``,
    ``height``: ``driver.plan_params``) or the reference images do, as ``api.Pipeline`` does; seed, steps and
    guidance are given per run (``PipelineSession.run(params=...)``), so they build, compile and load nothing."""

    kind = "images"

    def __init__(self, options: ModelOptions):
        from ..pipeline.driver import plan_params
        from ..recipe.loader import load_recipe

        if options.context is not None:
            raise InputError("--context applies to language models; an image pipeline takes none")
        self.options = options
        self.doc = load_recipe(options.recipe).doc
        self.name = self.doc.name
        self.takes_images = "images" in self.doc.inputs
        self._plan_names = plan_params(self.doc) & set(self.doc.params)
        self._serve = serve_command(options)
        self._session = None
        self._key: tuple | None = None
        self._lock = threading.Lock()
        self._session_for({}, [], "")  # every flag checked at start-up, before any request
        self.params = dict(self._session.pipe.params)

    def _session_for(self, plan_values: Mapping[str, Any], images: Sequence[bytes], prompt: str):
        """The kept session when its plans hold for ``plan_values`` and ``images``, else a new one (the kept one
        released first). Uploaded images are given as their bytes: read as `run --image` reads a file, hashed as
        its file is (``provenance.image_hash``), recorded as ``image[k]``."""
        import hashlib

        from ..pipeline.generate import GenerateRequest, PipelineSession
        from ..recipe.lora import parse_lora_flag

        key = (tuple(sorted(plan_values.items())), tuple(hashlib.sha256(data).hexdigest() for data in images))
        if self._session is not None and self._key == key:
            return self._session
        if self._session is not None:
            self._session.release()
        self._session = self._key = None
        o = self.options
        # the prompt only tells the session's input checks that one is given; each request's is read and checked
        # by ``read_prompts``
        req = GenerateRequest(o.recipe, [prompt], params=dict(plan_values), files={"images": list(images) or None},
                              weights=o.weights, sets=list(o.sets), max_memory=o.max_memory, compile=o.compile,
                              allow_nonfinite=o.allow_nonfinite, runtime=o.runtime,
                              max_host_memory=o.max_host_memory, compute_dtype=o.compute_dtype,
                              loras=[parse_lora_flag(text) for text in o.loras], command=self._serve)
        session = PipelineSession(req)
        session.prepare()
        self._session, self._key = session, key
        return session

    def prepare(self) -> None:
        self._session.prepare()

    def run(self, req: ImageRequest) -> bytes:
        """The PNG `luminal-recipe run --prompt ... [--width/--height/--steps/--guidance/--seed]` writes for the
        same settings, as bytes; its ``command`` chunk names the server and the request."""
        given = {"width": req.width, "height": req.height, "steps": req.steps, "guidance": req.guidance}
        given = {name: value for name, value in given.items() if value is not None}
        for name in [*given, *(["seed"] if req.seed is not None else [])]:
            if name not in self.doc.params:
                raise InputError(f"pipeline '{self.name}' has no parameter '{name}'")
        if req.images and not self.takes_images:
            raise InputError(f"pipeline '{self.name}' takes no reference images; use /v1/images/generations")
        plan_values = {k: v for k, v in given.items() if k in self._plan_names}
        run_values = {k: v for k, v in given.items() if k not in self._plan_names}
        with self._lock:
            session = self._session_for(plan_values, list(req.images), req.prompt)
            (prompt,) = session.read_prompts([req.prompt])
            result = session.run(prompt, req.seed, keep_loaded=True, params=run_values)
        kind, value = next(iter(result.values.values()))
        if kind != "image":
            raise PipelineError(f"pipeline '{self.name}': its output is {kind}, not an image")
        text = dict(result.text)
        text["command"] = f"{self._serve} | {request_text(req, result)}"
        return png_bytes(value, text)

    def close(self) -> None:
        with self._lock:
            if self._session is not None:
                self._session.release()


def serve_command(options: ModelOptions) -> str:
    """`luminal-recipe serve` as started, with the options that shape the model (those it shares with `run`)."""
    import shlex

    words = ["luminal-recipe", "serve", str(options.recipe)]
    for flag, value in (("--weights", options.weights), ("--runtime", None if options.runtime == "numpy"
                                                          else options.runtime),
                        ("--compute-dtype", options.compute_dtype)):
        if value is not None:
            words += [flag, str(value)]
    for flag, values in (("--set", options.sets), ("--lora", options.loras)):
        for value in values:
            words += [flag, str(value)]
    if not options.compile:
        words.append("--no-compile")
    return shlex.join(words)


def request_text(req: ImageRequest, result) -> str:
    """The request an image answered, as its fields (the route's names, the values this image was made with)."""
    import json

    fields = {"prompt": req.prompt}
    if req.width is not None:
        fields["size"] = f"{req.width}x{req.height}"
    if result.seed is not None:
        fields["seed"] = result.seed
    if req.steps is not None:
        fields["num_inference_steps"] = req.steps
    if req.guidance is not None:
        fields["guidance_scale"] = req.guidance
    if req.images:
        fields["image[]"] = len(req.images)
    route = "/v1/images/edits" if req.images else "/v1/images/generations"
    return f"POST {route} {json.dumps(fields, ensure_ascii=False)}"


def png_bytes(image: np.ndarray, text: Mapping[str, str]) -> bytes:
    """The PNG `run` writes for a decoded image (``image_io.save_image``), in memory."""
    from ..image_io import encode_png, to_uint8

    buffer = io.BytesIO()
    encode_png(buffer, to_uint8(image), text)
    return buffer.getvalue()


def load_backend(options: ModelOptions):
    """The backend for ``options.recipe``'s kind, loaded (not yet compiled: call ``prepare``)."""
    kind = recipe_kind(options.recipe)
    return {"text": TextBackend, "embeddings": EmbeddingBackend, "images": ImageBackend}[kind](options)
