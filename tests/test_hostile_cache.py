"""Hostile plan-cache entries and files left behind (issue 21, classes 5 and 8).

Class 5: an entry is used only when it carries the user's HMAC (the key lives outside the cache folder) AND it is
a program of the graph being compiled (``compiler/plan_check.py``); anything else is a miss: a one-line warning
naming the entry and the reason, the plan rebuilt, the entry replaced, and the run's result that of a fresh compile.
Each probe below is built here from a real entry. Class 8: SIGTERM while an output or an entry is being written
leaves nothing behind (exit 143); a temporary file a killed process left is swept by the next write into that
folder and by ``cache clear`` once stale, and a fresh one (another process's write in flight) is kept.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from luminal_recipes import ops, tempfiles
from luminal_recipes.compiler import SearchOptions, cache, compile_graph
from luminal_recipes.graph import Graph, run_reference
from luminal_recipes.runtimes.cpu.backend import NumpyRuntime

ROOT = Path(__file__).resolve().parents[1]
OPTS = SearchOptions(time_top=0)


@pytest.fixture(scope="module")
def runtime():
    return NumpyRuntime()


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A private cache folder and cache key, and no warnings remembered from other tests."""
    monkeypatch.setenv("LUMINAL_RECIPES_CACHE", str(tmp_path / "plans"))
    monkeypatch.setenv("LUMINAL_RECIPES_CACHE_KEY", str(tmp_path / "config" / "cache.key"))
    monkeypatch.setattr(cache, "_warned", set())
    return tmp_path / "plans"


def graph() -> Graph:
    """A weight, an array constant, an Elementwise kernel and a symbolic dim ``s``."""
    g = Graph()
    x = g.input("x", ("s", 8))
    table = g.constant(np.arange(8, dtype=np.float32) / 8)
    y = ops.softmax(ops.linear(x, g.weight("w", (8, 8))), -1)
    g.mark_output("y", y * 2.0 + table.expand(0, "s"))
    g.weight("other", (8, 8))  # another weight of the same shape, which the graph does not read
    return g


DIMS = {"s": 8}


def values(dims=DIMS):
    rng = np.random.default_rng(0)
    return ({"x": rng.standard_normal((dims["s"], 8)).astype(np.float32)},
            {"w": rng.standard_normal((8, 8)).astype(np.float32), "other": np.zeros((8, 8), np.float32)})


def run(plan, dims=DIMS) -> np.ndarray:
    inputs, weights = values(dims)
    return np.asarray(NumpyRuntime().run(plan.program, inputs, weights, dims)["y"])


def compiled(runtime, folder) -> tuple[Path, dict]:
    plan = compile_graph(graph(), runtime, dims=DIMS, options=OPTS)
    assert plan.report["cache"] == "miss"
    (entry,) = folder.glob("*.json")
    return entry, json.loads(entry.read_text())


def signed(entry: Path, data: dict) -> None:
    """Write ``data`` with a valid HMAC: as if the user's own key had signed it (the structural check alone)."""
    data["checksum"] = cache._checksum(data)
    entry.write_text(json.dumps(data))


def rebuilt(runtime, entry: Path, reason: str) -> None:
    """The next compile warns (one line naming the entry and ``reason``), rebuilds, replaces the entry, and its
    program computes what a fresh compile's does."""
    with pytest.warns(UserWarning, match=re.escape(str(entry)) + ".*" + reason + ".*compiling again") as caught:
        plan = compile_graph(graph(), runtime, dims=DIMS, options=OPTS)
    assert plan.report["cache"] == "miss"
    assert all("\n" not in str(w.message) for w in caught)
    fresh = compile_graph(graph(), runtime, dims=DIMS, options=SearchOptions(time_top=0, use_cache=False))
    np.testing.assert_array_equal(run(plan), run(fresh))
    inputs, weights = values()
    want = run_reference(graph(), inputs, weights, DIMS, mode="f64")["y"]
    np.testing.assert_allclose(run(plan), want, rtol=1e-5, atol=1e-5)
    assert compile_graph(graph(), runtime, dims=DIMS, options=OPTS).report["cache"] == "hit"  # replaced


def nodes(data, op):
    return [n for n in data["program"]["nodes"] if n["op"] == op]


def a_read(data) -> dict:
    """The view of an operand that reads a node's whole buffer (a kernel reading the input ``x``)."""
    prog = data["program"]["nodes"]
    x = next(i for i, n in enumerate(prog) if n["op"] == "Input" and n["attrs"]["name"] == "x")
    return next(v for n in prog for src, v in n["inputs"] if src == x)


# ---- class 5: what the cache trusts ----------------------------------------------------------------------------
def test_an_edited_and_resummed_entry_is_rebuilt(runtime, folder):
    """Whoever can write the folder but not read the key can edit a constant and recompute a SHA-256 over the
    content (the old checksum): the entry is not accepted, and the image is the fresh compile's."""
    entry, data = compiled(runtime, folder)
    (const,) = [n for n in nodes(data, "Constant") if "data" in n]
    table = np.frombuffer(base64.b64decode(const["data"]), np.float32).copy()
    table[:] = 1000.0
    const["data"] = base64.b64encode(table.tobytes()).decode()
    body = {k: v for k, v in data.items() if k != "checksum"}
    data["checksum"] = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
    entry.write_text(json.dumps(data))
    rebuilt(runtime, entry, "checksum")


def test_a_constant_not_of_the_graph_is_rebuilt_even_when_signed(runtime, folder):
    entry, data = compiled(runtime, folder)
    (const,) = [n for n in nodes(data, "Constant") if "data" in n]
    const["data"] = base64.b64encode(np.full(8, 1000.0, np.float32).tobytes()).decode()
    signed(entry, data)
    rebuilt(runtime, entry, "array constant this graph does not have")


def test_the_key_is_made_private_outside_the_cache_folder(runtime, folder):
    compiled(runtime, folder)
    key = cache.key_path()
    assert folder not in key.parents and key.stat().st_mode & 0o777 == 0o600
    assert len(bytes.fromhex(key.read_text().strip())) == 32


def test_an_entry_under_another_key_is_a_miss(runtime, folder, tmp_path, monkeypatch):
    """Another user's entry in a shared folder (their key, not ours) is rebuilt, never used."""
    entry, _ = compiled(runtime, folder)
    monkeypatch.setenv("LUMINAL_RECIPES_CACHE_KEY", str(tmp_path / "someone-else.key"))
    rebuilt(runtime, entry, "checksum")


@pytest.mark.parametrize("field, value, reason", [
    ("offset", str(2 ** 40), f"reads elements {2 ** 40}..{2 ** 40 + 7} of a buffer of 8"),
    ("offset", str(-2 ** 40), f"reads elements {-2 ** 40}.."),
    ("strides", [str(2 ** 40), "1"], f"reads elements 0..{2 ** 40 + 7} of a buffer of 16 at s=2"),
    ("strides", [str(2 ** 50), "1"], "a stride or offset beyond any buffer"),
    ("strides", ["9", "1"], "reads elements 0..16 of a buffer of 16 at s=2"),  # a row too far
    ("offset", "8 - s", "reads elements 7..14 of a buffer of 8 at s=1"),  # in bounds at s=8 only
    ("shape", ["s", "9"], "reads elements"),
])
def test_views_out_of_their_buffer_are_rebuilt(runtime, folder, field, value, reason):
    entry, data = compiled(runtime, folder)
    a_read(data)[field] = value
    signed(entry, data)
    rebuilt(runtime, entry, re.escape(reason))


def test_unknown_kernels_and_attributes_are_rebuilt(runtime, folder):
    entry, data = compiled(runtime, folder)
    nodes(data, "Softmax")[0]["attrs"] = {"__class__": "os.system"}
    signed(entry, data)
    rebuilt(runtime, entry, "Softmax has no attribute '__class__'")
    data = json.loads(entry.read_text())
    nodes(data, "Softmax")[0]["op"] = "os.system"
    signed(entry, data)
    rebuilt(runtime, entry, "unknown kernel 'os.system'")


@pytest.mark.parametrize("name", ["other", "missing"])
def test_an_entry_naming_another_weight_is_rebuilt_not_a_failed_run(runtime, folder, name):
    """``other`` is a weight of the graph of the same shape that the graph does not read; ``missing`` none."""
    entry, data = compiled(runtime, folder)
    (w,) = [n for n in nodes(data, "Input") if n["attrs"]["name"] == "w"]
    w["attrs"]["name"] = name
    signed(entry, data)
    rebuilt(runtime, entry, f"'{name}' is not an input, weight or state this graph reads")


@pytest.mark.parametrize("where", ["expr", "dim"])
def test_a_50000_deep_expression_is_rebuilt(runtime, folder, where):
    entry, data = compiled(runtime, folder)
    if where == "expr":
        node = nodes(data, "Elementwise")[0]
        node["attrs"]["expr"] = "(Exp " * 50_000 + "in0" + ")" * 50_000
        reason = "nested 50000 deep"
    else:
        a_read(data)["offset"] = "(" * 50_000 + "0" + ")" * 50_000
        reason = "dimension expression of 100001 characters"
    signed(entry, data)
    rebuilt(runtime, entry, reason)


def test_an_oversized_entry_is_not_read(runtime, folder):
    """An 8 GiB entry (a sparse file: no disk) in a process limited to 3 GiB of address space: refused from its
    size, never read, and the plan rebuilt, in seconds."""
    entry, _ = compiled(runtime, folder)
    with open(entry, "r+b") as f:
        f.truncate(8 << 30)
    script = textwrap.dedent("""
        import sys, warnings
        sys.path.insert(0, {tests!r})
        from test_hostile_cache import graph, DIMS, OPTS
        from luminal_recipes.compiler import compile_graph
        from luminal_recipes.runtimes.cpu.backend import NumpyRuntime
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = compile_graph(graph(), NumpyRuntime(), dims=DIMS, options=OPTS)
        print(plan.report["cache"])
        print(*[str(w.message) for w in caught], sep="\\n")
    """).format(tests=str(Path(__file__).parent))

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          preexec_fn=limit)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("miss"), proc.stdout
    assert f"{entry}" in proc.stdout and f"it is {8 << 30} bytes, more than the" in proc.stdout, proc.stdout
    assert time.monotonic() - started < 90
    assert entry.stat().st_size < 1 << 20  # replaced by the rebuilt entry


# ---- class 8: no file left behind ------------------------------------------------------------------------------
def _writer_blocked(kind: str, target: Path, ready: Path) -> subprocess.Popen:
    """A child process that blocks in the middle of writing (``os.fsync`` of the temporary file waits) after
    saying so in ``ready``: a PNG through the real command line, or a plan-cache entry."""
    block = textwrap.dedent(f"""
        import os, time
        from pathlib import Path
        def blocked(fd):
            Path({str(ready)!r}).write_text("writing")
            time.sleep(120)
        os.fsync = blocked
    """)
    if kind == "png":
        body = textwrap.dedent(f"""
            import sys
            sys.argv = ["luminal-recipe", "run", {str(ROOT / "recipes" / "flux2-tiny.yaml")!r}, "-p", "a cat",
                        "--no-compile", "--steps", "1", "--width", "32", "--height", "32", "--set",
                        "max_sequence_length=64", "--quiet", "-o", {str(target)!r}]
            from luminal_recipes.cli import entry
            entry()
        """)
    else:
        body = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from luminal_recipes.cli import TERMINATED_EXIT, Terminated, handle_sigterm
            handle_sigterm()  # as the command line does
            from test_hostile_cache import graph, DIMS, OPTS
            from luminal_recipes.compiler import compile_graph
            from luminal_recipes.runtimes.cpu.backend import NumpyRuntime
            try:
                compile_graph(graph(), NumpyRuntime(), dims=DIMS, options=OPTS)
            except Terminated:
                sys.exit(TERMINATED_EXIT)
        """)
    return subprocess.Popen([sys.executable, "-c", block + body], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=target.parent.parent)


def _wait_for(ready: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the child never reached the write"
        time.sleep(0.05)


@pytest.mark.parametrize("kind,signum", [("png", signal.SIGTERM), ("entry", signal.SIGTERM), ("png", signal.SIGHUP)])
def test_sigterm_while_writing_leaves_nothing(folder, tmp_path, kind, signum):
    out = tmp_path / "out" / "cat.png"
    out.parent.mkdir()
    ready = tmp_path / "ready"
    cache.secret_key()  # made here: the child's first write (and fsync) is then the entry's
    proc = _writer_blocked(kind, out, ready)
    written = out.parent if kind == "png" else folder
    try:
        _wait_for(ready, proc)
        assert [p for p in written.iterdir() if tempfiles.TEMP_NAME.match(p.name)]  # it was writing
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert list(written.iterdir()) == [], list(written.iterdir())  # neither the file nor a temporary one


def test_sigkill_leftovers_are_swept_once_stale_and_fresh_ones_kept(folder, tmp_path):
    """SIGKILL leaves the temporary file (nothing can run); the next write into the folder removes it once it is
    older than an hour and its writer is gone, and keeps a fresh one and one whose writer still runs."""
    out = tmp_path / "out" / "cat.png"
    out.parent.mkdir()
    ready = tmp_path / "ready"
    proc = _writer_blocked("png", out, ready)
    try:
        _wait_for(ready, proc)
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    (left,) = list(out.parent.iterdir())
    assert tempfiles.TEMP_NAME.match(left.name) and f".{proc.pid}." in left.name
    fresh = out.parent / f".other.png.{proc.pid}.{'a' * 12}.tmp"  # a write in flight on another machine, say
    fresh.write_bytes(b"in flight")
    alive = out.parent / f".mine.png.{os.getpid()}.{'b' * 12}.tmp"  # old, but its writer (this process) runs
    alive.write_bytes(b"slow")
    old = time.time() - 2 * tempfiles.STALE_AFTER_S
    os.utime(left, (old, old))
    os.utime(alive, (old, old))
    from luminal_recipes.image_io import write_png

    write_png(out, np.zeros((4, 4, 3), np.uint8))
    assert not left.exists() and fresh.exists() and alive.exists() and out.exists()


def test_cache_clear_and_the_next_compile_sweep_stale_temporaries(runtime, folder):
    from typer.testing import CliRunner

    from luminal_recipes.cli import app

    folder.mkdir(parents=True)
    (folder / "cuda").mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    old = time.time() - 2 * tempfiles.STALE_AFTER_S
    stale = [folder / f".{'c' * 64}.json.{gone}.{'1' * 12}.tmp", folder / "cuda" / f".m.cubin.{gone}.{'2' * 12}.tmp"]
    fresh = folder / f".{'d' * 64}.json.{gone}.{'3' * 12}.tmp"
    for path in [*stale, fresh]:
        path.write_bytes(b"x")
    for path in stale:
        os.utime(path, (old, old))
    compile_graph(graph(), runtime, dims=DIMS, options=OPTS)  # writes an entry: sweeps the folder first
    assert not stale[0].exists() and fresh.exists() and stale[1].exists()
    stale[0].write_bytes(b"x")
    os.utime(stale[0], (old, old))
    result = CliRunner().invoke(app, ["cache", "clear"])
    assert result.exit_code == 0, result.output
    assert not any(p.exists() for p in stale) and fresh.exists() and not list(folder.glob("*.json"))
