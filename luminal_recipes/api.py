"""The Python API, as diffusers' and transformers' users expect it (docs/python-api.md)::

    from luminal_recipes import Pipeline

    pipe = Pipeline.from_recipe("recipes/flux2.yaml", weights="path/to/FLUX.2-dev", max_memory="24GiB")
    out = pipe("a red fox in the snow", num_images=2, seed=7, steps=28)
    out.images[0].save("fox.png")          # PIL images; out.save("folder/") keeps the provenance text chunks

    lm = Pipeline.from_pretrained("path/to/Llama-3.2-1B-Instruct")   # the recipe chosen from config.json
    print(lm.generate(["Name three rivers.", "And three lakes."])[1].text)

It runs the path `luminal-recipe run` runs (``pipeline.generate.PipelineSession`` for pipelines,
``tasks.generation.LanguageModel`` for language models): the same checks before any work, the same plans, the
same pixels (``image_io.to_uint8``) and the same provenance. A pipeline stays loaded between calls: a second call
with the same sizes builds, compiles and loads nothing (``instrument`` counts prove it in the tests); a call that
changes what the plans depend on (width, height, reference images) builds the pipeline again, its plans read from
the plan cache. Every error is a ``LuminalError`` naming the argument and the fix.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputError, LuminalError

PIPELINE_OPTIONS = ("weights", "max_memory", "runtime", "compute_dtype", "loras", "sets", "compile",
                    "allow_nonfinite", "max_host_memory", "progress")
LANGUAGE_MODEL_OPTIONS = ("sets", "runtime", "max_memory", "compile", "context", "chat_template", "allow_nonfinite")


@dataclass
class PipelineOutput:
    """What one call of a pipeline made: per output image a ``PIL.Image`` (``images``; its ``info`` holds the text
    chunks a PNG of it records: prompt, seed, weights, ``parameters``...), the seed of each (``seeds``), every
    declared output by name (``outputs``: one dict per image, images as PIL, arrays as numpy, text as str),
    and timings in seconds."""

    images: list = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)
    prompts: list[str | None] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, Any] = field(default_factory=dict)

    def save(self, folder: str | Path, stem: str = "image") -> list[Path]:
        """Write every image as ``folder/<stem>-<k>.png`` with its text chunks (``image_io.write_png``: atomic,
        never over an existing file); the paths."""
        from .image_io import write_png

        folder = Path(folder)
        return [write_png(folder / f"{stem}-{k}.png", np.asarray(image), _text_of(image), overwrite=False)
                for k, image in enumerate(self.images)]


def _text_of(image) -> dict[str, str]:
    return {k: v for k, v in image.info.items() if isinstance(k, str) and isinstance(v, str)}


def _size(value: Any, name: str) -> int | None:
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        from .pipeline.generate import parse_size

        return parse_size(value, name)
    raise InputError(f"{name}={value!r}: expected a number of bytes or a size such as '24GiB'")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _call_text(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """A Python call as the outputs record it (the API's counterpart of the command line)."""
    parts = [_shown(a) for a in args] + [f"{k}={_shown(v)}" for k, v in kwargs.items() if v is not None]
    return f"{name}({', '.join(parts)})"


class Pipeline:
    """A pipeline recipe (``kind: pipeline``: FLUX.2, MiniLM...) ready to run from Python; made by
    ``Pipeline.from_recipe`` or ``Pipeline.from_pretrained``, which return a ``LanguageModelPipeline`` for a
    language-model recipe."""

    @classmethod
    def from_recipe(cls, recipe: str | Path, weights: str | Path | None = None, *, max_memory: int | str | None = None,
                    runtime: str = "numpy", compute_dtype: str | None = None,
                    loras: Sequence[str | Path | tuple[str | Path, float]] = (), sets: Sequence[str] = (),
                    compile: bool = True, allow_nonfinite: bool = False, max_host_memory: int | str | None = None,
                    progress: Callable[[str, int, int], None] | None = None, **options) -> Any:
        """``recipe`` with ``weights`` (a folder, ``hf://org/repo[@rev]``; default the recipe's own). A language
        model recipe gives a ``LanguageModelPipeline`` (``options``: ``context``, ``chat_template``); ``loras``:
        paths or ``(path, scale)`` pairs or ``"path:scale"``; ``max_memory``: bytes or ``"24GiB"``."""
        from .recipe.loader import load_recipe
        from .recipe.schema import ModelRecipe

        path = Path(recipe)
        doc = load_recipe(path).doc
        if isinstance(doc, ModelRecipe):
            return LanguageModelPipeline._make(path, weights, max_memory=max_memory, runtime=runtime,
                                               compute_dtype=compute_dtype, loras=loras, sets=sets, compile=compile,
                                               allow_nonfinite=allow_nonfinite, max_host_memory=max_host_memory,
                                               options=options)
        if options:
            from .recipe.suggest import did_you_mean

            name = next(iter(options))
            raise InputError(f"Pipeline.from_recipe(..., {name}=...): unknown option for pipeline '{doc.name}' "
                             f"({path}){did_you_mean(name, PIPELINE_OPTIONS)}; the options are "
                             f"{', '.join(PIPELINE_OPTIONS)}")
        return cls(path, weights, max_memory=_size(max_memory, "max_memory"), runtime=runtime,
                   compute_dtype=compute_dtype, loras=loras, sets=sets, compile=compile,
                   allow_nonfinite=allow_nonfinite, max_host_memory=_size(max_host_memory, "max_host_memory"),
                   progress=progress)

    @classmethod
    def from_pretrained(cls, weights: str | Path, **options) -> Any:
        """The shipped recipe that accepts ``weights`` (``recipe/choose.py``: model_index.json, config.json or a
        GGUF file's architecture), made by ``from_recipe``."""
        from .recipe.choose import choose_recipe

        return cls.from_recipe(choose_recipe(weights), weights=str(weights), **options)

    def __init__(self, recipe: Path, weights, *, max_memory, runtime, compute_dtype, loras, sets, compile,
                 allow_nonfinite, max_host_memory, progress):
        from .pipeline.driver import plan_params
        from .recipe.loader import load_recipe
        from .recipe.lora import parse_lora_flag

        self.recipe = recipe
        self.doc = load_recipe(recipe).doc
        self.weights = None if weights is None else str(weights)
        self._plan_names = plan_params(self.doc) & set(self.doc.params)
        pairs = []
        for item in loras:
            if isinstance(item, tuple) and len(item) == 2:
                pairs.append((Path(item[0]), float(item[1])))
            elif isinstance(item, str | Path):
                pairs.append(parse_lora_flag(str(item)))
            else:
                raise InputError(f"loras: {_shown(item)} is not a path, 'path:scale' or (path, scale)")
        self._base = dict(weights=self.weights, sets=list(sets), max_memory=max_memory, compile=compile,
                          allow_nonfinite=allow_nonfinite, runtime=runtime, max_host_memory=max_host_memory,
                          compute_dtype=compute_dtype, loras=pairs)
        self._progress = progress
        self._session = None
        self._session_key: tuple | None = None
        self._made = _call_text("Pipeline.from_recipe", [str(recipe)],
                                {"weights": self.weights, "runtime": runtime, "compute_dtype": compute_dtype,
                                 "loras": [f"{p}:{s:g}" for p, s in pairs] or None})

    @property
    def params(self) -> dict[str, Any]:
        """The pipeline's parameters and their defaults (what ``__call__`` and ``params=`` may set)."""
        return {name: spec.default for name, spec in self.doc.params.items()}

    def _session_for(self, plan_values: dict[str, Any], images: list | None, prompts: list[str], seed: int | None):
        """The session whose plans hold for ``plan_values`` and ``images`` (kept from the last call when they are
        the same), else a new one (the last released first)."""
        from .pipeline.generate import GenerateRequest, PipelineSession

        key = (tuple(sorted(plan_values.items())), None if not images else id(images))
        if self._session is not None and self._session_key == key and not images:
            return self._session
        self.release()
        self._session = None
        params = dict(plan_values)
        if seed is not None:
            params["seed"] = seed
        req = GenerateRequest(self.recipe, list(prompts), params=params,
                              files={"images": list(images) if images else None}, command=self._made,
                              **self._base)
        self._session = PipelineSession(req, self._progress)
        self._session_key = key
        return self._session

    def __call__(self, prompt: str | Sequence[str] | None = None, *, num_images: int | None = None,
                 seed: int | str | Sequence[int] | None = None, steps: int | None = None,
                 guidance: float | None = None, width: int | None = None, height: int | None = None,
                 image: Any = None, callback: Callable[[int, int, Any], None] | None = None,
                 params: Mapping[str, Any] | None = None) -> PipelineOutput:
        """Run the pipeline: for each prompt, ``num_images`` runs with the seeds ``seed, seed + 1, ...`` (a list:
        one run per seed; None: drawn at random, or ``$LUMINAL_RECIPES_SEED``). ``image``: reference images
        (PIL images or paths, one or a list); ``callback(step, total, latents)`` after every denoising step;
        ``params``: any other pipeline parameter by name."""
        from .pipeline.seeds import batch_seeds

        t0 = time.perf_counter()
        if prompt is None:
            prompts: list[str] = []
        elif isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list | tuple) and all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        else:
            raise InputError(f"prompt={_shown(prompt)}: expected a str or a list of str")
        if callback is not None and not callable(callback):
            raise InputError(f"callback={_shown(callback)}: expected a function (step, total, latents)")
        if params is not None and not isinstance(params, Mapping):
            raise InputError(f"params={_shown(params)}: expected a mapping of parameter names to values")
        given = {"steps": steps, "guidance": guidance, "width": width, "height": height, **(params or {})}
        given = {k: v for k, v in given.items() if v is not None}
        if "seed" in given:
            raise InputError("params={'seed': ...}: pass seed=... (an int, a list, 'random' or None)")
        for name in given:
            if name not in self.doc.params:
                from .recipe.suggest import did_you_mean, one_of

                raise InputError(f"{name}={_shown(given[name])}: pipeline '{self.doc.name}' ({self.recipe}) has no "
                                 f"parameter '{name}'{did_you_mean(name, self.doc.params)}; its parameters: "
                                 f"{one_of(self.doc.params)}")
        if "seed" in self.doc.params:
            seeds: list[int | None] = list(batch_seeds(seed, num_images, flag="seed", count_flag="num_images"))
        elif seed is not None or (num_images or 1) != 1:
            raise InputError(f"seed/num_images: pipeline '{self.doc.name}' has no seed parameter, so its runs would "
                             f"all be the same")
        else:
            seeds = [None]
        images = _images(image)
        plan_values = {k: v for k, v in given.items() if k in self._plan_names}
        run_values = {k: v for k, v in given.items() if k not in self._plan_names}
        session = self._session_for(plan_values, images, prompts, seeds[0])
        read = session.read_prompts(prompts)
        first = session.pipe.plans is None
        session.prepare()
        compile_s = session.compile_seconds if first else 0.0
        if callback is not None:
            session.pipe.on_loop_step = lambda stage, k, total, value: callback(k, total, value)
        out = PipelineOutput(timings={"compile_s": round(compile_s, 3), "runs_s": []})
        try:
            for text in read:
                for s in seeds:
                    result = session.run(text, s, keep_loaded=True, params=run_values)
                    out.timings["runs_s"].append(round(result.seconds, 3))
                    converted = {name: _convert(kind, value, result.text) for name, (kind, value) in
                                 result.values.items()}
                    out.outputs.append(converted)
                    out.images += [converted[name] for name, (kind, _) in result.values.items() if kind == "image"]
                    out.seeds.append(result.seed)
                    out.prompts.append(text)
        finally:
            session.pipe.on_loop_step = None
        out.timings["total_s"] = round(time.perf_counter() - t0, 3)
        return out

    def embed(self, texts: str | Sequence[str]) -> np.ndarray:
        """The embedding of each text (an encoder pipeline, one array output such as recipes/minilm.yaml's):
        ``(len(texts), dim)`` float32, row k for ``texts[k]``."""
        single = isinstance(texts, str)
        items = [texts] if single else texts
        if not isinstance(items, list | tuple) or not items or not all(isinstance(t, str) for t in items):
            raise InputError(f"embed({_shown(texts)}): expected a str or a non-empty list of str")
        arrays = [name for name, spec in self.doc.outputs.items() if spec.type == "array"]
        if len(self.doc.outputs) != 1 or len(arrays) != 1:
            raise InputError(f"embed(): pipeline '{self.doc.name}' ({self.recipe}) does not return one array "
                             f"(its outputs: {', '.join(f'{k} ({v.type})' for k, v in self.doc.outputs.items())}); "
                             f"call it instead")
        out = self(list(items))
        rows = [np.asarray(o[arrays[0]]) for o in out.outputs]
        rows = [r[0] if r.ndim > 1 and r.shape[0] == 1 else r for r in rows]
        return np.stack(rows).astype(np.float32, copy=False)

    def release(self) -> None:
        """Drop the loaded models (weights, arenas); the next call loads them again."""
        if self._session is not None:
            self._session.release()

    close = release

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<luminal_recipes.Pipeline {self.doc.name} ({self.recipe})>"


def _images(image: Any) -> list | None:
    """``image=``: one or a list of PIL images (read as ``diffusers.utils.load_image`` reads one: EXIF orientation
    applied, RGB) or paths; None for none."""
    if image is None:
        return None
    items = list(image) if isinstance(image, list | tuple) else [image]
    out = []
    for k, item in enumerate(items):
        if isinstance(item, str | Path):
            out.append(Path(item))
            continue
        try:
            from PIL import Image, ImageOps
        except ImportError:  # pragma: no cover - pillow is a dependency
            raise InputError("image=: reading PIL images needs pillow") from None
        if not isinstance(item, Image.Image):
            raise InputError(f"image[{k}]={_shown(item)}: expected a PIL image or a path")
        out.append(np.asarray(ImageOps.exif_transpose(item).convert("RGB")))
    return out or None


def _convert(kind: str, value: Any, text: Mapping[str, str]) -> Any:
    """An output as the API returns it: an image as a ``PIL.Image`` (the CLI's pixels, ``image_io.to_uint8``)
    whose ``info`` holds the text chunks; arrays and text as they are."""
    if kind != "image":
        return value
    from PIL import Image

    from .image_io import png_text, to_uint8

    picture = Image.fromarray(to_uint8(value), mode="RGB")
    picture.info.update({k: png_text(v) for k, v in text.items()})
    return picture


class _Stop(Exception):
    """Ends a streamed generation whose reader stopped reading."""


class LanguageModelPipeline:
    """A language-model recipe ready to ``generate`` from Python (``Pipeline.from_recipe``/``from_pretrained``
    on a recipe with `generation:`). ``.model`` is the ``LanguageModel`` underneath (``logits``, ``encode``)."""

    @classmethod
    def _make(cls, recipe: Path, weights, *, max_memory, runtime, compute_dtype, loras, sets, compile,
              allow_nonfinite, max_host_memory, options) -> LanguageModelPipeline:
        from .recipe.suggest import did_you_mean

        for name, value in (("compute_dtype", compute_dtype), ("loras", list(loras) or None),
                            ("max_host_memory", max_host_memory)):
            if value is not None:
                raise InputError(f"Pipeline.from_recipe({recipe}, {name}=...): not an option for a language model "
                                 f"(it belongs to pipelines)")
        for name in options:
            if name not in LANGUAGE_MODEL_OPTIONS:
                raise InputError(f"Pipeline.from_recipe(..., {name}=...): unknown option for a language model"
                                 f"{did_you_mean(name, LANGUAGE_MODEL_OPTIONS)}; the options are "
                                 f"{', '.join(LANGUAGE_MODEL_OPTIONS)}")
        from .tasks.generation import LanguageModel

        model = LanguageModel(recipe, weights=weights, sets=list(sets), runtime=runtime,
                              max_memory=_size(max_memory, "max_memory"), compile=compile,
                              allow_nonfinite=allow_nonfinite, **options)
        return cls(model)

    def __init__(self, model) -> None:
        self.model = model
        self.recipe = model.model.recipe.path if hasattr(model.model, "recipe") else None
        self._batch = None  # the batched decoder's Slots, made by the first list of prompts (_slots)
        self.batch_refused: str | None = None  # why lists of prompts run in turn, once found

    def generate(self, prompt: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
                 max_new_tokens: int = 256, *, stream: bool = False, seed: int | str | None = None,
                 **options) -> Any:
        """Reply to ``prompt``: a str (or token ids) gives one ``Generation``; a list of str (or of id lists)
        gives a list, one each (in turn, ``_generate_batch``). ``stream=True`` (one prompt) yields the text
        pieces as they are decoded. ``seed``: of the sampling (with ``temperature`` > 0): an int, ``'random'``,
        or None (drawn, or ``$LUMINAL_RECIPES_SEED``); ``result.seed`` says which. ``options``: those of
        ``LanguageModel.generate`` (temperature, top_k, top_p, repetition_penalty, stop, chat, system,
        chat_vars)."""
        from .pipeline.seeds import parse_seed

        for name in ("on_text", "on_token"):
            if name in options:
                raise InputError(f"generate({name}=...): pass stream=True to read the text as it is decoded")
        if "seed" in options:  # pragma: no cover - a keyword above
            raise InputError("generate(seed=...) is given twice")
        value = parse_seed(seed, "seed")
        batch = _batch(prompt)
        if stream:
            if batch is not None:
                raise InputError(f"generate(stream=True) streams one prompt; got a list of {len(batch)} prompts. "
                                 f"Stream them one by one, or drop stream=True to get a reply each")
            return self._stream(prompt, max_new_tokens, value, options)
        if batch is None:
            result = self.model.generate(prompt, max_new_tokens, seed=value, **options)
            result.seed = value
            return result
        return self._generate_batch(batch, max_new_tokens, value, options)

    def _generate_batch(self, prompts: list, max_new_tokens: int, seed: int, options: dict) -> list:
        """One reply per prompt, every prompt checked (and refused, located) before the first is run; decoded
        together through the pipeline's batched decoder (``_slots``), else in turn. Either way each reply is the
        one ``generate`` gives that prompt alone (ids, text, finish reason, the same seed)."""
        requests = []
        for k, prompt in enumerate(prompts):
            try:
                requests.append(self.model.request(prompt, max_new_tokens, seed=seed, frames=2, **options))
            except LuminalError as exc:
                raise type(exc)(f"prompt {k + 1} of {len(prompts)}: {exc}") from None
        from .tasks.generation.length import ContextLengthWarning

        slots = self._slots()
        out: list = [None] * len(prompts)
        # In turn: a prompt and reply longer than a slot (slot_len tokens), and every prompt of a recipe or runtime
        # the batched program cannot serve (see _slots: no update_cache/positional causal attention, or its
        # weights and every slot's KV cache over the memory budget) - LanguageModel.generate plans each alone.
        together = [k for k, r in enumerate(requests)
                    if slots is not None and len(r.ids) + r.max_tokens <= slots.decoder.slot_len]
        if together:
            self._decode_together(slots, requests, together, out)
        for k, prompt in enumerate(prompts):
            if out[k] is None:
                try:
                    with warnings.catch_warnings():  # its context warning was given by request() above
                        warnings.simplefilter("ignore", ContextLengthWarning)
                        out[k] = self.model.generate(prompt, max_new_tokens, seed=seed, **options)
                except LuminalError as exc:
                    raise type(exc)(f"prompt {k + 1} of {len(prompts)}: {exc}") from None
            out[k].seed = seed
        return out

    def _slots(self):
        """The slot/step loop over this pipeline's ``BatchedDecoder`` (``DEFAULT_SLOTS`` sequences of
        ``--context`` or up to ``DEFAULT_SLOT_TOKENS`` tokens), built, compiled and loaded on the first list of
        prompts and kept for the next; None (remembered, with why in ``batch_refused``) where it cannot be made."""
        if self._batch is None and self.batch_refused is None:
            from .errors import BudgetError, GraphError
            from .tasks.generation.batched import DEFAULT_SLOT_TOKENS, DEFAULT_SLOTS, BatchedDecoder, Slots

            lm = self.model
            recipe, weights, sets = lm.source
            decoder = None
            try:
                decoder = BatchedDecoder(lm, recipe, weights, sets, slots=DEFAULT_SLOTS,
                                         slot_len=lm.context or min(lm.max_context, DEFAULT_SLOT_TOKENS))
                decoder.prepare(longest_prompt=64)
            except (InputError, GraphError, BudgetError) as exc:
                if decoder is not None:
                    decoder.close()
                self.batch_refused = str(exc)
                return None
            self._batch = Slots(decoder)
        return self._batch

    def _decode_together(self, slots, requests: list, keys: list[int], out: list) -> None:
        """The replies of ``requests[k]`` for ``k`` in ``keys``, into ``out[k]``: prompts admitted into free slots
        between decode steps, every running reply decoded in one step; errors name the prompt."""
        from .pipeline import peak_rss
        from .tasks.generation.batched import Reply
        from .tasks.generation.model import Generation

        lm, total = self.model, len(requests)
        replies = {k: Reply(requests[k].ids, requests[k].max_tokens, requests[k].settings, requests[k].stop,
                            set(lm.eos_ids), lm.tokenizer.decode, lambda piece: None) for k in keys}
        slot_of: dict[int, int] = {}
        ended: list = []
        waiting = list(keys)
        try:
            while waiting or slots.active:
                while waiting and slots.free:
                    k = waiting.pop(0)
                    try:
                        if slots.admit(replies[k]):
                            ended.append(replies[k])
                        else:
                            slot_of[replies[k].slot] = k
                    except LuminalError as exc:
                        raise type(exc)(f"prompt {k + 1} of {total}: {exc}") from None
                if slots.active:
                    running = {slot_of[s] for s in slots.active}
                    try:
                        ended.extend(slots.decode())
                    except LuminalError as exc:
                        if slots.failed is not None:  # its logits were refused
                            where = f"prompt {next(k for k in running if replies[k] is slots.failed) + 1} of {total}"
                        else:  # the step itself failed
                            where = f"prompts {', '.join(str(k + 1) for k in sorted(running))} of {total}"
                        raise type(exc)(f"{where}: {exc}") from None
        finally:
            for s in list(slots.active):  # an error or an interrupt: free every slot for the next call
                slots.drop(s)
        peak = peak_rss.peak()
        for k in keys:
            r = replies[k]
            first = r.first_token_at - r.started_at
            out[k] = Generation(r.ids, list(r.out), r.text, r.finish, r.prefill_s, first,
                                r.ended_at - r.first_token_at, peak)

    def _stream(self, prompt, max_new_tokens: int, seed: int, options: dict) -> Iterator[str]:
        """The text pieces of one reply, as ``generate(on_text=...)`` gives them, from a worker thread; closing
        the iterator early stops the generation at its next token."""
        pieces: queue.Queue = queue.Queue()
        stop = threading.Event()
        done = object()

        def on_text(piece: str) -> None:
            if stop.is_set():
                raise _Stop
            pieces.put(piece)

        def work() -> None:
            try:
                self.model.generate(prompt, max_new_tokens, seed=seed, on_text=on_text, **options)
                pieces.put(done)
            except _Stop:
                pieces.put(done)
            except BaseException as exc:  # handed to the reader, raised there
                pieces.put(exc)

        # errors in the arguments are raised at the call, before any thread (the generator starts lazily)
        self.model.encode(prompt, options.get("chat"), options.get("system"), options.get("chat_vars"))
        thread = threading.Thread(target=work, name="luminal-generate", daemon=True)

        def reader() -> Iterator[str]:
            thread.start()
            try:
                while True:
                    item = pieces.get()
                    if item is done:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                stop.set()
                thread.join()

        return reader()

    def embed(self, texts) -> np.ndarray:
        raise InputError(f"embed(): {self.model.name} is a language model (it generates text); embeddings come "
                         f"from an encoder pipeline such as recipes/minilm.yaml")

    def __call__(self, prompt, *args, **kwargs):
        return self.generate(prompt, *args, **kwargs)

    def release(self) -> None:
        if self._batch is not None:
            self._batch.decoder.close()
            self._batch = None
        self.model.release()

    close = release

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _batch(prompt: Any) -> list | None:
    """A list of prompts (str, or token-id lists), or None for one prompt (a str, or one list of ids); anything
    mixed is refused, naming the item."""
    if isinstance(prompt, str) or not isinstance(prompt, list | tuple) or not prompt:
        return None
    kinds = {"text" if isinstance(p, str) else "ids" if isinstance(p, list | tuple | np.ndarray) else "id"
             for p in prompt}
    if kinds == {"id"}:
        return None  # token ids of one prompt
    if len(kinds) > 1:
        bad = next(k for k, p in enumerate(prompt) if not isinstance(p, str))
        raise InputError(f"generate(prompt=[...]): item {bad} is {_shown(prompt[bad])}; pass one prompt (a str or a "
                         f"list of token ids) or a list of prompts (all str, or all lists of token ids)")
    return list(prompt)

