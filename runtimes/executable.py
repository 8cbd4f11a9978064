"""The one executable every backend runs Programs with, and the runtime that pairs it with a backend.

``BackendRuntime(backend)`` is a ``Runtime``: ``load`` prepares every kernel with the backend's implementations
(operand layouts, scratch needs), lets the backend build what they need as a whole (``backend.build``: the CUDA
backends compile one module of every node's kernels), plans memory with those needs, allocates one activation arena
(``backend.allocate``; every activation and scratch array is a typed slot of it at its planned offset), binds the
weights (``backend.upload``: the numpy backend keeps memory-mapped checkpoint arrays memory-mapped, a GPU backend
binds arrays already in its memory as they are), and binds every kernel to its arrays. ``Executable.run`` then
copies the inputs into their slots (``backend.copy_in``), calls the prepared steps in program order and hands the
outputs back; the hot loop allocates nothing. Execution is single-stream and every reduction has a fixed order, so
the same inputs give the same bits. ``execute`` runs the kernels on inputs staged in device memory, without host
transfers (what a benchmark times).

With ``stream=`` (weight name -> block name), the repeated blocks' weights are not bound to the checkpoint but
streamed through two slot buffers by a ``streaming.WeightStreamer`` (on a device backend through pinned staging
buffers of ``staging_bytes`` in all, on its copy stream); ``close()`` stops its loader thread and drops every
buffer. ``stats`` counts the bytes each run moved between host and device.

On a backend with device graphs (``backend.graphs``: CUDA), the second run at a binding records every kernel as one
graph (``backend.capture``) and later runs replay it; steps that cannot be recorded (streamed weights, a kernel the
device refuses to capture) run one by one, with a one-line notice. The numpy backend records runs of compiled
kernel calls as chains (``cpu/jit/chain.py``) at the run ``backend.capture_after`` names, without notices. From
then on, where every kernel touching an input's (an output's) slot runs inside a chain, the chains are re-pointed per
run at the caller's array (a fresh array) instead of copying it in (out): ``direct_io.py``, ``fresh_outputs``.

Re-binding keeps the last ``BINDINGS`` bindings of an executable that ran (keyed by their dims, the least recently
used dropped first): each one's bound steps, plan, input and output slots, and its recorded graph or chains with its
run count. Returning to dims bound before (a prompt length seen before, a batch of 1 after a batch of 2, the decode
loop's attended-prefix buckets of the next reply) restores them without preparing, planning or recording again. The
weights, constants, states (KV caches) and the arena are the executable's, shared by every binding, never copied;
runs are one at a time, and no binding keeps values in the arena from one run to the next (inputs are copied in each
run, scratch and activations are written before they are read), so bindings may overlap in it. A binding belongs to
the arena it was bound in: when a larger plan replaces the arena, the bindings into the old one are dropped with it,
so one arena is held at a time.
"""

from __future__ import annotations

import bisect
import functools
import math
import sys
import time
import tracemalloc
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from luminal_recipes import heap
from luminal_recipes.errors import GraphError, InputError, UnboundDimError
from luminal_recipes.graph.core import Node
from luminal_recipes.graph.symbolic import free_symbols, shape_str

from . import profile as kernel_profile
from .backend import Array, Backend, GraphCaptureError
from .binding import check_array, check_input_names, declared_shape, fetch_weight
from .direct_io import DirectIO
from .kernels import REGISTRY, SOURCES
from .kernels.context import KernelContext, KernelInput, Scratch
from .memory import MemoryPlan, check_dims, plan_at, plan_memory
from .memory import state_updates as updates_of
from .program import Program
from .protocol import MemoryReport, RuntimeBase
from .streaming import WeightStreamer, stream_layout
from .views import gather_into, strided


class BackendRuntime(RuntimeBase):
    """A ``Runtime``: a backend's kernels and memory, run by the generic ``Executable``."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.name, self.device, self.machine = backend.name, backend.device, backend.machine
        self.timed = backend.timed  # whether the compiler may time candidates on this device
        self._scratch_memo: dict[tuple, dict] = {}  # dims -> node content -> scratch bytes (``scratch_bytes``)

    def capabilities(self) -> set[str]:
        return {op for op in REGISTRY if op in self.backend.kernels or op in SOURCES}

    def contended(self) -> str | None:
        """Why timing candidates now would measure other work too (the backend's ``contended``), or None."""
        check = getattr(self.backend, "contended", None)
        return check() if check is not None else None

    @property
    def target(self) -> str | None:
        """What the backend's kernels are built for, where it has a choice (the CPU's instruction-set path)."""
        return getattr(self.backend, "target", None)

    def capacity(self) -> int:
        """The default memory budget of this runtime's device (bytes)."""
        return self.backend.capacity()

    def prepare(self, program: Program, dims: Mapping[str, int] | None = None, only=None) -> dict[int, tuple]:
        """Per node id: ``(bind function, Scratch)``, for every node that runs a kernel (of the ids ``only``
        where given)."""
        self.check_capabilities(program)
        dims = dict(dims or {})
        check_dims(program, dims)
        by_id = {n.id: n for n in program.nodes}
        # a backend that generates code may bind the dims to values that remember their symbol (the CUDA
        # backends' ``kernel_dims``: kernels read symbolic dims from their arguments, one module for every length)
        symbolic = getattr(self.backend, "kernel_dims", None)
        kdims = symbolic(dims) if symbolic is not None else dims
        prepared = {}
        for node in program.nodes if only is None else (by_id[nid] for nid in only):
            if node.op in SOURCES:
                continue
            scratch = Scratch()
            inputs = [KernelInput(view.bind(kdims), by_id[src].dtype.np, _numel(by_id[src], kdims))
                      for src, view in node.inputs]
            ctx = KernelContext(node, declared_shape(node, kdims), node.dtype.np, inputs, scratch)
            prepared[node.id] = (self.backend.kernels[node.op](ctx), scratch)
        return prepared

    def plan(self, program: Program, dims=None, weight_bytes: int | None = None) -> MemoryPlan:
        """The memory plan ``load`` would use (kernel scratch included), without allocating anything."""
        return plan_memory(program, dims, weight_bytes, self.scratch_bytes(program, dims))

    def scratch_bytes(self, program: Program, dims=None) -> dict[int, int]:
        """Per kernel node id: the scratch bytes its prepared kernel asks for (what ``prepare`` would give).

        A kernel's scratch depends only on what its context holds - op, attributes, dtypes, shapes, the input
        views - at the bound dims, so nodes identical in those (a repeated block's, the same node in several
        candidates of a search) are prepared once per runtime: planning every candidate of a search prepared
        every node of each, the largest part of a cold compile."""
        self.check_capabilities(program)
        dims = dict(dims or {})
        check_dims(program, dims)
        memo = self._scratch_memo.setdefault(tuple(sorted(dims.items())), {})
        by_id = {n.id: n for n in program.nodes}
        out = {}
        for node in program.nodes:
            if node.op in SOURCES:
                continue
            key = (node.op, node.attrs, node.dtype, node.shape,
                   tuple((view, by_id[src].dtype, by_id[src].shape) for src, view in node.inputs))
            try:
                nbytes = memo.get(key)
            except TypeError:  # an attribute that cannot be hashed: prepared, not remembered
                key, nbytes = None, None
            if nbytes is None:
                scratch = Scratch()
                inputs = [KernelInput(view.bind(dims), by_id[src].dtype.np, _numel(by_id[src], dims))
                          for src, view in node.inputs]
                self.backend.kernels[node.op](KernelContext(node, declared_shape(node, dims), node.dtype.np,
                                                            inputs, scratch))
                nbytes = scratch.nbytes
                if key is not None:
                    memo[key] = nbytes
            out[node.id] = nbytes
        return out

    def load(self, program: Program, weights=None, dims=None, stream: Mapping[str, str] | None = None,
             states_from: Executable | None = None, staging_bytes: int | None = None) -> Executable:
        """Bind ``program`` to its weights at ``dims``; ``stream`` (weight name -> block name) streams the
        blocks' weights instead of binding them (``streaming``), staged through ``staging_bytes`` of pinned host
        memory on a device backend (default: ``streaming.DEFAULT_STAGING``); ``states_from``: share that
        executable's state buffers (a prefill and a decode program of one model writing one KV cache) instead of
        allocating."""
        return Executable(self, program, weights, dict(dims or {}), stream, states_from, staging_bytes)

    def memory_held(self) -> int | None:
        """Bytes the backend holds on its device now (None where it cannot tell)."""
        return self.backend.memory_held()

    def release_memory(self) -> dict | None:
        """Give the memory the backend's allocator caches back to the device (a stage has ended and closed its
        executables): the bytes held before and after, or None where the backend cannot tell (numpy)."""
        if self.backend.memory_held() is None:
            return None
        import gc

        gc.collect()  # arrays kept alive only by reference cycles
        before = self.backend.memory_held()
        self.backend.release_memory()
        return {"held_before_release_bytes": before, "held_after_release_bytes": self.backend.memory_held()}


def _numel(node: Node, dims) -> int:
    n = 1
    for d in declared_shape(node, dims):
        n *= d
    return n


@dataclass
class TransferStats:
    """Bytes one run moved: host -> device (inputs), device -> host (outputs), device -> device."""

    runs: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    bytes_device: int = 0
    rebinds: int = 0  # re-bindings to other dims (``Executable.bind``), their total seconds, and the arenas they
    rebind_seconds: float = 0.0  # had to allocate (none when loaded for the largest dims)
    arena_allocations: int = 0
    rebinds_cached: int = 0  # re-bindings that restored a binding kept from before (no plan, nothing recorded)
    rebinds_in_place: int = 0  # re-bindings in the loaded plan's places: only the nodes whose shapes change re-bound
    nodes_rebound: int = 0  # (the kernels those prepared again)
    replays: int = 0  # runs that replayed a recorded device graph or chains


BINDINGS = 4  # bindings an executable keeps, its current one included (1: none kept); a binding is kept when it is
# left after running at least once. Each holds its bound steps and recording - Python objects and array views, no
# array data: 3.5-6 MiB for SmolLM2-135M's 30 layers (docs/quantization-gguf.md, "Kept bindings")

# what one binding is: restored together by ``bind`` (``_bind`` sets every one of them)
_BINDING_FIELDS = ("dims", "plan", "_replay", "_launches", "_inputs", "_steps", "_step_nodes", "_labels",
                   "_instances", "_outputs", "_input_specs", "_input_names", "_output_views", "_write_back",
                   "_memory", "_direct", "_node_steps", "_scratch_bytes")


class Executable:
    """A Program bound to its weights, dims and arena on one backend; ``run`` executes it.

    Loaded for ``dims`` (e.g. a size bucket: the largest lengths it will see), it can be re-bound to other dims
    (``bind``, or ``run(..., dims=)``) without loading again: the weights, constants, states and arena stay; the
    kernels are prepared and the memory planned for the new dims, and the steps are bound to new slots of the same
    arena (a new arena only if the new plan needs more than the loaded one). The last ``BINDINGS`` bindings are
    kept: going back to dims bound before restores their steps and recording as they were.
    """

    def __init__(self, runtime: BackendRuntime, program: Program, weights, dims: dict[str, int],
                 stream: Mapping[str, str] | None = None, states_from: Executable | None = None,
                 staging_bytes: int | None = None):
        self.runtime, self.backend = runtime, runtime.backend
        self.program, self.dims = program, dict(dims)
        self.loaded_dims = dict(dims)
        self.stats = TransferStats()
        self._by_id = {n.id: n for n in program.nodes}
        self._closed = False
        self._staged: list[tuple[Array, Array]] = []  # ``execute``'s inputs in device memory, and their slots
        # device graphs: tried from the second run at a binding, unless the steps include host work (streaming)
        self._graphs = bool(getattr(runtime.backend, "graphs", False))
        self._capture_after = int(getattr(runtime.backend, "capture_after", 1))  # runs of a binding before it
        self._replay = None
        self.fresh_outputs: frozenset[str] = frozenset()  # outputs the last run wrote into fresh memory
        # the other bindings kept (not the current one): dims -> (arena, the binding's fields), least recently left
        # first
        self._bindings: dict[tuple, tuple] = {}
        backend = self.backend
        if states_from is not None and states_from.backend is not backend:
            raise InputError("states are shared only between executables of one runtime (one device)")
        prepared, plan = self._plan(self.dims)
        self._loaded_plan = plan  # the places every re-binding within the loaded dims keeps (``_in_place``)
        self._node_symbols: dict[int, frozenset[str]] | None = None  # (``_in_place``, on its first use)
        self.streamer = None
        if stream is not None:
            self.streamer = WeightStreamer(stream_layout(program, plan, dims, stream), program, weights, dims,
                                           backend, staging_bytes)
            if self._graphs:
                self._graphs = False
                if getattr(backend, "graph_notices", True):
                    _notice(backend, "weights are streamed: the host loads blocks between kernels")
        self.arena = backend.allocate(plan.arena_bytes)
        # bound once, whatever the dims: weights, constants, Iota (its prefix serves shorter lengths), states
        self._fixed: dict[int, Array] = {}
        self._states: dict[str, tuple[Node, Array]] = {}  # name -> (state input, its buffer): kept across runs
        self.weights: dict[str, Array] = {}  # name -> bound array: the caller's on a host backend
        self._weight_array_bytes = 0
        for nid in plan.order:
            node = self._by_id[nid]
            kind = plan.resident.get(nid)
            slot = self.streamer.view(nid) if self.streamer and kind == "weight" else None
            if slot is not None:
                self._fixed[nid] = slot  # filled block by block while the program runs
            elif kind == "state" and node.op == "Input":
                buf = _shared_state(states_from, node, plan.nbytes[nid]) if states_from is not None else \
                    backend.slot(backend.allocate(plan.nbytes[nid]), 0, plan.nbytes[nid], node.dtype.np)
                self._fixed[nid] = buf
                self._states[node.name] = (node, buf)
            elif kind == "weight":
                arr = fetch_weight(weights, node.name)
                check_array("weight", node, arr, dims)
                self._fixed[nid] = backend.upload(arr)
                self.weights[node.name] = self._fixed[nid].reshape(arr.shape)
                self._weight_array_bytes += self._fixed[nid].nbytes
            elif node.op == "Constant":
                data = node.data if node.data is not None else np.asarray(node.attr("value"), node.dtype.np)
                self._fixed[nid] = backend.upload(np.ascontiguousarray(data, dtype=node.dtype.np).reshape(-1))
            elif node.op == "Iota":
                self._fixed[nid] = backend.upload(np.arange(declared_shape(node, dims)[0], dtype=np.int32))
        self._known_inputs = {n.name for n in program.nodes if n.op == "Input"
                              and n.attr("kind") not in ("weight", "state")}
        self._bind(self.dims, prepared, plan)

    def _plan(self, dims: Mapping[str, int]) -> tuple[dict, MemoryPlan]:
        prepared = self.runtime.prepare(self.program, dims)
        plan = plan_memory(self.program, dims, None, {nid: s.nbytes for nid, (_, s) in prepared.items()})
        self.backend.build({nid: bind for nid, (bind, _) in prepared.items()})
        return prepared, plan

    def bind(self, dims: Mapping[str, int]) -> None:
        """Re-bind to other values of the symbolic dims (within what was loaded: weights and states must keep
        their shapes, an Iota may only get shorter). Allocates nothing unless the new plan's arena is larger."""
        dims = {**self.dims, **dims}
        if dims == self.dims:
            return
        t0 = time.perf_counter()
        kept = self._bindings.pop(_dims_key(dims), None)
        keep_steps = False
        if kept is None or kept[0] is not self.arena:
            kept = None
            in_place = self._in_place(dims)
            if in_place is None:
                self._check_fixed(dims)
                prepared, plan = self._plan(dims)
            else:
                prepared, plan, keep_steps = in_place
        if self._launches:  # kept only if it ran: a binding left unrun (loaded for a bucket, bound away at once)
            self._bindings[_dims_key(self.dims)] = (self.arena, tuple(getattr(self, f) for f in _BINDING_FIELDS))
        if kept is not None:
            for name, value in zip(_BINDING_FIELDS, kept[1], strict=True):
                setattr(self, name, value)
            self._staged = []
            self.stats.rebinds_cached += 1
        else:
            if plan.arena_bytes > self.arena.nbytes:  # not expected when loaded for the largest dims of a bucket
                self.arena = self.backend.allocate(plan.arena_bytes)
                self._bindings.clear()  # they point into the old arena: dropped with it (one arena held at a time)
                self.stats.arena_allocations += 1
            self._bind(dims, prepared, plan, keep_steps)
        while len(self._bindings) > max(0, BINDINGS - 1):  # the current one besides them: the oldest left go
            del self._bindings[next(iter(self._bindings))]
        self.stats.rebinds += 1
        self.stats.rebind_seconds += time.perf_counter() - t0

    def _in_place(self, dims: dict[str, int]) -> tuple[dict, MemoryPlan, bool] | None:
        """A re-binding that keeps the loaded plan's places (``memory.plan_at``): the kernels whose shapes, input
        views or inputs' shapes name a dim that changes are prepared and bound again; every other node keeps its
        bound step, which reads and writes the same arrays at the same places. ``(prepared, plan, keep_steps)``
        (False: the current binding is in other places, every kernel was prepared), or None where the dims exceed
        the loaded ones, the places do not hold, weights are streamed or the arrays are a device's (then ``bind``
        plans afresh). A decode loop through a compiled PyTorch model (its cache one row longer every step, a new
        length each time) spent ~95 ms a token re-binding afresh for a Qwen3-100M-shaped model, whose step runs in
        ~25."""
        if (self.streamer is not None or not self.backend.host_arrays
                or any(v > self.loaded_dims.get(k, v) for k, v in dims.items())):
            return None
        base = self._loaded_plan
        if self._node_symbols is None:
            self._node_symbols = _node_symbols(self.program, self._by_id)
        current = self.plan if self.plan.offsets is base.offsets else None
        if current is not None:  # the current binding is in these places: its other steps are kept
            moved = {k for k, v in dims.items() if self.dims.get(k) != v}
            nodes = [nid for nid in base.order if self._node_symbols[nid] & moved]
        else:
            nodes = list(base.order)
        for nid in nodes:
            buf = self._fixed.get(nid)
            if buf is not None and (self._by_id[nid].op != "Iota" or declared_shape(self._by_id[nid], dims)[0]
                                    > buf.size):
                return None  # a weight or state changing shape, an Iota longer than loaded: ``_check_fixed``
        kernels = [nid for nid in nodes if self._by_id[nid].op not in SOURCES]
        prepared = self.runtime.prepare(self.program, dims, only=kernels)
        plan = plan_at(base, self._by_id, dims, [nid for nid in nodes if nid not in self._fixed],
                       {nid: scratch.nbytes for nid, (_, scratch) in prepared.items()}, current)
        if plan is None:
            return None
        self.backend.build({nid: bind for nid, (bind, _) in prepared.items()})
        self.stats.rebinds_in_place += 1
        self.stats.nodes_rebound += len(prepared)
        return prepared, plan, current is not None

    def _check_fixed(self, dims: dict[str, int]) -> None:
        """Weights and states keep their shapes at ``dims``, and an Iota is no longer than loaded."""
        for nid, buf in self._fixed.items():
            node = self._by_id[nid]
            kind = node.attr("kind") if node.op == "Input" else None
            if kind in ("weight", "state") and declared_shape(node, dims) != declared_shape(node, self.dims):
                raise UnboundDimError(
                    f"{kind} '{node.name}' has shape {shape_str(node.shape)}: it cannot change with the dims "
                    f"(loaded for {self.loaded_dims}, asked {dims}); load the program again for these dims")
            if node.op == "Iota" and declared_shape(node, dims)[0] > buf.size:
                raise UnboundDimError(
                    f"Iota #{nid} of length {shape_str(node.shape)} = {declared_shape(node, dims)[0]} exceeds the "
                    f"{buf.size} it was loaded for (dims {self.loaded_dims}); load the program for a larger bucket")

    def _bind(self, dims: dict[str, int], prepared: dict, plan: MemoryPlan, keep_steps: bool = False) -> None:
        """Every activation slot, kernel step, input and output at ``dims``. ``keep_steps``: only the kernels in
        ``prepared`` are bound again, the others' steps kept from the current binding (``_in_place``)."""
        backend, program, by_id = self.backend, self.program, self._by_id
        kept_steps: dict = {}
        scratch_bytes = {nid: scratch.nbytes for nid, (_, scratch) in prepared.items()}
        if keep_steps:
            kept_steps = {nid: step for nid, step in self._node_steps.items() if nid not in prepared}
            scratch_bytes = {**{nid: self._scratch_bytes[nid] for nid in kept_steps}, **scratch_bytes}
        self.dims, self.plan = dims, plan
        self._replay, self._launches = None, 0  # a graph records one binding's steps
        self._direct: DirectIO | None = None  # inputs read in place, outputs written fresh (``direct_io``)
        self._staged = []
        flats: dict[int, Array] = {}
        self._inputs: dict[str, tuple[Node, Array]] = {}
        for nid in plan.order:
            node = by_id[nid]
            if nid in self._fixed:
                flats[nid] = self._fixed[nid]
                if node.op == "Iota":
                    flats[nid] = flats[nid][: declared_shape(node, dims)[0]]
            elif plan.resident.get(nid) == "state":  # computes the state's new value in its buffer (in place)
                flats[nid] = self._fixed[plan.states[nid]]
            else:
                flats[nid] = backend.slot(self.arena, plan.offsets[nid], plan.nbytes[nid], node.dtype.np)
                if node.op == "Input":
                    self._inputs[node.name] = (node, flats[nid])
        steps = []
        for position, nid in enumerate(plan.order):
            if nid in kept_steps:
                steps.append((position, kept_steps[nid]))
                continue
            if nid not in prepared:
                continue
            node = by_id[nid]
            bind, scratch = prepared[nid]
            base = plan.scratch_offsets.get(nid, 0)
            arrays = [backend.slot(self.arena, base + at, n, dtype).reshape(shape)
                      for at, n, shape, dtype in scratch.layout()]
            out = flats[nid].reshape(declared_shape(node, dims))
            steps.append((position, bind(out, [flats[src] for src, _ in node.inputs], arrays)))
        self._node_steps = {plan.order[position]: step for position, step in steps}
        # what the live schedule needs of the prepared kernels: not the kernels (their contexts and bind closures,
        # ~30 objects the garbage collector tracks per kernel, would live as long as the binding is kept)
        self._scratch_bytes = scratch_bytes
        self._steps = self.streamer.interleave(steps) if self.streamer else [step for _, step in steps]
        node_of = {id(step): plan.order[pos] for pos, step in steps}  # profile labels
        self._step_nodes = [node_of.get(id(step)) for step in self._steps]
        self._labels = [kernel_profile.STREAMING if nid is None else by_id[nid].op for nid in self._step_nodes]
        self._instances: list[str] | None = None  # described on the first profiled run that lists instances
        self._outputs = {name: (flats[src], view.bind(dims)) for name, (src, view) in program.outputs.items()
                         if name not in self._states}
        # what ``run`` needs per call, worked out once per binding: each input's slot, declared shape and dtype
        # (an exact match skips the checks, which evaluate symbolic shapes), and each output as a view of the
        # arena on a host backend (the arena stays until the next binding)
        self._input_specs = [(name, node, slot, declared_shape(node, dims), node.dtype.np, _address(slot))
                             for name, (node, slot) in self._inputs.items()]
        self._input_names = frozenset(self._inputs)
        views = {name: strided(flat, bv) for name, (flat, bv) in self._outputs.items()} if backend.host_arrays else {}
        self._output_views = views if all(v is not None for v in views.values()) else {}  # else gathered per run
        # a state's new value computed elsewhere (not in place) is copied into its buffer after each run
        self._write_back = []
        for name, (node, buf) in self._states.items():
            if name not in program.outputs:
                continue
            src, view = program.outputs[name]
            if plan.states.get(src) == node.id:
                continue  # updated in place
            if src not in updates_of(program, dims):
                raise GraphError(f"state '{name}': its new value (the output '{name}') must be a tensor of the "
                                 f"state's shape read whole, in order; make it contiguous first")
            self._write_back.append((buf, flats[src]))
        weight_bytes, weight_array_bytes = plan.weight_bytes, self._weight_array_bytes
        if self.streamer:  # what is held: weights outside blocks and the two slots
            layout = self.streamer.layout
            weight_bytes = layout.resident_weight_bytes
            weight_array_bytes += sum(layout.slot_bytes)
        arena_bytes = int(self.arena.nbytes)
        # made when asked for (``memory``): its live schedule walks every node, ~2 ms a binding for a Qwen3-100M
        # decode step, which a decode loop re-binding every token never reads
        self._memory = functools.partial(
            MemoryReport, weight_bytes=weight_bytes, weight_array_bytes=weight_array_bytes,
            constant_bytes=plan.constant_bytes, arena_bytes=arena_bytes,
            planned_peak=weight_bytes + plan.constant_bytes + plan.state_bytes + arena_bytes,
            live_peak=functools.partial(_live_schedule, plan, program.outputs, by_id,  # (sizes, not the arrays:
                                        {nid: a.nbytes for nid, a in flats.items()}, scratch_bytes),  # nothing held)
            state_bytes=plan.state_bytes)

    # ---- inputs and states ---------------------------------------------------------------------------------
    def input(self, name: str) -> Array:
        """Input ``name``'s slot, at its shape: data written there and passed to ``run`` as that input is not
        copied (bound in place)."""
        node, slot = self._inputs[name]
        return slot.reshape(declared_shape(node, self.dims))

    def state(self, name: str) -> np.ndarray:
        """A host copy of state ``name``'s current value."""
        node, buf = self._state(name)
        return np.array(self.backend.download(buf), copy=True).reshape(declared_shape(node, self.dims))

    def set_state(self, name: str, value: np.ndarray | None = None) -> None:
        """Set state ``name`` to ``value`` (zeros when None)."""
        node, buf = self._state(name)
        if value is None and self.backend.host_arrays and isinstance(buf, np.ndarray):
            heap.clear(buf)  # pages never written stay unallocated (a cache planned long costs the rows written),
            # those written are kept: handed back, each reply would fault them in again row by row
            return
        if value is None:
            value = np.zeros(declared_shape(node, self.dims), node.dtype.np)
        value = np.asarray(value)
        check_array("state", node, value, self.dims)
        self.backend.copy_in(buf, value)

    def _state(self, name: str) -> tuple[Node, Array]:
        if name not in self._states:
            raise InputError(f"no state '{name}'; the program's states are {', '.join(self._states) or 'none'}")
        return self._states[name]

    def close(self) -> None:
        """Stop the weight loader (streaming) and drop every buffer (arena, weights, states, slots, graph), so the
        backend can free them; the executable cannot run afterwards."""
        if self.streamer:
            self.streamer.close()
        self._closed = True
        self._replay = None
        self._memory = self.memory  # (made now: what it is made from goes below)
        self._bindings.clear()
        self._steps, self._labels, self._write_back, self._staged = [], [], [], []
        self._node_steps, self._scratch_bytes = {}, {}  # (the steps hold the arena's arrays)
        self._inputs, self._outputs = {}, {}
        self._input_specs, self._output_views = [], {}
        self._fixed.clear()
        self._states.clear()
        self.weights.clear()
        self.arena = None

    def _check_open(self) -> None:
        if self._closed:
            raise GraphError("this executable was closed (its buffers are released); load the program again")

    @property
    def memory(self) -> MemoryReport:
        if isinstance(self._memory, functools.partial):  # (``_bind``: made on first use)
            make = self._memory
            self._memory = make(live_peak=make.keywords["live_peak"]())
        return self._memory

    @property
    def replaying(self) -> bool:
        """Runs replay a recorded device graph (recorded at the second run of a binding, where the backend can)."""
        return self._replay is not None

    @property
    def settled(self) -> bool:
        """Runs now go as every later run of this binding will: replaying its recording, or with nothing to
        record (a backend without graphs or chains, or a recording that found nothing worth it). Until then a run
        may be one of the first ``capture_after`` runs, kernel by kernel (what a timing should not measure)."""
        return self._replay is not None or not self._graphs

    def run(self, inputs: Mapping[str, np.ndarray] | None = None, copy_outputs: bool = True,
            trace: bool = False, dims: Mapping[str, int] | None = None, fresh: bool = False
            ) -> dict[str, np.ndarray]:
        """Execute once (at ``dims``, re-binding first if they differ). Outputs are fresh host arrays; with
        ``copy_outputs=False`` a host backend hands out read-only views of the arena instead, valid until the
        next run (no copy in a loop that consumes them at once). Once the binding's steps are recorded as chains,
        inputs may be read where the caller holds them and outputs written straight into fresh arrays, handed out
        as they are instead of copies (``direct_io.py``; ``fresh_outputs`` names them): with ``copy_outputs``, or
        with ``fresh=True`` beside ``copy_outputs=False`` (a caller that copies the views itself; without it, views
        stay views: no allocation). ``trace=True`` measures allocations made outside the arena
        (``memory.transient_peak``)."""
        self._check_open()
        if dims is not None:
            self.bind(dims)
        inputs = inputs if inputs is not None else {}
        if inputs.keys() != self._input_names:  # the usual call passes exactly the inputs: nothing to check
            inputs = dict(inputs)
            for name in inputs:
                if name in self._states:
                    raise InputError(f"'{name}' is a state of this program: it persists across runs; set it with "
                                     f"set_state('{name}', value), not as an input")
            check_input_names(inputs, sorted(self._inputs), self._known_inputs)
        stats = self.stats
        stats.runs += 1
        stats.bytes_in = stats.bytes_out = stats.bytes_device = 0
        copy_in = self.backend.copy_in
        # past the recording (``direct_io``): inputs read where the caller holds them, outputs written fresh
        direct = self._direct if self._replay is not None and kernel_profile.active() is None else None
        if direct is not None:
            direct.begin()
        for k, (name, node, slot, shape, dtype, address) in enumerate(self._input_specs):
            given = inputs[name]
            if direct is not None and direct.read_in_place(k, given):
                continue  # (also where it is its slot's memory: one look at its address, not two)
            if _same_memory(given, slot, address):
                continue  # written in its slot by the caller (``input(name)``): bound without a copy
            arr = np.asarray(given)
            if arr.shape != shape or arr.dtype != dtype:
                check_array("input", node, arr, self.dims)  # raises, naming the input
            copy_in(slot, arr)
            stats.bytes_in += arr.nbytes
        written = {}  # output name -> the fresh array the run writes it into
        if direct is not None:
            if copy_outputs or fresh:
                written = direct.fresh_outputs()
            direct.relocation.apply(direct.deltas)
        self.fresh_outputs = direct.names if written else frozenset()
        if trace:
            tracemalloc.start()
        try:
            self._launch()
            stats.bytes_device += sum(value.nbytes for _, value in self._write_back)
            self.backend.synchronize()
            if trace:
                self.memory.transient_peak = tracemalloc.get_traced_memory()[1]
        finally:
            if direct is not None:
                direct.relocation.restore()  # no table keeps pointing at the caller's memory
            if trace:
                tracemalloc.stop()
        views = self._output_views
        if views:
            if written:
                views = {name: written.get(name, view) for name, view in views.items()}
            if not copy_outputs:
                return dict(views)
            out = {name: view if name in written else np.array(view, copy=True) for name, view in views.items()}
            stats.bytes_out += sum(arr.nbytes for name, arr in out.items() if name not in written)
            return out
        return {name: self._read(flat, bv, copy_outputs) for name, (flat, bv) in self._outputs.items()}

    def execute(self, inputs: Mapping[str, np.ndarray] | None = None) -> None:
        """Run the program once without host transfers and wait: what a benchmark times. ``inputs`` (given on
        the first call, or to change them) are staged in device memory once (``backend.upload``); every call
        copies them device-side into their slots (the plan may reuse an input's slot for later values) and runs
        the kernels (one graph replay where the backend has graphs). States keep their values across calls."""
        self._check_open()
        if inputs is not None:
            inputs = dict(inputs)
            check_input_names(inputs, sorted(self._inputs), self._known_inputs)
            staged = []
            for name, (node, slot) in self._inputs.items():
                given = inputs[name]
                arr = given if hasattr(given, "__cuda_array_interface__") else np.asarray(given)
                check_array("input", node, arr, self.dims)
                staged.append((slot, self.backend.upload(arr)))
            self._staged = staged
        elif not self._staged and self._inputs:
            names = ", ".join(repr(n) for n in self._inputs)
            raise InputError(f"execute: no inputs are staged yet; pass them on the first call (inputs {names})")
        for slot, value in self._staged:
            self.backend.copy(slot, value)
        self.stats.bytes_device = sum(value.nbytes for _, value in self._staged)
        self._launch()
        self.backend.synchronize()

    def _launch(self) -> None:
        """Every kernel step, then the states' write-backs, in program order: recorded as one device graph at the
        second run of a binding where the backend has graphs, and replayed from then on."""
        profile = kernel_profile.active()
        if profile is not None:  # ``--profile``: every step timed on its own (synchronised), no graph replay
            if profile.top and self._instances is None:
                self._instances = [kernel_profile.STREAMING if nid is None else
                                   _describe(self._by_id[nid], self._by_id, self.dims)
                                   for nid in self._step_nodes]
            with np.errstate(all="ignore"):
                profile.run_steps(self._steps, self._labels, self.backend.synchronize,
                                  self._instances if profile.top else None)
            for buf, value in self._write_back:
                self.backend.copy(buf, value)
            return
        if self._replay is None and self._graphs and self._launches >= self._capture_after:
            self._replay = self._capture()
        self._launches += 1
        if self._replay is not None:
            self.stats.replays += 1
            self._replay()
            return
        with np.errstate(all="ignore"):
            for step in self._steps:
                step()
        for buf, value in self._write_back:
            self.backend.copy(buf, value)

    def warm(self) -> None:
        """Load now what recording this binding's steps as a device graph will load (``backend.warm``: the CPU
        backend's chains), where the backend has it: a caller that binds before reading its weights moves those
        loads ahead of them. Runs nothing."""
        warm = getattr(self.backend, "warm", None)
        if warm is None or not self._graphs or self.streamer is not None:
            return
        try:
            warm([*self._steps, *(_copy_step(self.backend, buf, value) for buf, value in self._write_back)])
        except GraphCaptureError:  # said (once) where the recording itself is tried
            return

    def _buffer_lifetimes(self) -> list[tuple[int, int, int, int]] | None:
        """The arena's buffers as ``(first byte, end byte, first step, last step)``, steps as indices in
        ``self._steps`` (-1: live before the first step; past the last: live after it), for a backend whose
        recording may move temporaries (``cpu/jit/rename.py``); None where the arena is not host memory."""
        arena = self.arena
        if not isinstance(arena, np.ndarray) or not self.plan.buffers:
            return None
        base = arena.ctypes.data
        position = {nid: k for k, nid in enumerate(self.plan.order)}
        at = sorted((position[nid], i) for i, nid in enumerate(self._step_nodes) if nid in position)
        keys = [k for k, _ in at]
        after = len(self._steps) + len(self._write_back)
        out = []
        for b in self.plan.buffers:
            if b.nbytes <= 0:
                continue
            lo = bisect.bisect_left(keys, b.start)  # the first step at or after its first node
            hi = bisect.bisect_right(keys, b.end) - 1  # the last step at or before its last node
            first = -1 if b.start < 0 or lo >= len(at) else at[lo][1]
            last = after if b.end >= len(self.plan.order) - 1 or hi < 0 else at[hi][1]
            out.append((base + b.offset, base + b.offset + b.nbytes, first, last))
        return out

    def _capture(self):
        steps = [*self._steps, *(_copy_step(self.backend, buf, value) for buf, value in self._write_back)]
        try:
            if getattr(self.backend, "takes_buffers", False):
                replay = self.backend.capture(steps, self._buffer_lifetimes())
            else:
                replay = self.backend.capture(steps)
            if replay is None:  # nothing worth recording (the CPU backend's chains): steps one by one
                self._graphs = False
            else:
                self._direct = DirectIO.plan(self, replay)
            return replay
        except GraphCaptureError as exc:
            self._graphs = False
            _notice(self.backend, str(exc))
            return None

    def _read(self, flat: Array, bv, copy: bool) -> np.ndarray:
        if not self.backend.host_arrays:
            flat = self.backend.download(flat)
            self.stats.bytes_out += flat.nbytes
            copy = False  # already a fresh host array
        view = strided(flat, bv)
        if view is not None:
            if copy:
                view = np.array(view, copy=True)
                self.stats.bytes_out += view.nbytes
            return view
        out = np.empty(bv.shape, flat.dtype)
        gather_into(out, flat, bv)
        if self.backend.host_arrays:
            self.stats.bytes_out += out.nbytes
        return out


def _dims_key(dims: Mapping[str, int]) -> tuple:
    return tuple(sorted(dims.items()))


def _shared_state(other: Executable, node: Node, nbytes: int) -> Array:
    """``other``'s buffer of state ``node.name``: it must exist there with the same dtype and size."""
    if node.name in other._states:
        theirs, buf = other._states[node.name]
        if theirs.dtype == node.dtype and buf.nbytes == nbytes:
            return buf
        raise InputError(f"state '{node.name}' is {node.dtype} of {nbytes} bytes here but {theirs.dtype} of "
                         f"{buf.nbytes} bytes in the executable it is shared with; load both at the same dims")
    raise InputError(f"state '{node.name}' is not a state of the executable it should be shared with (its "
                     f"states: {', '.join(other._states) or 'none'})")


def _describe(node: Node, by_id: dict[int, Node], dims: Mapping[str, int]) -> str:
    """A kernel instance for the profile: op, output shape and dtype, expression, and the views it reads."""
    parts = [node.op, "x".join(map(str, declared_shape(node, dims))), node.dtype.value]
    expr = node.attr("expr") if node.op == "Elementwise" else None
    if isinstance(expr, str):
        parts.append(expr)
    reads = []
    for src, view in node.inputs:
        bv = view.bind(dims)
        if by_id[src].op == "Constant" and not any(bv.strides):
            reads.append("const")
            continue
        text = "x".join(map(str, bv.shape)) + ":" + ",".join(map(str, bv.strides))
        if bv.offset:
            text += f"+{bv.offset}"
        if bv.mask is not None:
            text += " masked"
        reads.append(text)
    return " ".join(parts) + " <- " + "; ".join(reads)


def _copy_step(backend: Backend, dst: Array, src: Array):
    return lambda: backend.copy(dst, src)


def _notice(backend: Backend, why: str) -> None:
    """The one line saying a program runs kernel by kernel rather than as a device graph, and why."""
    print(f"note: {backend.name}: running the program kernel by kernel, not as one device graph: {why}",
          file=sys.stderr)


def _address(arr) -> tuple | None:
    for attr in ("__array_interface__", "__cuda_array_interface__"):
        info = getattr(arr, attr, None)
        if info is not None:
            return info["data"][0], tuple(arr.shape), info.get("strides"), str(arr.dtype)
    return None


def _same_memory(given, slot, slot_address: tuple | None = None) -> bool:
    """``given`` is exactly the slot's memory: same address, contiguous, same size and dtype (``slot_address``:
    ``_address(slot)``, worked out once)."""
    if isinstance(given, np.ndarray) and isinstance(slot, np.ndarray):  # the host case, without building strings
        start = slot_address[0] if slot_address is not None else slot.__array_interface__["data"][0]
        return (given.size == slot.size and given.dtype == slot.dtype and given.flags.c_contiguous
                and given.__array_interface__["data"][0] == start)
    a, b = _address(given), slot_address or _address(slot)
    return (a is not None and b is not None and a[0] == b[0] and a[2] is None and a[3] == b[3]
            and math.prod(a[1]) == math.prod(b[1]))


def _node_symbols(program: Program, by_id: dict[int, Node]) -> dict[int, frozenset[str]]:
    """Per node: the dims its kernel's binding depends on - its shape, its input views and its inputs' shapes
    (a kernel is prepared from these alone: ``KernelContext``)."""
    out = {}
    for node in program.nodes:
        names = set(free_symbols(node.shape))
        for src, view in node.inputs:
            names |= free_symbols(by_id[src].shape) | free_symbols((*view.shape, *view.strides, view.offset))
            if view.mask is not None:
                names |= free_symbols([d for pair in view.mask for d in pair])
        out[node.id] = frozenset(names)
    return out


def _live_schedule(plan: MemoryPlan, outputs: dict, by_id: dict[int, Node], sizes: dict,
                   scratch_bytes: dict[int, int]) -> int:
    """The most bytes held at one step by live activation arrays and kernel scratch, summed over the arrays
    actually bound (unaligned): a check on the plan, which must be at least this large."""
    step_of = {nid: i for i, nid in enumerate(plan.order)}
    end = len(plan.order)
    last: dict[int, int] = {}
    for nid in plan.order:
        for src, _ in by_id[nid].inputs:
            last[src] = max(last.get(src, -1), step_of[nid])
    for src, _ in outputs.values():
        last[src] = end
    spans: dict[int, list[int]] = {}  # in-place chains share one buffer: keyed by the chain's root
    for nid in plan.order:
        if nid in plan.resident:
            continue
        root = nid
        while root in plan.aliases:
            root = plan.aliases[root]
        start = 0 if by_id[nid].op == "Input" else step_of[nid] + 1
        stop = last.get(nid, step_of[nid]) + 1
        lo, hi = spans.get(root, [start, stop])
        spans[root] = [min(lo, start), max(hi, stop)]
    delta = [0] * (end + 3)
    for root, (lo, hi) in spans.items():
        delta[lo] += sizes[root]
        delta[hi + 1] -= sizes[root]
    for nid, nbytes in scratch_bytes.items():
        if nid in step_of and nbytes:
            delta[step_of[nid] + 1] += nbytes
            delta[step_of[nid] + 2] -= nbytes
    live = peak = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak
