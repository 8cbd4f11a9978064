"""The two CUDA backends and the executable that runs a Program on either.

``CudaEmuBackend`` (name ``cuda-emu``): numpy arrays, the program's CUDA C module built by g++ (``emu.py``), GEMMs
through the numpy model of their cuBLAS descriptor (``gemm.run_model``). Needs only g++ and numpy.
``CudaBackend`` (name ``cuda``): CuPy device arrays, the module compiled by NVRTC (``nvrtc.py``) and loaded with
``cupy.RawModule``, GEMMs through cuBLAS ``gemmStridedBatchedEx`` (f32 compute). Importing this module needs
neither CuPy nor a GPU; ``CudaBackend()`` explains what is missing.

``CudaExecutable`` prepares every node (``nodes.prepare``), plans one arena with the kernels' scratch
(``runtimes.memory.plan_memory``), builds one module for the whole program, binds every launch's arguments once
and runs the steps in program order. It follows the backend contract (BACKEND_CONTRACT.md) so that the generic
executable of issue 9 can replace it: ``Backend.allocate / slot / upload / copy_in / download / synchronize``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from luminal_recipes.errors import InputError, LuminalError
from luminal_recipes.graph.core import Node
from luminal_recipes.runtimes.binding import check_array, check_input_names, declared_shape, fetch_weight
from luminal_recipes.runtimes.kernels.context import KernelContext, KernelInput, Scratch, aligned
from luminal_recipes.runtimes.memory import MemoryPlan, check_dims, plan_memory
from luminal_recipes.runtimes.program import KERNELS, Program
from luminal_recipes.runtimes.protocol import MemoryReport, RuntimeBase
from luminal_recipes.runtimes.views import gather_into, strided

from . import gemm as gemm_mod
from .module import module_source
from .nodes import PREPARE, CudaOptions, SkipIfSame, prepare
from .plan import Gemm, IndexCheck, Launch, NodePlan, Ref

SOURCES = ("Input", "Constant")


class CudaUnavailableError(LuminalError):
    """The cuda runtime cannot start here (no CuPy, or no GPU); the message says which and what to install."""


@dataclass
class DeviceBuffer:
    """A typed region of a backend array: ``base`` (the backend's flat uint8 array), byte ``offset``, ``dtype``
    (numpy, ml_dtypes included), element count ``size``."""

    base: object
    offset: int
    dtype: np.dtype
    size: int

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


# ---- cuda-emu -------------------------------------------------------------------------------------------------
class CudaEmuBackend:
    name = "cuda-emu"
    device = "cpu (CUDA C through g++)"

    def __init__(self, options: CudaOptions | None = None, sanitize: str | None = None):
        self.options = options or CudaOptions(max_blocks=64)
        self.sanitize = sanitize

    def allocate(self, nbytes: int) -> np.ndarray:
        if self.sanitize:  # exactly sized, so AddressSanitizer's red zone starts right after the last byte
            return np.zeros(max(nbytes, 1), dtype=np.uint8)
        raw = np.zeros(max(nbytes, 1) + 256, dtype=np.uint8)
        skip = -raw.ctypes.data % 256  # 256-byte aligned, as cudaMalloc's
        return raw[skip: skip + max(nbytes, 1)]

    def address(self, base: np.ndarray) -> int:
        return base.ctypes.data

    def upload(self, host: np.ndarray) -> np.ndarray:
        flat = np.ascontiguousarray(host).reshape(-1)
        return flat.view(np.uint8) if flat.size else np.zeros(1, np.uint8)

    def copy_in(self, dst: DeviceBuffer, src: np.ndarray) -> None:
        view = dst.base[dst.offset: dst.offset + dst.nbytes]
        view[...] = np.ascontiguousarray(src, dtype=dst.dtype).reshape(-1).view(np.uint8)

    def download(self, src: DeviceBuffer) -> np.ndarray:
        return src.base[src.offset: src.offset + src.nbytes].view(src.dtype).copy()

    def copy_device(self, dst: DeviceBuffer, src) -> None:
        dst.base[dst.offset: dst.offset + dst.nbytes] = src[: dst.nbytes]

    def synchronize(self) -> None:
        pass

    def compile(self, sources, describe) -> object:
        from .emu import compile_emu

        return compile_emu(module_source(sources), self.sanitize, describe)

    def launcher(self, module, source, launch: Launch, args: list):
        return module.launcher(source.name, source.params, launch.grid, launch.block, args)

    def gemm(self, desc, a: tuple, b: tuple, c: tuple):
        def run():
            gemm_mod.run_model(desc, a, b, c)

        return run

    def read_flag(self, base, offset: int) -> int:
        return int(base[offset: offset + 4].view(np.int32)[0])


# ---- cuda (CuPy) ----------------------------------------------------------------------------------------------
INSTALL_HINT = ('install the CUDA extra: pip install -e ".[cuda13]" (CUDA 13 drivers) or ".[cuda]" (CUDA 12); '
                "it brings CuPy and the NVRTC/CUDA headers wheels")


def require_cupy():
    """CuPy and a visible GPU, or a CudaUnavailableError saying which is missing (one paragraph)."""
    try:
        import cupy
    except ImportError as e:
        raise CudaUnavailableError(f"the cuda runtime needs CuPy, which is not installed ({e}); {INSTALL_HINT}. "
                                   "Without a GPU, --runtime numpy runs everything on the CPU.") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError when the driver is missing
        raise CudaUnavailableError(f"the cuda runtime found CuPy {cupy.__version__} but no usable GPU ({e}). Run "
                                   "on a machine with an NVIDIA GPU and driver, or use --runtime numpy.") from None
    if count == 0:
        raise CudaUnavailableError(f"the cuda runtime found CuPy {cupy.__version__} but no GPU (0 devices). Run on "
                                   "a machine with an NVIDIA GPU, or use --runtime numpy.")
    return cupy


class CudaBackend:
    name = "cuda"

    def __init__(self, options: CudaOptions | None = None, device_id: int = 0):
        cp = require_cupy()
        self.cp = cp
        self.dev = cp.cuda.Device(device_id)
        props = cp.cuda.runtime.getDeviceProperties(device_id)
        self.arch = f"sm_{props['major']}{props['minor']}"
        self.device = f"{props['name'].decode() if isinstance(props['name'], bytes) else props['name']} " \
                      f"({self.arch})"
        sms = props["multiProcessorCount"]
        self.options = options or CudaOptions(max_blocks=sms * 16)
        self._handle = None

    @property
    def handle(self):
        if self._handle is None:
            from cupy_backends.cuda.libs import cublas

            self._handle = cublas.create()
            cublas.setStream(self._handle, self.cp.cuda.get_current_stream().ptr)
        return self._handle

    def allocate(self, nbytes: int):
        return self.cp.zeros(max(nbytes, 1), dtype=self.cp.uint8)

    def address(self, base) -> int:
        return int(base.data.ptr)

    def upload(self, host):
        """A weight or constant in device memory; a device array (CuPy, ``device.DeviceTensor``, anything with
        ``__cuda_array_interface__``) is bound as it is, without a copy."""
        if hasattr(host, "__cuda_array_interface__"):
            from .device import DeviceTensor

            dev = self.cp.asarray(host.data if isinstance(host, DeviceTensor) else host)  # cupy's .data is a pointer
            if not dev.flags.c_contiguous:
                raise InputError("a device weight must be C-contiguous (bound without a copy)")
            return dev.reshape(-1).view(self.cp.uint8) if dev.size else self.cp.zeros(1, self.cp.uint8)
        flat = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        return self.cp.asarray(flat) if flat.size else self.cp.zeros(1, self.cp.uint8)

    def copy_in(self, dst: DeviceBuffer, src: np.ndarray) -> None:
        host = np.ascontiguousarray(src, dtype=dst.dtype).reshape(-1).view(np.uint8)
        dst.base[dst.offset: dst.offset + dst.nbytes].set(host)

    def download(self, src: DeviceBuffer) -> np.ndarray:
        return self.cp.asnumpy(src.base[src.offset: src.offset + src.nbytes]).view(src.dtype)

    def copy_device(self, dst: DeviceBuffer, src) -> None:
        self.cp.copyto(dst.base[dst.offset: dst.offset + dst.nbytes], src[: dst.nbytes])

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def compile(self, sources, describe):
        from .nvrtc import compile_cubin

        cubin = compile_cubin(module_source(sources), self.arch, describe)
        return self.cp.RawModule(code=cubin)

    def launcher(self, module, source, launch: Launch, args: list):
        fn = module.get_function(source.name)
        packed = tuple(np.uint64(a) if p.endswith("*") else _NP_SCALAR[p.replace("const ", "").strip()](a)
                       for p, a in zip(source.params, args, strict=True))
        grid, block = launch.grid, launch.block

        def run():
            fn(grid, block, packed)

        return run

    def gemm(self, desc, a: tuple, b: tuple, c: tuple):
        from cupy_backends.cuda.libs import cublas

        alpha, beta = np.array(desc.alpha, np.float32), np.array(desc.beta, np.float32)
        t = gemm_mod.CUDA_DATA_TYPE
        args = (gemm_mod.CUBLAS_OP_T if desc.trans_a else gemm_mod.CUBLAS_OP_N,
                gemm_mod.CUBLAS_OP_T if desc.trans_b else gemm_mod.CUBLAS_OP_N, desc.m, desc.n, desc.k,
                alpha.ctypes.data, a, t[desc.a_type.name], desc.lda, desc.stride_a, b, t[desc.b_type.name], desc.ldb,
                desc.stride_b, beta.ctypes.data, c, t[desc.c_type.name], desc.ldc, desc.stride_c, desc.batch,
                gemm_mod.CUBLAS_COMPUTE_32F, gemm_mod.CUBLAS_GEMM_DEFAULT)
        handle = self.handle

        def run(keep=(alpha, beta)):
            cublas.gemmStridedBatchedEx(handle, *args)

        return run

    def read_flag(self, base, offset: int) -> int:
        return int(self.cp.asnumpy(base[offset: offset + 4]).view(np.int32)[0])


_NP_SCALAR = {"int": np.int32, "unsigned": np.uint32, "long long": np.int64, "float": np.float32}


# ---- the executable -------------------------------------------------------------------------------------------
class CudaRuntime(RuntimeBase):
    """``Runtime`` over a CUDA backend (cuda or cuda-emu)."""

    def __init__(self, backend):
        self.backend = backend
        self.name = backend.name
        self.device = backend.device

    def capabilities(self) -> set[str]:
        return {op for op in KERNELS if op in PREPARE or op in SOURCES}

    def plan(self, program: Program, dims=None, weight_bytes=None) -> MemoryPlan:
        prepared = prepare_program(program, dict(dims or {}), self.backend.options)
        return plan_memory(program, dims, weight_bytes, {nid: s.nbytes for nid, (_, s) in prepared.items()})

    def load(self, program: Program, weights=None, dims=None) -> CudaExecutable:
        self.check_capabilities(program)
        return CudaExecutable(self.backend, program, weights, dict(dims or {}))


def prepare_program(program: Program, dims: dict, options: CudaOptions) -> dict[int, tuple[NodePlan, Scratch]]:
    check_dims(program, dims)
    by_id = {n.id: n for n in program.nodes}
    out = {}
    for node in program.nodes:
        if node.op in SOURCES:
            continue
        scratch = Scratch()
        inputs = [KernelInput(view.bind(dims), by_id[src].dtype.np, _numel(by_id[src], dims))
                  for src, view in node.inputs]
        ctx = KernelContext(node, declared_shape(node, dims), node.dtype.np, inputs, scratch)
        out[node.id] = (prepare(ctx, options), scratch)
    return out


def _numel(node: Node, dims) -> int:
    return math.prod(declared_shape(node, dims))


class CudaExecutable:
    def __init__(self, backend, program: Program, weights, dims: dict[str, int]):
        self.backend, self.program, self.dims = backend, program, dims
        prepared = prepare_program(program, dims, backend.options)
        self.plan = plan = plan_memory(program, dims, None, {nid: s.nbytes for nid, (_, s) in prepared.items()})
        by_id = {n.id: n for n in program.nodes}
        self.arena = backend.allocate(plan.arena_bytes)
        self.buffers: dict[int, DeviceBuffer] = {}
        self._keep = []
        self._inputs: dict[str, tuple[Node, DeviceBuffer]] = {}
        weight_bytes = 0
        for nid in plan.order:
            node = by_id[nid]
            numel = _numel(node, dims)
            if plan.resident.get(nid) == "weight":
                arr = fetch_weight(weights, node.name)
                check_array("weight", node, arr, dims)
                dev = backend.upload(arr)
                self._keep.append(dev)
                weight_bytes += arr.nbytes
                self.buffers[nid] = DeviceBuffer(dev, 0, node.dtype.np, numel)
            elif node.op == "Constant" or plan.resident.get(nid) == "constant":
                if node.op == "Iota":
                    data = np.arange(numel, dtype=node.dtype.np)
                else:
                    data = node.data if node.data is not None else np.asarray(node.attr("value"), node.dtype.np)
                dev = backend.upload(np.ascontiguousarray(data, dtype=node.dtype.np))
                self._keep.append(dev)
                self.buffers[nid] = DeviceBuffer(dev, 0, node.dtype.np, numel)
            else:
                offset = plan.offsets[nid]
                self.buffers[nid] = DeviceBuffer(self.arena, offset, node.dtype.np, numel)
                if node.op == "Input":
                    self._inputs[node.name] = (node, self.buffers[nid])
        sources, owners = [], {}
        for nid, (np_plan, _) in prepared.items():
            for s in np_plan.sources:
                owners.setdefault(s.name, []).append(f"{by_id[nid].op} #{nid}")
                sources.append(s)
        text = module_source(sources)
        module = backend.compile(sources, _line_owner(text, sources, owners)) if sources else None
        by_name = {s.name: s for s in sources}
        self._steps = []
        base_addr = backend.address(self.arena)
        for nid in plan.order:
            if nid not in prepared:
                continue
            np_plan, scratch = prepared[nid]
            node = by_id[nid]
            scratch_base = base_addr + plan.scratch_offsets.get(nid, 0)
            scratch_offsets, at = [], 0
            for shape, dtype in scratch.specs:
                scratch_offsets.append(at)
                at += aligned(math.prod(shape) * dtype.itemsize)
            out_buf = self.buffers[nid]
            in_bufs = [self.buffers[src] for src, _ in node.inputs]

            def resolve(ref: Ref, out_buf=out_buf, in_bufs=in_bufs, scratch_base=scratch_base,
                        scratch_offsets=scratch_offsets) -> int:
                if ref.kind == "out":
                    buf = out_buf
                elif ref.kind == "in":
                    buf = in_bufs[ref.index]
                else:
                    return scratch_base + scratch_offsets[ref.index] + ref.byte_offset
                return backend.address(buf.base) + buf.offset + ref.byte_offset

            for step in np_plan.steps:
                self._steps.extend(self._bind(step, module, by_name, resolve, scratch, scratch_offsets, nid))
        self._outputs = {name: (self.buffers[src], view.bind(dims)) for name, (src, view) in program.outputs.items()}
        self._known_inputs = {n.name for n in program.nodes if n.op == "Input" and n.attr("kind") != "weight"}
        self._memory = MemoryReport(weight_bytes=plan.weight_bytes, weight_array_bytes=weight_bytes,
                                    constant_bytes=plan.constant_bytes, arena_bytes=plan.arena_bytes,
                                    planned_peak=plan.peak)

    def _bind(self, step, module, by_name, resolve, scratch, scratch_offsets, nid):
        b = self.backend
        if isinstance(step, SkipIfSame):
            if resolve(step.a) == resolve(step.b):
                return []
            step = step.launch
        if isinstance(step, Launch):
            args = [resolve(a) if isinstance(a, Ref) else a for a in step.args]
            return [b.launcher(module, by_name[step.kernel], step, args)]
        if isinstance(step, Gemm):
            return [b.gemm(step.desc, self._operand(resolve, step.a), self._operand(resolve, step.b),
                           self._operand(resolve, step.c))]
        if isinstance(step, IndexCheck):
            flag = resolve(step.flag)
            base = self.arena
            offset = flag - b.address(base)

            def check(message=step.message, offset=offset):
                if b.read_flag(base, offset):
                    raise InputError(message)

            return [check]
        raise TypeError(f"unknown step {step!r}")

    def _operand(self, resolve, ref: Ref):
        """A GEMM operand: the raw address for cuBLAS, (arena-or-buffer, byte offset) for the numpy model."""
        address = resolve(ref)
        if isinstance(self.backend, CudaEmuBackend):
            for base in [self.arena, *self._keep]:
                start = base.ctypes.data
                if start <= address < start + base.nbytes or (address == start + base.nbytes):
                    return base, address - start
            raise AssertionError("GEMM operand outside every buffer")
        return address

    @property
    def memory(self) -> MemoryReport:
        return self._memory

    def execute(self, inputs: Mapping[str, np.ndarray] | None = None) -> None:
        """Run the program's kernels once without host transfers and wait: what a benchmark times. ``inputs``
        are uploaded once into device staging buffers; every call copies them device-side into the input slots
        the memory plan lets later kernels reuse (the others keep their values from the previous call)."""
        if inputs is not None:
            check_input_names(inputs, sorted(self._inputs), self._known_inputs)
            self._staged = []
            reused = _reused_slots(self.plan, {n.id: n for n in self.program.nodes})
            for name, (node, buf) in self._inputs.items():
                arr = np.asarray(inputs[name])
                check_array("input", node, arr, self.dims)
                self.backend.copy_in(buf, arr)
                if node.id in reused:
                    staged = self.backend.upload(np.ascontiguousarray(arr, dtype=buf.dtype))
                    self._staged.append((buf, staged))
        for buf, staged in getattr(self, "_staged", ()):
            self.backend.copy_device(buf, staged)
        for step in self._steps:
            step()
        self.backend.synchronize()

    def run(self, inputs: Mapping[str, np.ndarray] | None = None, copy_outputs: bool = True
            ) -> dict[str, np.ndarray]:
        inputs = dict(inputs or {})
        check_input_names(inputs, sorted(self._inputs), self._known_inputs)
        for name, (node, buf) in self._inputs.items():
            arr = np.asarray(inputs[name])
            check_array("input", node, arr, self.dims)
            self.backend.copy_in(buf, arr)
        for step in self._steps:
            step()
        self.backend.synchronize()
        out = {}
        for name, (buf, bv) in self._outputs.items():
            flat = self.backend.download(buf)
            view = strided(flat, bv)
            if view is None:
                view = np.empty(bv.shape, flat.dtype)
                gather_into(view, flat, bv)
            out[name] = np.array(view, copy=True)
        return out


def _reused_slots(plan: MemoryPlan, by_id: dict) -> set[int]:
    """Input node ids whose arena bytes another buffer of the plan overlaps (the slot is reused after the
    input's last read, so its value does not survive a run)."""
    spans = [(plan.offsets[n], plan.offsets[n] + plan.nbytes[n], n) for n in plan.offsets]
    out = set()
    for nid, off in plan.offsets.items():
        if by_id[nid].op != "Input":
            continue
        end = off + plan.nbytes[nid]
        if any(o < end and off < e and n != nid for o, e, n in spans):
            out.add(nid)
    return out


def _line_owner(text: str, sources, owners):
    """line number in the module -> 'kernel <name> of <nodes>' for compiler messages."""
    starts = []
    for s in sources:
        at = text.find(s.code.strip())
        if at >= 0:
            starts.append((text.count("\n", 0, at) + 1, text.count("\n", 0, at + len(s.code.strip())) + 1, s.name))

    def owner(line: int) -> str:
        for lo, hi, name in starts:
            if lo <= line <= hi:
                return f"kernel {name} of {', '.join(sorted(set(owners.get(name, []))))}"
        return ""

    return owner
