"""FP8 GEMMs through cuBLASLt: the descriptor, the numpy model cuda-emu runs, and the ctypes binding the GPU runs.

``LtDesc`` is one ``cublasLtMatmul`` in cuBLAS terms (column-major, as ``gemm.GemmDesc``):
``D (m x n, ldd) = scale_a * scale_b * op(A) (m x k) @ op(B) (k x n)``, A/B FP8, compute and scale type f32
(CUBLAS_COMPUTE_32F / CUDA_R_32F), ``beta = 0`` with C = D (C's type is D's: bf16, f16 or f32). ``scale_a`` /
``scale_b`` are device f32 scalars (CUBLASLT_MATMUL_DESC_A_SCALE_POINTER / B_SCALE_POINTER; 1 when absent).
``check`` applies cuBLASLt's FP8 requirements on sm_89/sm_90 (cublasLtMatmul documentation): A transposed and B
not ("TN"), 16-byte aligned leading dimensions and pointers, FP8 in at most one of the e5m2 flavours.

For DequantMatMul's ``out [M, N] = x [M, K] @ W [N, K]^T`` the weight is cuBLAS's A (stored K x N column-major,
i.e. W row-major with ``lda`` = its row stride, op T) and the e4m3-quantized activation is B (K x M, ``ldb = K``,
op N): the TN layout falls out of the checkpoint's [out, in] weights with no copy.

``run_model`` executes a descriptor on flat numpy buffers as cuBLASLt reads and writes them (leading dimensions,
transposes, the two scales read from their buffers, f32 accumulation, one rounding to D's type), refusing any
element outside its buffer: cuda-emu runs every FP8 GEMM through it. ``CublasLt`` is the same call on a GPU:
ctypes on ``libcublasLt.so`` (``find_library``: an explicit path, the nvidia-cublas wheel torch/CuPy installed,
torch's own lib folder, the system's), descriptors and the heuristic's algorithm made once per bound node, the
workspace from the memory plan's scratch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from luminal_recipes.errors import LuminalError

from .gemm import CUBLAS_COMPUTE_32F, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_DATA_TYPE, F32, GemmLayoutError, _colmajor

# cublasLt.h (CUDA 12.x / 13.x): cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t
CUBLASLT_MATMUL_DESC_TRANSA = 3  # int32
CUBLASLT_MATMUL_DESC_TRANSB = 4  # int32
CUBLASLT_MATMUL_DESC_A_SCALE_POINTER = 17  # const void* (device f32)
CUBLASLT_MATMUL_DESC_B_SCALE_POINTER = 18
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1  # uint64
CUDA_R_32F = CUDA_DATA_TYPE["float32"]
LT_MIN_ARCH = 89  # FP8 tensor cores: Ada (sm_89), Hopper (sm_90), Blackwell
ALIGN = 16  # bytes: cuBLASLt FP8 kernels need 16-byte aligned pointers and leading dimensions
WORKSPACE = 32 << 20  # what NVIDIA recommends for Hopper; smaller problems ask for less (``workspace_bytes``)

E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
FP8_TYPES = {E4M3, E5M2}
D_TYPES = {F32, np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}  # C = D: one of these


class LtUnavailable(LuminalError):
    """cuBLASLt's FP8 GEMM cannot run here (no library, an architecture without FP8 tensor cores)."""


@dataclass(frozen=True)
class LtDesc:
    trans_a: bool
    trans_b: bool
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldd: int
    a_type: np.dtype
    b_type: np.dtype
    d_type: np.dtype
    a_scale: bool  # a device f32 scale pointer is set for A (else 1)
    b_scale: bool
    workspace: int  # bytes of workspace the heuristic may use

    def check(self) -> None:
        """cuBLASLt's requirements for FP8 GEMMs (it refuses the others with NOT_SUPPORTED / INVALID_VALUE)."""
        if not (self.trans_a and not self.trans_b):
            raise GemmLayoutError(f"FP8 GEMMs need A transposed and B not (TN), got {self}")
        if self.a_type not in FP8_TYPES or self.b_type not in FP8_TYPES or self.a_type == self.b_type == E5M2:
            raise GemmLayoutError(f"FP8 GEMM operand types {self.a_type}, {self.b_type}: e4m3 x e4m3, or one e5m2")
        if self.d_type not in D_TYPES:
            raise GemmLayoutError(f"FP8 GEMM output {self.d_type}: bf16, f16 or f32")
        if min(self.m, self.n, self.k) <= 0:
            raise GemmLayoutError(f"empty FP8 GEMM {self}")
        if self.lda < self.k or self.ldb < self.k or self.ldd < self.m:
            raise GemmLayoutError(f"leading dimension too small in {self}")
        for what, ld, item in (("A", self.lda, 1), ("B", self.ldb, 1), ("D", self.ldd, self.d_type.itemsize)):
            if ld * item % ALIGN:
                raise GemmLayoutError(f"FP8 GEMM: {what}'s leading dimension {ld} is not a multiple of {ALIGN} bytes")
        if self.k % ALIGN:
            raise GemmLayoutError(f"FP8 GEMM: k = {self.k} is not a multiple of {ALIGN}")

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def workspace_bytes(m: int, n: int) -> int:
    """cuBLASLt workspace for an m x n output: split-K partial sums of a few f32 tiles, at most ``WORKSPACE``."""
    return int(min(WORKSPACE, max(1 << 20, 4 * m * n)))


def check_pointers(**addresses: int) -> None:
    """Every operand's device address is 16-byte aligned (cuBLASLt FP8 kernels load 16 bytes at a time)."""
    bad = [f"{k} at {v:#x}" for k, v in addresses.items() if v % ALIGN]
    if bad:
        raise GemmLayoutError(f"FP8 GEMM operands not {ALIGN}-byte aligned: {', '.join(bad)}")


def _scale(ref: tuple[np.ndarray, int] | None) -> np.float32:
    if ref is None:
        return np.float32(1.0)
    buf, offset = ref
    raw = buf.reshape(-1).view(np.uint8)
    if offset < 0 or offset % 4 or offset + 4 > raw.nbytes:
        raise GemmLayoutError(f"FP8 GEMM scale at byte {offset} is outside its buffer of {raw.nbytes} bytes")
    return raw[offset: offset + 4].view(np.float32)[0]


def run_model(desc: LtDesc, a: tuple[np.ndarray, int], b: tuple[np.ndarray, int], d: tuple[np.ndarray, int],
              a_scale: tuple[np.ndarray, int] | None, b_scale: tuple[np.ndarray, int] | None) -> None:
    """``D = (scale_a * scale_b) * op(A) op(B)`` on ``(buffer, byte offset)`` operands as cuBLASLt computes it
    (FP8 products exact in f32, f32 accumulation, one rounding to D's type; up to the order of the K-sum)."""
    desc.check()
    if (a_scale is not None) != desc.a_scale or (b_scale is not None) != desc.b_scale:
        raise GemmLayoutError("FP8 GEMM: scale pointers do not match the descriptor")
    ra, ca = (desc.k, desc.m) if desc.trans_a else (desc.m, desc.k)
    rb, cb = (desc.n, desc.k) if desc.trans_b else (desc.k, desc.n)
    am = _colmajor(*a, desc.a_type, ra, ca, desc.lda, 0, 1, "A")[0]
    bm = _colmajor(*b, desc.b_type, rb, cb, desc.ldb, 0, 1, "B")[0]
    dm = _colmajor(*d, desc.d_type, desc.m, desc.n, desc.ldd, 0, 1, "D")[0]
    opa = am.astype(F32).T if desc.trans_a else am.astype(F32)
    opb = bm.astype(F32).T if desc.trans_b else bm.astype(F32)
    acc = np.matmul(opa, opb)
    alpha = np.float32(_scale(a_scale) * _scale(b_scale))
    with np.errstate(over="ignore", invalid="ignore"):
        if alpha != 1:
            acc *= alpha
        dm[...] = acc.astype(desc.d_type)


# ---- the library ---------------------------------------------------------------------------------------------
def _candidates(major: int | None) -> list[str]:
    """Where a libcublasLt may be, most specific first: $LUMINAL_CUBLASLT, one already loaded (by CuPy's cuBLAS),
    the nvidia-cublas wheel (what torch and CuPy's CUDA wheels install; nvidia/cublas/lib or nvidia/cu13/lib),
    torch's lib folder, CUDA_HOME, the loader's search path. Versions matching the CUDA runtime's major come first
    among the files found in folders."""
    out: list[str] = []
    explicit = os.environ.get("LUMINAL_CUBLASLT")
    if explicit:
        out.append(explicit)
    out += _loaded()  # the copy CuPy's cuBLAS already brought into the process: one cuBLASLt, not two
    folders: list[str] = []
    for pkg, sub in (("nvidia", "*/lib"), ("torch", "lib")):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            spec = None
        for base in (spec.submodule_search_locations or []) if spec else []:
            folders += sorted(glob.glob(os.path.join(base, sub)))
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            folders.append(os.path.join(os.environ[env], "lib64"))
    folders.append("/usr/local/cuda/lib64")
    found = [f for folder in folders for f in sorted(glob.glob(os.path.join(folder, "libcublasLt.so*")))]
    if major is not None:
        found.sort(key=lambda p: not p.endswith(f".so.{major}") and f".so.{major}." not in p)
    out += found
    system = ctypes.util.find_library("cublasLt")
    if system:
        out.append(system)
    return list(dict.fromkeys(out))


def _loaded() -> list[str]:
    """libcublasLt files already mapped into this process (Linux: /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return list(dict.fromkeys(line.split()[-1] for line in maps.splitlines()
                              if "/libcublasLt.so" in line and line.split()[-1].startswith("/")))


def find_library(major: int | None = None) -> str:
    """The path of a loadable libcublasLt (raises LtUnavailable saying where it looked)."""
    tried = []
    for path in _candidates(major):
        try:
            ctypes.CDLL(path)
            return path
        except OSError as e:
            tried.append(f"{path} ({e})")
    where = "; ".join(tried) or "no libcublasLt.so* in the nvidia-cublas wheel, torch/lib, CUDA_HOME or the " \
                                "loader's path"
    raise LtUnavailable(f"libcublasLt not found ({where}); set LUMINAL_CUBLASLT to its path")


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_vp, _i32, _u64, _i64, _sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
_SIGNATURES = {
    "cublasLtCreate": [ctypes.POINTER(_vp)],
    "cublasLtGetVersion": [],
    "cublasLtGetStatusName": [_i32],
    "cublasLtMatmulDescCreate": [ctypes.POINTER(_vp), _i32, _i32],
    "cublasLtMatmulDescDestroy": [_vp],
    "cublasLtMatmulDescSetAttribute": [_vp, _i32, _vp, _sz],
    "cublasLtMatrixLayoutCreate": [ctypes.POINTER(_vp), _i32, _u64, _u64, _i64],
    "cublasLtMatrixLayoutDestroy": [_vp],
    "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(_vp)],
    "cublasLtMatmulPreferenceDestroy": [_vp],
    "cublasLtMatmulPreferenceSetAttribute": [_vp, _i32, _vp, _sz],
    "cublasLtMatmulAlgoGetHeuristic": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _i32, ctypes.POINTER(HeuristicResult),
                                       ctypes.POINTER(_i32)],
    "cublasLtMatmul": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _sz, _vp],
}


class CublasLt:
    """One cuBLASLt handle (``cublasLtCreate``) on the library at ``path``."""

    def __init__(self, path: str):
        self.path = path
        self.lib = ctypes.CDLL(path)
        for name, args in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes = args
            fn.restype = {"cublasLtGetVersion": _sz, "cublasLtGetStatusName": ctypes.c_char_p}.get(name, _i32)
        self.handle = _vp()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.version = int(self.lib.cublasLtGetVersion())

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            name = self.lib.cublasLtGetStatusName(status)
            raise LuminalError(f"{what} failed: {name.decode() if name else status}")

    def matmul(self, desc: LtDesc, a: int, b: int, d: int, a_scale: int | None, b_scale: int | None,
               workspace: int, stream: int) -> LtCall:
        """The call running ``desc`` on these device addresses, its descriptors and algorithm made now."""
        desc.check()
        check_pointers(A=a, B=b, D=d, workspace=workspace)
        return LtCall(self, desc, (a, b, d, a_scale, b_scale, workspace), stream)


class LtCall:
    """A prepared ``cublasLtMatmul``: matmul descriptor (compute f32, scale f32, TN, scale pointers), layouts of
    A, B, C = D, the heuristic's best algorithm within the workspace; ``__call__`` launches it on the stream."""

    def __init__(self, lt: CublasLt, desc: LtDesc, pointers: tuple, stream: int):
        lib, check = lt.lib, lt._check
        a, b, d, sa, sb, ws = pointers
        owned: list[tuple] = []  # (destroy function, handle) for the finaliser
        self._finalizer = weakref.finalize(self, _destroy, lib, owned)
        mdesc = _vp()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(mdesc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
              "cublasLtMatmulDescCreate")
        owned.append((lib.cublasLtMatmulDescDestroy, mdesc))

        def set_attr(attr: int, value) -> None:
            check(lib.cublasLtMatmulDescSetAttribute(mdesc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                  f"cublasLtMatmulDescSetAttribute({attr})")

        set_attr(CUBLASLT_MATMUL_DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T if desc.trans_a else CUBLAS_OP_N))
        set_attr(CUBLASLT_MATMUL_DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_T if desc.trans_b else CUBLAS_OP_N))
        if sa is not None:
            set_attr(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, _vp(sa))
        if sb is not None:
            set_attr(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, _vp(sb))

        def layout(dtype, rows: int, cols: int, ld: int) -> _vp:
            h = _vp()
            check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(h), CUDA_DATA_TYPE[np.dtype(dtype).name], rows, cols,
                                                 ld), "cublasLtMatrixLayoutCreate")
            owned.append((lib.cublasLtMatrixLayoutDestroy, h))
            return h

        ra, ca = (desc.k, desc.m) if desc.trans_a else (desc.m, desc.k)
        rb, cb = (desc.n, desc.k) if desc.trans_b else (desc.k, desc.n)
        la, lb = layout(desc.a_type, ra, ca, desc.lda), layout(desc.b_type, rb, cb, desc.ldb)
        ld_ = layout(desc.d_type, desc.m, desc.n, desc.ldd)
        pref = _vp()
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        owned.append((lib.cublasLtMatmulPreferenceDestroy, pref))
        wsb = ctypes.c_uint64(desc.workspace)
        check(lib.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                       ctypes.byref(wsb), ctypes.sizeof(wsb)),
              "cublasLtMatmulPreferenceSetAttribute")
        result, count = HeuristicResult(), _i32(0)
        check(lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, mdesc, la, lb, ld_, ld_, pref, 1, ctypes.byref(result),
                                                 ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        if count.value < 1 or result.state != 0:
            raise LtUnavailable(f"cuBLASLt has no FP8 algorithm for {desc} (heuristic returned {count.value})")
        self.algorithm_workspace = int(result.workspaceSize)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._args = (lt.handle, mdesc, ctypes.byref(self.alpha), _vp(a), la, _vp(b), lb, ctypes.byref(self.beta),
                      _vp(d), ld_, _vp(d), ld_, ctypes.byref(result), _vp(ws), desc.workspace, _vp(stream))
        self._keep = (result, lt)
        self._matmul, self._check = lib.cublasLtMatmul, check

    def __call__(self) -> None:
        self._check(self._matmul(*self._args), "cublasLtMatmul")


def _destroy(lib, owned: list) -> None:
    for fn, h in reversed(owned):
        fn(h)
    owned.clear()


def arch_number(arch: str) -> int:
    """``sm_90`` -> 90, ``sm_100a`` -> 100."""
    digits = "".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit())
    return int(digits) if digits else 0


def fp8_unsupported(arch: str, load=None) -> str | None:
    """Why cuBLASLt FP8 GEMMs cannot run on ``arch`` (None when they can): no FP8 tensor cores below sm_89, or
    ``load()`` (loading the library) failing."""
    if arch_number(arch) < LT_MIN_ARCH:
        return f"{arch} has no FP8 tensor cores (cuBLASLt FP8 GEMMs need sm_89 or newer)"
    if load is not None:
        try:
            load()
        except (LuminalError, OSError) as e:
            return f"cuBLASLt is unavailable ({e})"
    return None
