"""`run`'s progress: loops show their rate and time left (measured after the first iteration, which compiles and
loads), and a stage that takes no time (a host step) gets no bar of its own."""

from __future__ import annotations

import io
import time

from rich.console import Console

from luminal_recipes.pipeline.progress import Rate, eta_text, progress_printer, rate_text


def test_rate_leaves_out_the_first_iteration():
    rate = Rate(total=6)
    for t, done in ((0.0, 0), (10.0, 1), (10.5, 2), (11.0, 3), (11.5, 4)):  # 10 s compiling, then 0.5 s a step
        rate.update(done, t)
    assert rate.per_second() == 2.0
    assert rate.remaining_s() == 1.0  # two steps left


def test_rate_of_one_iteration_is_its_own_time():
    rate = Rate(total=3)
    rate.update(0, 5.0)
    assert rate.per_second() is None and rate.remaining_s() is None
    rate.update(1, 9.0)
    assert rate.per_second() == 0.25 and rate.remaining_s() == 8.0


def test_rate_and_eta_texts():
    assert rate_text(None) == "" and eta_text(None) == ""
    assert rate_text(2.3456) == "2.35 it/s" and rate_text(0.25) == "4.00 s/it"
    assert eta_text(75.4) == "ETA 1:15" and eta_text(3725) == "ETA 1:02:05"


def _printed(script) -> str:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=120)
    with progress_printer(console=console, show_after_s=0.1) as update:
        script(update)
    return out.getvalue()


def test_quick_stages_get_no_bar_slow_ones_and_loops_do():
    def script(update):
        for name in ("tokenize", "positions", "schedule"):  # host steps: done at once
            update(name, 0, 1)
            update(name, 1, 1)
        update("text_encoder", 0, 1)
        time.sleep(0.4)  # past show_after_s: shown while it runs, kept when done
        update("text_encoder", 1, 1)
        update("denoise", 0, 4)
        for k in range(4):
            time.sleep(0.05)
            update("denoise", k + 1, 4)

    text = _printed(script)
    for quick in ("tokenize", "positions", "schedule"):
        assert quick not in text, text
    assert "text_encoder" in text and "1/1" in text
    assert "denoise" in text and "4/4" in text and ("it/s" in text or "s/it" in text), text


def test_a_loop_shows_time_left_while_it_runs():
    def script(update):
        update("denoise", 0, 10)
        for k in range(3):
            time.sleep(0.02)
            update("denoise", k + 1, 10)

    text = _printed(script)  # the last render: 3 of 10 done
    assert "3/10" in text and "ETA 0:00" in text and "it/s" in text, text
