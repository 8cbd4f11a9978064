"""Where execution time goes: seconds per kernel class, per model, summed over every run while profiling.

``with profiling() as profile:`` makes every ``Executable.run`` in that block time each step (one clock read
per kernel call) and add it to ``profile`` under the running model's name (``profile.model(name)``, set by
whoever runs the model) and the kernel's name (``MatMul``, ``Elementwise``, ``Attention``...; weight streaming's
loads and waits as ``(weight streaming)``). Outside such a block ``run`` reads no clock per step.
``luminal-recipe run --profile`` prints ``profile.table()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

STREAMING = "(weight streaming)"


@dataclass
class KernelProfile:
    """Seconds and calls per (model, kernel class)."""

    seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    current: str = "(model)"

    @contextmanager
    def model(self, name: str) -> Iterator[None]:
        """Attribute the runs inside this block to model ``name``."""
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def run_steps(self, steps: Sequence[Callable[[], None]], labels: Sequence[str],
                  synchronize: Callable[[], None] | None = None) -> None:
        """Call ``steps`` in order, timing each under its label (``synchronize`` after each: a device backend's
        kernels run asynchronously)."""
        model, clock = self.current, time.perf_counter
        times = [0.0] * len(steps)
        for i, step in enumerate(steps):
            t0 = clock()
            step()
            if synchronize is not None:
                synchronize()
            times[i] = clock() - t0
        for label, dt in zip(labels, times):
            key = (model, label)
            self.seconds[key] = self.seconds.get(key, 0.0) + dt
            self.calls[key] = self.calls.get(key, 0) + 1

    def table(self) -> str:
        """Per model (largest total first): each kernel class's seconds, share of the model and calls."""
        models: dict[str, float] = {}
        for (model, _), s in self.seconds.items():
            models[model] = models.get(model, 0.0) + s
        lines = []
        for model, total in sorted(models.items(), key=lambda kv: -kv[1]):
            lines.append(f"{model}: {total * 1e3:.1f} ms in kernels")
            rows = sorted(((k, s) for (m, k), s in self.seconds.items() if m == model), key=lambda kv: -kv[1])
            for kernel, s in rows:
                share = s / total if total > 0 else 0.0
                lines.append(f"  {kernel:<20} {s * 1e3:10.1f} ms {100 * share:5.1f}%  "
                             f"{self.calls[(model, kernel)]:6d} calls")
        return "\n".join(lines)

    @staticmethod
    def from_json(data: dict) -> KernelProfile:
        profile = KernelProfile()
        for model, kernels in data.items():
            for kernel, rec in kernels.items():
                profile.seconds[(model, kernel)] = rec["seconds"]
                profile.calls[(model, kernel)] = rec["calls"]
        return profile

    def to_json(self) -> dict:
        out: dict[str, dict] = {}
        for (model, kernel), s in self.seconds.items():
            out.setdefault(model, {})[kernel] = {"seconds": round(s, 6), "calls": self.calls[(model, kernel)]}
        return out


_ACTIVE: list[KernelProfile] = []


def active() -> KernelProfile | None:
    """The profile being recorded, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def profiling(profile: KernelProfile | None = None) -> Iterator[KernelProfile]:
    """Record every executable run in this block into ``profile`` (a new one if None)."""
    profile = profile if profile is not None else KernelProfile()
    _ACTIVE.append(profile)
    try:
        yield profile
    finally:
        _ACTIVE.remove(profile)


@contextmanager
def model_section(name: str) -> Iterator[None]:
    """Attribute runs in this block to model ``name`` in the active profile (a no-op when none is active)."""
    profile = active()
    if profile is None:
        yield
        return
    with profile.model(name):
        yield
