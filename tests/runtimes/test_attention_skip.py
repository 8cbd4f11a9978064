"""The numpy attention kernels skip masked keys (``kernels/attention.py``: ``_mask_spans``, ``_pieces``): a causal
mask's upper triangle, a sliding window's far keys, padded keys. Each case is checked against PyTorch's SDPA in
float64 with the same boolean mask (tests/TOLERANCES.md), at lengths that are not multiples of the pieces or key
blocks, with q_len != kv_len (queries at an offset: a chunk of a prompt after a KV cache), and the skipping is
seen to happen (a spy on ``_pieces``), so a wrong span or piece fails the comparison rather than going unused.
Pieces of 4 rows and small query blocks make the shapes small."""

from __future__ import annotations

import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes import ops
from luminal_recipes.graph import DType, Graph, View, cast, run_reference
from luminal_recipes.ops.elementwise import logical_not
from luminal_recipes.runtimes.cpu import jit
from luminal_recipes.runtimes.cpu.kernels import attention as numpy_attention

torch = pytest.importorskip("torch")

H, HKV, D = 4, 2, 8
NEG = float(np.finfo(np.float32).min)


def _mask(s: int, t: int, kind: str) -> np.ndarray:
    """Boolean ``[S, T]`` (True = attend). ``causal``: queries at the last S of T positions (bottom-right, as a
    KV cache's prompt chunk); ``top-left``: torch's ``is_causal`` (query i sees keys 0..i); ``window``: causal
    within 7 keys; ``padded``: the last 5 keys masked for every query; ``none``: all keys."""
    i, j = np.arange(s)[:, None], np.arange(t)[None, :]
    if kind == "causal":
        return j <= i + (t - s)
    if kind == "top-left":
        return j <= i
    if kind == "window":
        return (j <= i + (t - s)) & (j > i + (t - s) - 7)
    if kind == "padded":
        return np.broadcast_to(j < t - 5, (s, t)).copy()
    return np.ones((s, t), bool)


def _case(s: int, t: int, kind: str):
    """The graph (grouped-query attention with the mask as an input, as transformers passes it), the fused
    kernel's operand views, and inputs."""
    g = Graph()
    q = g.input("q", (1, H, s, D))
    k = g.input("k", (1, HKV, t, D))
    v = g.input("v", (1, HKV, t, D))
    allowed = g.input("allowed", (1, 1, s, t), DType.BOOL)
    bias = cast(logical_not(allowed), DType.F32) * NEG  # as ops.scaled_dot_product_attention turns a bool mask
    g.mark_output("y", ops.scaled_dot_product_attention(q, k, v, mask=allowed, scale=0.3))
    rep = H // HKV
    views = [q.split_dim(1, (HKV, rep)), k.unsqueeze(2).broadcast_to((1, HKV, rep, t, D)),
             v.unsqueeze(2).broadcast_to((1, HKV, rep, t, D)),
             bias.unsqueeze(1).broadcast_to((1, HKV, rep, s, t))]
    rng = np.random.default_rng(s * 100 + t)
    inputs = {"q": rng.standard_normal((1, H, s, D)).astype(np.float32),
              "k": rng.standard_normal((1, HKV, t, D)).astype(np.float32),
              "v": rng.standard_normal((1, HKV, t, D)).astype(np.float32),
              "allowed": _mask(s, t, kind)[None, None]}
    return g, views, inputs


def _torch_sdpa(inputs) -> np.ndarray:
    q, k, v = (torch.from_numpy(inputs[n]).double() for n in "qkv")
    rep = H // HKV
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mask = torch.from_numpy(np.ascontiguousarray(inputs["allowed"]))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3).numpy()


def _run(numpy_runtime, op: str, s: int, t: int, kind: str, monkeypatch) -> tuple[np.ndarray, dict, list]:
    monkeypatch.setattr(numpy_attention, "SKIP_ROWS", 4)
    monkeypatch.setattr(numpy_attention, "MIN_ROWS", 1)  # query blocks of ceil(s / 3) rows: several pieces each
    skipped = []
    pieces = numpy_attention._pieces
    monkeypatch.setattr(numpy_attention, "_pieces", lambda *a, **kw: skipped.append(pieces(*a, **kw)) or
                        skipped[-1])
    g, views, inputs = _case(s, t, kind)
    f = Fused(g)
    grouped = (1, HKV, H // HKV, s, D)
    y = f.add(op, views, grouped, scale=0.3, **({"block": 8} if op == "AttentionBlocked" else {}))
    program = f.program()
    program.outputs["y"] = (y, View.contiguous(grouped).reshape((1, H, s, D)))
    return numpy_runtime.run(program, inputs)["y"], inputs, [p for p in skipped if p is not None]


@pytest.mark.parametrize("op", ["Attention", "AttentionBlocked"])
@pytest.mark.parametrize(("s", "t", "kind"), [
    (37, 37, "causal"),      # the prompt: a staircase of pieces, 37 rows: not a multiple of the 4-row pieces
    (13, 40, "causal"),      # q_len != kv_len: 13 queries at positions 27..39 of 40 keys
    (29, 50, "top-left"),    # torch's is_causal with s < t: most keys masked for every query
    (40, 13, "top-left"),    # s > t: the last queries see every key
    (45, 45, "window"),      # a sliding window: spans that start past key 0
    (20, 33, "padded"),      # the same masked keys for every query (the spans end before t)
])
def test_masked_keys_are_skipped_with_torch_sdpa_values(op, s, t, kind, numpy_runtime, assert_close, monkeypatch):
    got, inputs, skipped = _run(numpy_runtime, op, s, t, kind, monkeypatch)
    assert_close("attention", got, _torch_sdpa(inputs))
    # (AttentionBlocked's blocks of 14 rows of 40 x 13 all reach the last key: a block is skipped whole or not)
    assert skipped or (op, s, t) == ("AttentionBlocked", 40, 13), "no task skipped a masked key"
    if op == "Attention" and kind in ("causal", "window") and s >= 24:  # query blocks of >= 8 rows
        assert any(len(p) > 1 for p in skipped)  # blocks cut into pieces of rows, each with its own keys


@pytest.mark.parametrize("op", ["Attention", "AttentionBlocked"])
def test_nothing_masked_skips_nothing(op, numpy_runtime, assert_close, monkeypatch):
    got, inputs, skipped = _run(numpy_runtime, op, 23, 31, "none", monkeypatch)
    assert_close("attention", got, _torch_sdpa(inputs))
    assert skipped == []


@pytest.mark.parametrize("op", ["Attention", "AttentionBlocked"])
def test_a_fully_masked_row_skips_nothing_in_its_block(op, numpy_runtime, assert_close, monkeypatch):
    """A row with every key masked: its softmax is over the masked scores (the mean of v, tests/TOLERANCES.md),
    which skipping would change, so its block computes every key: the reference interpreter's values."""
    monkeypatch.setattr(numpy_attention, "SKIP_ROWS", 4)
    monkeypatch.setattr(numpy_attention, "MIN_ROWS", 1)
    g, views, inputs = _case(30, 30, "causal")
    inputs["allowed"][..., 17, :] = False
    f = Fused(g)
    grouped = (1, HKV, H // HKV, 30, D)
    y = f.add(op, views, grouped, scale=0.3, **({"block": 8} if op == "AttentionBlocked" else {}))
    program = f.program()
    program.outputs["y"] = (y, View.contiguous(grouped).reshape((1, H, 30, D)))
    got = numpy_runtime.run(program, inputs)["y"]
    assert_close("attention", got, run_reference(g, inputs)["y"])
    v = inputs["v"].astype(np.float64).repeat(2, 1)
    assert np.allclose(got[:, :, 17], v.mean(2), atol=1e-5)


def test_mask_spans_compiled_and_numpy_agree(monkeypatch):
    """``_mask_spans``'s compiled pass and its numpy passes: the same spans, on masks of -inf, f32's most negative
    value and NaN, read in place through strided views."""
    rng = np.random.default_rng(7)
    for trial in range(60):
        s, t = (int(n) for n in rng.integers(1, 90, 2))
        low = -np.inf if trial % 2 else NEG
        bias = np.where(rng.random((s, t)) < rng.random(), low, rng.standard_normal((s, t))).astype(np.float32)
        if trial % 5 == 0:
            bias[rng.integers(0, s), rng.integers(0, t)] = np.nan
        if trial % 3 == 0:
            bias = bias[:, ::2]
        results = []
        for compiled in (True, False):
            monkeypatch.setattr(jit, "AVAILABLE", compiled and jit.AVAILABLE)
            spans = [np.zeros(bias.shape[0], np.int64), np.zeros(bias.shape[0], np.int64),
                     np.zeros(bias.shape[0], np.bool_)]
            numpy_attention._mask_spans(bias, *spans)
            results.append(spans)
        seen = ~(bias <= numpy_attention.MASKED)
        rows = seen.any(1)
        first = np.argmax(seen, 1)
        last = bias.shape[1] - np.argmax(seen[:, ::-1], 1)
        for lo, hi, keep in results:
            assert np.array_equal(lo[rows], first[rows]) and np.array_equal(hi[rows], last[rows])
            assert np.array_equal(keep, (np.nan_to_num(bias, nan=-np.inf) >= numpy_attention.KEEP).any(1))
