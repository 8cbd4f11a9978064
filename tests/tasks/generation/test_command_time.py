"""`done in T s` is this command's own time: a shell that waits and then `exec`s the command (same process, same
start time in /proc) does not add its wait, and the interpreter's start-up still counts."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time

from generation_checkpoints import RECIPES

SLEEP = 3.0


def timed(script: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=600)
    return result, time.perf_counter() - t0


def test_the_clock_starts_at_exec_not_at_the_shells_start():
    probe = shlex.quote("import time; from luminal_recipes import cli; print(time.perf_counter() - cli._IMPORTED_AT)")
    for before in ("", f"sleep {SLEEP} && "):
        result, wall = timed(f"{before}exec {shlex.quote(sys.executable)} -c {probe}")
        assert result.returncode == 0, result.stderr
        counted = float(result.stdout)
        assert counted > 0.0  # the interpreter's start-up and imports count
        assert counted <= wall - (SLEEP if before else 0.0), (before, counted, wall)


def test_run_after_exec_reports_its_own_time(llama):
    command = " ".join(shlex.quote(a) for a in [
        sys.executable, "-m", "luminal_recipes", "run", str(RECIPES / "llama.yaml"), "--weights", str(llama[0]),
        "--prompt", "Hello", "--max-new-tokens", "3"])
    result, wall = timed(f"sleep {SLEEP} && exec {command}")
    assert result.returncode == 0, result.stderr
    done = re.search(r"done in ([\d.]+) s", result.stderr)
    assert done, result.stderr
    assert 0.0 < float(done.group(1)) <= wall - SLEEP + 0.05, (done.group(0), wall)  # printed with one decimal
