"""The numpy backend's compiled kernels (``numba_kernels``, numba), loaded lazily and warmed up in the background.

Importing numba and loading its first function from the disk cache costs about a second (LLVM's start-up);
``warm_up()`` (called when a numpy backend is made) does it on a daemon thread while the pipeline builds and
compiles its graphs, and ``kernels()`` waits for it when a kernel is bound. numba is optional (``pip install
luminal-recipes[jit]``): ``AVAILABLE`` is False where it is not installed, or with ``LUMINAL_RECIPES_JIT=0`` or
``LUMINAL_RECIPES_ISA=numpy``, and
the kernels keep their numpy passes (the same values; the tests compare both).

Only the kernels a program calls are loaded: each compiled version of a kernel (one per layout of its arguments)
holds its machine code and numba's module for it, 0.2-1.6 MiB resident each, and loading every version of the
"core" family (20) for a language model that calls 7 of them cost 14.6 MiB of SmolLM2-135M's peak. A version is
loaded from numba's disk cache (~12 ms) on its first call, which the compiler's timing runs after a warm-up run
and a run's first token pays; ``load_all()`` loads (or compiles) every version of every family at once.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import threading
from collections.abc import Callable
from types import ModuleType

import numpy as np

from .. import isa
from ..threads import parallel, split

# LUMINAL_RECIPES_JIT=0 (or LUMINAL_RECIPES_ISA=numpy: ``..isa``) keeps the numpy passes: numba and LLVM add ~1 s
# of start-up and ~90 MiB of resident memory to a process (SmolLM2-135M's peak: 325 vs 234 MiB; libllvmlite's code
# pages 69 MiB of it: 36 as it loads, 32 creating the JIT and compiling numba's runtime module), for kernels a few
# times faster than numpy's passes
AVAILABLE = isa.selected() != "numpy"
_LOCK = threading.Lock()
_MODULE: ModuleType | None = None
_WARMING: threading.Thread | None = None
_STARTED = False
_ALL: set[str] = set()
# the kernels' families: "core" (softmax, norms, RoPE, attention, fused elementwise), "image" (GroupNorm,
# convolutions, upsampling) and "lowp" (FP8/NVFP4 decoding); each kernel is loaded on its first call (see above)
FAMILIES = ("core", "image", "lowp")


def kernels(family: str = "core") -> ModuleType:
    """``numba_kernels``, imported, once numba has started (``warm_up``); a kernel's machine code is loaded (from
    numba's disk cache, compiled on the first run ever) on its first call with a layout of arguments."""
    global _MODULE, _STARTED
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; one of {FAMILIES}")
    with _LOCK:
        if _MODULE is None or not _STARTED:
            with _without_optional_imports():
                if _MODULE is None:
                    _numba_without_scipy()
                    from . import code_pages

                    code_pages.install()  # LLVM's code pages dropped after each compilation or load from the cache
                    from . import numba_kernels as numpy_jit

                    _MODULE = numpy_jit
                if not _STARTED:
                    _start(_MODULE)
                    _STARTED = True
    return _MODULE


# imported by numba's start-up only when installed, for nothing these kernels use: ``scipy`` (a version check in
# numba/__init__.py), ``colorama`` (coloured error messages, off by default), ``cffi`` (typing calls of cffi
# functions from jitted code: ``numba.core.typing.cffi_utils``, at the typing context's first refresh); 3.4 MiB
# resident together (scipy 1.6, cffi + pycparser 1.4, colorama 0.4), measured
OPTIONAL_IMPORTS = ("scipy", "colorama", "cffi")


class _Hidden(importlib.abc.MetaPathFinder):
    """Answers "not installed" for ``names``, to the thread that starts numba only (any other thread imports
    them as usual, and so does every thread once numba has started)."""

    def __init__(self, names: tuple[str, ...]):
        self.names, self.thread = names, threading.get_ident()

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names and threading.get_ident() == self.thread:
            raise ModuleNotFoundError(f"{name} is not imported while numba starts (runtimes/cpu/jit)", name=name)
        return None


@contextlib.contextmanager
def _without_optional_imports():
    """numba's start-up without ``OPTIONAL_IMPORTS`` (those a process imported before are left alone). numba
    then keeps no cffi support in this process: a jitted function of the user's that calls a cffi function fails
    to type (import cffi before the first model runs to keep it)."""
    import sys

    hidden = _Hidden(tuple(n for n in OPTIONAL_IMPORTS if n not in sys.modules))
    if not hidden.names or "numba.core.typing.cffi_utils" in sys.modules:
        yield
        return
    sys.meta_path.insert(0, hidden)
    try:
        yield
    finally:
        sys.meta_path.remove(hidden)


def _numba_without_scipy() -> None:
    """numba's start-up imports ``numba.np.arraymath``, whose module-level check ``_HAVE_BLAS`` imports
    ``scipy.linalg`` (28.8 MiB resident, measured) only to pick BLAS for ``np.correlate``/``np.convolve`` in jitted
    code (a plain loop otherwise, same values). No kernel here calls BLAS through numba (they call
    ``cblas_sgemm`` by address: ``..cblas``), so arraymath is imported with that check answering "no BLAS"; numba's
    ``np.dot``/``np.linalg`` still import scipy when a jitted function of the process uses them (``ensure_blas``
    runs at their typing). A process that imported scipy or arraymath before keeps numba's own check."""
    import sys

    if "numba.np.arraymath" in sys.modules or "scipy.linalg" in sys.modules:
        return
    try:
        import numba.np.linalg as nb_linalg
    except ImportError:  # a numba without this layout: its own start-up applies
        return
    ensure_blas = getattr(nb_linalg, "ensure_blas", None)
    if ensure_blas is None:
        return

    def no_blas_yet():
        raise ImportError("scipy.linalg is imported by numba only where a jitted function uses BLAS")

    nb_linalg.ensure_blas = no_blas_yet
    try:
        import numba.np.arraymath as arraymath
    finally:
        nb_linalg.ensure_blas = ensure_blas
    if getattr(arraymath, "ensure_blas", None) is no_blas_yet:
        arraymath.ensure_blas = ensure_blas


def _start(module: ModuleType) -> None:
    """numba's start-up (LLVM, its typing and lowering registries), paid once, on the kernel every model calls:
    the fused element-wise pass, on the layout it binds."""
    rows = np.zeros((2, 16), np.float32)
    out = np.zeros((2, 16), np.float32)
    code = np.array([[0, 0, 0, 0, 0], [1, 1, 1, 0, 0], [8, 1, 1, 0, 0], [3, 1, 1, 0, 0], [2, 0, 1, 0, 0]], np.int32)
    table = np.array([[out.__array_interface__["data"][0], 0, 16, 1], [rows.__array_interface__["data"][0], 0, 16, 1]],
                     np.int64)
    module.elementwise_tiles(code, np.ones(1, np.float32), table, np.array([1, 2, 16], np.int64),
                             np.zeros((2, 8), np.float32))


def load_all() -> ModuleType:
    """Every version of every family's kernels loaded (or compiled and cached) now, not on first calls: for a
    test session (numba compiles under ``warnings.catch_warnings``, which is not thread-safe) and for filling the
    disk cache ahead of a run."""
    module = kernels()
    with _LOCK:
        for family, touch in (("core", _touch_core), ("image", _touch_image), ("lowp", _touch_lowp)):
            if family not in _ALL:
                touch(module)
                _ALL.add(family)
    return module


def _touch(module: ModuleType) -> None:
    """Every family's kernels (see ``load_all``)."""
    _touch_core(module)
    _touch_image(module)
    _touch_lowp(module)


def _touch_core(module: ModuleType) -> None:
    """Call every kernel once on tiny arrays of the layouts the kernels bind (contiguous rows, or row-strided
    2-D blocks), so that their code is loaded (or compiled and cached) now."""
    rows = np.zeros((2, 16), np.float32)
    out = np.zeros((2, 16), np.float32)
    vec = np.zeros(2, np.float32)
    one = np.float32(1)
    fixed = _read_only(vec)  # the norms' scale and shift vectors are passed read-only
    for scores in (rows, rows[:, :8]):
        module.exp_rows(scores, vec)
        module.exp_rows_sum(scores, vec)
        module.exp_rows_online(scores, vec, vec, vec, True)
    # rows read in place (read-only views of the producer, contiguous or strided) or copied into scratch: numba
    # compiles one version per type, read-only included, and one compiled in the middle of a run costs seconds
    for x in (_read_only(rows), _read_only(rows[:, ::2]), rows):
        dst = out[:, : x.shape[1]].copy()
        module.softmax_rows(x, dst)
        module.rms_norm_rows(x, dst, fixed, fixed, 0, one, one)
        module.layer_norm_rows(x, dst, fixed, fixed, 0, one, one)
    block = np.zeros((2, 8), np.float32)  # rows read out of a flat buffer
    module.rms_norm_strided(rows.reshape(-1), 1, 16, block, fixed, fixed, 0, one, one)
    module.layer_norm_strided(rows.reshape(-1), 1, 16, block, fixed, fixed, 0, one, one)
    flat = _read_only(rows.reshape(-1))  # RMSNorm + RoPE: x and the tables read in place, read-only
    module.rms_norm_rope_rows(flat, 0, 16, block, _read_only(np.zeros(8, np.float32)), flat, 0, 16, flat, 0, 16, one,
                              one, np.zeros(16, np.float32))
    spans = np.zeros(2, np.int64)  # attention's masked keys: the bias as a read-only flat run
    module.mask_spans(_read_only(rows.reshape(-1)), 2, 16, 16, 1, spans, spans.copy(), np.zeros(2, np.bool_),
                      np.float32(-1), np.float32(0))
    # decoding's attention: operands as flat read-only runs; its one query row (``u0:u1`` = 0:1)
    one_row = np.array([1, 1, 1, 1, 1] + [0] * 10 + [0, 1], np.int64)
    module.attention_rows(fixed, fixed, fixed, fixed, vec.copy(), one_row, True, one, vec.copy(), vec.copy(),
                          np.float32(-1e37), np.float32(-1e36))
    code = np.array([[0, 0, 0, 0, 0], [1, 1, 1, 0, 0], [8, 1, 1, 0, 0], [3, 1, 1, 0, 0], [2, 0, 1, 0, 0]], np.int32)
    table = np.array([[out.__array_interface__["data"][0], 0, 16, 1], [rows.__array_interface__["data"][0], 0, 16, 1]],
                     np.int64)
    module.elementwise_tiles(code, np.ones(1, np.float32), table, np.array([1, 2, 16], np.int64),
                             np.zeros((2, 8), np.float32))


def _touch_lowp(module: ModuleType) -> None:
    out = np.zeros((2, 16), np.float32)
    vec = np.zeros(2, np.float32)
    codes = np.zeros((2, 16), np.uint8)
    table = np.zeros(256, np.float32)
    module.decode_fp8_rows(codes, vec[:, None], out, table)  # per-channel or per-tensor (broadcast) scales
    module.decode_fp8_rows(codes, np.broadcast_to(vec[:1, None], (2, 1)), out, table)
    for packed in (codes[:, :8], codes[:, :8].copy()):  # padded (comfy) or exact rows of bytes
        module.decode_nvfp4_rows(packed, codes.copy(), out, np.zeros((256, 2), np.float32), table, out[:1, :1])


def _touch_image(module: ModuleType) -> None:
    rows = np.zeros((2, 16), np.float32)
    out = np.zeros((2, 16), np.float32)
    vec = np.zeros(2, np.float32)
    one = np.float32(1)
    fixed = _read_only(vec)
    for silu in (False, True):  # GroupNorm: rows of a read-only flat buffer, per-channel read-only vectors
        module.group_norm_rows(_read_only(rows.reshape(-1)), 0, 16, out, 0, 2, fixed, fixed, 1, 8, one, one, silu)
    image = np.zeros((2, 4, 6), np.float32)
    # a padded image in scratch, or read in place (read-only: another kernel's output or the caller's input)
    for x in (image, image[:, :, :5], _read_only(image), _read_only(image[:, :, :5])):
        module.conv_kw3_rows(x, np.zeros((2, 3, 3, 4), np.float32), vec[:1].repeat(4), np.zeros((3, 2, 3), np.float32),
                             0, 2)
        module.winograd_input(x, np.zeros((16, 2, 2), np.float32), 0, 1, 2, 1, 1)
    u, m = np.zeros((16, 2, 2), np.float32), np.zeros((16, 2, 2), np.float32)
    for w in (np.zeros((2, 2, 3, 3), np.float32), np.zeros((2, 2, 3, 3, 2), np.float32)[..., 0]):  # own or a view
        module.winograd_weights(w, u)
        module.winograd_weights(_read_only(w), u)  # a checkpoint weight, read in place
    module.winograd_output(m, vec, np.zeros((2, 2, 4), np.float32), 0, 1, 2)
    source = np.zeros((2, 4), np.float32)  # Copy's upsampling: rows of a read-only view, one run or strided
    for src in (_read_only(source), _read_only(source[:, :3])):
        module.upsample2_rows(src, np.zeros((4, 2 * src.shape[1]), np.float32), 0, 2)
    from .. import cblas

    blas = cblas.sgemm()
    if blas is not None:  # the band loop, on the same input layouts (no band to run: nothing is multiplied)
        images = np.zeros((1, 2, 4, 6), np.float32)
        no_bands = np.zeros((0, 3), np.int64)
        for x in (images, images[..., :5], _read_only(images), _read_only(images[..., :5])):
            module.winograd_bands(x, u.ctypes.data, np.ones(4, np.int64), u, vec, np.zeros((1, 2, 2, 4), np.float32), u,
                                  m, no_bands, np.zeros(2, np.int64), 2, 1, 1, *blas)


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def warm_up() -> None:
    """Start loading the kernels on a daemon thread (once per process)."""
    global _WARMING
    if not AVAILABLE or _WARMING is not None:
        return
    _WARMING = threading.Thread(target=_warm, name="luminal-jit-warm-up", daemon=True)
    _WARMING.start()


def wait_for_warm_up() -> None:
    """Start the warm-up if it has not started, wait for it, and load (or compile) every kernel (``load_all``)."""
    warm_up()
    if _WARMING is not None:
        _WARMING.join()
    if AVAILABLE:
        load_all()


def _warm() -> None:
    kernels()
    from .. import amx
    from ..amx import dequant as amx_dequant

    if amx.ready():  # the AMX product's kernels too, on a CPU with AMX (else a no-op)
        from ..amx import attention as amx_attention

        amx_attention.ready()
    amx_dequant.ready()  # and the quantized weights' product on AMX


def by_rows(kernel: Callable, arrays: list[np.ndarray], *scalars) -> Callable[[], None]:
    """A step calling ``kernel(*row_parts, *scalars)`` on one part of the rows (axis 0 of every array) per
    core (each row computed on its own: any cut gives the same bits). The kernel writes the last array only."""
    n = arrays[0].shape[0]
    width = arrays[0].size // max(n, 1)

    def describe():  # the row slices are made once per description, here
        calls = []
        for i, sl in enumerate(split(n, width)):
            parts = [a[sl] for a in arrays]
            # what it touches (``chain.Call.access``): the last array's rows written, everything else read
            reads = (*parts[:-1], *(a for a in scalars if isinstance(a, np.ndarray)))
            calls.append((kernel, (*parts, *scalars), i, (reads, (parts[-1],))))
        return calls

    calls = describe()
    bound = [lambda args=args: kernel(*args) for _, args, _, _ in calls]
    return described(parallel(bound), calls, redescribe=describe)


def described(step: Callable[[], None], calls: list[tuple],
              redescribe: Callable[[], list[tuple]] | None = None) -> Callable[[], None]:
    """``step`` described as one phase of ``(kernel, args, part)`` calls - or ``(kernel, args, part, (reads,
    writes))``: ``chain.Call.access`` - for the CPU backend's chains (``chain.tag``), where numba is in use.
    ``redescribe``: the same calls made again, for a chain's finer parts (``chain.finer``: it calls this inside
    ``threads.finer_parts``)."""
    if not AVAILABLE:
        return step
    from .chain import Call, tag

    def phase(calls):
        return [Call(fn, args, part, access=rest[0] if rest else None) for fn, args, part, *rest in calls]

    again = None if redescribe is None else lambda: [phase(redescribe())]
    return tag(step, phase(calls), redescribe=again)
