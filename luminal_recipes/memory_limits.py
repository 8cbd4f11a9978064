"""The memory this process may still use, and what to say when an allocation fails.

The host runtimes' default budget (``--max-memory`` when not given; ``NumpyBackend.capacity``) is the smallest of

* physical memory;
* the cgroup (container) limit minus what the cgroup uses already (``memory.max`` - (``memory.current`` -
  ``inactive_file``) in cgroup v2; ``memory.limit_in_bytes`` - (``memory.usage_in_bytes`` -
  ``total_inactive_file``) in v1): page cache that can be dropped is not counted as used;
* the address-space limit (``RLIMIT_AS``, ``ulimit -v``) minus what the process maps already (``VmSize``) minus
  ``address_reserve()``: what the libraries of a run map besides the model (numba's LLVM, the tokenizer, worker
  threads' stacks and malloc arenas), measured on the tiny pipelines. Memory-mapped checkpoints count against
  this limit, as the budget counts the weights.

``out_of_memory`` turns an allocation failure (``MemoryError``, numpy's ``_ArrayMemoryError``, an ``OSError``
ENOMEM, llvmlite failing to map its library under a limit) into one paragraph: what was asked, which limit
applies, what to do. An allocation inside a Rust extension (tokenizers, safetensors, egglog) aborts the process
instead of raising; the budget's reserve is what keeps a run from getting there (``check_headroom`` refuses a
run whose limits leave nothing for it).
"""

from __future__ import annotations

import errno
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from .errors import BudgetError

CGROUP = Path("/sys/fs/cgroup")
MiB = 1 << 20


@dataclass(frozen=True)
class Limit:
    """One bound on the memory left: its name, the bytes still available under it, and how that was derived."""

    name: str
    available: int
    how: str
    total: int = 0  # the limit itself


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if abs(n) >= 1 << 30 else f"{n / MiB:.0f} MiB"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, ValueError):
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_limit(root: Path | None = None) -> Limit | None:
    """The cgroup's memory limit minus its current use (v2, else v1; under ``root``, default ``CGROUP``); None
    without a limit."""
    root = CGROUP if root is None else root
    physical = physical_memory()
    for limit_file, usage_file, stat_file, inactive in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
         "total_inactive_file"),
    ):
        limit = _read_int(root / limit_file)
        if limit is None or limit >= physical:  # "max", or v1's "unlimited" (a huge number)
            continue
        usage = _read_int(root / usage_file) or 0
        used = max(0, usage - _stat(root / stat_file, inactive))
        return Limit("the cgroup (container) memory limit", max(0, limit - used),
                     f"{_gib(limit)} ({root / limit_file}) minus the {_gib(used)} its processes use", limit)
    return None


def address_reserve() -> int:
    """Address space a run maps besides the model: 512 MiB (numba's LLVM ~150 MiB, Python's heap, the tokenizer)
    and 72 MiB per core (a worker thread's stack and its malloc arena)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return 512 * MiB + 72 * MiB * cores


def mapped_bytes() -> int:
    """The address space this process maps now (``VmSize``); 0 where unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def address_space_limit() -> Limit | None:
    """``RLIMIT_AS`` minus what the process maps and ``address_reserve()``; None without a limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    mapped, reserve = mapped_bytes(), address_reserve()
    return Limit("the process's address-space limit (RLIMIT_AS, ulimit -v)", max(0, soft - mapped - reserve),
                 f"{_gib(soft)} minus the {_gib(mapped)} the process maps already and {_gib(reserve)} kept for "
                 f"the run's libraries and threads", soft)


def limits() -> list[Limit]:
    """Every bound that applies, physical memory first."""
    out = [Limit("physical memory", physical_memory(), _gib(physical_memory()), physical_memory())]
    return out + [lim for lim in (cgroup_limit(), address_space_limit()) if lim is not None]


def host_memory() -> int:
    """The default budget of a host runtime: the smallest ``available`` of ``limits()``."""
    return min(lim.available for lim in limits())


def describe() -> str:
    """The binding limit in words, for messages."""
    lim = min(limits(), key=lambda item: item.available)
    return f"{lim.name}: {_gib(lim.available)} left ({lim.how})"


MIN_HEADROOM = 16 * MiB


def check_headroom() -> int:
    """``host_memory()``, or BudgetError when the process's limits leave (almost) nothing for a run - said before
    any library that aborts on a failed allocation runs."""
    available = host_memory()
    if available < MIN_HEADROOM:
        raise BudgetError(
            f"no memory is left for a run under {describe()}. Raise the limit (ulimit -v, the container's memory "
            f"limit).")
    return available


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: MemoryError (numpy's included), an OSError ENOMEM, or llvmlite
    unable to map its library while an address-space limit is set."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOMEM or "Cannot allocate memory" in str(exc):
            return True
        return "libllvmlite" in str(exc) and address_space_limit() is not None
    return False


def out_of_memory(exc: BaseException) -> str:
    """One paragraph for an allocation failure: what was asked, the limit that applies, what to do."""
    asked = str(exc).strip() or type(exc).__name__
    if len(asked) > 300:
        asked = asked[:297] + "..."
    try:  # the tightest limit the process set itself (a container's, ulimit -v), else physical memory
        found = limits()
        lim = min(found[1:] or found, key=lambda item: item.total)
        where = f"{lim.name} of {_gib(lim.total)}"
    except Exception:  # noqa: BLE001 - reading the limits must not hide the original failure
        where = "the process's memory limits"
    return (f"out of memory: an allocation failed ({asked}). The limit that applies is {where}. Use a smaller "
            f"size (--width/--height, fewer prompt or reply tokens, --context), a lower --max-memory so the plan "
            f"streams weights or refuses up front, or raise the limit (ulimit -v, the container's memory limit).")


def budget(runtime, max_memory: int | None) -> int:
    """The memory budget of a run: ``max_memory`` (``--max-memory``), or the runtime's ``capacity()``. On a host
    runtime a ``max_memory`` above what the cgroup or address-space limit leaves is refused: the process could
    not allocate it, and a library that aborts on a failed allocation would end it without a word."""
    if max_memory is None:
        return runtime.capacity()
    backend = getattr(runtime, "backend", None)
    if getattr(backend, "host_arrays", False):
        bounds = [lim for lim in (cgroup_limit(), address_space_limit()) if lim is not None]
        tight = min(bounds, key=lambda item: item.available) if bounds else None
        if tight is not None and max_memory > tight.available:
            raise BudgetError(
                f"--max-memory {_gib(max_memory)} is more than this process may use under {tight.name}: "
                f"{_gib(tight.available)} left ({tight.how}). "
                + (f"Pass at most --max-memory {tight.available // MiB}MiB, or raise the limit."
                   if tight.available >= MIN_HEADROOM else "Raise the limit (ulimit -v, the container's limit)."))
    return max_memory


# what egglog maps (measured on the tiny pipelines): building the rules' base e-graph and the first search ~300 MiB,
# each later search on that base ~130 MiB at most
EGGLOG_BASE_RESERVE = 384 * MiB
EGGLOG_SEARCH_RESERVE = 192 * MiB


def require_address_space(nbytes: int, what: str, fix: str) -> None:
    """BudgetError unless the address-space limit (if any) leaves ``nbytes`` beyond what the process maps: for
    work done inside an extension that aborts the process when an allocation fails (egglog)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return
    mapped = mapped_bytes()
    if soft - mapped < nbytes:
        raise BudgetError(
            f"{what} needs about {_gib(nbytes)} of address space, and the process's address-space limit (RLIMIT_AS, "
            f"ulimit -v) of {_gib(soft)} leaves {_gib(max(0, soft - mapped))} beyond the {_gib(mapped)} it maps: "
            f"{fix}, or raise the limit.")
