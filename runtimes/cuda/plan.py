"""What a prepared CUDA node does, independent of the device that runs it.

``prepare`` (``runtimes/cuda/nodes.py``) turns a program node into a ``NodePlan``: kernel sources (CUDA C, one
``extern "C" __global__`` entry each), scratch requests, and ``steps``: kernel ``Launch``es, cuBLAS ``Gemm`` and
cuBLASLt FP8 ``LtGemm`` calls whose pointer arguments are ``Ref``s to the node's output, inputs or scratch arrays.
A backend binds the refs to its arrays (CuPy device memory, or numpy arrays for cuda-emu) and runs the steps:
``CudaBackend`` launches through ``RawModule.get_function`` and calls cuBLAS / cuBLASLt, ``CudaEmuBackend`` calls
the same kernels compiled by g++ and the numpy models of the GEMM descriptors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cublaslt import LtDesc
from .gemm import GemmDesc


@dataclass(frozen=True)
class Ref:
    """A pointer argument: ``kind`` "out" | "in" | "scratch", ``index`` (input or scratch number), plus
    ``offset`` elements of ``itemsize`` bytes."""

    kind: str
    index: int = 0
    offset: int = 0
    itemsize: int = 1

    def at(self, elements: int, itemsize: int) -> Ref:
        return Ref(self.kind, self.index, elements, itemsize)

    @property
    def byte_offset(self) -> int:
        return self.offset * self.itemsize


OUT = Ref("out")


def IN(i: int) -> Ref:  # noqa: N802 (reads like the refs it makes)
    return Ref("in", i)


def SCRATCH(i: int) -> Ref:  # noqa: N802
    return Ref("scratch", i)


@dataclass(frozen=True)
class KernelSource:
    """One kernel entry: ``params`` are the C parameter types in order (pointers end in ``*``); ``sync``: it uses
    ``__syncthreads``/warp shuffles (cuda-emu runs its threads concurrently, otherwise as a plain loop)."""

    name: str
    params: tuple[str, ...]
    code: str
    sync: bool


@dataclass(frozen=True)
class Launch:
    """A kernel launch: ``args`` match the kernel's params (``Ref`` for pointers, numbers otherwise)."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple


@dataclass(frozen=True)
class Gemm:
    """A cuBLAS ``gemmStridedBatchedEx`` call (column-major, see ``gemm.GemmDesc``) on three refs."""

    desc: GemmDesc
    a: Ref
    b: Ref
    c: Ref


@dataclass(frozen=True)
class LtGemm:
    """A cuBLASLt FP8 ``cublasLtMatmul`` (see ``cublaslt.LtDesc``): A, B, D refs, the f32 scale refs of A and B
    (None: 1) and the workspace scratch."""

    desc: LtDesc
    a: Ref
    b: Ref
    d: Ref
    a_scale: Ref | None
    b_scale: Ref | None
    workspace: Ref


@dataclass(frozen=True)
class IndexCheck:
    """After the node runs: the i32 at ``flag`` holds 0, or 1 + the first offending index of a Gather/Scatter
    (kernels clamp and record instead of reading out of bounds); ``message`` names the node and the range."""

    flag: Ref
    message: str


@dataclass
class NodePlan:
    sources: list[KernelSource] = field(default_factory=list)
    steps: list = field(default_factory=list)

    def kernel(self, source: KernelSource) -> str:
        if all(s.name != source.name for s in self.sources):
            self.sources.append(source)
        return source.name


def grid_1d(work: int, block: int, max_blocks: int) -> tuple[int, int, int]:
    """Blocks for a grid-stride loop over ``work`` items (at least one block)."""
    return (max(1, min(-(-work // block), max_blocks)), 1, 1)
