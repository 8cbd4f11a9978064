"""The plan cache: hits skip the search, keys separate what differs, corrupt entries are rebuilt with a
warning, and an interrupted write leaves nothing behind."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil

import numpy as np
import pytest
from compiler_helpers import check_program

from luminal_recipes import ops
from luminal_recipes.compiler import SearchOptions, cache, compile_graph, search
from luminal_recipes.graph import Graph


def small_graph(width: int = 8, name: str = "w") -> Graph:
    g = Graph()
    x = g.input("x", (4, width))
    g.mark_output("y", ops.softmax(ops.linear(x, g.weight(name, (6, width))), -1))
    return g


OPTS = SearchOptions(time_top=0)


def test_second_compile_loads_the_plan_without_searching(runtime, assert_close, private_cache, monkeypatch):
    first = compile_graph(small_graph(), runtime, options=OPTS)
    assert first.report["cache"] == "miss"
    assert len(list(private_cache.glob("*.json"))) == 1

    def no_search(*args):
        raise AssertionError("searched although the plan is cached")

    monkeypatch.setattr(search, "search_segment", no_search)
    second = compile_graph(small_graph(), runtime, options=OPTS)
    assert second.report["cache"] == "hit"
    assert [(n.op, n.inputs, n.attrs) for n in second.program.nodes] == [
        (n.op, n.inputs, n.attrs) for n in first.program.nodes]
    check_program(small_graph(), second.program, runtime, assert_close)


def test_a_timed_search_is_cached_under_its_key(runtime, private_cache, monkeypatch):
    """With timing (segments measured, the default options), the entry is written under the plan's own key, so
    the next compile of the same graph loads it."""
    g = Graph()
    x = g.input("x", (64, 32))
    for i in range(3):  # a repeated block: its candidates are timed once
        with g.block(f"layers.{i}"):
            x = ops.rms_norm(ops.softmax(ops.linear(x, g.weight(f"w{i}", (32, 32))), -1), g.weight(f"n{i}", (32,)))
    g.mark_output("y", x)
    first = compile_graph(g, runtime)
    assert first.report["cache"] == "miss"
    monkeypatch.setattr(search, "search_segment", lambda *args: pytest.fail("searched although cached"))
    assert compile_graph(g, runtime).report["cache"] == "hit"
    assert len(list(private_cache.glob("*.json"))) == 1


def test_a_plan_is_cached_per_instruction_set_path(runtime, private_cache, monkeypatch):
    """The CPU's path (AMX, AVX-512, ...) is part of the key: a kernel's scratch (AMX packing) and so the plan's
    memory figures differ between paths, and `LUMINAL_RECIPES_AMX=0` must not read a plan made with AMX."""
    if runtime.target == "numpy":
        pytest.skip("numba is not installed: the numpy path is the only one")
    first = compile_graph(small_graph(), runtime, options=OPTS)
    monkeypatch.setenv("LUMINAL_RECIPES_ISA", "numpy")
    assert runtime.target == "numpy"
    other = compile_graph(small_graph(), runtime, options=OPTS)
    assert (first.report["cache"], other.report["cache"]) == ("miss", "miss")
    assert len(list(private_cache.glob("*.json"))) == 2
    monkeypatch.delenv("LUMINAL_RECIPES_ISA")
    assert compile_graph(small_graph(), runtime, options=OPTS).report["cache"] == "hit"


def test_key_separates_graphs_names_dims_runtimes_and_budgets(runtime):
    keys = {
        cache.plan_key(small_graph(), "numpy", "cpu", {}, {}),
        cache.plan_key(small_graph(width=10), "numpy", "cpu", {}, {}),
        cache.plan_key(small_graph(name="other"), "numpy", "cpu", {}, {}),
        cache.plan_key(small_graph(), "cupy", "cuda:0", {}, {}),
        cache.plan_key(small_graph(), "numpy", "cpu", {"s": 4}, {}),
        cache.plan_key(small_graph(), "numpy", "cpu", {}, {"budget": 10}),
    }
    assert len(keys) == 6
    assert cache.plan_key(small_graph(), "numpy", "cpu", {}, {}) in keys  # and it is stable


def two_weights(swap: bool = False, shared: bool = False) -> Graph:
    """y = softmax(x a^T) - x b^T: the same names, kinds and shapes whether a and b are swapped or one weight is
    read twice, so only the wiring tells the graphs apart."""
    g = Graph()
    x = g.input("x", (4, 8))
    a, b = g.weight("a", (6, 8)), g.weight("b", (6, 8))
    if swap:
        a, b = b, a
    if shared:
        b = a
    g.mark_output("y", ops.softmax(ops.linear(x, a), -1) - ops.linear(x, b))
    return g


def test_key_separates_graphs_that_differ_only_in_wiring(runtime):
    keys = {cache.plan_key(two_weights(**kw), "numpy", "cpu", {}, {})
            for kw in ({}, {"swap": True}, {"shared": True})}
    assert len(keys) == 3


def test_a_plan_is_never_reused_for_a_graph_wired_otherwise(runtime, assert_close, private_cache):
    first = compile_graph(two_weights(), runtime, options=OPTS)
    assert first.report["cache"] == "miss"
    swapped = compile_graph(two_weights(swap=True), runtime, options=OPTS)
    assert swapped.report["cache"] == "miss"  # not the first graph's plan, which reads a and b the other way
    check_program(two_weights(swap=True), swapped.program, runtime, assert_close)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LUMINAL_RECIPES_CACHE", str(tmp_path / "explicit"))
    assert cache.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("LUMINAL_RECIPES_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "luminal-recipes"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_dir() == cache.Path.home() / ".cache" / "luminal-recipes"


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_format"])
def test_corrupt_entry_is_ignored_and_rebuilt(damage, runtime, assert_close, private_cache):
    compile_graph(small_graph(), runtime, options=OPTS)
    (entry,) = private_cache.glob("*.json")
    text = entry.read_text()
    if damage == "truncate":
        entry.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        entry.write_bytes(b"\x00\xffnot json")
    else:
        entry.write_text(json.dumps(dict(json.loads(text), format="something-else")))
    with pytest.warns(UserWarning, match="unreadable.*compiling again"):
        plan = compile_graph(small_graph(), runtime, options=OPTS)
    assert plan.report["cache"] == "miss"
    check_program(small_graph(), plan.program, runtime, assert_close)
    assert json.loads(entry.read_text())["format"] == cache.FORMAT  # rebuilt in place


def test_interrupted_write_leaves_no_entry(runtime, private_cache, monkeypatch):
    def interrupted(fd):
        raise KeyboardInterrupt

    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        compile_graph(small_graph(), runtime, options=OPTS)
    assert list(private_cache.iterdir()) == []  # neither an entry nor a temporary file
    monkeypatch.setattr(os, "fsync", fsync)
    assert compile_graph(small_graph(), runtime, options=OPTS).report["cache"] == "miss"


def test_cache_can_be_bypassed(runtime, private_cache):
    compile_graph(small_graph(), runtime, options=SearchOptions(use_cache=False, time_top=0))
    assert not private_cache.exists() or not list(private_cache.iterdir())


# ---- adversarial entries and folders (issue 8): never trusted blindly, never a crash -----------------------------
def constant_graph() -> Graph:
    g = Graph()
    x = g.input("x", (4, 8))
    table = g.constant(np.arange(32, dtype=np.float32).reshape(4, 8) / 8)
    g.mark_output("y", ops.softmax(x + table, -1))
    return g


def test_hand_edited_constant_fails_the_checksum_and_is_rebuilt(runtime, assert_close, private_cache):
    compile_graph(constant_graph(), runtime, options=OPTS)
    (entry,) = private_cache.glob("*.json")
    data = json.loads(entry.read_text())
    node = next(n for n in data["program"]["nodes"] if "data" in n)
    values = np.frombuffer(base64.b64decode(node["data"]), dtype=np.float32).copy()
    values[0] = 1000.0  # a different image, if it ran
    node["data"] = base64.b64encode(values.tobytes()).decode()
    entry.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=re.escape(str(entry)) + ".*checksum.*compiling again"):
        plan = compile_graph(constant_graph(), runtime, options=OPTS)
    assert plan.report["cache"] == "miss"
    check_program(constant_graph(), plan.program, runtime, assert_close)  # the original constant, not 1000
    assert compile_graph(constant_graph(), runtime, options=OPTS).report["cache"] == "hit"  # rebuilt in place


def test_unknown_kernel_names_the_entry_and_is_rebuilt(runtime, assert_close, private_cache):
    compile_graph(small_graph(), runtime, options=OPTS)
    (entry,) = private_cache.glob("*.json")
    data = json.loads(entry.read_text())
    data["program"]["nodes"][-1]["op"] = "Bogus"
    data["checksum"] = cache._checksum(data)  # a consistent entry, as another build could have written
    entry.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=re.escape(str(entry)) + ".*unknown kernel 'Bogus'"):
        plan = compile_graph(small_graph(), runtime, options=OPTS)
    check_program(small_graph(), plan.program, runtime, assert_close)
    assert compile_graph(small_graph(), runtime, options=OPTS).report["cache"] == "hit"


def test_unusable_cache_folder_means_no_cache_not_a_crash(runtime, assert_close, tmp_path, monkeypatch):
    not_a_folder = tmp_path / "cache-file"
    not_a_folder.write_text("a file where the cache folder should be")
    monkeypatch.setenv("LUMINAL_RECIPES_CACHE", str(not_a_folder))
    monkeypatch.setattr(cache, "_warned", set())
    with pytest.warns(UserWarning, match=re.escape(str(not_a_folder)) + ".*compiling without a cache"):
        plan = compile_graph(small_graph(), runtime, options=OPTS)
    check_program(small_graph(), plan.program, runtime, assert_close)
    assert compile_graph(small_graph(), runtime, options=OPTS).report["cache"] == "miss"  # again, quietly


def test_unwritable_entry_means_no_cache_not_a_crash(runtime, private_cache, monkeypatch):
    monkeypatch.setattr(cache, "_warned", set())
    compile_graph(small_graph(), runtime, options=OPTS)
    (entry,) = private_cache.glob("*.json")
    entry.unlink()
    entry.mkdir()  # a folder where the entry should be written: the write fails
    with pytest.warns(UserWarning, match="cannot write the plan cache entry"):
        assert compile_graph(small_graph(), runtime, options=OPTS).report["cache"] == "miss"
    assert [p.name for p in private_cache.iterdir()] == [entry.name]  # no temporary file left
# ---- the key covers the rules and the kernels --------------------------------------------------------------
def _edited_rules(tmp_path, monkeypatch, family: str, old: str, new: str):
    from luminal_recipes.compiler import rules

    folder = tmp_path / "rules"
    shutil.copytree(rules.rules_dir(), folder)
    path = folder / f"{family}.egg"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    monkeypatch.setattr(rules, "rules_dir", lambda: folder)


def test_editing_a_rule_file_never_reuses_a_stale_plan(runtime, tmp_path, monkeypatch, private_cache,
                                                       assert_close):
    """One cache for both compiles: the edited rule text is a new key (and a different program), not a hit."""
    first = compile_graph(small_graph(), runtime, options=OPTS)
    assert first.report["cache"] == "miss" and "Softmax" in first.program.kernel_counts()
    assert compile_graph(small_graph(), runtime, options=OPTS).report["cache"] == "hit"
    # the softmax rule now looks for a different constant: it no longer fires
    _edited_rules(tmp_path, monkeypatch, "softmax", "1.4426950408889634", "1.5")
    edited = compile_graph(small_graph(), runtime, options=OPTS)
    assert edited.report["cache"] == "miss" and "Softmax" not in edited.program.kernel_counts()
    check_program(small_graph(), edited.program, runtime, assert_close)
    assert len(list(private_cache.glob("*.json"))) == 2


def test_keys_differ_under_two_rule_texts_and_two_kernel_versions(runtime, tmp_path, monkeypatch):
    import dataclasses

    from luminal_recipes.compiler.fingerprint import plan_fingerprints
    from luminal_recipes.runtimes import kernels

    base = plan_fingerprints(runtime)
    with pytest.MonkeyPatch.context() as patch:
        _edited_rules(tmp_path, patch, "cleanup", "x*1", "x times one")  # a rule's name only
        assert plan_fingerprints(runtime)["rules"] != base["rules"]
    assert plan_fingerprints(runtime) == base
    spec = kernels.REGISTRY["Softmax"]
    monkeypatch.setitem(kernels.REGISTRY, "Softmax", dataclasses.replace(spec, version="2"))
    assert plan_fingerprints(runtime)["kernels"] != base["kernels"]


def test_editing_a_kernel_implementation_changes_the_key(runtime, tmp_path, monkeypatch):
    from luminal_recipes.compiler import fingerprint

    copies = []
    for path in fingerprint.implementation_sources(runtime):
        copy = tmp_path / f"{len(copies)}-{path.name}"
        copy.write_bytes(path.read_bytes())
        copies.append(copy)
    monkeypatch.setattr(fingerprint, "implementation_sources", lambda rt: copies)
    before = fingerprint.plan_fingerprints(runtime)["implementation"]
    kernel = next(c for c in copies if c.name.endswith("-norms.py"))
    kernel.write_text(kernel.read_text().replace("ROW_TILE = 1 << 16", "ROW_TILE = 1 << 15"))
    assert fingerprint.plan_fingerprints(runtime)["implementation"] != before
