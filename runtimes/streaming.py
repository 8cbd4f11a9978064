"""Weights streamed block by block: a program runs with only a few of its repeated blocks' weights in memory.

When a model's weights do not fit the memory budget, the weights of each repeated block (a transformer layer:
``Graph.blocks``, by weight name) are not bound to the memory-mapped checkpoint. Instead there are two owned
slot buffers; block ``b`` lives in slot ``b % 2``, which is as large as the largest block it takes, and its
kernels are bound, once, to views into that slot. While block ``b`` computes, a background thread copies
block ``b + 1``'s tensors from the checkpoint into the other slot and drops their file pages
(``file_pages``); block ``b + 2`` is loaded into block ``b``'s slot as soon as ``b``'s last kernel has run.
Weights outside blocks (embeddings, final norms...) stay bound as usual. Resident weight memory is thus at
most ``outside blocks + 2 x largest block``, whatever the depth of the model.

The schedule is cyclic: after the last block of a run the first blocks are prefetched for the next run (the
denoising loop re-runs one program per step). One loader thread runs loads in submission order, so a slot is
never written by two loads at once, and a slot is only refilled after every kernel reading it has run. The
kernels see the same bytes as with memory-mapped weights, so the results are bit-identical.

On a device backend (one with a ``copy_stream``: cuda, cuda-emu) the slots live in device memory and a block
travels through two pinned host staging buffers (``staging_bytes`` in all, the ``--max-host-memory`` budget): the
loader thread fills a staging buffer from the checkpoint and queues its upload on the copy stream, while the other
buffer's upload runs; a block larger than a buffer goes in several pieces. Events order the two streams: a slot's
first upload waits for the event recorded on the compute stream after the last kernel reading the slot's previous
block, the compute stream waits for a block's last upload before its first kernel (the host does not block), and
the loader waits for a staging buffer's previous upload before refilling it. So block ``b + 1`` uploads while
block ``b`` computes, on the GPU as on the host emulation of the same schedule.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from luminal_recipes.errors import BudgetError
from luminal_recipes.graph.core import Node
from luminal_recipes.graph.symbolic import evaluate

from .binding import check_array, fetch_weight
from .file_pages import PageDropper, will_need
from .kernels.context import ALIGNMENT, aligned
from .memory import MemoryPlan, format_bytes
from .program import Program

SLOTS = 2  # the block computing and the block being prefetched
STAGING_BUFFERS = 2  # pinned host buffers: one being filled by the loader while the other uploads
DEFAULT_STAGING = 512 << 20  # pinned host bytes when no --max-host-memory is given (two 256 MiB buffers)
MIN_STAGING_BUFFER = 4096
COPY_THREADS = 4  # host copies into a staging buffer split over threads (one core copies ~10 GB/s; PCIe takes 50)
SPLIT_COPY_BYTES = 16 << 20  # pieces at least this large are split


@dataclass(frozen=True)
class StreamedBlock:
    name: str
    weights: tuple[int, ...]  # program node ids, in order of first use
    offsets: tuple[int, ...]  # byte offset of each weight inside the slot
    nbytes: int  # bytes the block fills in its slot
    first: int  # position in the plan's order of the first kernel reading one of its weights
    last: int  # ... and of the last one


@dataclass(frozen=True)
class StreamLayout:
    """Which weights are streamed, where each lands in its slot, and what stays resident."""

    blocks: tuple[StreamedBlock, ...]
    slot_bytes: tuple[int, ...]  # one per slot: the largest block it takes
    streamed_weight_bytes: int  # packed bytes of every streamed weight (all blocks)
    unstreamed_weight_bytes: int  # packed bytes of the weights bound to the checkpoint as usual

    @property
    def slots(self) -> int:
        return len(self.slot_bytes)

    @property
    def resident_weight_bytes(self) -> int:
        """Weight memory held while the program runs: the weights outside blocks and the slots."""
        return self.unstreamed_weight_bytes + sum(self.slot_bytes)

    @property
    def largest_block_bytes(self) -> int:
        return max((b.nbytes for b in self.blocks), default=0)


def stream_layout(program: Program, plan: MemoryPlan, dims: Mapping[str, int],
                  block_of: Mapping[str, str]) -> StreamLayout:
    """Group the program's weights by block (``block_of``: weight name -> block name) and lay each block out
    in a slot. A block's span is the program positions of the kernels reading its weights; blocks whose spans
    overlap are merged (each must finish before the next starts). Weights outside every block, and weights
    the program returns as outputs, are not streamed."""
    by_id = {n.id: n for n in program.nodes}
    position = {nid: i for i, nid in enumerate(plan.order)}
    outputs = {src for src, _ in program.outputs.values()}
    span: dict[int, list[int]] = {}
    for nid in plan.order:
        for src, _ in by_id[nid].inputs:
            if plan.resident.get(src) == "weight":
                lo, hi = span.get(src, [position[nid], position[nid]])
                span[src] = [min(lo, position[nid]), max(hi, position[nid])]
    groups: dict[str, list[int]] = {}
    for nid in sorted(span, key=lambda w: (span[w][0], w)):
        name = block_of.get(by_id[nid].name)
        if name is not None and nid not in outputs:
            groups.setdefault(name, []).append(nid)
    merged: list[tuple[str, list[int], int, int]] = []
    for name, members in sorted(groups.items(), key=lambda g: min(span[w][0] for w in g[1])):
        lo, hi = min(span[w][0] for w in members), max(span[w][1] for w in members)
        if merged and lo <= merged[-1][3]:
            prev = merged.pop()
            name, members = f"{prev[0]}+{name}", prev[1] + members
            lo, hi = prev[2], max(prev[3], hi)
        merged.append((name, members, lo, hi))
    blocks = []
    for name, members, lo, hi in merged:
        offsets, top = [], 0
        for nid in members:
            offsets.append(top)
            top += aligned(_array_bytes(by_id[nid], dims))
        blocks.append(StreamedBlock(name, tuple(members), tuple(offsets), top, lo, hi))
    slots = min(SLOTS, len(blocks))
    slot_bytes = tuple(max(b.nbytes for b in blocks[s::slots]) for s in range(slots))
    streamed = sum(plan.nbytes[nid] for b in blocks for nid in b.weights)
    return StreamLayout(tuple(blocks), slot_bytes, streamed, plan.weight_bytes - streamed)


def _array_bytes(node: Node, dims: Mapping[str, int]) -> int:
    return math.prod(evaluate(d, dims) for d in node.shape) * node.dtype.np.itemsize


@dataclass
class StreamStats:
    """What streaming cost: block loads, bytes copied, seconds the loader spent and the kernels waited."""

    loads: int = 0
    bytes_copied: int = 0
    bytes_dropped: int = 0
    load_seconds: float = 0.0
    wait_seconds: float = 0.0
    uploads: int = 0  # staged uploads queued on the copy stream (device backends)
    staging_bytes: int = 0  # pinned host memory of the staging buffers


class WeightStreamer:
    """Owns the slots and the loader thread of one loaded program (see the module docstring)."""

    def __init__(self, layout: StreamLayout, program: Program, weights, dims: Mapping[str, int], backend,
                 staging_bytes: int | None = None):
        self.layout = layout
        self._backend = backend
        self.stats = StreamStats()
        self._by_id = {n.id: n for n in program.nodes}
        self._source = weights
        self._dims = dict(dims)
        self._place = {nid: (b, off) for b, block in enumerate(layout.blocks)
                       for nid, off in zip(block.weights, block.offsets)}
        self._holds: list[int | None] = [None] * layout.slots  # block each slot holds or is being filled with
        self._pending: dict[int, Future] = {}
        # device backends: the copy stream, its staging buffers, and per slot the events ordering the streams
        self._copies = backend.copy_stream() if layout.blocks else None
        self._staging: list[np.ndarray] = []
        self._staging_done: list = [None] * STAGING_BUFFERS  # each buffer's last upload
        self._released: list = [None] * layout.slots  # compute event: the slot's last reader has run
        self._filled: list = [None] * layout.slots  # copy event: the slot's block has arrived
        if self._copies is not None:
            piece = staging_buffer_bytes(layout, staging_bytes)
            self._staging = [self._copies.staging(piece) for _ in range(STAGING_BUFFERS)]
            self.stats.staging_bytes = piece * STAGING_BUFFERS
        self._slots = [backend.allocate(n) for n in layout.slot_bytes]
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-prefetch")
        self._copiers = ThreadPoolExecutor(max_workers=COPY_THREADS, thread_name_prefix="weight-copy") \
            if self._copies is not None else None
        self._pages = PageDropper()

    # ---- binding -----------------------------------------------------------------------------------------
    def view(self, nid: int) -> np.ndarray | None:
        """The flat array a streamed weight's kernels read (a view into its block's slot), or None."""
        if nid not in self._place:
            return None
        b, off = self._place[nid]
        node = self._by_id[nid]
        slot = self._slots[b % len(self._slots)]
        return self._backend.slot(slot, off, _array_bytes(node, self._dims), node.dtype.np)

    def interleave(self, steps: Iterable[tuple[int, Callable[[], None]]]) -> list[Callable[[], None]]:
        """The program's steps (``(position in plan order, step)``) with the loads and waits inserted: start
        the first blocks' loads before anything runs, wait for a block before its first kernel, refill its
        slot after its last kernel."""
        first = {block.first: b for b, block in enumerate(self.layout.blocks)}
        last = {block.last: b for b, block in enumerate(self.layout.blocks)}
        out: list[Callable[[], None]] = [self._start_run] if self.layout.blocks else []
        for pos, step in steps:
            if pos in first:
                out.append(_bound(self._acquire, first[pos]))
            out.append(step)
            if pos in last:
                out.append(_bound(self._release, last[pos]))
        return out

    # ---- schedule ----------------------------------------------------------------------------------------
    def _start_run(self) -> None:
        for b in range(len(self._slots)):
            self._load(b)

    def _acquire(self, b: int) -> None:
        self._load(b)  # a no-op when the prefetch was submitted
        slot = b % len(self._slots)
        future = self._pending.pop(b, None)
        if future is not None:
            t0 = time.perf_counter()
            try:
                future.result()
            except BaseException:
                self._holds[slot] = None  # half-filled: load again next time
                raise
            self.stats.wait_seconds += time.perf_counter() - t0
        if self._copies is not None and self._filled[slot] is not None:
            self._copies.wait(self._filled[slot])  # the block's kernels start once its last upload is done

    def _release(self, b: int) -> None:
        n, slots = len(self.layout.blocks), len(self._slots)
        if self._copies is not None:  # the slot may be overwritten once the kernels issued so far have run
            self._released[b % slots] = self._copies.record()
        following = b + slots if b + slots < n else b % slots  # the next block of this slot, cyclically
        self._load(following)

    def _load(self, b: int) -> None:
        slot = b % len(self._slots)
        if self._holds[slot] == b:
            return
        self._holds[slot] = b
        fill = self._fill if self._copies is None else self._stage
        self._pending[b] = self._loader.submit(fill, b, slot, self._released[slot])

    def _arrays(self, block: StreamedBlock) -> list[tuple[Node, np.ndarray]]:
        nodes = [self._by_id[nid] for nid in block.weights]
        arrays = [fetch_weight(self._source, node.name) for node in nodes]
        for array in arrays:
            will_need(array)
        for node, array in zip(nodes, arrays):
            check_array("weight", node, array, self._dims)
        return list(zip(nodes, arrays))

    def _fill(self, b: int, slot: int, released=None) -> None:
        """Loader thread (host backend): copy block ``b``'s tensors into ``slot``, then drop their file pages."""
        t0 = time.perf_counter()
        block = self.layout.blocks[b]
        buffer = self._slots[slot]
        for (node, array), off in zip(self._arrays(block), block.offsets):
            self._backend.copy_in(self._backend.slot(buffer, off, array.nbytes, node.dtype.np), array)
            self.stats.bytes_copied += array.nbytes
            self.stats.bytes_dropped += self._pages.drop(array)
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - t0

    def _stage(self, b: int, slot: int, released) -> None:
        """Loader thread (device backend): block ``b``'s bytes, laid out as in its slot, go through the staging
        buffers piece by piece; each piece is queued on the copy stream, the first after ``released`` (the
        slot's previous block is no longer read). The block has arrived when its last upload has."""
        t0 = time.perf_counter()
        block = self.layout.blocks[b]
        device = self._slots[slot]
        pieces = [(off, node, np.ascontiguousarray(array).reshape(-1).view(np.uint8), array)
                  for (node, array), off in zip(self._arrays(block), block.offsets)]
        size = len(self._staging[0])
        after, k, done = released, 0, None
        for start in range(0, block.nbytes, size):
            end = min(start + size, block.nbytes)
            if self._staging_done[k] is not None:
                self._copies.host_wait(self._staging_done[k])  # its previous upload has read it
            host = self._staging[k]
            for off, _, raw, array in pieces:  # the parts of the tensors that fall in [start, end)
                lo, hi = max(off, start), min(off + raw.size, end)
                if lo < hi:
                    self._copy(host[lo - start: hi - start], raw[lo - off: hi - off])
                    if hi == off + raw.size:  # the tensor's last byte is staged: its pages can go
                        self.stats.bytes_copied += raw.size
                        self.stats.bytes_dropped += self._pages.drop(array)
            done = self._copies.upload(self._backend.slot(device, start, end - start, np.uint8),
                                       host[: end - start], after)
            self._staging_done[k] = done
            self.stats.uploads += 1
            after, k = None, (k + 1) % len(self._staging)  # the copy stream keeps its own order
        self._filled[slot] = done
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - t0

    def _copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """``dst[...] = src`` (bytes), split over the copy threads when large (numpy copies release the GIL)."""
        if dst.size < SPLIT_COPY_BYTES:
            dst[...] = src
            return
        step = -(-dst.size // COPY_THREADS)
        parts = [self._copiers.submit(dst[i: i + step].__setitem__, Ellipsis, src[i: i + step])
                 for i in range(0, dst.size, step)]
        for part in parts:
            part.result()

    def close(self) -> None:
        """Wait for the loader and the copy stream, then release the slots, staging buffers and file
        descriptors."""
        self._loader.shutdown(wait=True, cancel_futures=True)
        if self._copiers is not None:
            self._copiers.shutdown(wait=True)
        self._pending.clear()
        if self._copies is not None:
            self._copies.close()
            self._copies = None
        self._staging, self._staging_done = [], [None] * STAGING_BUFFERS
        self._released, self._filled = [None] * len(self._slots), [None] * len(self._slots)
        self._holds = [None] * len(self._slots)
        self._slots = []
        self._pages.close()


def staging_buffer_bytes(layout: StreamLayout, staging_bytes: int | None) -> int:
    """The size of each of the two staging buffers: the largest block (one upload per block) within
    ``staging_bytes`` in all (``DEFAULT_STAGING`` when None), a multiple of the slot alignment."""
    budget = DEFAULT_STAGING if staging_bytes is None else staging_bytes
    per_buffer = budget // STAGING_BUFFERS // ALIGNMENT * ALIGNMENT
    if per_buffer < MIN_STAGING_BUFFER:
        raise BudgetError(f"--max-host-memory {format_bytes(budget)} is too small for the pinned staging of "
                          f"streamed weights: it needs {STAGING_BUFFERS} buffers of at least "
                          f"{format_bytes(MIN_STAGING_BUFFER)} ({format_bytes(STAGING_BUFFERS * MIN_STAGING_BUFFER)}"
                          f" in all, as much as the largest block for one upload per block); give more, e.g. 1GiB")
    return max(ALIGNMENT, min(aligned(layout.largest_block_bytes), per_buffer))


def _bound(fn: Callable[[int], None], b: int) -> Callable[[], None]:
    return lambda: fn(b)
