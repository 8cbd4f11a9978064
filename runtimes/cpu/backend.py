"""The numpy backend (CPU): host memory, and the kernels of ``kernels/`` (``PREPARE``).

``NumpyRuntime()`` is ``BackendRuntime(NumpyBackend())``: the generic executable (``executable.py``) over numpy
arrays. The arena is one ``np.uint8`` buffer and every slot a typed view of it; weights and constants are bound
without copying (memory-mapped checkpoint arrays stay memory-mapped); outputs can be handed out as views. The
default memory budget is what the process may still use (``host_memory``: host RAM, the container's limit and
the address-space limit, whichever leaves least). From the second run of a binding, runs of compiled kernel
calls replay as chains, one compiled call each (``capture``, ``jit/chain.py``).
"""

from __future__ import annotations

import os

import numpy as np

from luminal_recipes import memory_limits

from ..executable import BackendRuntime, Executable
from ..kernels import Machine
from ..kernels.context import ALIGNMENT
from . import isa, jit
from .kernels import PREPARE

NUMPY_PREPARE = PREPARE  # every kernel of the registry, by name (``kernels/__init__.py``)

# cost-model constants of this CPU backend: numpy dispatch per kernel, memory bandwidth, elementwise and BLAS
# throughput; numpy's exp2 calls libm once per element (5.6 ns vs 1.75 ns for its vectorised exp)
CPU = Machine(launch_s=4e-6, bytes_per_s=8e9, ew_flops_per_s=1.5e9, mm_flops_per_s=4e10,
              op_weights=(("Exp2", 3.2),))


def host_memory() -> int:
    """The memory a run may use: the smallest of physical memory, the cgroup (container) limit minus its current
    use, and the address-space limit (RLIMIT_AS) minus what the process maps and a reserve for its libraries
    (``luminal_recipes.memory_limits``)."""
    return memory_limits.host_memory()


BUSY_SAMPLES, BUSY_EVERY_S = 5, 0.002  # ``NumpyBackend.contended``: the machine's ready threads, sampled


class NumpyBackend:
    name = "numpy"
    device = "cpu"
    machine = CPU
    kernels = NUMPY_PREPARE
    host_arrays = True
    timed = True
    graph_notices = False  # a program run step by step (streamed weights, nothing to chain) is the usual case
    # chains are recorded at the fifth run of a binding (a decoding loop), not for the compiler's timing of a
    # candidate (``protocol.time_executable``: four runs), which would compile chains for programs never used
    capture_after = 4

    def contended(self) -> str | None:
        """Why timings taken now would measure other work too, or None: other processes' threads ready to run
        leave fewer cores than the runtime's threads in most of a few samples over ~10 ms
        (``threads.others_running``). A plan timed then is a bet on the neighbours' load (a decode step's fused
        attention, 10% faster on a quiet machine, measured 50% slower than its unfused chain beside one busy
        thread), and it is cached: the compiler leaves such a choice to its cost model (``search._busy``)."""
        import time

        from . import threads as cpu_threads

        cpus = os.cpu_count() or 1
        room = cpus - cpu_threads.THREADS
        busy, seen = 0, []
        for i in range(BUSY_SAMPLES):
            if i:
                time.sleep(BUSY_EVERY_S)
            running = cpu_threads._running_threads()
            if running is None:
                return None
            others = cpu_threads.others_running(running, 1)
            seen.append(others)
            busy += others > room
        if 2 * busy <= BUSY_SAMPLES:
            return None
        return (f"{max(seen)} threads of other processes were ready to run beside this one's "
                f"{cpu_threads.THREADS} on {cpus} cores")

    @property
    def target(self) -> str:
        """The instruction-set path the kernels take (``isa.check``): part of the plan cache's key, as a kernel's
        scratch (AMX packing) and so the plan's memory figures differ between paths."""
        return isa.check()

    @property
    def graphs(self) -> bool:
        """Captured "graphs" are chains of compiled kernel calls (``jit/chain.py``): where numba runs, unless
        ``LUMINAL_RECIPES_CHAIN=0``."""
        if not jit.AVAILABLE:
            return False
        from .jit import chain

        return chain.enabled()

    def capacity(self) -> int:
        return memory_limits.check_headroom()  # host_memory(), refused when the limits leave nothing

    def allocate(self, nbytes: int) -> np.ndarray:
        # on a cache line, as the planner aligns every buffer inside it (numpy aligns to 16 bytes only; AMX tile
        # loads of rows split across two lines run at half speed)
        raw = np.zeros(nbytes + ALIGNMENT, dtype=np.uint8)
        start = -raw.ctypes.data % ALIGNMENT
        return raw[start:start + nbytes]

    def slot(self, buf: np.ndarray, offset: int, nbytes: int, dtype) -> np.ndarray:
        return buf[offset : offset + nbytes].view(dtype)

    def upload(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host).reshape(-1)  # a no-op for the arrays checkpoints hand out

    def copy_in(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst.reshape(src.shape), src)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def download(self, src: np.ndarray) -> np.ndarray:
        return src

    def synchronize(self) -> None:
        pass

    def build(self, binds) -> None:
        pass  # numpy's kernels need nothing compiled

    def copy_stream(self) -> None:
        return None  # weights are copied straight into their slots

    takes_buffers = True  # ``capture`` takes the arena's buffers and their lifetimes (``jit/rename.py``)

    def capture(self, steps, buffers=None):
        """One step replaying ``steps``, runs of compiled kernel calls chained (``jit/chain.py``); None where
        nothing chains (the executable then calls the steps one by one). ``buffers``: the arena's buffers
        ``(first byte, end byte, first step, last step)``, whose temporaries a lockstep chain may move."""
        from . import threads
        from .jit import chain

        return chain.capture(steps, threads.THREADS, buffers)

    def warm(self, steps) -> None:
        """Load now what recording ``steps`` as chains will load (``jit/chain.py``, ``warm``); nothing where
        chains are off."""
        if not self.graphs:
            return
        from . import threads
        from .jit import chain

        chain.warm(steps, threads.THREADS)

    def memory_held(self) -> None:
        return None  # host memory: the pipeline measures the process's resident set instead

    def release_memory(self) -> None:
        pass


class NumpyRuntime(BackendRuntime):
    def __init__(self) -> None:
        isa.check()  # a LUMINAL_RECIPES_ISA this CPU cannot run is refused here, with the paths it can
        super().__init__(NumpyBackend())
        jit.warm_up()  # numba's start-up, while the caller builds and compiles


NumpyExecutable = Executable  # the executable of every backend
