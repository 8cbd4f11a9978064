"""A language-model recipe, compiled and loaded for text generation: prefill, decode, sampling, streaming text.

One graph serves both phases (recipes/README.md, "Language models"): the **prefill** program runs the prompt at
once (seq = ctx = n, a symbolic length: one executable per power-of-two bucket of prompt lengths, re-bound to the
exact length), the **decode** program one token at a time (seq = 1). Both are loaded with the same KV cache:
the decode executable owns the states (``cache`` rows, allocated once for the context a run needs) and the
prefill executable shares them (``states_from``), so the prompt's keys and values are where decoding reads them,
never copied. Decoding attends to a power-of-two bucket of the cache (``ctx``; the rows past the filled prefix
are masked by the recipe's causal mask), so the executable is re-bound only when the reply crosses a bucket,
never per token, and each step's work grows with the filled length, not the allocated one.

Memory is planned before the weights are loaded: weights + the KV cache for the context + both programs'
arenas must fit the budget (``--max-memory``; default the runtime's device memory), else ``BudgetError``. (The
weights and the KV cache are checked before compiling; the compiler's search only times candidates that fit the
budget on their own, on the memory-mapped weights.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ... import memory_limits
from ...errors import BudgetError, InputError, NonFiniteError
from ...graph.symbolic import evaluate
from ...nonfinite import nonfinite_counts
from ...recipe.builder import BuiltModel, build
from ...recipe.instances import eval_field
from ...recipe.loader import load_recipe
from ...runtimes.memory import format_bytes
from ...runtimes.program import Program
from ...runtimes.registry import get_runtime
from ...text.check import check_text
from ...text.tokenizer import TextTokenizer, eos_token_ids
from . import contract
from .detokenize import IncrementalDetokenizer, StopStrings
from .length import warn_beyond_context
from .sampling import Sampler, SamplingSettings

HUB_PATTERNS = ("*.json", "*.safetensors", "*.jinja")  # weights, configs, tokenizer.json and chat templates
MIN_BUCKET = 64  # the smallest prompt-length, cache and attended-prefix bucket
COMPILE_PREFILL = 128  # dims the two programs are compiled at (the plan cache serves every later run)
COMPILE_DECODE = 256


def bucket(n: int, limit: int) -> int:
    """The power of two >= n (at least MIN_BUCKET), capped at ``limit``."""
    return min(limit, max(MIN_BUCKET, 1 << max(0, n - 1).bit_length()))


@dataclass
class Generation:
    """One reply: its ids (the EOS token included when it ended the reply), text and timings."""

    prompt_ids: list[int]
    ids: list[int]
    text: str
    finish_reason: str  # "eos" (an EOS token), "stop" (a --stop string) or "length" (max tokens or the context)
    prefill_s: float
    first_token_s: float  # prompt in -> first token chosen (prefill + sampling)
    decode_s: float  # the decode steps (after the first token)
    peak_memory_bytes: int | None = None
    seed: int | None = None  # the sampling seed (set by the Python API, which may draw it)

    @property
    def decode_steps(self) -> int:
        return max(0, len(self.ids) - 1)

    @property
    def time_per_output_token_ms(self) -> float | None:
        return 1000 * self.decode_s / self.decode_steps if self.decode_steps else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode_steps / self.decode_s if self.decode_steps and self.decode_s > 0 else None

    def summary(self) -> dict:
        def r(x, n=3):
            return None if x is None else round(x, n)

        return {"prompt_token_ids": self.prompt_ids, "generated_token_ids": self.ids, "text": self.text,
                "finish_reason": self.finish_reason, "prompt_tokens": len(self.prompt_ids),
                "generated_tokens": len(self.ids), "time_to_first_token_ms": r(1000 * self.first_token_s),
                "prefill_ms": r(1000 * self.prefill_s), "time_per_output_token_ms": r(self.time_per_output_token_ms),
                "decode_tokens_per_s": r(self.decode_tokens_per_s, 2), "peak_memory_bytes": self.peak_memory_bytes}


@dataclass
class LoadStats:
    build_s: float = 0.0
    compile_s: float = 0.0  # compiling (or loading plans from the cache) and memory planning
    load_s: float = 0.0  # binding weights, allocating arenas and the KV cache
    rebinds: int = 0
    plans: dict = field(default_factory=dict)  # role -> memory figures


TEXT_FLOOR = 1 << 20  # prompt text up to this many characters always reaches the tokenizer


class _Session:
    """The executables of one KV-cache length: decode (owns the states) and the current prefill bucket."""

    def __init__(self, cache: int, decode, prefill, prefill_len: int):
        self.cache, self.decode, self.prefill, self.prefill_len = cache, decode, prefill, prefill_len


@dataclass
class Request:
    """A reply's checked request (``LanguageModel.request``): prompt ids, sampling, the reply's token budget."""

    ids: list[int]
    settings: SamplingSettings
    max_tokens: int
    stop: Sequence[str]


class LanguageModel:
    """A language-model recipe with its checkpoint: ``generate`` replies, ``logits`` scores a sequence.

    ``recipe``: a model recipe with a `generation:` section; ``weights``: its checkpoint folder (or
    ``hf://org/repo``; default the recipe's ``weights.source``), which must hold the tokenizer; ``sets``: parameter
    overrides; ``runtime``: a runtime name or object (default numpy); ``max_memory``: the budget in bytes (default
    the runtime's device memory); ``compile=False`` runs the naive primitive program; ``context``: the longest
    prompt + reply to plan the KV cache for (default: what each call needs, at most the model's context);
    ``chat_template``: replaces the checkpoint's template (a Jinja text, or the name of one of its templates);
    ``allow_nonfinite=True`` generates even when the logits hold NaN or infinity (by default the prefill's and
    every decode step's logits are checked, and ``NonFiniteError`` names the step and the likely cause).
    """

    def __init__(self, recipe: str | Path, weights: str | Path | None = None, sets: Iterable[str] | Mapping = (),
                 runtime: Any = None, max_memory: int | None = None, compile: bool = True,
                 context: int | None = None, chat_template: str | None = None, allow_nonfinite: bool = False):
        t0 = time.perf_counter()
        for flag, value in (("compile", compile), ("allow_nonfinite", allow_nonfinite)):
            if not isinstance(value, (bool, np.bool_)):  # a string such as "no" would count as true
                raise InputError(f"{flag}={_shown(value)}: expected True or False")
        self.runtime = get_runtime(runtime)
        # first: a budget the process's limits cannot give is refused before a library that aborts on a failed
        # allocation (the tokenizer, safetensors) runs
        if isinstance(max_memory, str):  # "24GiB", as --max-memory takes it
            from ...pipeline.generate import parse_size

            max_memory = parse_size(max_memory, "max_memory")
        elif isinstance(max_memory, np.integer):
            max_memory = int(max_memory)
        if max_memory is not None and (isinstance(max_memory, bool) or not isinstance(max_memory, int)
                                       or max_memory <= 0):
            raise InputError(f"max_memory {_shown(max_memory)}: expected a positive number of bytes or a size "
                             f"such as '24GiB'")
        self.budget = memory_limits.budget(self.runtime, max_memory)
        loaded = load_recipe(recipe)
        contract.check_static(loaded)
        # a hub checkpoint is fetched with the tokenizer and its template too; the recipe's own stays the recipe's
        # (its files fenced inside the repository's cache folder), --weights the user's
        sets = sets if isinstance(sets, Mapping) else list(sets)
        self.model: BuiltModel = build(recipe, weights=weights, sets=sets, patterns=HUB_PATTERNS)
        self.source = (recipe, weights, sets)  # what it was built from (a BatchedDecoder builds the same again)
        contract.check_built(self.model)
        self.name = self.model.name
        spec = loaded.doc.generation
        value = eval_field(spec.context, loaded.origin("generation", "context"), self.model.params.values,
                           "generation.context")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise loaded.origin("generation", "context").error(
                f"generation.context is {value!r}; it must be a positive whole number (the model's longest sequence)")
        self.max_context = value
        self._longest_token: int | None = None  # the vocabulary's longest token in characters (computed once)
        if context is not None:
            if isinstance(context, bool) or not isinstance(context, int) or context < 2:
                raise InputError(f"--context {context}: must be a whole number >= 2")
            if context > self.max_context:
                raise InputError(f"--context {context} is longer than the model's context of {self.max_context} "
                                 f"tokens ({loaded.source.display} generation.context)")
        self.context = context
        self.checkpoint = Path(self.model.checkpoint_root)
        self.tokenizer = TextTokenizer.from_checkpoint(self.checkpoint, chat_template)
        self.eos_ids = eos_token_ids(self.checkpoint)
        self.compile = compile
        self.allow_nonfinite = bool(allow_nonfinite)
        self.stats = LoadStats(build_s=time.perf_counter() - t0)
        self._programs: dict[str, Program] = {}
        self._session: _Session | None = None
        self._vocab = int(self.model.graph.tensor("logits").shape[2])
        self._states = [n for n in self.model.graph.inputs("state")]

    # ---- planning and loading ------------------------------------------------------------------------------
    def _dims(self, seq: int, ctx: int, cache: int, keep: int = 1) -> dict[str, int]:
        dims = {"batch": 1, "seq": seq, "ctx": ctx, "cache": cache, "keep": keep}
        return {k: v for k, v in dims.items() if k in self.model.recipe.doc.dims}

    def _state_bytes(self, cache: int) -> int:
        dims = self._dims(1, cache, cache)
        return sum(n.dtype.nbytes(math.prod(int(evaluate(d, dims)) for d in n.shape)) for n in self._states)

    def _weight_bytes(self) -> int:
        return sum(b.nbytes for b in self.model.weights.values())

    def _program(self, role: str) -> Program:
        if role not in self._programs:
            t0 = time.perf_counter()
            if not self.compile:
                program = Program.from_graph(self.model.graph)
            else:
                from ...compiler.search import compile_graph

                n = min(COMPILE_PREFILL if role == "prefill" else COMPILE_DECODE, self.max_context)
                dims = self._dims(n if role == "prefill" else 1, n, n)
                # under the budget: a candidate the search times (running it on the memory-mapped weights) fits
                program = compile_graph(self.model.graph, self.runtime, dims, budget_bytes=self.budget,
                                        weights=self.model.load_weight).program
            self._programs[role] = program
            self.stats.compile_s += time.perf_counter() - t0
        return self._programs[role]

    def plan(self, cache: int, prompt_len: int) -> dict:
        """Memory figures of a session with a KV cache of ``cache`` rows and a prompt bucket of ``prompt_len``;
        raises BudgetError when they exceed the budget. Nothing is loaded."""
        weights, states = self._weight_bytes(), self._state_bytes(cache)
        if weights + states > self.budget:  # before compiling (whose timing may read weights)
            raise self._too_small(weights, states, 0, cache)
        compiled = len(self._programs)
        programs = self._program("decode"), self._program("prefill")  # (their compile time is counted there)
        if self.compile and len(self._programs) > compiled:  # nothing more to compile: the search's memory back
            from ...compiler.saturate import release_egraphs

            release_egraphs()
        t0 = time.perf_counter()
        decode = self.runtime.plan(programs[0], self._dims(1, cache, cache))
        prefill = self.runtime.plan(programs[1], self._dims(prompt_len, prompt_len, cache))
        self.stats.compile_s += time.perf_counter() - t0
        activations = decode.arena_bytes + prefill.arena_bytes + decode.constant_bytes + prefill.constant_bytes
        figures = {"weight_bytes": weights, "kv_cache_bytes": states, "activation_bytes": activations,
                   "planned_peak_bytes": weights + states + activations, "budget_bytes": self.budget,
                   "cache_tokens": cache, "prompt_bucket": prompt_len, "runtime": self.runtime.name,
                   "device": self.runtime.device}
        if figures["planned_peak_bytes"] > self.budget:
            raise self._too_small(weights, states, activations, cache)
        self.stats.plans = figures
        return figures

    def _too_small(self, weights: int, states: int, activations: int, cache: int) -> BudgetError:
        need = weights + states + activations
        return BudgetError(
            f"the memory budget of {format_bytes(self.budget)} ({self.runtime.device} memory of the "
            f"{self.runtime.name} runtime) is too small for {self.name}: weights {format_bytes(weights)} + KV cache "
            f"for {cache} tokens {format_bytes(states)}"
            + (f" + activations {format_bytes(activations)}" if activations else "")
            + f" = {format_bytes(need)}. Raise --max-memory, or plan a shorter context (--max-new-tokens, "
            f"--context, a shorter prompt).")

    def _ensure(self, needed: int, prompt_len: int) -> _Session:
        """A session whose cache holds ``needed`` tokens and whose prefill executable takes ``prompt_len``."""
        limit = self.context or self.max_context
        cache = bucket(max(needed, self.context or 0), limit)
        session = self._session
        if session is not None and session.cache >= needed and session.cache >= (self.context or 0):
            cache = session.cache
        pbucket = bucket(prompt_len, cache)
        if session is None or session.cache != cache:
            self.plan(cache, pbucket)
            self.release()
            t0 = time.perf_counter()
            decode = self.runtime.load(self._program("decode"), self.model.load_weight, self._dims(1, cache, cache))
            prefill = self.runtime.load(self._program("prefill"), decode.weights,
                                        self._dims(pbucket, pbucket, cache), states_from=decode)
            # what the decoding loop's chains load (recorded at its fifth step, when every weight page has been
            # read) loaded now: each load's LLVM pages then come and go below the run's peak. Bound first at the
            # dims of the reply's first step: a KV window shorter than the cache is a strided view, and the
            # chains' copies are loaded for the layout most of a reply runs
            decode.bind(self._dims(1, bucket(prompt_len + 1, cache), cache))
            decode.warm()
            self._session = session = _Session(cache, decode, prefill, pbucket)
            self.stats.load_s += time.perf_counter() - t0
        elif prompt_len > session.prefill_len:
            self.plan(cache, pbucket)
            t0 = time.perf_counter()
            session.prefill = self.runtime.load(self._program("prefill"), session.decode.weights,
                                                self._dims(pbucket, pbucket, cache), states_from=session.decode)
            session.prefill_len = pbucket
            self.stats.load_s += time.perf_counter() - t0
        return session

    def release(self) -> None:
        """Drop the loaded executables (weights bindings, arenas, KV cache)."""
        if self._session is not None:
            for exe in (self._session.prefill, self._session.decode):
                exe.close()
            self._session = None

    def prepare(self, prompt_tokens: int = 1, max_new_tokens: int = 256) -> None:
        """Compile, plan and load for a prompt of ``prompt_tokens`` and a reply of ``max_new_tokens`` (what
        ``generate`` does on its first call); raises BudgetError before any weight is read if it cannot fit."""
        prompt_tokens, max_new_tokens = _whole(prompt_tokens), _whole(max_new_tokens)
        for name, value in (("prompt_tokens", prompt_tokens), ("max_new_tokens", max_new_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"prepare({name}={_shown(value)}): expected a whole number >= 1")
        self._ensure(min(prompt_tokens + max_new_tokens, self.max_context), prompt_tokens)

    # ---- prompts -------------------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], chat: bool | None = None, system: str | None = None,
               chat_vars: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a prompt: a list of ids is used as is; text goes through the chat template (the default
        when the checkpoint has one) or, with ``chat=False``, is encoded as ``tokenizer(prompt)``."""
        if not isinstance(prompt, str):
            ids = _token_ids(prompt)
            if not ids:
                raise InputError("the prompt is an empty list of token ids; pass at least one")
            self._check_vocab(ids, "the prompt's token ids", from_text=False)
            return ids
        if not prompt:
            raise InputError("the prompt is empty; pass some text with --prompt")
        check_text(prompt, "the prompt", InputError)
        check_text(system, "--system", InputError)
        self._check_text_length(len(prompt) + len(system or ""))
        for name, value in (chat_vars or {}).items():
            check_text(value, f"--chat-var {name}", InputError)
        if chat is None:
            chat = self.tokenizer.chat_template is not None
        ids = self.tokenizer.prompt_ids(prompt, chat, system, dict(chat_vars or {}))
        if not ids:
            raise InputError(f"the prompt {prompt!r} encodes to no tokens")
        shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
        self._check_vocab(ids, f"the prompt {shown!r}, as {self.tokenizer.folder / 'tokenizer.json'} encodes it"
                          + (" through the chat template" if chat else ""))
        return ids

    def _check_text_length(self, chars: int) -> None:
        """Text far longer than the context could hold is refused before the tokenizer sees it: encoding is
        linear but takes ~1 s and hundreds of bytes per thousand characters, and tokenizers' regex engine panics
        (a Rust panic, not a Python error) when an allocation fails. The bound: every token of the context as
        long as the vocabulary's longest, four times over (a normalizer may shorten text), and at least 1 Mi
        characters."""
        if chars <= TEXT_FLOOR:
            return
        if self._longest_token is None:
            vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
            self._longest_token = max((len(token) for token in vocab), default=1)
        limit = max(TEXT_FLOOR, 4 * self.max_context * self._longest_token)
        if chars > limit:
            raise InputError(f"the prompt is {chars:,} characters long: more than {self.name}'s context of "
                             f"{self.max_context:,} tokens could hold ({limit:,} characters at most, the longest "
                             f"token of {self.tokenizer.folder / 'tokenizer.json'} being {self._longest_token} "
                             f"characters). Shorten the prompt.")

    def _check_vocab(self, ids: Sequence[int], what: str, from_text: bool = True) -> None:
        """Every id indexes a row of the embedding (checked before any weight is read): else an error naming the
        token (id and text), where it came from, and the embedding tensor with its size."""
        bad = next(((k, i) for k, i in enumerate(ids) if not 0 <= i < self._vocab), None)
        if bad is None:
            return
        position, token = bad
        try:
            text = self.tokenizer.backend.id_to_token(token) if token >= 0 else None
        except (OverflowError, TypeError, ValueError):
            text = None
        named = f"token {token}" + (f" {text!r}" if text is not None else "")
        tables = [b for b in self.model.weights.values() if b.shape and b.shape[0] == self._vocab]
        table = next((b for b in tables if "embed" in b.name), tables[0] if tables else None)
        rows = (f"the embedding {table.name} {list(table.shape)} has {self._vocab} rows" if table is not None else
                f"the model's vocabulary has {self._vocab} tokens")
        fix = (f"The tokenizer does not match the checkpoint ({self.checkpoint}): use the tokenizer saved with these "
               f"weights, or drop the token (an added token the embedding was never resized for) from the prompt."
               if from_text else f"Pass ids in 0..{self._vocab - 1}.")
        raise InputError(f"{what}: {named} (at position {position}) is beyond {self.name}'s vocabulary: {rows} (ids "
                         f"0..{self._vocab - 1}). {fix}")

    # ---- running -------------------------------------------------------------------------------------------
    def _reset(self, session: _Session) -> None:
        for node in self._states:
            session.decode.set_state(node.name)

    def _step(self, exe, tokens: np.ndarray, positions: np.ndarray, dims: dict[str, int]) -> np.ndarray:
        before = exe.stats.rebinds
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # the logits are checked (_check_logits)
            out = exe.run({"tokens": tokens, "positions": positions}, copy_outputs=False, dims=dims)["logits"]
        self.stats.rebinds += exe.stats.rebinds - before
        return out[0, -1]

    def request(self, prompt: str | Sequence[int], max_new_tokens: int = 256, *, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int = 0,
                stop: Sequence[str] = (), chat: bool | None = None, system: str | None = None,
                chat_vars: Mapping[str, Any] | None = None, on_text: Callable[[str], None] | None = None,
                on_token: Callable[[int, str], None] | None = None, frames: int = 0) -> Request:
        """``generate``'s arguments checked (and refused, located) and its prompt encoded, before anything runs:
        the prompt ids, the sampling settings and the tokens the reply may take (``max_new_tokens`` within the
        context). ``generate`` and the batched replies of the Python API (``api.py``) both start here; ``frames``:
        the calls between the user's line and this one's caller (a context warning points at the user's line)."""
        # numpy scalars become Python numbers; anything else reaches SamplingSettings as given, which refuses it
        settings = SamplingSettings(_real(temperature), _whole(top_k), _real(top_p), _real(repetition_penalty),
                                    _whole(seed))
        max_new_tokens = _whole(max_new_tokens)
        for flag, value, fits, expected in (
                ("chat", chat, lambda v: isinstance(v, bool), "True, False or None"),
                ("system", system, lambda v: isinstance(v, str), "a string or None"),
                ("chat_vars", chat_vars, lambda v: isinstance(v, Mapping), "a mapping of names to values or None"),
                ("on_text", on_text, callable, "a callable or None"),
                ("on_token", on_token, callable, "a callable or None")):
            if value is not None and not fits(value):
                raise InputError(f"generate({flag}=...): expected {expected}, got "
                                 f"{_shown(value)} ({type(value).__name__})")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"--max-new-tokens {max_new_tokens}: must be a whole number >= 1")
        StopStrings(stop)  # a bad `stop` is refused here, before anything runs
        ids = self.encode(prompt, chat, system, chat_vars)
        n = len(ids)
        limit = self.context or self.max_context
        if n >= limit:
            raise InputError(f"the prompt is {n} tokens long; {self.name} takes at most {limit} tokens of prompt and "
                             f"reply together ({'--context' if self.context else 'its generation.context'}), which "
                             f"leaves no room for a reply. Shorten the prompt.")
        warn_beyond_context(self.name, max_new_tokens, n, limit, "--context" if self.context else "generation.context",
                            stacklevel=3 + frames)
        return Request(ids, settings, min(max_new_tokens, limit - n), stop)

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 256, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int = 0,
                 stop: Sequence[str] = (), chat: bool | None = None, system: str | None = None,
                 chat_vars: Mapping[str, Any] | None = None, on_text: Callable[[str], None] | None = None,
                 on_token: Callable[[int, str], None] | None = None) -> Generation:
        """Reply to ``prompt`` (text, or token ids). Greedy by default (``temperature=0``); stops at an EOS id
        of the checkpoint, a ``stop`` string, ``max_new_tokens`` or the context. ``on_text(piece)`` receives the
        text as it is decoded (never half a character, never part of a stop string); ``on_token(id, piece)`` each
        token with the text it released."""
        request = self.request(prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               repetition_penalty=repetition_penalty, seed=seed, stop=stop, chat=chat, system=system,
                               chat_vars=chat_vars, on_text=on_text, on_token=on_token, frames=1)
        ids, settings, budget_tokens = request.ids, request.settings, request.max_tokens
        n = len(ids)
        session = self._ensure(n + budget_tokens, n)
        self._reset(session)
        sampler = Sampler(settings)
        detok = IncrementalDetokenizer(self.tokenizer.decode)
        stops = StopStrings(stop)
        seen = list(ids)
        out_ids: list[int] = []
        pieces: list[str] = []
        eos = set(self.eos_ids)

        def emit(token: int | None, text: str) -> None:
            if text:
                pieces.append(text)
                if on_text is not None:
                    on_text(text)
            if on_token is not None and token is not None:
                on_token(token, text)

        t0 = time.perf_counter()
        logits = self._step(session.prefill, np.asarray([ids], np.int32), np.arange(n, dtype=np.int32),
                            self._dims(n, n, session.cache))
        self._check_logits(logits, f"the prefill of the {n}-token prompt")
        prefill_s = time.perf_counter() - t0
        finish, first_s, t1 = "length", 0.0, 0.0
        position = n
        while True:
            token = sampler(logits, np.asarray(seen))
            if not out_ids:
                t1 = time.perf_counter()
                first_s = t1 - t0
            out_ids.append(token)
            seen.append(token)
            if token in eos:
                finish = "eos"
                emit(token, "")
                break
            text, stopped = stops.feed(detok.push(token))
            emit(token, text)
            if stopped:
                finish = "stop"
                break
            if len(out_ids) >= budget_tokens:
                break
            ctx = bucket(position + 1, session.cache)
            logits = self._step(session.decode, np.asarray([[token]], np.int32),
                                np.asarray([position], np.int32), self._dims(1, ctx, session.cache))
            self._check_logits(logits, f"decode step {len(out_ids)} (position {position}, after token {token})")
            position += 1
        decode_s = time.perf_counter() - t1 if out_ids else 0.0
        if finish != "stop":
            tail, stopped = stops.feed(detok.flush())
            tail += "" if stopped else stops.flush()
            finish = "stop" if stopped else finish
            emit(None, tail)
        from ...pipeline import peak_rss

        return Generation(ids, out_ids, "".join(pieces), finish, prefill_s, first_s, decode_s, peak_rss.peak())

    def logits(self, prompt: str | Sequence[int], chat: bool = False) -> np.ndarray:
        """Next-token logits at every position of ``prompt`` ([n, vocab], float32): transformers'
        ``model(ids).logits[0]``. Text is encoded as ``tokenizer(prompt)`` unless ``chat=True``."""
        ids = self.encode(prompt, chat)
        n = len(ids)
        if n > self.max_context:
            raise InputError(f"the sequence is {n} tokens long, more than the model's context of {self.max_context}")
        dims = self._dims(n, n, n, n)
        program = self._program("prefill")
        plan = self.runtime.plan(program, dims)
        if plan.peak > self.budget:
            raise BudgetError(f"scoring {n} tokens needs {format_bytes(plan.peak)} (weights, KV cache and "
                              f"activations), more than the memory budget of {format_bytes(self.budget)}")
        exe = self.runtime.load(program, self.model.load_weight, dims)
        try:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # checked below
                out = exe.run({"tokens": np.asarray([ids], np.int32), "positions": np.arange(n, dtype=np.int32)})
        finally:
            exe.close()
        self._check_logits(out["logits"][0], f"scoring the {n}-token sequence")
        return out["logits"][0]

    # ---- non-finite logits ---------------------------------------------------------------------------------
    def _check_logits(self, logits: np.ndarray, where: str) -> None:
        """Stop when ``logits`` (a step's row, or a scored sequence) hold NaN or infinity, unless
        ``allow_nonfinite`` (one float64 sum of the row: a decode step pays microseconds)."""
        counts = None if self.allow_nonfinite else nonfinite_counts(logits)
        if counts is None:
            return
        nan, inf = counts
        raise NonFiniteError(
            f"{self.name} (checkpoint {self.checkpoint}): the logits of {where} hold non-finite values ({nan} NaN, "
            f"{inf} infinite of {logits.size}); the reply would be garbage, so generation stops. "
            f"{self._nonfinite_cause()} Pass --allow-nonfinite (Python: load_recipe(..., allow_nonfinite=True)) "
            f"to generate anyway.")

    def _nonfinite_cause(self, seconds: float = 10.0) -> str:
        """The likely cause, for the message: the floating-point weights holding NaN or infinity (read for at
        most ``seconds``, in slices of 4M values; this runs only once the logits are found bad)."""
        bad, checked, deadline = [], 0, time.perf_counter() + seconds
        floats = [b for b in self.model.weights.values() if b.dtype.is_float and b.load is not None]
        for binding in floats:
            if time.perf_counter() > deadline:
                break
            checked += 1
            try:
                flat = np.asarray(binding.load()).reshape(-1)
                count = 0
                for start in range(0, flat.size, 1 << 22):
                    part = flat[start:start + (1 << 22)]
                    if not np.isfinite(np.sum(part, dtype=np.float64)):
                        count += int((~np.isfinite(part.astype(np.float32))).sum())
            except (TypeError, ValueError, OSError):  # a dtype numpy cannot sum: not checked
                continue
            if count:
                bad.append(f"{binding.name} ({count} of {flat.size} values)")
        if bad:
            shown = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
            return (f"The checkpoint's weights hold NaN or infinity: {shown}; the file is corrupt or comes from a "
                    f"diverged training run (download or export it again).")
        scope = "" if checked == len(floats) else f" as far as checked ({checked} of {len(floats)} tensors)"
        return (f"Its weights are finite{scope}, so the computation overflowed (or divided by zero): check the "
                f"parameters it read from config.json (norm epsilons, RoPE theta and scaling, softcapping) and any "
                f"--set, and whether the weights are too large for the compute dtype.")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _real(value: Any) -> Any:
    """A numpy floating/integer scalar as a Python float; anything else unchanged (for the settings to judge)."""
    return float(value) if isinstance(value, (np.floating, np.integer)) else value


def _whole(value: Any) -> Any:
    """A numpy integer scalar as a Python int; anything else unchanged (for the caller's check to judge)."""
    return int(value) if isinstance(value, np.integer) else value


def _token_ids(prompt: Any) -> list[int]:
    """A prompt given as token ids: a list, tuple or 1-D integer array of whole numbers (not bools, not floats
    that happen to be whole, not bytes, which are text to decode first); else InputError naming what was given."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise InputError("the prompt is bytes; pass text as a str (decode it, e.g. prompt.decode('utf-8')) or "
                         "token ids as a list of ints")
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not (np.issubdtype(prompt.dtype, np.integer) or prompt.size == 0):
            raise InputError(f"the prompt's token ids are a {prompt.ndim}-D {prompt.dtype} array; pass a 1-D "
                             f"integer array or a list of ints")
        return [int(i) for i in prompt]
    if not isinstance(prompt, (list, tuple)):
        raise InputError(f"the prompt must be text (str) or token ids (a list of ints), got {_shown(prompt)} "
                         f"({type(prompt).__name__})")
    if prompt and all(isinstance(item, str) for item in prompt):
        texts = f"{len(prompt)} text{'s' * (len(prompt) > 1)}"
        raise InputError(f"the prompt is a list of {texts}: LanguageModel.generate replies to one "
                         f"prompt (text, or a list of token ids); for one reply each, use luminal_recipes.Pipeline."
                         f"from_recipe(recipe, weights=...).generate([...]), or call generate once per prompt")
    for position, item in enumerate(prompt):
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer)):
            raise InputError(f"the prompt's token ids: item {position} is {_shown(item)} "
                             f"({type(item).__name__}), not a whole number; pass ints")
    return [int(i) for i in prompt]

