"""Inputs read where the caller holds them and outputs written straight into fresh memory, without copying them
through their slots of the arena (host backends whose recorded runs can be re-pointed: the CPU backend's chains).

``Executable.run`` copies each input into its slot and, unless asked for views, each output out of its slot. A
decode step over a KV cache passed in and handed back (``torch.compile``'s ``DynamicCache``: 24 inputs of 0.5 MB,
concatenated into 24 outputs) spent ~4 ms of its ~40 in those two copies. Once a binding's steps are recorded as
chains (``cpu/jit/chain.py``), every chained call's arrays are addresses in the chain's int table (or in int64
tables of operand addresses a call is given): a slot read or written only by chained calls can be moved, per run,
by patching those addresses (``chain.Relocation``).

Per binding, at the recording (``DirectIO.plan``):

- an input is read in place when every kernel reading it runs inside a chain, none writes into it (no in-place
  kernel takes its buffer: ``MemoryPlan.aliases``; ``Call.access`` where given), and it is no output of the
  program. Within the input's lifetime no other value shares its bytes (the planner's contract), so the arrays of
  its readers' calls inside the slot are the input's; later values in the same bytes are other steps' and stay;
- an output is written into a fresh array per run when its kernel and every kernel reading it run inside chains,
  it owns its buffer (not computed in place into another, nothing computed in place into it), it is no input,
  state or weight, and the executable hands it out as a view of its slot.

Slots under ``MIN_BYTES`` are copied as before (a copy of a few KiB costs less than patching). Per run
(``begin``, ``read_in_place``, ``fresh_outputs``, then ``apply``/``restore`` around the kernels): an
input array is read in place when it is a C-contiguous numpy array of the slot's exact shape and dtype whose
bytes lie outside the arena and the states' buffers (which the run writes); otherwise it is copied as before.
The addresses are put back after each run, so no table keeps pointing at a caller's memory. Nothing is written
into an input read in place. The same compiled calls run on the same values: outputs are bit for bit those of
the copying path. ``LUMINAL_RECIPES_DIRECT_IO=0`` turns it off (every input and output copied).

A chained kernel that refuses its input runs again on its own to raise its located error (``chain._Chain._failed``);
it then reads its slot, which holds no copy of an input read in place: the run still fails (an ``InputError``), the
message possibly the chain's generic one rather than the kernel's.
"""

from __future__ import annotations

import os

import numpy as np

from .kernels.context import ALIGNMENT
from .views import in_bounds, is_unmasked, strided

ENV = "LUMINAL_RECIPES_DIRECT_IO"
# slots smaller than this are copied as before: patching the tables costs a few microseconds a run, a copy of a
# few KiB less (a decoding loop's token and position; the LLM decode's KV caches are states, not inputs)
MIN_BYTES = 1 << 16


def enabled() -> bool:
    """Whether inputs may be read in place and outputs written into fresh memory (``LUMINAL_RECIPES_DIRECT_IO``
    not 0), read at each recording."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _start_of(arr: np.ndarray) -> int:
    """The address of ``arr``'s first element."""
    return arr.__array_interface__["data"][0]


def _start_reader():
    """``_start_of`` read from the array object itself: its ``data`` pointer follows the object header, as NumPy's
    C API lays an array out (``PyArrayObject_fields``). ~0.1 us against ~0.9 us for ``__array_interface__``,
    which builds a dict; a decode step asks for ~50 addresses (each input read in place, each fresh output), its
    Python cold. None where the layout is not that one (checked here on arrays of several kinds: another
    interpreter, a build with another object header), or without ctypes."""
    try:
        import ctypes

        read, header = ctypes.c_size_t.from_address, object.__basicsize__
        base = np.empty(4096, np.uint8)
        probes = [np.empty(n, np.uint8) for n in (0, 1, 100, 1 << 20)]
        probes += [base[64:], base[1:], base.view(np.float32)[4:].reshape(-1, 4)[::2].T, np.zeros(())]
        if all(read(id(a) + header).value == _start_of(a) for a in probes):
            return lambda arr: read(id(arr) + header).value
    except Exception:  # (no ctypes, or an object ctypes cannot read): the plain way
        pass
    return None


# an array's address (every caller passes a numpy array): read from the array object where ``_start_reader`` checks
# out, else through ``__array_interface__``
_start = _start_reader() or _start_of


def _fresh_bytes(nbytes: int) -> tuple[np.ndarray, int, int]:
    """A new uninitialised byte buffer holding ``nbytes`` from a cache line on, as the planner places every slot:
    ``(buffer, offset of that cache line in it, its address)``."""
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = _start(raw)
    skip = -start % ALIGNMENT
    return raw, skip, start + skip


def fresh_flat(nbytes: int, dtype) -> np.ndarray:
    """A new flat array of ``nbytes`` on a cache line (uninitialised: the kernel writing the output writes all
    of it)."""
    raw, skip, _ = _fresh_bytes(nbytes)
    return raw[skip:skip + nbytes].view(dtype)


class DirectIO:
    """One binding's inputs read in place and outputs written into fresh memory (see the module docstring)."""

    def __init__(self, relocation, inputs: dict[int, tuple], outputs: list[tuple], avoid: list[tuple[int, int]]):
        self.relocation = relocation
        self.inputs = inputs  # position in ``_input_specs`` -> (region, slot start, shape, dtype, nbytes)
        self.outputs = outputs  # (region, slot start, nbytes, dtype, [(output name, its bound view)])
        self.avoid = avoid  # byte ranges the run writes (arena, states): an input there is copied
        self.deltas = np.zeros(len(relocation.ok), np.int64)
        # per output buffer, its views' (name, shape, byte strides, byte offset), worked out once: a run then builds
        # each view with one ``np.ndarray`` call (a decode step hands out 25: ~14 us each through ``strided``,
        # its Python cold after the kernels streamed the weights); None where only ``strided`` can (masked views)
        self._layouts = [_layouts(nbytes, np.dtype(dtype), views) for _, _, nbytes, dtype, views in outputs]
        self.names = frozenset(name for *_, views in outputs for name, _ in views)
        self.refused: dict[str, str] = {}  # the inputs and outputs still copied, and why (``plan``)

    @classmethod
    def plan(cls, exe, replay) -> DirectIO | None:
        """The inputs and outputs of ``exe``'s current binding that can bypass their slots under ``replay`` (its
        recorded steps); None where none can, or the recording cannot be re-pointed."""
        make = getattr(replay, "relocation", None)
        if make is None or not enabled() or not exe.backend.host_arrays or exe.streamer is not None:
            return None
        program, plan = exe.program, exe.plan
        step_of = {nid: i for i, nid in enumerate(exe._step_nodes) if nid is not None}
        readers: dict[int, list[int]] = {}
        for node in program.nodes:
            for src, _ in node.inputs:
                readers.setdefault(src, []).append(node.id)
        shared = set(plan.aliases) | set(plan.aliases.values())  # buffers written in place
        output_srcs = {src for src, _ in program.outputs.values()}

        def steps_of(nids) -> set[int] | None:
            got = {step_of.get(n) for n in nids}
            return None if None in got else got

        regions, inputs, outputs = [], {}, []
        refused: dict[str, str] = {}  # input or output name -> why it is copied
        for k, (name, node, slot, shape, dtype, _) in enumerate(exe._input_specs):
            steps = steps_of(readers.get(node.id, ()))
            if slot.nbytes < MIN_BYTES:
                continue
            if not isinstance(slot, np.ndarray) or node.id in shared or node.id in output_srcs or not steps:
                refused[name] = ("written in place" if node.id in shared else "an output too" if node.id in
                                 output_srcs else "a reader outside the chains" if steps is None else "not read")
                continue
            start = _start(slot)
            inputs[k] = (len(regions), start, tuple(shape), np.dtype(dtype), slot.nbytes)
            regions.append((start, start + slot.nbytes, steps, True))
        by_src: dict[int, list] = {}
        if exe._output_views:  # outputs handed out as views of their slots (not gathered)
            for name, (flat, bv) in exe._outputs.items():
                by_src.setdefault(program.outputs[name][0], []).append((name, bv, flat))
        written_back = {program.outputs[name][0] for name in exe._states if name in program.outputs}
        for src, views in by_src.items():
            node, flat = exe._by_id[src], views[0][2]
            if flat.nbytes < MIN_BYTES:
                continue
            if (node.op == "Input" or src in plan.resident or src in shared or src in written_back
                    or src not in step_of or not isinstance(flat, np.ndarray)
                    or any(f is not flat for *_, f in views)):
                refused.update((name, "not a kernel's own buffer") for name, *_ in views)
                continue
            steps = steps_of(readers.get(src, ()))
            if steps is None:
                refused.update((name, "a reader outside the chains") for name, *_ in views)
                continue
            start = _start(flat)
            outputs.append((len(regions), start, flat.nbytes, flat.dtype, [(name, bv) for name, bv, _ in views]))
            regions.append((start, start + flat.nbytes, steps | {step_of[src]}, False))
        if not regions:
            return None
        relocation = make(regions)
        for k, spec in inputs.items():
            if not relocation.ok[spec[0]]:
                refused[exe._input_specs[k][0]] = relocation.why[spec[0]]
        for spec in outputs:
            if not relocation.ok[spec[0]]:
                refused.update((name, relocation.why[spec[0]]) for name, _ in spec[4])
        inputs = {k: spec for k, spec in inputs.items() if relocation.ok[spec[0]]}
        outputs = [spec for spec in outputs if relocation.ok[spec[0]]]
        if not inputs and not outputs:
            return None
        avoid = [(_start(exe.arena), _start(exe.arena) + exe.arena.nbytes)]
        avoid += [(_start(buf), _start(buf) + buf.nbytes) for _, buf in exe._states.values()
                  if isinstance(buf, np.ndarray)]
        direct = cls(relocation, inputs, outputs, avoid)
        direct.refused = refused
        return direct

    def begin(self) -> None:
        self.deltas[:] = 0

    def read_in_place(self, k: int, given) -> bool:
        """Whether input ``k`` (its position in ``_input_specs``) is read from ``given`` this run, not copied: read
        where the caller holds it, or ``given`` is its slot's own memory (written there by the caller: nothing to
        move)."""
        spec = self.inputs.get(k)
        if spec is None or type(given) is not np.ndarray:
            return False
        region, slot_start, shape, dtype, nbytes = spec
        flags = given.flags
        if given.shape != shape or given.dtype != dtype or not flags.c_contiguous or not flags.aligned:
            return False
        start = _start(given)
        if start == slot_start:
            return True  # (its delta stays 0: ``begin``)
        end = start + nbytes
        for lo, hi in self.avoid:
            if start < hi and lo < end:
                return False
        self.deltas[region] = start - slot_start
        return True

    def fresh_outputs(self) -> dict[str, np.ndarray]:
        """Per output written into fresh memory this run: its array (a view of a new buffer, writeable)."""
        out = {}
        deltas = self.deltas
        for (region, slot_start, nbytes, dtype, views), layouts in zip(self.outputs, self._layouts):
            if layouts is None:
                flat = fresh_flat(nbytes, dtype)
                deltas[region] = _start(flat) - slot_start
                for name, bv in views:
                    out[name] = strided(flat, bv, writeable=True)
                continue
            raw, skip, start = _fresh_bytes(nbytes)
            deltas[region] = start - slot_start
            for name, shape, strides, offset in layouts:
                out[name] = np.ndarray(shape, dtype, raw, skip + offset, strides)
        return out


def _layouts(nbytes: int, dtype: np.dtype, views) -> list[tuple] | None:
    """``(name, shape, byte strides, byte offset)`` of each view of a flat buffer of ``nbytes`` (``fresh_outputs``);
    None when one is masked, empty, reads outside the buffer or runs backwards (``strided`` handles those)."""
    size = nbytes // dtype.itemsize
    out = []
    for name, bv in views:
        if not is_unmasked(bv) or not in_bounds(bv, size) or 0 in bv.shape or any(s < 0 for s in bv.strides):
            return None
        out.append((name, tuple(bv.shape), tuple(s * dtype.itemsize for s in bv.strides), bv.offset * dtype.itemsize))
    return out
