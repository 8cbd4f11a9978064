"""Where execution time goes: seconds per kernel class, per model, summed over every run while profiling.

``with profiling() as profile:`` makes every ``Executable.run`` in that block time each step (one clock read
per kernel call) and add it to ``profile`` under the running model's name (``profile.model(name)``, set by
whoever runs the model) and the kernel's name (``MatMul``, ``Elementwise``, ``Attention``...; weight streaming's
loads and waits as ``(weight streaming)``). Outside such a block ``run`` reads no clock per step.
``luminal-recipe run --profile`` prints ``profile.table()``.

With ``LUMINAL_RECIPES_PROFILE_TOP=N`` (read when a profile is made) each step is also recorded under its kernel
*instance* - the kernel with its output shape and dtype, its expression (``Elementwise``) and the views it reads
(shape:strides, ``+offset``, ``masked``) - and the table ends with the N costliest instances per model. Identical
instances (the same kernel of every repeated block) add up into one row: what to fuse or speed up first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

STREAMING = "(weight streaming)"
TOP_ENV = "LUMINAL_RECIPES_PROFILE_TOP"


def _top_from_env() -> int:
    try:
        return max(0, int(os.environ.get(TOP_ENV, "0") or 0))
    except ValueError:
        return 0


@dataclass
class KernelProfile:
    """Seconds and calls per (model, kernel class)."""

    seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    current: str = "(model)"
    top: int = field(default_factory=_top_from_env)  # instances listed per model (0: classes only)
    instance_seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    instance_calls: dict[tuple[str, str], int] = field(default_factory=dict)

    @contextmanager
    def model(self, name: str) -> Iterator[None]:
        """Attribute the runs inside this block to model ``name``."""
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def run_steps(self, steps: Sequence[Callable[[], None]], labels: Sequence[str],
                  synchronize: Callable[[], None] | None = None,
                  instances: Sequence[str] | None = None) -> None:
        """Call ``steps`` in order, timing each under its label (``synchronize`` after each: a device backend's
        kernels run asynchronously), and under its instance description when ``instances`` are given."""
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
        if instances is not None:
            for instance, dt in zip(instances, times):
                key = (model, instance)
                self.instance_seconds[key] = self.instance_seconds.get(key, 0.0) + dt
                self.instance_calls[key] = self.instance_calls.get(key, 0) + 1

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
            rows = sorted(((k, s) for (m, k), s in self.instance_seconds.items() if m == model),
                          key=lambda kv: -kv[1])[: self.top]
            if rows:
                lines.append(f"  the {len(rows)} costliest kernel instances (ms, share, calls):")
            for instance, s in rows:
                share = s / total if total > 0 else 0.0
                lines.append(f"    {s * 1e3:9.1f} {100 * share:5.1f}% {self.instance_calls[(model, instance)]:6d}  "
                             f"{instance}")
        return "\n".join(lines)

    @staticmethod
    def from_json(data: dict, instances: dict | None = None) -> KernelProfile:
        """The profile ``to_json`` (and ``instances_json``) wrote."""
        profile = KernelProfile()
        for model, kernels in data.items():
            for kernel, rec in kernels.items():
                profile.seconds[(model, kernel)] = rec["seconds"]
                profile.calls[(model, kernel)] = rec["calls"]
        for model, rows in (instances or {}).items():
            profile.top = max(profile.top, len(rows))
            for rec in rows:
                profile.instance_seconds[(model, rec["kernel"])] = rec["seconds"]
                profile.instance_calls[(model, rec["kernel"])] = rec["calls"]
        return profile

    def to_json(self) -> dict:
        out: dict[str, dict] = {}
        for (model, kernel), s in self.seconds.items():
            out.setdefault(model, {})[kernel] = {"seconds": round(s, 6), "calls": self.calls[(model, kernel)]}
        return out

    def instances_json(self) -> dict:
        """Per model, the ``top`` costliest instances, costliest first: ``{"kernel", "seconds", "calls"}``."""
        out: dict[str, list] = {}
        for (model, instance), s in sorted(self.instance_seconds.items(), key=lambda kv: -kv[1]):
            rows = out.setdefault(model, [])
            if len(rows) < self.top:
                rows.append({"kernel": instance, "seconds": round(s, 6),
                             "calls": self.instance_calls[(model, instance)]})
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
