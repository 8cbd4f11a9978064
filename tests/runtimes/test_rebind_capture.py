"""Re-binding keeps an executable's recent bindings (``Executable.bind``, ``executable.BINDINGS``): going back to
dims bound before restores their bound steps and their recorded chains (``cpu/jit/chain.py``) without planning or
recording again, and gives the bits the steps give one by one; alternating dims replay on both sides; a larger arena
drops the bindings into the old one (which is then freed); a reply sequence long, short, long prompt gives a fresh
model's ids and prefill logits for each reply. On the tiny Q4_K/Q6_K llama GGUF made by llama.cpp's quantizer."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")
pytest.importorskip("gguf")

from luminal_recipes.runtimes import executable  # noqa: E402
from luminal_recipes.runtimes.cpu import jit  # noqa: E402
from luminal_recipes.runtimes.cpu.backend import NumpyBackend  # noqa: E402
from luminal_recipes.tasks.generation import LanguageModel  # noqa: E402

if not jit.AVAILABLE:
    pytest.skip("numba is off (LUMINAL_RECIPES_JIT=0 or LUMINAL_RECIPES_ISA=numpy): no chains", allow_module_level=True)

from luminal_recipes.runtimes.cpu.jit import chain  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "llama.yaml"
GGUF = ROOT / "tests" / "fixtures" / "gguf" / "tiny-llama-q4_k.gguf"
PROMPT = [(7 * i + 3) % 1000 + 3 for i in range(80)]  # token ids of the tiny model's 1024


def _model() -> LanguageModel:
    return LanguageModel(RECIPE, weights=GGUF, context=128)


@pytest.fixture(scope="module")
def lm():
    model = _model()
    model.prepare(prompt_tokens=64, max_new_tokens=8)  # decode and a prefill loaded for 64 tokens
    return model


def _prefill(lm: LanguageModel, n: int, chains: bool, monkeypatch, ctx: int | None = None) -> executable.Executable:
    """A prefill executable loaded for ``n`` tokens attending to ``ctx`` (default ``n``; sharing the session's
    weights and KV cache), chains on or off, with its plans counted."""
    monkeypatch.setenv(chain.ENV, "1" if chains else "0")
    session = lm._session
    exe = lm.runtime.load(lm._program("prefill"), session.decode.weights, lm._dims(n, ctx or n, session.cache),
                          states_from=session.decode)
    monkeypatch.setenv(chain.ENV, "1")
    exe.plans = 0
    plan = exe._plan

    def counted(dims):
        exe.plans += 1
        return plan(dims)

    exe._plan = counted
    return exe


def _planned(exe) -> int:
    """Bindings made since loading: planned afresh or in the loaded plan's places (``Executable._in_place``)."""
    return exe.plans + exe.stats.rebinds_in_place


def _run(lm: LanguageModel, exe, n: int) -> np.ndarray:
    feeds = {"tokens": np.asarray([PROMPT[:n]], np.int32), "positions": np.arange(n, dtype=np.int32)}
    return exe.run(feeds, dims=lm._dims(n, n, lm._session.cache))["logits"]


def _reference(lm: LanguageModel, lengths, monkeypatch) -> dict[int, np.ndarray]:
    """Each length's logits from an executable loaded for it that runs its steps one by one (no chains)."""
    out = {}
    for n in lengths:
        exe = _prefill(lm, n, False, monkeypatch)
        out[n] = _run(lm, exe, n)
        assert not exe.replaying and exe.stats.replays == 0
        exe.close()
    return out


def test_going_back_replays_the_recorded_chains_bit_for_bit(lm, monkeypatch):
    ref = _reference(lm, (24, 40), monkeypatch)
    exe = _prefill(lm, 40, True, monkeypatch)
    past = NumpyBackend.capture_after + 2
    for _ in range(past):
        assert np.array_equal(_run(lm, exe, 24), ref[24])
    assert exe.replaying and exe.stats.replays == 2 and exe._replay.chains >= 1
    assert not exe._bindings  # the binding loaded for 40 tokens never ran: not kept
    recorded, steps = exe._replay, exe._steps
    assert np.array_equal(_run(lm, exe, 40), ref[40])  # planned again, its steps one by one
    assert not exe.replaying and exe.stats.replays == 2 and len(exe._bindings) == 1
    back = _run(lm, exe, 24)  # back: the recording restored, replayed at once, nothing planned again
    assert exe._replay is recorded and exe._steps is steps and exe.stats.replays == 3
    assert np.array_equal(back, ref[24])
    assert _planned(exe) == 2 and exe.stats.rebinds == 3 and exe.stats.rebinds_cached == 1
    exe.close()
    assert not exe._bindings


def test_alternating_dims_replay_on_both_sides(lm, monkeypatch):
    ref = _reference(lm, (17, 33), monkeypatch)
    exe = _prefill(lm, 33, True, monkeypatch)
    rounds = NumpyBackend.capture_after + 4
    for _ in range(rounds):
        for n in (17, 33):
            assert np.array_equal(_run(lm, exe, n), ref[n]), n
    assert _planned(exe) == 2  # each length once (the loaded binding was left before it ran)
    assert exe.stats.rebinds == 2 * rounds and exe.stats.rebinds_cached == 2 * rounds - 2
    assert exe.stats.replays == 2 * (rounds - NumpyBackend.capture_after)  # each recorded at its fifth run
    exe.close()


def test_a_larger_arena_drops_the_bindings_into_the_old_one(lm, monkeypatch):
    ref = _reference(lm, (3, 5, 60), monkeypatch)
    exe = _prefill(lm, 5, True, monkeypatch, ctx=60)  # its Iota serves 60 positions, its arena 5 tokens
    for n in (3, 5):
        assert np.array_equal(_run(lm, exe, n), ref[n])
    old = weakref.ref(exe.arena.base)
    assert len(exe._bindings) == 1  # 3 (5 is the current one)
    assert np.array_equal(_run(lm, exe, 60), ref[60])  # 60 tokens need a larger arena
    assert exe.stats.arena_allocations == 1 and not exe._bindings
    gc.collect()
    assert old() is None, "a dropped binding kept the old arena alive"
    for n in (3, 5):  # planned again, in the new arena
        assert np.array_equal(_run(lm, exe, n), ref[n])
    assert _planned(exe) == 5 and exe.stats.rebinds_cached == 0
    exe.close()


def test_the_kept_bindings_are_bounded_least_recently_used_first(lm, monkeypatch):
    monkeypatch.setattr(executable, "BINDINGS", 3)
    exe = _prefill(lm, 64, True, monkeypatch)
    for n in (10, 11, 12, 13):
        _run(lm, exe, n)
    assert [dict(key)["seq"] for key in exe._bindings] == [11, 12]  # and 13, the current one; 10 dropped
    plans = _planned(exe)
    _run(lm, exe, 11)  # kept: not planned
    assert _planned(exe) == plans and [dict(key)["seq"] for key in exe._bindings] == [12, 13]
    _run(lm, exe, 10)  # dropped: planned again, and 12 goes
    assert _planned(exe) == plans + 1 and [dict(key)["seq"] for key in exe._bindings] == [13, 11]
    exe.close()
    monkeypatch.setattr(executable, "BINDINGS", 1)  # none kept besides the current one
    exe = _prefill(lm, 64, True, monkeypatch)
    for n in (10, 11, 10):
        _run(lm, exe, n)
    assert not exe._bindings and _planned(exe) == 3 and exe.stats.rebinds_cached == 0
    exe.close()


def test_a_reply_sequence_gives_a_fresh_models_ids(monkeypatch):
    """Long, short, long, short, long prompt on one model (recording at a binding's second run, so the prefills
    replay too) against a fresh model for each prompt: the same ids and the same prefill logits, bit for bit."""
    long, short = PROMPT[:70], PROMPT[:6]

    def reply(model: LanguageModel, ids: list[int]) -> tuple[list[int], np.ndarray]:
        seen = []
        model.prepare(prompt_tokens=70, max_new_tokens=12)
        exe = model._session.prefill
        run = exe.run

        def recording(*args, **kwargs):
            out = run(*args, **kwargs)
            seen.append(np.array(out["logits"], copy=True))
            return out

        exe.run = recording
        try:
            ids = model.generate(ids, max_new_tokens=12, stop=()).ids
        finally:
            del exe.run
        return ids, seen[0]

    want = {len(ids): reply(_model(), ids) for ids in (long, short)}
    monkeypatch.setattr(NumpyBackend, "capture_after", 1)
    model = _model()
    for ids in (long, short, long, short, long):
        got = reply(model, ids)
        assert got[0] == want[len(ids)][0]
        assert np.array_equal(got[1], want[len(ids)][1])
    session = model._session
    assert session.prefill.stats.replays == 3  # the third and later replies' prefills replayed their chains
    assert session.prefill.stats.rebinds_cached == 3 and session.decode.stats.rebinds_cached >= 3
    assert session.decode.stats.replays > 0


def test_a_rebinding_within_the_loaded_dims_keeps_the_other_kernels_steps(lm, monkeypatch):
    """Shorter prompts than the loaded 48 tokens: the loaded plan's places are kept (``memory.plan_at``), only
    the kernels whose shapes or views name ``seq``/``ctx`` are prepared and bound again (a prefill's token rows:
    nearly all), every other step is the same object as before; the logits are those of an executable loaded for
    each length, bit for bit. Longer than loaded: planned afresh, as before."""
    lengths = (9, 30, 31, 48)
    ref = _reference(lm, lengths, monkeypatch)
    exe = _prefill(lm, 48, True, monkeypatch, ctx=60)  # its Iota serves 60 positions
    steps = dict(exe._node_steps)
    for n in lengths:
        assert np.array_equal(_run(lm, exe, n), ref[n]), n
    assert exe.plans == 0 and exe.stats.rebinds_in_place == len(lengths)
    moving = {nid for nid in steps if exe._node_symbols[nid] & {"seq", "ctx"}}
    kept = {nid for nid, step in exe._node_steps.items() if steps[nid] is step}
    assert kept and kept == set(steps) - moving
    assert exe.stats.nodes_rebound == len(moving) * len(lengths)
    assert np.array_equal(_run(lm, exe, 49), _reference(lm, (49,), monkeypatch)[49])
    assert exe.plans == 1 and exe.stats.rebinds_in_place == len(lengths)  # beyond the loaded dims: planned afresh
    exe.close()


def test_kept_bindings_hold_no_prepared_kernels_or_view_holders(lm, monkeypatch):
    """What a kept binding holds lives as long as it is kept, so the garbage collector walks it again and again
    (a decode loop through a compiled PyTorch model re-binds every token: docs/torch.md, "garbage collector"):
    no prepared kernel (its context and bind closure: only its scratch size is kept) and no holder object that
    ``as_strided`` leaves behind every view it makes (``views.alias`` makes views without one), and few tracked
    objects per kernel bound again."""
    exe = _prefill(lm, 48, True, monkeypatch, ctx=60)
    _run(lm, exe, 48)
    gc.collect()
    gc.disable()
    try:
        before = {id(o) for o in gc.get_objects()}
        rebound = exe.stats.nodes_rebound
        for n in (29, 30, 31):
            _run(lm, exe, n)
        rebound = exe.stats.nodes_rebound - rebound
        kept = [o for o in gc.get_objects() if id(o) not in before]
    finally:
        gc.enable()
    kinds = {type(o).__name__ for o in kept}
    assert rebound > 0 and exe.stats.rebinds_in_place >= 3
    assert not kinds & {"DummyArray", "KernelContext", "KernelInput", "Scratch"}, kinds
    assert len(kept) < 60 * rebound, (len(kept), rebound)  # 105 a kernel before: 46 now (the bound steps)
    exe.close()
