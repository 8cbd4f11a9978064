"""Runs one built model: binds its symbolic dims from the inputs, plans and compiles once per size bucket,
executes on a runtime within the memory budget.

A ``ModelEngine`` is what a pipeline stage holds while it runs. Dims are served by size buckets: a plan made
before anything was loaded (``plan.StagePlan``) whose dims cover them (each at least as large; the smallest such),
else the bucket of the dims (``bucket_dims``: each rounded up to the next power of two, or to a declared size),
planned then (``plan.plan_model``; the plan cache is keyed on the bucket's dims); a dim that sizes a state (a
KV cache's length) is never rounded up, since a loaded state keeps its shape. One executable is loaded per
bucket and re-bound to each exact length (``Executable.bind``: no reload, no allocation), so a new length
neither re-plans nor reloads. A plan that does not fit the budget is refused before loading. A streamed plan
loads with its blocks' weights streamed (``runtimes.streaming``; on a device runtime through pinned staging of
``host_budget_bytes``). ``release()`` drops the compiled programs, the loaded executables (their activation
arenas, streaming slots and loader threads) and the checkpoint mappings, so at most one large model is resident,
and gives the device memory the runtime's allocator caches back (measured: ``StageStats.device_memory``).

Values cross the model's boundary in the dtypes it declares: a float input is converted to the declared float
dtype (bf16 under ``--compute-dtype bf16``) and float outputs come back as f32, the dtype host steps compute in.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .. import instrument
from ..errors import InputError
from ..graph.symbolic import Expr, evaluate, free_symbols, shape_str
from ..recipe.builder import BuiltModel
from ..runtimes.profile import active as profile_active
from ..runtimes.profile import model_section
from ..runtimes.registry import get_runtime
from .plan import StagePlan, check_budget, plan_model

_F32 = np.dtype(np.float32)  # (``dtype == np.float32`` converts the type to a dtype first: per output, per call)


@dataclass
class StageStats:
    compile_s: float = 0.0
    run_s: list[float] = field(default_factory=list)
    plan: StagePlan | None = None  # the plan of the last executable loaded
    planned_peak: int | None = None  # as the loaded executable accounts it (weights held + constants + arena)
    weight_bytes: int | None = None  # weights held: all of them, or outside blocks + slots when streamed
    arena_bytes: int | None = None
    live_peak: int | None = None  # the most bytes live activations and scratch held at one step
    transient_peak: int | None = None  # allocations outside the arena during the first run (tracemalloc)
    stream: dict | None = None  # streaming's loads, bytes copied/dropped, seconds loading and waiting
    search: str | None = None
    device_memory: dict | None = None  # device bytes held when the stage ended, before and after the release
    loads: int = 0  # executables loaded (one per size bucket)
    rebinds: int = 0  # re-bindings to another exact length within a bucket, and their seconds
    rebind_s: float = 0.0

    def memory(self) -> dict:
        """Planned and measured figures, JSON-ready."""
        out = self.plan.summary() if self.plan else {}
        out.update({"loaded_peak_bytes": self.planned_peak, "live_peak_bytes": self.live_peak,
                    "transient_peak_bytes": self.transient_peak, "loads": self.loads, "rebinds": self.rebinds,
                    "rebind_seconds": round(self.rebind_s, 4)})
        if self.stream is not None:
            out["stream"] = self.stream
        if self.device_memory is not None:
            out["device_memory"] = self.device_memory
        return out


def bucket_dims(dims: Mapping[str, int], sizes: Mapping[str, Sequence[int]] | None = None) -> dict[str, int]:
    """The size bucket of ``dims``: each value rounded up to the smallest declared size that holds it
    (``sizes[name]``), else to the next power of two."""
    out = {}
    for name, value in dims.items():
        declared = sorted(v for v in (sizes or {}).get(name, ()) if v >= value)
        out[name] = declared[0] if declared else 1 << max(0, int(value) - 1).bit_length()
    return out


def read_inputs(model: BuiltModel) -> set[str]:
    """The model inputs its outputs depend on. A declared input the graph never reads (FLUX.2's `guidance`
    when the transformer has no guidance embedding, as in FLUX.2 [klein]) need not be given."""
    graph = model.graph
    seen: set[int] = set()
    todo = [node for node, _ in graph.outputs.values()]
    while todo:
        index = todo.pop()
        if index not in seen:
            seen.add(index)
            todo.extend(child for child, _ in graph.nodes[index].inputs)
    return {graph.nodes[i].name for i in seen if graph.nodes[i].op == "Input"} & set(model.inputs)


def infer_dims(model: BuiltModel, inputs: Mapping[str, np.ndarray], needed: set[str] | None = None
               ) -> dict[str, int]:
    """Bind each symbolic dim from the first input axis that is that symbol times a whole number (``seq``, or
    ``16 * h`` for an image of 16 pixels per latent row); check every shape. ``needed``: the inputs that must be
    given (default: every declared one); others are checked when given."""
    dims: dict[str, int] = {}
    for name, tensor in model.inputs.items():
        if name not in inputs and needed is not None and name not in needed:
            continue
        if name not in inputs:
            raise InputError(f"model '{model.name}' needs input '{name}' {shape_str(tensor.shape)}; the "
                             f"stage does not provide it")
        array = inputs[name]
        if array.ndim != len(tensor.shape):
            raise InputError(f"model '{model.name}' input '{name}' has shape {array.shape}, expected "
                             f"{shape_str(tensor.shape)}")
        for d, n in zip(tensor.shape, array.shape):
            if isinstance(d, Expr) and len(d.terms) == 1 and d.terms[0][1] >= 1 and len(d.terms[0][0]) == 1 \
                    and isinstance(d.terms[0][0][0], str):
                dims.setdefault(d.terms[0][0][0], int(n) // d.terms[0][1])  # a remainder fails the check below
    for name, tensor in model.inputs.items():
        if name not in inputs:
            continue
        want = tuple(evaluate(d, dims) for d in tensor.shape)
        if tuple(inputs[name].shape) != want:
            raise InputError(f"model '{model.name}' input '{name}' has shape {inputs[name].shape}, expected "
                             f"{shape_str(tensor.shape)} = {want}")
    return dims


class ModelEngine:
    """Plan, compile and run one model of a pipeline within ``budget_bytes`` (None: unbounded)."""

    def __init__(self, model: BuiltModel, runtime=None, budget_bytes: int | None = None, compile: bool = True,
                 plans: Sequence[StagePlan] = (), buckets: Mapping[str, Sequence[int]] | None = None,
                 host_budget_bytes: int | None = None):
        self.model = model
        self.runtime = get_runtime(runtime)  # a name or a Runtime (default numpy)
        self.budget_bytes = budget_bytes
        self.host_budget_bytes = host_budget_bytes  # pinned staging of streamed blocks (a device runtime's)
        self.compile = compile
        self.plans = list(plans)  # made in advance (``plan.plan_stages``); used when their dims cover the inputs'
        self.buckets = dict(buckets or {})  # dim name -> declared bucket sizes (else powers of two)
        self.stats = StageStats()
        self._executables: dict[tuple, object] = {}
        # dims that size a state (a KV cache's length) are never bucketed: a loaded state keeps its shape
        self._exact = set().union(*(free_symbols(n.shape) for n in model.graph.inputs("state")))
        self._read: set[str] | None = None  # the inputs the model's outputs depend on
        self._shapes: tuple | None = None  # the last call's input shapes and the dims inferred from them
        self._dims: dict[str, int] = {}
        self._np: dict[str, np.dtype] = {}  # each declared input's numpy dtype, as first seen (read per call)
        self._last: tuple[dict, tuple] | None = None  # the last call's dims and its executable's key

    def _weights(self):
        return self.model.load_weight

    def bucket(self, dims: Mapping[str, int]) -> dict[str, int]:
        """The dims the executable serving ``dims`` is loaded for: the smallest loaded executable or advance plan
        whose dims cover them (each at least as large), else their bucket."""
        def covers(candidate: Mapping[str, int]) -> bool:
            return set(candidate) == set(dims) and all(
                candidate[k] == v if k in self._exact else candidate[k] >= v for k, v in dims.items())

        loaded = [dict(key) for key in self._executables if covers(dict(key))]
        planned = [dict(p.dims) for p in self.plans if p.program is not None and covers(p.dims)]
        if loaded or planned:
            return min(loaded + planned, key=lambda d: sorted(d.values()))
        free = {k: v for k, v in dims.items() if k not in self._exact}
        return {**dims, **bucket_dims(free, self.buckets)}

    def _plan(self, target: dict[str, int], dims: dict[str, int], inputs: Mapping[str, np.ndarray]) -> StagePlan:
        for plan in self.plans:
            if plan.dims == target and plan.program is not None:
                return plan
        # the inputs only serve the compiler's timing, which needs them at the bucket's own dims
        timing = dict(inputs) if target == dims else None
        return plan_model(self.model, target, self.budget_bytes, self.runtime, self.compile,
                          inputs=timing, weights=self._weights(), host_budget=self.host_budget_bytes)

    def executable(self, dims: dict[str, int], inputs: Mapping[str, np.ndarray]):
        last = self._last
        if last is not None and last[0] == dims and last[1] in self._executables:
            key = last[1]  # the dims of the call before: the same executable (none was loaded since)
        else:
            target = self.bucket(dims)
            key = tuple(sorted(target.items()))
        if key not in self._executables:
            t0 = time.perf_counter()
            plan = self._plan(target, dims, inputs)
            if not plan.fits and target != dims:  # the bucket is too large for the budget: these dims alone
                target, key = dict(dims), tuple(sorted(dims.items()))
                plan = self._plan(target, dims, inputs)
            check_budget([plan], self.budget_bytes)  # before a single weight is read
            extra = {"stream": plan.stream, "staging_bytes": self.host_budget_bytes} if plan.streamed else {}
            exe = self.runtime.load(plan.program, self._weights(), target, **extra)
            instrument.count(instrument.LOAD)
            self.stats.compile_s += time.perf_counter() - t0
            self.stats.loads += 1
            self.stats.plan = plan
            self.stats.search = str(plan.program.meta.get("selected_by", ""))
            mem = exe.memory
            self.stats.planned_peak = mem.planned_peak
            self.stats.weight_bytes = mem.weight_bytes
            self.stats.arena_bytes = mem.arena_bytes
            self.stats.live_peak = mem.live_peak
            self._executables[key] = exe
        self._last = (dims, key)
        exe = self._executables[key]
        before = exe.stats.rebinds, exe.stats.rebind_seconds
        exe.bind(dims)  # the exact lengths, within the bucket: no reload, no allocation
        self.stats.rebinds += exe.stats.rebinds - before[0]
        self.stats.rebind_s += exe.stats.rebind_seconds - before[1]
        return exe

    def __call__(self, inputs: Mapping[str, np.ndarray], dims: Mapping[str, int] | None = None
                 ) -> dict[str, np.ndarray]:
        """Run on ``inputs``; ``dims`` gives the symbolic dims no input shape binds (a KV cache's length)."""
        if self._read is None:
            self._read = read_inputs(self.model)
        # an input the graph does not read is no input of its program
        # (np.require, not np.ascontiguousarray: that makes a 0-dim input 1-dim)
        declared, read, wanted = self.model.inputs, self._read, self._np
        given, inputs, shapes = inputs, {}, []
        for k, v in given.items():
            if k in declared:
                if k not in read:
                    continue
                want = wanted.get(k)
                if want is None:
                    want = wanted[k] = declared[k].dtype.np
                if not (type(v) is np.ndarray and v.dtype == want and v.flags.c_contiguous):
                    v = np.require(self._as_declared(k, v), requirements="C")
            else:
                v = np.require(self._as_declared(k, v), requirements="C")
            inputs[k] = v
            shapes.append((k, v.shape))
        shapes = tuple(shapes)
        if shapes != self._shapes:  # the dims follow from the input shapes alone: inferred once per set of shapes
            self._shapes, self._dims = shapes, infer_dims(self.model, inputs, self._read)
        dims = {**self._dims, **(dims or {})}
        exe = self.executable(dims, inputs)
        first = self.stats.transient_peak is None  # measure allocations outside the arena once
        t0 = time.perf_counter()
        # views of the arena, copied below (a copy by ``run`` as well would be a second one), or fresh arrays the
        # run wrote its outputs into (``fresh_outputs``, ``runtimes/direct_io.py``): not copied again
        if profile_active() is None:
            out = (exe.run(inputs, copy_outputs=False, trace=first, fresh=True) if first else
                   exe.run(inputs, copy_outputs=False, fresh=True))
        else:
            with model_section(self.model.name):  # ``--profile``: kernel time per model
                out = exe.run(inputs, copy_outputs=False, trace=first, fresh=True)
        self.stats.run_s.append(time.perf_counter() - t0)
        if first:
            self.stats.transient_peak = exe.memory.transient_peak
        self._record_stream(exe)
        fresh = getattr(exe, "fresh_outputs", ())
        return {k: v if k in fresh and (v.dtype == _F32 or not _narrow_float(v)) else
                np.array(v, dtype=np.float32 if _narrow_float(v) else None, copy=True) for k, v in out.items()}

    def _as_declared(self, name: str, value):
        """A float input in the float dtype the model declares (e.g. bf16 under --compute-dtype bf16)."""
        tensor = self.model.inputs.get(name)
        value = np.asarray(value)
        if tensor is None or not tensor.dtype.is_float or value.dtype == tensor.dtype.np:
            return value
        if value.dtype.kind != "f" and not _narrow_float(value):
            return value  # not a float: the runtime's dtype check names it
        return value.astype(tensor.dtype.np)

    def _record_stream(self, exe) -> None:
        streamer = getattr(exe, "streamer", None)
        if streamer is not None:
            s = streamer.stats
            self.stats.stream = {"loads": s.loads, "bytes_copied": s.bytes_copied,
                                 "bytes_dropped": s.bytes_dropped, "load_seconds": round(s.load_seconds, 4),
                                 "wait_seconds": round(s.wait_seconds, 4), "uploads": s.uploads,
                                 "staging_bytes": s.staging_bytes}

    def release(self) -> None:
        held = self.runtime.memory_held() if hasattr(self.runtime, "memory_held") else None
        for exe in self._executables.values():
            close = getattr(exe, "close", None)
            if close is not None:
                close()  # waits for a prefetch still in flight, so the streaming figures are final
                self._record_stream(exe)
        self._executables.clear()
        released = self.runtime.release_memory() if hasattr(self.runtime, "release_memory") else None
        if released is not None:
            self.stats.device_memory = {"held_at_stage_end_bytes": held, **released}


def _narrow_float(value) -> bool:
    """A float array of a dtype host steps do not compute in (bf16, f16, fp8: ml_dtypes or float16)."""
    dtype = np.asarray(value).dtype
    return dtype != np.float32 and dtype != np.float64 and (dtype.kind == "f" or "float" in dtype.name)
