"""The CPU backend's chains (``runtimes/cpu/jit/chain.py``): runs of compiled kernel calls replayed by one generated
interpreter must give the bits the steps give one by one, at one and two threads, on a quantized GGUF model and on
an f32 model; ``LUMINAL_RECIPES_CHAIN=0`` turns them off; a chained kernel's located error still reaches the
caller."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")
pytest.importorskip("gguf")

from luminal_recipes.runtimes.cpu import jit  # noqa: E402
from luminal_recipes.runtimes.cpu import threads as cpu_threads  # noqa: E402
from luminal_recipes.tasks.generation import LanguageModel  # noqa: E402

if not jit.AVAILABLE:
    pytest.skip("numba is off (LUMINAL_RECIPES_JIT=0 or LUMINAL_RECIPES_ISA=numpy): no chains", allow_module_level=True)

from luminal_recipes.runtimes.cpu.jit import chain  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
GGUF = ROOT / "tests" / "fixtures" / "gguf" / "tiny-llama-q4_k.gguf"  # Q4_K and Q6_K by llama.cpp's quantizer
TOKENS = 10  # decode steps: the chains are recorded at the fifth run of the decode program


def _decode_outputs(lm: LanguageModel, prompt: list[int]) -> tuple[list[dict], object, object]:
    """Every output of every decode step of a greedy reply of ``TOKENS`` tokens (EOS ignored), and the decode
    executable."""
    lm.generate(prompt, max_new_tokens=2)  # builds the session (programs compiled, loaded)
    exe = lm._session.decode
    seen: list[dict] = []
    run = exe.run

    def recording(*args, **kwargs):
        out = run(*args, **kwargs)
        seen.append({k: np.array(v, copy=True) for k, v in out.items()})
        return out

    exe.run = recording
    eos = lm.eos_ids if hasattr(lm, "eos_ids") else None
    for _ in range(2):  # two replies: the second one wholly replayed
        lm.generate(prompt, max_new_tokens=TOKENS, stop=())
    del exe.run
    return seen, exe, eos


def _compare(make, prompt, monkeypatch, threads: int, most: float, lockstep: bool) -> None:
    """The decode outputs chained and step by step are equal; Python calls per replay at most ``most`` of the
    steps."""
    monkeypatch.setattr(cpu_threads, "THREADS", threads)
    if threads > 1:  # tiny models: split every kernel that can, and run every chain in lockstep (barriers)
        monkeypatch.setattr(cpu_threads, "MIN_PART", 64)
        monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
        monkeypatch.setattr(chain, "ADAPTIVE", False)  # lockstep even on a loaded machine
    monkeypatch.setenv(chain.ENV, "1")
    chained, exe, _ = _decode_outputs(make(), prompt)
    assert exe.replaying, "the decode program was never chained"
    assert exe._replay.chains >= 1
    if threads > 1 and lockstep:
        assert exe._replay.lockstep >= 1  # some chain ran on both threads (the quantized products split)
    assert exe._replay.launches <= most * len(exe._steps)  # steps in chains: fewer Python calls per token
    monkeypatch.setenv(chain.ENV, "0")
    plain, exe_plain, _ = _decode_outputs(make(), prompt)
    assert not exe_plain.replaying
    assert len(chained) == len(plain) > 0
    for step, (a, b) in enumerate(zip(chained, plain)):
        assert a.keys() == b.keys()
        for name in a:
            assert np.array_equal(a[name], b[name]), f"decode step {step}, output {name}: chained != step by step"


@pytest.mark.parametrize("threads", [1, 2])
def test_gguf_decode_is_bit_identical_chained(monkeypatch, threads):
    def make():
        return LanguageModel(RECIPES / "llama.yaml", weights=GGUF, context=64)

    _compare(make, [1, 5, 9, 2, 7, 3], monkeypatch, threads, 0.5, True)


@pytest.mark.parametrize("threads", [1, 2])
def test_f32_decode_is_bit_identical_chained(tmp_path_factory, monkeypatch, threads):
    sys.path.insert(0, str(ROOT / "tests" / "recipe"))
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from llm_checkpoints import save_tiny

    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(folder, "Qwen3ForCausalLM", tokenizer=True)

    def make():
        return LanguageModel(RECIPES / "qwen3.yaml", weights=folder, context=64)

    # the f32 products of one token are compiled calls too (jit/f32_kernels.py): chained, split over the threads
    _compare(make, [3, 1, 4, 1, 5, 9], monkeypatch, threads, 0.3, True)


def test_switch_off(monkeypatch):
    from luminal_recipes.runtimes.cpu.backend import NumpyBackend

    monkeypatch.setenv(chain.ENV, "0")
    assert not NumpyBackend().graphs
    monkeypatch.setenv(chain.ENV, "1")
    assert NumpyBackend().graphs


def _scatter_program(threads: int):
    """Two described steps: a checked row scatter (a KV-cache write) and a compiled copy after it."""
    out = np.zeros((4, 3), np.float32)
    idx = np.array([1], np.int32)
    src = np.arange(3, dtype=np.float32).reshape(1, 3)
    after = np.zeros((4, 3), np.float32)
    seen = []

    def scatter():
        i = int(idx[0])
        if not 0 <= i < 4:
            raise IndexError(f"scatter: row {i} outside [0, 4)")
        out[i] = src[0]
        seen.append("scatter")

    def copy():
        after[...] = out

    scatter = chain.tag(scatter, [chain.Call(chain.scatter_rows, (out, idx, src, 4), checked=True)])
    copy = chain.tag(copy, [chain.Call(chain.copy_region, (after, after, out, False))])
    return chain.capture([scatter, copy], threads), out, idx, after, seen


@pytest.mark.parametrize("threads", [1, 2])
def test_checked_kernel_error_reaches_the_caller(monkeypatch, threads):
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 0)  # two threads in lockstep, though only thread 0 works
    replay, out, idx, after, seen = _scatter_program(threads)
    assert replay is not None and replay.chains == 1 and replay.launches == 1
    replay()
    assert out[1].tolist() == [0, 1, 2] and np.array_equal(after, out) and not seen  # ran compiled
    idx[0] = 7
    with pytest.raises(IndexError, match="row 7 outside"):  # the step itself ran, and raised its own error
        replay()
    idx[0] = 2
    replay()  # the chain runs again after a failure
    assert out[2].tolist() == [0, 1, 2] and np.array_equal(after, out)
