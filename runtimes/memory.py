"""The memory planner: liveness analysis over a Program, in-place kernels, and one activation arena.

Every activation (a kernel's output, an activation input, a kernel's scratch) is a buffer with a lifetime
``[first step, last step]`` in program order. Buffers whose lifetimes overlap never share bytes; the others
may. Offsets come from greedy best-fit by decreasing size (the "greedy by size" strategy of TFLite's arena
planner), which lands close to the lower bound ``live_peak`` (the most bytes ever live at one step); very
large programs use a linear sweep in program order instead, which is O(n log n).

In place: an elementwise kernel writes into an input's buffer when that input dies at this kernel, is read
through the identity view, has the output's dtype and size, and is neither an output, an input activation nor
read by another edge of the kernel through a different view. ``ScatterInPlace`` writes into its destination's
buffer under the same conditions (otherwise it falls back to a copy, noted in ``MemoryPlan.notes``).

Weights and array constants live outside the arena (memory-mapped or owned by the program): they count in
``weight_bytes`` (packed size: f4e2m1 is half a byte an element) and ``constant_bytes``. State buffers (inputs of
kind ``state``, e.g. a KV cache) live outside it too, for the executable's whole life (``state_bytes``); a kernel
that computes a state's new value (the output of the state's name) in place - ``ScatterInPlace`` writing rows into
it - writes into the state's own buffer, so nothing is copied per run.
``peak = weight_bytes + constant_bytes + state_bytes + arena_bytes`` is the number a memory budget is checked
against.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from luminal_recipes.errors import UnboundDimError
from luminal_recipes.graph.core import Node
from luminal_recipes.graph.serialize import reachable
from luminal_recipes.graph.symbolic import evaluate, free_symbols

from .kernels import ALIASING_KERNELS, INPLACE_KERNELS
from .kernels.context import aligned
from .program import Program
from .views import is_identity

INPLACE_OPS = INPLACE_KERNELS  # may write into an input that dies here (element i reads only elements i)
ALIASING_OPS = ALIASING_KERNELS  # kernel -> input whose buffer it writes into
GREEDY_BY_SIZE_LIMIT = 20_000  # buffers; above this the O(n log n) sweep is used
END = 1 << 62  # lifetime end of program outputs


@dataclass(frozen=True)
class Buffer:
    """One arena allocation: ``key`` is a node id (its output) or ``("scratch", node id)``."""

    key: object
    nbytes: int
    start: int
    end: int
    offset: int = -1


@dataclass
class MemoryPlan:
    order: list[int]  # node ids executed, in program order (dead nodes dropped)
    offsets: dict[int, int]  # node id -> byte offset of its output in the arena (activations only)
    scratch_offsets: dict[int, int]  # node id -> byte offset of its scratch region
    scratch_bytes: dict[int, int]  # node id -> scratch bytes it asked for
    nbytes: dict[int, int]  # node id -> bytes of its output (every executed node, resident ones included)
    aliases: dict[int, int]  # node id -> producer whose buffer it writes (in-place kernels)
    resident: dict[int, str]  # node id -> "weight" | "constant" | "state" (outside the arena)
    buffers: list[Buffer]
    arena_bytes: int
    weight_bytes: int
    constant_bytes: int
    live_peak: int  # lower bound: the most (aligned) bytes live at any one step
    total_buffer_bytes: int  # every buffer and scratch added up, as if nothing were reused
    strategy: str
    notes: list[str] = field(default_factory=list)
    state_bytes: int = 0  # state buffers (kept across runs, outside the arena)
    states: dict[int, int] = field(default_factory=dict)  # node id -> the state input whose buffer it is

    @property
    def activation_peak(self) -> int:
        return self.arena_bytes

    @property
    def peak(self) -> int:
        return self.weight_bytes + self.constant_bytes + self.state_bytes + self.arena_bytes

    def check(self) -> None:
        """Raise AssertionError if two buffers live at the same step share bytes, or one leaves the arena."""
        placed = sorted(self.buffers, key=lambda b: b.offset)
        for i, a in enumerate(placed):
            assert a.offset >= 0 and a.offset + a.nbytes <= self.arena_bytes, f"{a} leaves the arena"
            for b in placed[i + 1 :]:
                if b.offset >= a.offset + a.nbytes:
                    break
                if a.nbytes and b.nbytes and a.start <= b.end and b.start <= a.end:
                    raise AssertionError(f"buffers {a} and {b} overlap in time and in memory")

    def summary(self) -> str:
        b = format_bytes
        return (
            f"weights {b(self.weight_bytes)} + constants {b(self.constant_bytes)} + states {b(self.state_bytes)} "
            f"+ arena {b(self.arena_bytes)} = peak {b(self.peak)} "
            f"(buffers without reuse {b(self.total_buffer_bytes)}, live lower bound {b(self.live_peak)}, "
            f"{len(self.aliases)} in place, {self.strategy})"
        )


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


ScratchSource = Mapping[int, int] | Callable[[Node], int] | None


def check_dims(program: Program, dims: Mapping[str, int]) -> None:
    """All symbolic dimensions of the program must be bound; names every missing one at once."""
    symbols: set[str] = set()
    for n in program.nodes:
        symbols |= free_symbols(n.shape)
    missing = sorted(symbols - set(dims))
    if missing:
        raise UnboundDimError(
            f"symbolic dimension(s) {', '.join(missing)} have no value; pass dims={{"
            + ", ".join(f"'{m}': ..." for m in missing) + "}"
        )


def node_numel(node: Node, dims: Mapping[str, int]) -> int:
    return math.prod(evaluate(d, dims) for d in node.shape)


SOURCE_OPS = ("Input", "Constant", "Iota")


def run_order(program: Program, live) -> list[int]:
    """The order the live nodes run in: program order, except that the integer and boolean work on the inputs
    alone runs first - every kernel that reads or makes a non-float value and depends on no weight, state or
    activation (a causal mask built from position ids and an ``Iota``, the positions cast to f32), with the
    input-only nodes it reads. Those steps run from Python on the CPU (its compiled element-wise pass takes f32
    only); left where the program's walk put them (layer 0's mask after its q/k/v products), they cut the
    compiled steps of a decoding step into two chains (``cpu/jit/chain.py``), the first run on one thread.
    Any topological order gives the same values; liveness and the arena follow this one."""
    by_id = {n.id: n for n in program.nodes}
    input_only: set[int] = set()
    for n in program.nodes:  # (program order is topological)
        if n.op in SOURCE_OPS:
            if n.op != "Input" or n.attr("kind") not in ("weight", "state"):
                input_only.add(n.id)
        elif all(src in input_only for src, _ in n.inputs):
            input_only.add(n.id)

    def non_float(n: Node) -> bool:
        return not n.dtype.is_float or any(not by_id[src].dtype.is_float for src, _ in n.inputs)

    first: set[int] = set()
    for n in reversed(program.nodes):  # the integer work, then (walking back) every input-only node it reads
        if n.id in input_only and n.op not in SOURCE_OPS and (n.id in first or non_float(n)):
            first.add(n.id)
            first.update(src for src, _ in n.inputs)
    ordered = [n.id for n in program.nodes if n.id in live]
    return [nid for nid in ordered if nid in first] + [nid for nid in ordered if nid not in first]


def plan_memory(program: Program, dims: Mapping[str, int] | None = None, weight_bytes: int | None = None,
                scratch: ScratchSource = None) -> MemoryPlan:
    """Plan the activation arena of ``program`` with ``dims`` bound.

    ``weight_bytes`` overrides the packed size computed from the weight inputs (e.g. a checkpoint's real
    size); ``scratch`` gives each kernel's scratch bytes by node id (``Runtime.plan`` passes its kernels'
    needs; none when omitted).
    """
    dims = dict(dims or {})
    check_dims(program, dims)
    by_id = {n.id: n for n in program.nodes}
    live = reachable(_as_graph(by_id), [src for src, _ in program.outputs.values()])
    order = run_order(program, live)
    step = {nid: i for i, nid in enumerate(order)}

    resident: dict[int, str] = {}
    nbytes: dict[int, int] = {}
    for nid in order:
        n = by_id[nid]
        numel = node_numel(n, dims)
        if n.op in ("Constant", "Iota"):  # Iota depends on dims only: computed once at load
            resident[nid] = "constant"
        elif n.op == "Input" and n.attr("kind") == "weight":
            resident[nid] = "weight"
        elif n.op == "Input" and n.attr("kind") == "state":
            resident[nid] = "state"
        nbytes[nid] = n.dtype.nbytes(numel) if resident.get(nid) == "weight" else numel * n.dtype.np.itemsize
    w_bytes = sum(b for nid, b in nbytes.items() if resident.get(nid) == "weight")
    c_bytes = sum(b for nid, b in nbytes.items() if resident.get(nid) == "constant")
    s_bytes = sum(b for nid, b in nbytes.items() if resident.get(nid) == "state")

    # liveness: last step that reads each value (outputs live to the end)
    last: dict[int, int] = {}
    for nid in order:
        for src, _ in by_id[nid].inputs:
            last[src] = max(last.get(src, -1), step[nid])
    for src, _ in program.outputs.values():
        last[src] = END
    is_output = {src for src, _ in program.outputs.values()}
    updates = state_updates(program, dims)  # node id -> the state whose new value it is

    # in-place: union each eligible kernel with the producer whose buffer it overwrites
    root: dict[int, int] = {}
    aliases: dict[int, int] = {}
    states: dict[int, int] = {nid: nid for nid in order if resident.get(nid) == "state"}
    notes: list[str] = []

    def find(x: int) -> int:
        while x in root:
            x = root[x]
        return x

    for nid in order:
        n = by_id[nid]
        if n.id in resident or n.op == "Input":
            continue
        target = _inplace_target(n, by_id, dims, last, step, resident, is_output, find, updates)
        if target is not None:
            aliases[nid] = target
            root[nid] = find(target)
            if resident.get(root[nid]) == "state":  # computed in the state's own buffer
                resident[nid] = "state"
                states[nid] = root[nid]
        elif n.op in ALIASING_OPS:
            notes.append(f"{n.op} #{nid} cannot write into its destination (still read later, not the "
                         f"identity view, or a weight): it copies the destination first")

    # buffers: one per root (its lifetime spans every node aliased onto it), one per kernel scratch
    spans: dict[int, list[int]] = {}
    for nid in order:
        if nid in resident:
            continue
        r = find(nid)
        start = -1 if by_id[nid].op == "Input" else step[nid]
        end = last.get(nid, step[nid])
        lo, hi = spans.get(r, [start, end])
        spans[r] = [min(lo, start), max(hi, end)]
    buffers = [Buffer(r, aligned(nbytes[r]), lo, hi) for r, (lo, hi) in spans.items()]
    scratch_bytes: dict[int, int] = {}
    for nid in order:  # a kernel computing a state in place still needs its scratch in the arena
        if resident.get(nid) in ("weight", "constant") or by_id[nid].op == "Input":
            continue
        s = _scratch_of(scratch, by_id[nid])
        if s:
            scratch_bytes[nid] = s
            buffers.append(Buffer(("scratch", nid), aligned(s), step[nid], step[nid]))

    if len(buffers) <= GREEDY_BY_SIZE_LIMIT:
        placed, strategy = _greedy_by_size(buffers), "greedy-by-size"
    else:
        placed, strategy = _sweep(buffers), "sweep"
    arena = max((b.offset + b.nbytes for b in placed), default=0)
    offsets_by_key = {b.key: b.offset for b in placed}
    offsets = {nid: offsets_by_key[find(nid)] for nid in order if nid not in resident}
    scratch_offsets = {nid: offsets_by_key[("scratch", nid)] for nid in scratch_bytes}
    return MemoryPlan(
        order=order, offsets=offsets, scratch_offsets=scratch_offsets, scratch_bytes=scratch_bytes,
        nbytes=nbytes, aliases=aliases, resident=resident, buffers=placed, arena_bytes=arena,
        weight_bytes=w_bytes if weight_bytes is None else int(weight_bytes), constant_bytes=c_bytes,
        live_peak=_live_peak(placed, len(order)), total_buffer_bytes=sum(b.nbytes for b in placed),
        strategy=strategy, notes=notes, state_bytes=s_bytes, states=states,
    )


def plan_at(plan: MemoryPlan, by_id: Mapping[int, Node], dims: Mapping[str, int], nids,
            scratch: Mapping[int, int], current: MemoryPlan | None = None) -> MemoryPlan | None:
    """``plan`` (made at larger dims: a size bucket's) reused at ``dims``, where only the nodes ``nids`` change
    shape from ``current`` (a plan in the same places; default ``plan``), with ``scratch`` their kernels'
    scratch bytes now; None where it does not hold. Every buffer and
    scratch region keeps its offset, so it must not grow, and an in-place write (``aliases``) must still be one
    the planner would choose: the node's target of its own size, every read of that buffer element i -> element
    i (a slice that was the whole buffer at the bucket's length is no longer at a shorter one). Liveness does not
    depend on dims. What ``Executable.bind`` re-binds by: the other nodes' steps stay bound where they are."""
    nbytes, scratch_bytes = dict((current or plan).nbytes), dict((current or plan).scratch_bytes)

    def root(x: int) -> int:
        while x in plan.aliases:
            x = plan.aliases[x]
        return x

    for nid in nids:
        n = by_id[nid]
        if scratch.get(nid, 0) > plan.scratch_bytes.get(nid, 0):
            return None
        if plan.resident.get(nid) == "state" and n.op != "Input":
            pass  # a kernel computing a state in the state's own buffer: the buffer does not move (its shape is
            # checked with the state's), its inputs may
        elif nid in plan.resident or nid not in plan.nbytes:
            return None  # a weight, constant or state that changes shape: a fresh plan says why
        numel = node_numel(n, dims)
        size = numel * n.dtype.np.itemsize
        if size > plan.nbytes[nid]:
            return None
        nbytes[nid] = size
        if nid in scratch_bytes or scratch.get(nid):
            scratch_bytes[nid] = scratch.get(nid, 0)
        target = plan.aliases.get(nid)
        if target is not None:
            if node_numel(by_id[target], dims) != numel:
                return None
            out_shape = tuple(evaluate(d, dims) for d in n.shape)
            if not all(is_identity(view.bind(dims), out_shape, numel)
                       for src, view in n.inputs if root(src) == root(target)):
                return None
    return replace(plan, nbytes=nbytes, scratch_bytes=scratch_bytes)


def state_updates(program: Program, dims: Mapping[str, int]) -> dict[int, int]:
    """Node id -> state input id, for each state whose new value (the output named after it) a node computes
    in the state's layout (read whole, in order)."""
    states = {n.name: n for n in program.nodes if n.op == "Input" and n.attr("kind") == "state"}
    out = {}
    for name, (src, view) in program.outputs.items():
        state = states.get(name)
        if state is None:
            continue
        shape = tuple(evaluate(d, dims) for d in state.shape)
        if is_identity(view.bind(dims), shape, math.prod(shape)):
            out[src] = state.id
    return out


class _as_graph:  # noqa: N801 - the minimal Graph interface ``reachable`` needs
    def __init__(self, by_id: dict[int, Node]):
        self.nodes = by_id


def _scratch_of(scratch: ScratchSource, node: Node) -> int:
    if scratch is None:
        return 0
    if callable(scratch):
        return int(scratch(node))
    return int(scratch.get(node.id, 0))


def _inplace_target(n: Node, by_id, dims, last, step, resident, is_output, find, updates) -> int | None:
    if n.op in ALIASING_OPS:
        candidates = [ALIASING_OPS[n.op]]
    elif n.op in INPLACE_OPS:
        candidates = list(range(len(n.inputs)))
    else:
        return None
    out_shape = tuple(evaluate(d, dims) for d in n.shape)
    out_numel = math.prod(out_shape)
    for i in candidates:
        src, view = n.inputs[i]
        p = by_id[src]
        # a state's buffer may only be written by the kernel that computes that state's new value
        into_state = resident.get(src) == "state" and updates.get(n.id) == src
        if ((src in resident and not into_state) or src in is_output or last.get(src) != step[n.id]
                or p.dtype != n.dtype or node_numel(p, dims) != out_numel):
            continue
        bv = view.bind(dims)
        if not is_identity(bv, out_shape, out_numel):
            continue
        # every other edge reading the same buffer must read it identically (element i -> element i)
        others = [(s, v) for j, (s, v) in enumerate(n.inputs) if j != i and find(s) == find(src)]
        if n.op in ALIASING_OPS and others:
            continue  # a scatter must not read rows of the buffer it is writing
        if all(is_identity(v.bind(dims), out_shape, out_numel) for _, v in others):
            return src
    return None


def _greedy_by_size(buffers: list[Buffer]) -> list[Buffer]:
    """Largest first; each takes the smallest gap between buffers alive at the same time that fits it."""
    n = len(buffers)
    starts, ends = np.empty(n, np.int64), np.empty(n, np.int64)
    offs, sizes = np.empty(n, np.int64), np.empty(n, np.int64)
    count = 0
    placed: list[Buffer] = []
    for b in sorted(buffers, key=lambda b: (-b.nbytes, b.start, str(b.key))):
        offset = 0
        if b.nbytes and count:
            mask = (starts[:count] <= b.end) & (ends[:count] >= b.start)
            idx = np.flatnonzero(mask)
            if idx.size:
                order = idx[np.argsort(offs[idx], kind="stable")]
                best, best_gap, top = None, None, 0
                for o, s in zip(offs[order].tolist(), sizes[order].tolist()):
                    gap = o - top
                    if gap >= b.nbytes and (best_gap is None or gap < best_gap):
                        best, best_gap = top, gap
                    top = max(top, o + s)
                offset = top if best is None else best
        placed.append(Buffer(b.key, b.nbytes, b.start, b.end, offset))
        if b.nbytes:
            starts[count], ends[count], offs[count], sizes[count] = b.start, b.end, offset, b.nbytes
            count += 1
    return placed


def _sweep(buffers: list[Buffer]) -> list[Buffer]:
    """Program order: free what died, then place what starts in the best-fitting free gap (or on top)."""
    gaps: list[tuple[int, int]] = []  # sorted (offset, size) of free gaps below ``top``
    top = 0
    live: list[tuple[int, int, int]] = []  # heap of (end, offset, size)

    placed = []
    for b in sorted(buffers, key=lambda b: (b.start, -b.nbytes, str(b.key))):
        while live and live[0][0] < b.start:
            _, o, s = heapq.heappop(live)
            bisect.insort(gaps, (o, s))
            gaps = _coalesce(gaps)
        offset = 0
        if b.nbytes:
            fits = [(s, o) for o, s in gaps if s >= b.nbytes]
            if fits:
                s, offset = min(fits)
                gaps.remove((offset, s))
                if s > b.nbytes:
                    bisect.insort(gaps, (offset + b.nbytes, s - b.nbytes))
            else:
                # a free gap that ends at the top is extended upwards
                offset = gaps.pop()[0] if gaps and gaps[-1][0] + gaps[-1][1] == top else top
                top = max(top, offset + b.nbytes)
            heapq.heappush(live, (b.end, offset, b.nbytes))
        placed.append(Buffer(b.key, b.nbytes, b.start, b.end, offset))
    return placed


def _coalesce(gaps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for o, s in gaps:
        if out and out[-1][0] + out[-1][1] == o:
            out[-1] = (out[-1][0], out[-1][1] + s)
        else:
            out.append((o, s))
    return out


def _live_peak(buffers: list[Buffer], steps: int) -> int:
    """The most bytes live at one step: no offset assignment can use less."""
    delta = np.zeros(steps + 3, np.int64)
    for b in buffers:
        lo = b.start + 1  # start -1 (activation inputs) -> index 0
        hi = min(b.end, steps) + 2
        delta[lo] += b.nbytes
        delta[hi] -= b.nbytes
    return int(np.cumsum(delta).max(initial=0))
