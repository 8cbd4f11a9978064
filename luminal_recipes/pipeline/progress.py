"""Progress output for `run`, on stderr (rich): a bar per loop (the denoising steps: count, rate and time left) and
per stage that takes time; a stage done within ``SHOW_AFTER_S`` (a host step: tokenizing, packing, a schedule)
gets no bar of its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

SHOW_AFTER_S = 0.5  # a single-step stage still running after this long gets its bar; one done sooner never does


@dataclass
class Rate:
    """Iterations per second of a loop, from its own iterations after the first (which includes compiling and
    loading), and the time left at that rate."""

    total: int
    marks: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, done) at each update

    def update(self, done: int, now: float) -> None:
        self.marks.append((now, done))

    def per_second(self) -> float | None:
        steady = [m for m in self.marks if m[1] >= 1]
        if len(steady) >= 2:
            (t0, d0), (t1, d1) = steady[0], steady[-1]
        elif len(self.marks) >= 2 and self.marks[-1][1] > self.marks[0][1]:  # one iteration done: its own time
            (t0, d0), (t1, d1) = self.marks[0], self.marks[-1]
        else:
            return None
        return (d1 - d0) / (t1 - t0) if t1 > t0 and d1 > d0 else None

    def remaining_s(self) -> float | None:
        rate = self.per_second()
        done = self.marks[-1][1] if self.marks else 0
        return (self.total - done) / rate if rate else None


def rate_text(rate: float | None) -> str:
    """``2.31 it/s``, or ``s/it`` below one iteration a second, as tqdm writes them."""
    if rate is None:
        return ""
    return f"{rate:.2f} it/s" if rate >= 1.0 else f"{1.0 / rate:.2f} s/it"


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = int(round(seconds))
    return f"ETA {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"ETA {seconds // 60}:{seconds % 60:02d}"


@contextmanager
def progress_printer(enabled: bool = True, show_after_s: float = SHOW_AFTER_S,
                     console=None) -> Iterator[Callable[[str, int, int], None] | None]:
    """``update(stage, done, total)`` for the pipeline driver: a loop's bar (total > 1) shows at once, with its
    rate and time left; a single-step stage's only once it has run ``show_after_s``."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bars = Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[eta]}"),
                    console=console if console is not None else Console(stderr=True), transient=False)
    tasks: dict[str, int] = {}
    rates: dict[str, Rate] = {}
    timers: dict[str, threading.Timer] = {}
    lock = threading.Lock()

    def show(stage: str) -> None:
        with lock:
            if stage in tasks:
                bars.update(tasks[stage], visible=True)

    def update(stage: str, done: int, total: int) -> None:
        now = time.perf_counter()
        with lock:
            if stage not in tasks or (done == 0 and stage in rates):  # a stage run again (the next prompt) starts over
                if stage in tasks:
                    bars.remove_task(tasks[stage])
                single = total <= 1
                tasks[stage] = bars.add_task(stage, total=total, visible=not single, rate="", eta="")
                rates[stage] = Rate(total)
                if single:
                    timers[stage] = threading.Timer(show_after_s, show, (stage,))
                    timers[stage].daemon = True
                    timers[stage].start()
            task = tasks[stage]
            rate = rates[stage]
            rate.update(done, now)
            fields = {}
            if total > 1:
                fields = {"rate": rate_text(rate.per_second()),
                          "eta": eta_text(rate.remaining_s()) if done < total else ""}
            bars.update(task, completed=done, total=total, **fields)
            if total <= 1 and done >= total:
                timer = timers.pop(stage, None)
                if timer is not None:
                    timer.cancel()
                # shown (it took time) it stays as a record; one that took no time is never shown
                if not next(t.visible for t in bars.tasks if t.id == task):
                    bars.remove_task(task)
                    del tasks[stage]
                    del rates[stage]

    with bars:
        try:
            yield update
        finally:
            for timer in timers.values():
                timer.cancel()
