"""Several replies decoded together by one program: continuous batching for a language-model recipe.

The recipe's graph is built once more with two of its ops replaced (``build(..., ops=...)``; the recipe itself is
unchanged): the KV cache holds ``slots`` sequences interleaved - row ``position * slots + slot`` holds the keys
and values of ``slot``'s token at ``position`` - and every step runs a list of tokens, each of its own sequence:

- ``positions`` ``[seq]``: each token's position in its own sequence (RoPE and the causal mask use it, as in a
  single reply);
- ``cache_rows`` ``[seq]``: the row each token's keys and values are written to, replacing ``update_cache``'s;
- ``token_slot`` ``[seq]`` and ``key_slot``/``key_pos`` ``[ctx]`` (the slot and position of every cache row):
  ``attention`` lets a token see the rows of its own slot up to its own position (and, with a sliding window, the
  last ``window`` of them) - its own sequence, causally.

One step can so hold a new sequence's whole prompt (its prefill) or the next token of every running sequence (a
decode step); the logits of the last ``keep`` tokens come back. A step attends to the first ``ctx`` rows, a
power-of-two bucket of ``(longest position + 1) * slots``: the work grows with the running sequences' length, not
the cache's. ``BatchedDecoder`` holds the program, its executables (one per power-of-two bucket of tokens per
step, sharing the KV cache) and runs steps; ``Reply`` is one sequence's sampling and text, exactly as
``LanguageModel.generate`` makes them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ... import instrument
from ...errors import BudgetError, InputError
from ...graph import DType, Tensor, cast
from ...graph.symbolic import evaluate
from ...graph.view import View
from ...ops.attention import scaled_dot_product_attention
from ...ops.elementwise import equal, logical_and, logical_not
from ...ops.indexing import write_rows
from ...runtimes.memory import format_bytes
from .detokenize import IncrementalDetokenizer, StopStrings
from .sampling import Sampler, SamplingSettings

MIN_STEP_BUCKET = 8
DEFAULT_SLOTS = 8  # sequences decoded together (serve --max-batch, and generate([...]) of the Python API)
DEFAULT_SLOT_TOKENS = 2048  # tokens (prompt + reply) per sequence without --context


def _slot_input(graph, name: str, size):
    """The i32 input ``name`` of shape ``[size]`` (made once per graph; every layer reads the same)."""
    node = graph._inputs_by_name.get(name)
    if node is not None:
        n = graph.nodes[node]
        return Tensor(graph, node, View.contiguous(n.shape), n.dtype)
    return graph.input(name, (size,), "i32")


def update_cache_in_slots(cache, positions, x, length):
    """``update_cache`` writing each token's row at ``cache_rows`` (its slot's row for its position)."""
    from ...errors import GraphError

    graph = cache.graph
    node = graph.nodes[cache.node]
    if node.op != "Input" or node.attr("kind") != "state":
        raise GraphError("update_cache: the first argument must be a state as declared")
    rows = x.permute(2, 0, 1, 3)  # [S, B, H, D]
    if rows.dtype != cache.dtype:
        rows = cast(rows, cache.dtype)
    new = write_rows(cache, _slot_input(graph, "cache_rows", x.shape[2]), rows)
    graph.update_state(node.name, new)
    return new.slice(0, 0, length).permute(1, 2, 0, 3)


def attention_in_slots(q, k, v, mask=None, causal=False, window=None, key_mask=None, scale=None, positions=None):
    """``attention`` where a query sees the rows of its own slot up to its own row (and its window)."""
    from ...errors import GraphError

    if mask is not None or key_mask is not None or not causal or positions is None:
        raise GraphError("batched decoding replaces the causal attention over a KV cache (attention(..., "
                         "causal=True, positions=positions)); this recipe's attention takes a mask or is not "
                         "causal over positions: serve it with --max-batch 1")
    graph = q.graph
    s, t = q.shape[2], k.shape[2]
    own = equal(_slot_input(graph, "key_slot", t).expand(0, s), _slot_input(graph, "token_slot", s).expand(1, t))
    key_pos = _slot_input(graph, "key_pos", t).expand(0, s)  # [S, T]
    pos = (positions if positions.dtype == DType.I32 else cast(positions, DType.I32)).expand(1, t)
    allowed = logical_and(own, logical_not(pos < key_pos))  # its own slot, keys up to its own position
    if window is not None:
        allowed = logical_and(allowed, key_pos > (pos - window))
    return scaled_dot_product_attention(q, k, v, mask=allowed.unsqueeze(0).unsqueeze(0), scale=scale)


def step_bucket(n: int) -> int:
    return max(MIN_STEP_BUCKET, 1 << max(0, n - 1).bit_length())


class BatchedDecoder:
    """The batched program of ``lm`` (a loaded ``LanguageModel``): ``slots`` sequences of up to ``slot_len``
    tokens (prompt and reply) each; ``step`` runs tokens of any slots and returns the last ``keep`` logits."""

    def __init__(self, lm, recipe, weights, sets, slots: int, slot_len: int | None = None):
        from ...recipe.builder import build
        from ...recipe.check import default_ops
        from .model import HUB_PATTERNS

        if slots < 1:
            raise InputError(f"--max-batch {slots}: must be >= 1")
        self.lm = lm
        self.slots = slots
        self.slot_len = min(slot_len or lm.max_context, lm.context or lm.max_context)
        self.rows = slots * self.slot_len
        rows = np.arange(self.rows, dtype=np.int32)
        self._key_slot, self._key_pos = rows % np.int32(slots), rows // np.int32(slots)  # row = pos * slots + slot
        ops = {**default_ops(), "update_cache": update_cache_in_slots, "attention": attention_in_slots}
        self.model = build(recipe, weights=weights, sets=sets, ops=ops, patterns=HUB_PATTERNS)
        names = {n.name for n in self.model.graph.inputs("input")}
        if not {"cache_rows", "token_slot", "key_slot", "key_pos"} <= names:
            raise InputError(f"{self.model.name}: its recipe writes no KV cache through update_cache and attention "
                             f"over positions, so its replies cannot be decoded together; serve it with --max-batch 1")
        self.runtime = lm.runtime
        self._program = None
        self._exes: dict[int, object] = {}
        self._owner = None  # the executable holding the KV cache (the first loaded)

    def _dims(self, seq: int, keep: int, ctx: int | None = None) -> dict[str, int]:
        dims = {"batch": 1, "seq": seq, "ctx": ctx or self.rows, "cache": self.rows, "keep": keep}
        return {k: v for k, v in dims.items() if k in self.model.recipe.doc.dims}

    def state_bytes(self) -> int:
        dims = self._dims(1, 1)
        return sum(n.dtype.nbytes(math.prod(int(evaluate(d, dims)) for d in n.shape))
                   for n in self.model.graph.inputs("state"))

    def prepare(self, longest_prompt: int) -> None:
        """Compile, plan (weights + KV cache of every slot + arenas within the budget) and load."""
        from ...runtimes.program import Program

        weights = sum(b.nbytes for b in self.model.weights.values())
        states = self.state_bytes()
        if weights + states > self.lm.budget:
            raise BudgetError(f"the memory budget of {format_bytes(self.lm.budget)} is too small for {self.slots} "
                              f"sequences of {self.slot_len} tokens: weights {format_bytes(weights)} + KV cache "
                              f"{format_bytes(states)}. Lower --max-batch or --context, or raise --max-memory.")
        if self._program is None:
            if self.lm.compile:
                from ...compiler.search import compile_graph

                n = step_bucket(self.slots)
                self._program = compile_graph(self.model.graph, self.runtime, self._dims(n, n),
                                              budget_bytes=self.lm.budget, weights=self.model.load_weight).program
            else:
                self._program = Program.from_graph(self.model.graph)
        self._exe(step_bucket(self.slots))
        self._exe(step_bucket(min(longest_prompt, self.slot_len)))

    def _exe(self, bucket: int):
        exe = self._exes.get(bucket)
        if exe is None:
            dims = self._dims(bucket, bucket)
            plan = self.runtime.plan(self._program, dims)
            held = sum(e.plan.peak if hasattr(e, "plan") else 0 for e in self._exes.values())
            if plan.peak + held > self.lm.budget:
                raise BudgetError(f"a step of {bucket} tokens needs {format_bytes(plan.peak)} more than the memory "
                                  f"budget of {format_bytes(self.lm.budget)} leaves; lower --max-batch or --context")
            instrument.count(instrument.LOAD)
            if self._owner is None:
                exe = self.runtime.load(self._program, self.model.load_weight, dims)
                self._owner = exe
            else:
                exe = self.runtime.load(self._program, self._owner.weights, dims, states_from=self._owner)
            self._exes[bucket] = exe
        return exe

    def step(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int], keep: int) -> np.ndarray:
        """Run ``tokens`` (each at its ``position`` of the sequence in its ``slot``); the logits of the last
        ``keep`` tokens, ``[keep, vocab]``."""
        n = len(tokens)
        exe = self._exe(step_bucket(n))
        pos = np.asarray(positions, np.int32)
        slot = np.asarray(slots, np.int32)
        ctx = min(self.rows, max(MIN_STEP_BUCKET * self.slots,
                                 1 << max(0, (int(pos.max()) + 1) * self.slots - 1).bit_length()))
        feeds = {"tokens": np.asarray([tokens], np.int32), "positions": pos,
                 "cache_rows": pos * np.int32(self.slots) + slot, "token_slot": slot,
                 "key_slot": self._key_slot[:ctx], "key_pos": self._key_pos[:ctx]}
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            out = exe.run(feeds, copy_outputs=False, dims=self._dims(n, keep, ctx))["logits"]
        return np.array(out[0])

    def close(self) -> None:
        for exe in self._exes.values():
            exe.close()
        self._exes.clear()
        self._owner = None


@dataclass
class Reply:
    """One sequence: its prompt, sampling and text, decided token by token as ``LanguageModel.generate`` does."""

    ids: list[int]
    max_tokens: int
    settings: SamplingSettings
    stop: Sequence[str]
    eos: set[int]
    decode: Callable[[Sequence[int]], str]
    on_text: Callable[[str], None]
    slot: int = -1
    out: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish: str | None = None
    first_token_at: float | None = None
    started_at: float | None = None  # its prefill began (Slots.admit)
    prefill_s: float = 0.0
    ended_at: float | None = None

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.settings)
        self.detok = IncrementalDetokenizer(self.decode)
        self.stops = StopStrings(self.stop)
        self.seen = list(self.ids)

    @property
    def position(self) -> int:
        """The position of the last token chosen (the next step's input)."""
        return len(self.ids) + len(self.out) - 1

    def _emit(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            self.on_text(text)

    def take(self, logits: np.ndarray) -> bool:
        """Choose the next token from ``logits``; True when the reply is over."""
        token = self.sampler(logits, np.asarray(self.seen))
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.out.append(token)
        self.seen.append(token)
        if token in self.eos:
            return self._end("eos")
        text, stopped = self.stops.feed(self.detok.push(token))
        self._emit(text)
        if stopped:
            self.finish = "stop"
            return True
        if len(self.out) >= self.max_tokens:
            return self._end("length")
        return False

    def _end(self, finish: str) -> bool:
        tail, stopped = self.stops.feed(self.detok.flush())
        tail += "" if stopped else self.stops.flush()
        self.finish = "stop" if stopped else finish
        self._emit(tail)
        return True

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Slots:
    """The slot/step loop of continuous batching over a ``BatchedDecoder`` - the one both the server
    (``serving.batching.TextBatcher``) and the Python API (``LanguageModelPipeline.generate([...])``) run:
    ``admit`` runs a reply's prompt (its prefill, one step) into a free slot and chooses its first token;
    ``decode`` runs one step for every running reply and chooses their next tokens; a reply that ends frees its
    slot at once. The caller decides who waits and when to step."""

    def __init__(self, decoder: BatchedDecoder):
        self.decoder = decoder
        self.lm = decoder.lm
        self.free = list(range(decoder.slots))
        self.active: dict[int, Reply] = {}  # slot -> its running reply

    def admit(self, reply: Reply) -> bool:
        """Prefill ``reply`` into a free slot and take its first token; True when it is already over (its slot
        freed). An error frees the slot and is raised."""
        slot = reply.slot = self.free.pop(0)
        n = len(reply.ids)
        try:
            t0 = reply.started_at = time.perf_counter()
            logits = self.decoder.step(reply.ids, list(range(n)), [slot] * n, 1)[-1]
            self.lm._check_logits(logits, f"the prefill of the {n}-token prompt")
            reply.prefill_s = time.perf_counter() - t0
            done = reply.take(logits)
        except BaseException:
            self.free.append(slot)
            raise
        if done:
            reply.ended_at = time.perf_counter()
            self.free.append(slot)
        else:
            self.active[slot] = reply
        return done

    def drop(self, slot: int) -> Reply:
        """End the reply in ``slot`` where it is (its request was cancelled) and free the slot."""
        self.free.append(slot)
        return self.active.pop(slot)

    def decode(self) -> list[Reply]:
        """One step of every running reply: each takes its next token; the replies that ended (slots freed). An
        error ends every running reply (their slots freed) and is raised, with ``failed`` the reply whose logits
        were refused (None when the step itself failed)."""
        self.failed: Reply | None = None
        slots = list(self.active)
        replies = [self.active[s] for s in slots]
        try:
            rows = self.decoder.step([r.out[-1] for r in replies], [r.position for r in replies], slots, len(slots))
            for row, r in zip(rows, replies):
                self.failed = r
                self.lm._check_logits(row, f"decode step {len(r.out)} (position {r.position})")
            self.failed = None
        except BaseException:
            for s in slots:
                self.drop(s)
            raise
        ended = []
        for s, row in zip(slots, rows):
            if self.active[s].take(row):
                self.active[s].ended_at = time.perf_counter()
                ended.append(self.drop(s))
        return ended
