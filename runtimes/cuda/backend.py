"""The two CUDA backends of the generic executable (``runtimes.executable``), and the runtimes made of them.

Both implement every kernel of the registry the same way: ``nodes.prepare`` turns a program node into CUDA C kernel
sources, scratch requests and steps (launches, cuBLAS GEMMs, index checks) on refs to the node's arrays
(``NodeKernels``, the ``prepare(ctx) -> bind`` of the backend protocol); ``build`` compiles every node's sources
of a program into one module; binding resolves the refs to the arrays the executable hands over.

``CudaEmuBackend`` (runtime ``cuda-emu``): numpy arrays (copied on upload, downloaded, as on a device), the module
built by g++ (``emu.py``), GEMMs through the numpy model of their cuBLAS descriptor (``gemm.run_model``, which
refuses any element outside the array it was given), streamed weights staged through a host copy stream. Needs
only g++ and numpy; synchronous.
``CudaBackend`` (runtime ``cuda``): one CUDA stream for every kernel, GEMM and copy; CuPy device memory, as
``device.DeviceTensor`` slots (CuPy has no bf16/fp8 dtype); the module compiled by NVRTC (``nvrtc.py``); GEMMs
through cuBLAS ``gemmStridedBatchedEx`` (f32 compute); streamed weights through pinned host buffers on a second,
copy stream (``CudaCopyStream``); programs replayed as CUDA graphs (``capture``). Importing this module needs
neither CuPy nor a GPU; ``CudaBackend()`` explains what is missing.
"""

from __future__ import annotations

import functools
import hashlib
import math
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from luminal_recipes import instrument
from luminal_recipes.errors import InputError, LuminalError
from luminal_recipes.runtimes.backend import GraphCaptureError
from luminal_recipes.runtimes.binding import declared_shape
from luminal_recipes.runtimes.copy_stream import HostCopyStream
from luminal_recipes.runtimes.executable import BackendRuntime
from luminal_recipes.runtimes.kernels import REGISTRY, SOURCES
from luminal_recipes.runtimes.kernels.context import KernelContext, KernelInput, Scratch
from luminal_recipes.runtimes.memory import MemoryPlan, check_dims, plan_memory
from luminal_recipes.runtimes.program import Program

from . import cublaslt, symdims
from . import gemm as gemm_mod
from .device import DeviceTensor, twin
from .devices import GpuDescription, describe, device_description
from .module import module_source
from .nodes import PREPARE, CudaOptions, SkipIfSame, prepare
from .plan import Gemm, IndexCheck, Launch, LtGemm, NodePlan, Ref

MODULES_KEPT = 32  # compiled modules kept loaded per backend (a re-bound executable may come back to one)


class CudaUnavailableError(LuminalError):
    """The cuda runtime cannot start here (no CuPy, or no GPU); the message says which and what to install."""


# ---- one node's CUDA work, bound to the executable's arrays ---------------------------------------------------
class NodeKernels:
    """What both CUDA backends' ``prepare(ctx)`` returns: the node's ``NodePlan`` (kernel sources, scratch, steps on
    refs) and, called with the node's arrays (``bind(out, flats, scratch)``), its step. ``module`` (the program's
    compiled kernels) is set by the backend's ``build`` before binding."""

    def __init__(self, backend, ctx: KernelContext):
        self.backend = backend
        self.node = ctx.node
        self.plan: NodePlan = prepare(ctx, backend.options)
        self.module = None

    def __call__(self, out, flats: list, scratch: list) -> NodeStep:
        backend = self.backend
        arrays = {"out": [out], "in": flats, "scratch": scratch}

        def at(ref: Ref) -> tuple:
            return arrays[ref.kind][ref.index], ref.byte_offset

        def address(ref: Ref) -> int:
            arr, offset = at(ref)
            return backend.address(arr) + offset

        by_name = {s.name: s for s in self.plan.sources}
        calls: list = []
        for step in self.plan.steps:
            if isinstance(step, SkipIfSame):
                if address(step.a) == address(step.b):
                    continue  # in place: the planner put the destination in the output buffer
                step = step.launch
            if isinstance(step, Launch):
                args = [address(a) if isinstance(a, Ref) else a for a in step.args]
                calls.append(backend.launcher(self.module, by_name[step.kernel], step, args))
            elif isinstance(step, Gemm):
                calls.append(backend.gemm(step.desc, at(step.a), at(step.b), at(step.c)))
            elif isinstance(step, LtGemm):
                scales = [None if r is None else at(r) for r in (step.a_scale, step.b_scale)]
                try:
                    calls.append(backend.lt_gemm(step.desc, at(step.a), at(step.b), at(step.d), *scales,
                                                 at(step.workspace)))
                except (gemm_mod.GemmLayoutError, LuminalError) as exc:
                    raise LuminalError(f"{self.node.op} #{self.node.id}: the cuBLASLt FP8 GEMM cannot run: {exc} "
                                       "(LUMINAL_FP8_GEMM=dequant decodes the weights to bf16 instead)") from None
            elif isinstance(step, IndexCheck):
                calls.append(IndexFlag(backend, *at(step.flag), step.message))
            else:
                raise TypeError(f"unknown step {step!r} of {self.node.op} #{self.node.id}")
        return NodeStep(backend, calls)


class IndexFlag:
    """After a Gather/Scatter: the i32 flag its kernel wrote is 0, else the node's message is raised. While a
    graph is recorded the check is deferred to after each replay (reading memory is not recordable)."""

    def __init__(self, backend, array, offset: int, message: str):
        self.backend, self.array, self.offset, self.message = backend, array, offset, message

    def __call__(self) -> None:
        if self.backend.read_flag(self.array, self.offset):
            raise InputError(self.message)


class NodeStep:
    """One node's launches, GEMMs and index checks, in order."""

    __slots__ = ("backend", "calls")

    def __init__(self, backend, calls: list):
        self.backend, self.calls = backend, calls

    def __call__(self) -> None:
        deferred = self.backend.deferred_checks
        for call in self.calls:
            if deferred is not None and isinstance(call, IndexFlag):
                deferred.append(call)
            else:
                call()


class _CudaKernels(Mapping):
    """``Backend.kernels``: every kernel of ``nodes.PREPARE``, prepared into ``NodeKernels`` for ``backend``."""

    def __init__(self, backend):
        self._backend = backend

    def __getitem__(self, op: str):
        if op not in PREPARE:
            raise KeyError(op)
        return functools.partial(NodeKernels, self._backend)

    def __iter__(self):
        return iter(PREPARE)

    def __len__(self) -> int:
        return len(PREPARE)


class _ModuleBuilder:
    """``build`` of both backends: every node's kernel sources in one module, compiled once per source text (and
    cached on disk by the compiler); a compile error names the kernel and the nodes it was generated for."""

    def __init__(self, compile_module):
        self._compile = compile_module  # (source text, describe) -> module
        self._loaded: OrderedDict[str, object] = OrderedDict()

    def __call__(self, binds: Mapping[int, object]) -> None:
        kernels = [b for b in binds.values() if isinstance(b, NodeKernels)]
        sources, owners = [], {}
        for bind in kernels:
            for s in bind.plan.sources:
                owners.setdefault(s.name, []).append(f"{bind.node.op} #{bind.node.id}")
                sources.append(s)
        if not sources:
            return
        text = module_source(sources)
        key = hashlib.sha256(text.encode()).hexdigest()
        module = self._loaded.pop(key, None)
        if module is None:
            instrument.count(instrument.CUDA_MODULE)
            module = self._compile(text, _line_owner(text, sources, owners))
        self._loaded[key] = module
        while len(self._loaded) > MODULES_KEPT:
            self._loaded.popitem(last=False)
        for bind in kernels:
            bind.module = module


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


# ---- cuda-emu ---------------------------------------------------------------------------------------------------
class CudaEmuBackend:
    """The CUDA backend's kernels on the CPU (see the module docstring). ``planned_as``: the GPU whose cost
    constants the compiler uses here, so cuda-emu runs the programs that GPU would."""

    name = "cuda-emu"
    host_arrays = False  # a device's contract: uploads copy, outputs are downloaded
    timed = False  # the emulator's times say nothing of a GPU's: the compiler ranks by the cost model
    graphs = False

    def __init__(self, options: CudaOptions | None = None, sanitize: str | None = None,
                 planned_as: str | None = None):
        gpu = device_description(planned_as)
        # the planned GPU's architecture decides the paths (FP8 GEMMs on sm_89+), as the device's own would
        self.options = options or CudaOptions(max_blocks=64, arch=gpu.arch)
        self.sanitize = sanitize
        self.device = f"cpu (CUDA C through g++, planned as {gpu.name})"
        self.machine = gpu.machine()
        self.kernels = _CudaKernels(self)
        self.deferred_checks = None
        self.build = _ModuleBuilder(self._compile)
        self._live = 0  # bytes of this backend's allocations still referenced ("device memory" held)

    kernel_dims = staticmethod(symdims.kernel_dims)  # kernels read symbolic dims from their arguments

    def capacity(self) -> int:
        from luminal_recipes.runtimes.cpu.backend import host_memory

        return host_memory()  # the emulated device's memory is the host's

    def _track(self, raw: np.ndarray, nbytes: int) -> None:
        """Count ``nbytes`` (what a device allocator is asked for) while ``raw`` lives."""
        self._live += nbytes
        weakref.finalize(raw, self._untrack, nbytes)

    def _untrack(self, nbytes: int) -> None:
        self._live -= nbytes

    def allocate(self, nbytes: int) -> np.ndarray:
        if self.sanitize:  # exactly sized, so AddressSanitizer's red zone starts right after the last byte
            raw = np.zeros(max(nbytes, 1), dtype=np.uint8)
            self._track(raw, nbytes)
            return raw[:nbytes]
        raw = np.zeros(max(nbytes, 1) + 256, dtype=np.uint8)
        self._track(raw, nbytes)
        skip = -raw.ctypes.data % 256  # 256-byte aligned, as cudaMalloc's
        return raw[skip: skip + nbytes]

    def slot(self, buf: np.ndarray, offset: int, nbytes: int, dtype) -> np.ndarray:
        return buf[offset: offset + nbytes].view(dtype)

    def upload(self, host) -> np.ndarray:
        flat = np.ascontiguousarray(host).reshape(-1)
        dev = self.allocate(flat.nbytes).view(flat.dtype) if flat.nbytes else np.zeros(0, flat.dtype)
        dev[...] = flat
        return dev

    def copy_in(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, np.ascontiguousarray(src).reshape(-1))

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def download(self, src: np.ndarray) -> np.ndarray:
        return np.array(src, copy=True)

    def synchronize(self) -> None:
        pass

    def copy_stream(self) -> HostCopyStream:
        return HostCopyStream(self.copy_in)

    def capture(self, steps: Sequence) -> None:
        return None

    def memory_held(self) -> int:
        return self._live

    def release_memory(self) -> None:
        pass  # numpy frees an allocation when its last reference goes

    def address(self, arr: np.ndarray) -> int:
        return arr.ctypes.data

    def _compile(self, text: str, describe):
        from .emu import compile_emu

        return compile_emu(text, self.sanitize, describe)

    def launcher(self, module, source, launch: Launch, args: list):
        return module.launcher(source.name, source.params, launch.grid, launch.block, args)

    def gemm(self, desc, a: tuple, b: tuple, c: tuple):
        def run():
            gemm_mod.run_model(desc, a, b, c)

        return run

    def lt_gemm(self, desc, a: tuple, b: tuple, d: tuple, a_scale: tuple | None, b_scale: tuple | None,
                workspace: tuple):
        """The numpy model of the cuBLASLt call the GPU makes, after the same descriptor and alignment checks."""
        desc.check()
        named = {"A": a, "B": b, "D": d, "workspace": workspace}
        cublaslt.check_pointers(**{k: self.address(arr) + off for k, (arr, off) in named.items()})
        if workspace[0].nbytes - workspace[1] < desc.workspace:
            raise gemm_mod.GemmLayoutError(f"workspace of {workspace[0].nbytes} bytes < {desc.workspace}")

        def run():
            cublaslt.run_model(desc, a, b, d, a_scale, b_scale)

        return run

    def read_flag(self, array: np.ndarray, offset: int) -> int:
        return int(array.reshape(-1).view(np.uint8)[offset: offset + 4].view(np.int32)[0])


# ---- cuda (CuPy) ------------------------------------------------------------------------------------------------
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
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CudaUnavailableError(f"the cuda runtime found CuPy {cupy.__version__} but no usable GPU ({reason}). "
                                   "Run on a machine with an NVIDIA GPU and its driver, or use --runtime numpy "
                                   "(inspect --runtime cuda plans for a described GPU without one: --device)."
                                   ) from None
    if count == 0:
        raise CudaUnavailableError(f"the cuda runtime found CuPy {cupy.__version__} but no GPU (0 devices). Run on "
                                   "a machine with an NVIDIA GPU, or use --runtime numpy.")
    return cupy


class CudaBackend:
    """CuPy on one GPU (see the module docstring). Every kernel, GEMM and copy runs on ``self.stream``."""

    name = "cuda"
    host_arrays = False
    timed = True

    def __init__(self, options: CudaOptions | None = None, device_id: int = 0):
        cp = require_cupy()
        self.cp = cp
        self.dev = cp.cuda.Device(device_id)
        self.dev.use()
        props = cp.cuda.runtime.getDeviceProperties(device_id)
        self.gpu: GpuDescription = describe(props, int(cp.cuda.runtime.memGetInfo()[1]))
        self.arch = self.gpu.arch
        check_architecture(self.gpu)
        self.device = f"{self.gpu.name} ({self.arch})"
        self.machine = self.gpu.machine()
        self.options = options or CudaOptions(max_blocks=self.gpu.sms * 16, simt_flops=self.gpu.simt_flops,
                                              tensor_flops=self.gpu.tensor_flops, bytes_per_s=self.gpu.bytes_per_s,
                                              arch=self.arch)
        self.options.arch = self.arch  # the device's, whatever options were given
        self._lt = None
        self._lt_missing: list[str | None] = []
        self.options.fp8_check = self._fp8_check  # cuBLASLt is loaded only once an FP8 GEMM is asked for
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.kernels = _CudaKernels(self)
        self.deferred_checks = None  # set while a graph is recorded
        self.build = _ModuleBuilder(self._compile)
        self._handle = None

    @property
    def graphs(self) -> bool:
        """Executables loaded from now on replay CUDA graphs (``CudaOptions.graphs``)."""
        return self.options.graphs

    @property
    def handle(self):
        if self._handle is None:
            from cupy_backends.cuda.libs import cublas

            self._handle = cublas.create()
            cublas.setStream(self._handle, self.stream.ptr)
        return self._handle

    kernel_dims = staticmethod(symdims.kernel_dims)  # kernels read symbolic dims from their arguments

    def capacity(self) -> int:
        return self.gpu.memory

    def allocate(self, nbytes: int):
        with self.stream:
            return self.cp.zeros(max(nbytes, 1), dtype=self.cp.uint8)[:nbytes]

    def slot(self, buf, offset: int, nbytes: int, dtype) -> DeviceTensor:
        return DeviceTensor(buf[offset: offset + nbytes].view(twin(dtype)), np.dtype(dtype))

    def upload(self, host) -> DeviceTensor:
        """A weight or constant in device memory; a device array (``DeviceTensor``, CuPy, anything with
        ``__cuda_array_interface__``) is bound as it is, without a copy."""
        if isinstance(host, DeviceTensor):
            if not host.data.flags.c_contiguous:
                raise InputError("a device weight must be C-contiguous (it is bound without a copy)")
            return host.reshape(-1)
        if hasattr(host, "__cuda_array_interface__"):
            try:
                dev = self.cp.asarray(host)
            except (TypeError, ValueError) as e:
                raise InputError(f"a device array of a dtype CuPy lacks (bf16, fp8): wrap it, e.g. "
                                 f"runtimes.cuda.device.from_torch(tensor) ({e})") from None
            if not dev.flags.c_contiguous:
                raise InputError("a device weight must be C-contiguous (it is bound without a copy)")
            return DeviceTensor(dev.reshape(-1), np.dtype(dev.dtype))
        flat = np.ascontiguousarray(host).reshape(-1)
        with self.stream:
            dev = self.cp.asarray(flat.view(twin(flat.dtype)))
        return DeviceTensor(dev, flat.dtype)

    def copy_in(self, dst: DeviceTensor, src: np.ndarray) -> None:
        dst.data.set(np.ascontiguousarray(src).reshape(-1).view(twin(dst.dtype)), stream=self.stream)

    def copy(self, dst: DeviceTensor, src: DeviceTensor) -> None:
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(dst.ptr, src.ptr, dst.nbytes, rt.memcpyDeviceToDevice, self.stream.ptr)

    def download(self, src: DeviceTensor) -> np.ndarray:
        return src.data.get(stream=self.stream).view(src.dtype)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def copy_stream(self) -> CudaCopyStream:
        return CudaCopyStream(self)

    def capture(self, steps: Sequence):
        """The steps recorded as one CUDA graph on the backend's stream; each replay launches it, then runs the
        index checks the recording deferred."""
        if not self.graphs:
            return None
        stream, failure, graph = self.stream, None, None
        self.deferred_checks = []
        try:
            stream.begin_capture()
            try:
                for step in steps:
                    step()
            except Exception as exc:  # noqa: BLE001 - any failure means: run the steps one by one
                failure = exc
            try:
                graph = stream.end_capture()
            except Exception as exc:  # noqa: BLE001
                failure = failure or exc
        except Exception as exc:  # noqa: BLE001 - begin_capture refused
            failure = exc
        finally:
            checks, self.deferred_checks = self.deferred_checks, None
        if failure is not None or graph is None:
            raise GraphCaptureError(f"the CUDA graph could not be recorded ({type(failure).__name__}: {failure})")

        def replay():
            graph.launch(stream)
            for check in checks:
                check()

        return replay

    def memory_held(self) -> int:
        return int(self.cp.get_default_memory_pool().total_bytes())

    def release_memory(self) -> None:
        self.stream.synchronize()
        self.cp.get_default_memory_pool().free_all_blocks()
        self.cp.get_default_pinned_memory_pool().free_all_blocks()

    def address(self, arr) -> int:
        return arr.ptr if isinstance(arr, DeviceTensor) else int(arr.data.ptr)

    def _compile(self, text: str, describe):
        from .nvrtc import compile_cubin

        module = self.cp.cuda.function.Module()
        module.load(compile_cubin(text, self.arch, describe))
        return module

    def launcher(self, module, source, launch: Launch, args: list):
        fn = module.get_function(source.name)
        packed = tuple(np.uint64(a) if p.endswith("*") else _NP_SCALAR[p.replace("const ", "").strip()](a)
                       for p, a in zip(source.params, args, strict=True))
        grid, block, stream = launch.grid, launch.block, self.stream

        def run():
            fn(grid, block, packed, stream=stream)

        return run

    def gemm(self, desc, a: tuple, b: tuple, c: tuple):
        from cupy_backends.cuda.libs import cublas

        alpha, beta = np.array(desc.alpha, np.float32), np.array(desc.beta, np.float32)
        t = gemm_mod.CUDA_DATA_TYPE
        ptr = [self.address(arr) + offset for arr, offset in (a, b, c)]
        args = (gemm_mod.CUBLAS_OP_T if desc.trans_a else gemm_mod.CUBLAS_OP_N,
                gemm_mod.CUBLAS_OP_T if desc.trans_b else gemm_mod.CUBLAS_OP_N, desc.m, desc.n, desc.k,
                alpha.ctypes.data, ptr[0], t[desc.a_type.name], desc.lda, desc.stride_a, ptr[1],
                t[desc.b_type.name], desc.ldb, desc.stride_b, beta.ctypes.data, ptr[2], t[desc.c_type.name],
                desc.ldc, desc.stride_c, desc.batch, gemm_mod.CUBLAS_COMPUTE_32F, gemm_mod.CUBLAS_GEMM_DEFAULT)
        handle = self.handle

        def run(keep=(alpha, beta)):
            cublas.gemmStridedBatchedEx(handle, *args)

        return run

    def _fp8_check(self) -> str | None:
        if not self._lt_missing:
            self._lt_missing.append(cublaslt.fp8_unsupported(self.arch, self.lt_handle))
        return self._lt_missing[0]

    def lt_handle(self) -> cublaslt.CublasLt:
        """The cuBLASLt handle, made on first use from the library ``cublaslt.find_library`` finds (the one
        matching the CUDA runtime's major version first)."""
        if self._lt is None:
            major = self.cp.cuda.runtime.runtimeGetVersion() // 1000
            self._lt = cublaslt.CublasLt(cublaslt.find_library(major))
        return self._lt

    def lt_gemm(self, desc, a: tuple, b: tuple, d: tuple, a_scale: tuple | None, b_scale: tuple | None,
                workspace: tuple):
        return lt_call(self, self.lt_handle(), desc, (a, b, d, a_scale, b_scale, workspace), self.stream.ptr)

    def read_flag(self, array: DeviceTensor, offset: int) -> int:
        raw = array.data.reshape(-1).view(self.cp.uint8)[offset: offset + 4]
        return int(raw.get(stream=self.stream).view(np.int32)[0])


def lt_call(backend, lt: cublaslt.CublasLt, desc, operands: tuple, stream: int) -> cublaslt.LtCall:
    """The cuBLASLt call of an ``LtGemm`` step on ``(array, byte offset)`` operands (A, B, D, A scale, B scale,
    workspace; a scale may be None), at their device addresses."""
    ptr = [None if r is None else backend.address(r[0]) + r[1] for r in operands]
    return lt.matmul(desc, *ptr, stream=stream)


MIN_ARCH = 75  # CUDA 13 (cupy-cuda13x, cuBLAS 13, NVRTC 13) supports Turing and newer


def check_architecture(gpu: GpuDescription) -> None:
    """Refuse a GPU the runtime cannot serve: below sm_75 CUDA 13 has no cuBLAS/NVRTC target, and bf16 GEMMs
    (the compute dtype of the shipped recipes) are refused by cuBLAS on sm_60 and older."""
    if cublaslt.arch_number(gpu.arch) < MIN_ARCH:
        raise CudaUnavailableError(f"the cuda runtime needs a GPU of compute capability 7.5 (Turing) or newer; "
                                   f"{gpu.name} is {gpu.arch}. Use --runtime numpy on this machine.")


_NP_SCALAR = {"int": np.int32, "unsigned": np.uint32, "long long": np.int64, "float": np.float32}


class CudaCopyStream:
    """The ``CopyStream`` of the cuda backend: a second, non-blocking CUDA stream, page-locked staging buffers
    from CuPy's pinned pool, CUDA events. Uploads are queued from the weight loader's thread."""

    def __init__(self, backend: CudaBackend):
        self.cp, self.backend = backend.cp, backend
        with backend.dev:
            self.stream = self.cp.cuda.Stream(non_blocking=True)
        self._pinned: list = []

    def staging(self, nbytes: int) -> np.ndarray:
        memory = self.cp.cuda.alloc_pinned_memory(nbytes)
        self._pinned.append(memory)
        return np.frombuffer(memory, np.uint8, nbytes)

    def record(self):
        return self.backend.stream.record(self.cp.cuda.Event(disable_timing=True))

    def upload(self, dst: DeviceTensor, src: np.ndarray, after=None):
        rt = self.cp.cuda.runtime
        with self.backend.dev:  # the loader thread's current device
            if after is not None:
                self.stream.wait_event(after)
            rt.memcpyAsync(dst.ptr, src.ctypes.data, src.nbytes, rt.memcpyHostToDevice, self.stream.ptr)
            return self.stream.record(self.cp.cuda.Event(disable_timing=True))

    def wait(self, event) -> None:
        self.backend.stream.wait_event(event)

    def host_wait(self, event) -> None:
        event.synchronize()

    def close(self) -> None:
        self.stream.synchronize()
        self._pinned.clear()


# ---- the runtimes -----------------------------------------------------------------------------------------------
class CudaRuntime(BackendRuntime):
    """``BackendRuntime`` over a CUDA backend (cuda or cuda-emu): the generic executable."""


def cuda_runtime() -> CudaRuntime:
    """The ``cuda`` runtime of the registry: the first GPU, through CuPy."""
    return CudaRuntime(CudaBackend())


def cuda_emu_runtime() -> CudaRuntime:
    """The ``cuda-emu`` runtime of the registry: the CUDA backend's kernels on the CPU (needs g++)."""
    from .emu import gxx

    try:
        gxx()
    except LuminalError as exc:
        raise OSError(str(exc)) from None
    return CudaRuntime(CudaEmuBackend())


def prepare_program(program: Program, dims: dict, options: CudaOptions) -> dict[int, tuple[NodePlan, Scratch]]:
    """Per kernel node: its ``NodePlan`` and scratch at ``dims`` (what both backends compile and bind: symbolic
    dims read from kernel arguments)."""
    check_dims(program, dims)
    by_id = {n.id: n for n in program.nodes}
    kdims = symdims.kernel_dims(dims)
    out = {}
    for node in program.nodes:
        if node.op in SOURCES:
            continue
        scratch = Scratch()
        inputs = [KernelInput(view.bind(kdims), by_id[src].dtype.np, math.prod(declared_shape(by_id[src], kdims)))
                  for src, view in node.inputs]
        ctx = KernelContext(node, declared_shape(node, kdims), node.dtype.np, inputs, scratch)
        out[node.id] = (prepare(ctx, options), scratch)
    return out


class PlanningCudaRuntime:
    """The cuda runtime as the planner sees it, without a GPU: ``inspect --runtime cuda`` plans memory and compiles
    programs for a described device (``devices.DEVICES``) - its kernels, their scratch, its capacity and cost
    constants - and cannot load or time anything."""

    name = "cuda"
    timed = False
    host_arrays = False  # a device's memory: streamed blocks are staged through pinned host buffers

    def __init__(self, gpu: GpuDescription):
        self.gpu = gpu
        self.device = f"{gpu.name} ({gpu.arch})"
        self.machine = gpu.machine()
        self.options = CudaOptions(max_blocks=gpu.sms * 16, simt_flops=gpu.simt_flops,
                                   tensor_flops=gpu.tensor_flops, bytes_per_s=gpu.bytes_per_s, arch=gpu.arch)
        self.backend = self  # what the plan cache fingerprints (this package's sources)
        self.assumed = (f"planned for {gpu.label} from an offline description (no GPU here); --device chooses "
                        f"another ({', '.join(_known_devices())})")

    def capabilities(self) -> set[str]:
        return {op for op in REGISTRY if op in PREPARE or op in SOURCES}

    def capacity(self) -> int:
        return self.gpu.memory

    def plan(self, program: Program, dims=None, weight_bytes: int | None = None) -> MemoryPlan:
        prepared = prepare_program(program, dict(dims or {}), self.options)
        return plan_memory(program, dims, weight_bytes, {nid: s.nbytes for nid, (_, s) in prepared.items()})

    def load(self, *args, **kwargs):
        raise CudaUnavailableError(f"the cuda runtime {self.assumed.split(';')[0]}: it can plan, not run")


def _known_devices() -> list[str]:
    from .devices import DEVICES

    return list(DEVICES)


def planning_runtime(device: str | None = None):
    """For planning (inspect): the cuda runtime on this machine's GPU when there is one (and no other ``device``
    is asked for), else a ``PlanningCudaRuntime`` for the described ``device`` (default the H200)."""
    if device is None:
        try:
            from luminal_recipes.runtimes.registry import get_runtime

            return get_runtime("cuda")
        except LuminalError:
            pass
    return PlanningCudaRuntime(device_description(device))
