"""The numpy runtime's Conv2d against torch's conv2d: the im2col + BLAS path, the compiled direct convolution
(numba, wide rows and few output channels) and Winograd F(2x2, 3x3) (numba transforms around BLAS products; even
output sizes), each on odd sizes, a batch of two, stride 2 with the encoder's one-sided padding, with and without
bias, and fewer output windows than fit (the rule may give that)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fused_programs import Fused

from luminal_recipes.graph import Graph
from luminal_recipes.runtimes.cpu import cblas, jit
from luminal_recipes.runtimes.cpu.kernels import conv as conv_kernels
from luminal_recipes.runtimes.kernels.fused import conv_windows

# (batch, in channels, out channels, height, width, stride, padding (top/left, bottom/right), bias, crop)
CASES = {
    "direct, padded, bias, batch 2": (2, 5, 8, 7, 100, 1, (1, 1), True, 0),
    "direct, no bias": (1, 3, 4, 4, 97, 1, (1, 1), False, 0),
    "direct, unpadded, cropped windows": (1, 2, 8, 6, 101, 1, (0, 0), True, 1),
    "direct, out channels not a multiple of 4": (1, 3, 6, 5, 100, 1, (1, 1), True, 0),
    "direct, three out channels (an image)": (1, 4, 3, 3, 96, 1, (1, 1), True, 0),
    "im2col, narrow rows": (2, 3, 4, 9, 11, 1, (1, 1), True, 0),
    "im2col, stride 2, encoder padding": (2, 3, 4, 9, 100, 2, (0, 1), True, 0),
    "winograd, padded, bias, batch 2": (2, 5, 8, 6, 10, 1, (1, 1), True, 0),
    "winograd, no bias, nine out channels": (1, 4, 9, 4, 6, 1, (1, 1), False, 0),
    "winograd, unpadded, cropped windows": (1, 4, 8, 7, 9, 1, (0, 0), True, 1),
    "winograd, padded after only": (1, 4, 8, 6, 8, 1, (0, 2), True, 0),
    "winograd, padded before only": (2, 5, 8, 6, 8, 1, (2, 0), False, 0),
    # fewer than 4 channels: Winograd where its bands are one compiled call per core (else direct / im2col)
    "winograd, three out channels (an image)": (1, 16, 3, 6, 10, 1, (1, 1), True, 0),
    "winograd, three in channels, batch 2": (2, 3, 8, 4, 8, 1, (1, 1), False, 0),
    # the weight transform in chunks of 32 output channels, taken in turn with the bands
    "winograd, 70 out channels": (1, 6, 70, 6, 8, 1, (1, 1), True, 0),
    # 24 rows of tiles in bands of at most 8 rows, taken in turn by the cores (on two cores or more)
    "winograd, bands on every core": (1, 16, 16, 48, 64, 1, (1, 1), True, 0),
}
COMPILED_PATH = {name: name.split(",")[0] for name in CASES}  # the path numba takes; without it: im2col


@pytest.mark.parametrize("mode", ["numba", "numba, Python band loop", "numpy"])
@pytest.mark.parametrize("case", list(CASES))
def test_conv2d_kernel_matches_torch(case, mode, numpy_runtime, monkeypatch, rng, assert_close):
    """``numba, Python band loop``: Winograd's bands run from Python (``cpu_threads.claimed``), as where numpy's
    BLAS is not OpenBLAS; ``numba``: one compiled call per core (``numba_kernels.winograd_bands``) where it is."""
    compiled = mode != "numpy"
    if compiled and not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    if mode == "numba, Python band loop":
        if COMPILED_PATH[case] != "winograd" or min(CASES[case][1:3]) < conv_kernels.WINOGRAD_MIN_CHANNELS:
            pytest.skip("only the Winograd path has a band loop (from Python: with >= 4 channels)")
        monkeypatch.setattr(cblas, "sgemm", lambda: None)
    monkeypatch.setattr(jit, "AVAILABLE", compiled)
    paths = record_paths(monkeypatch)
    n, c, o, h, w, stride, (lo, hi), bias, crop = CASES[case]
    g = Graph()
    x = g.input("x", (n, c, h, w))
    wt, b = g.weight("w", (o, c, 3, 3)), g.weight("b", (o,))
    xp = x.pad(2, lo, hi).pad(3, lo, hi)
    ho, wo = (h + lo + hi - 3) // stride + 1 - crop, (w + lo + hi - 3) // stride + 1 - crop
    operands = [xp, wt] + ([b.reshape(1, o, 1, 1).broadcast_to((n, o, ho, wo))] if bias else [])
    f = Fused(g)
    y = f.add("Conv2d", operands, (n, o, ho, wo), stride=stride)
    inputs = {"x": rng.standard_normal((n, c, h, w)).astype(np.float32)}
    weights = {"w": (rng.standard_normal((o, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32),
               "b": rng.standard_normal(o).astype(np.float32)}
    got = numpy_runtime.run(f.program(y=y), inputs, weights)["y"]
    t = {k: torch.from_numpy(v.astype(np.float64)) for k, v in {**inputs, **weights}.items()}
    want = F.conv2d(F.pad(t["x"], (lo, hi, lo, hi)), t["w"], t["b"] if bias else None, stride=stride)
    want = want[:, :, :ho, :wo].numpy()
    assert_close("conv", got, want)
    assert paths == [COMPILED_PATH[case] if compiled else "im2col"]


def record_paths(monkeypatch) -> list[str]:
    """The numpy Conv2d paths prepared from now on, in order ("direct", "winograd" or "im2col")."""
    paths = []
    for name in ("direct", "winograd", "im2col"):
        prepare = getattr(conv_kernels, f"_prepare_{name}_conv")
        monkeypatch.setattr(conv_kernels, f"_prepare_{name}_conv",
                            lambda ctx, name=name, prepare=prepare: paths.append(name) or prepare(ctx))
    return paths


@pytest.mark.parametrize("path", ["direct", "winograd"])
def test_conv2d_kernel_bias_not_per_channel(path, numpy_runtime, monkeypatch, rng, assert_close):
    """A bias that varies over the image (a residual added by the rule "conv2d + bias") is added whole."""
    if not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    paths = record_paths(monkeypatch)
    n, c, o, h, w = (1, 3, 4, 5, 100) if path == "direct" else (1, 4, 8, 4, 6)  # odd: not Winograd's
    g = Graph()
    x, wt, r = g.input("x", (n, c, h, w)), g.weight("w", (o, c, 3, 3)), g.input("r", (n, o, h, w))
    f = Fused(g)
    y = f.add("Conv2d", [x.pad(2, 1, 1).pad(3, 1, 1), wt, r], (n, o, h, w), stride=1)
    inputs = {"x": rng.standard_normal((n, c, h, w)).astype(np.float32),
              "r": rng.standard_normal((n, o, h, w)).astype(np.float32)}
    weights = {"w": (rng.standard_normal((o, c, 3, 3)) / 5).astype(np.float32)}
    got = numpy_runtime.run(f.program(y=y), inputs, weights)["y"]
    t = {k: torch.from_numpy(v.astype(np.float64)) for k, v in {**inputs, **weights}.items()}
    assert_close("conv", got, (F.conv2d(t["x"], t["w"], padding=1) + t["r"]).numpy())
    assert paths == [path]


@pytest.mark.parametrize("path", ["direct", "winograd", "im2col"])
def test_conv2d_kernel_bf16_weights_and_output(path, numpy_runtime, monkeypatch, rng, assert_close):
    """bf16 weight and bias read by the f32 kernel, the result rounded once to a bf16 output."""
    compiled = path != "im2col"
    if compiled and not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    monkeypatch.setattr(jit, "AVAILABLE", compiled)
    paths = record_paths(monkeypatch)
    n, c, o, h, w = 1, 3 if path == "direct" else 4, 8, 5 if path == "direct" else 4, 100  # odd: not Winograd's
    g = Graph()
    x, wt, b = g.input("x", (n, c, h, w)), g.weight("w", (o, c, 3, 3), "bf16"), g.weight("b", (o,), "bf16")
    f = Fused(g)
    y = f.add("Conv2d", [x.pad(2, 1, 1).pad(3, 1, 1), wt, b.reshape(1, o, 1, 1).broadcast_to((n, o, h, w))],
              (n, o, h, w), "bf16", stride=1)
    inputs = {"x": rng.standard_normal((n, c, h, w)).astype(np.float32)}
    weights = {"w": (rng.standard_normal((o, c, 3, 3)) / 5).astype(ml_dtypes.bfloat16),
               "b": rng.standard_normal(o).astype(ml_dtypes.bfloat16)}
    got = numpy_runtime.run(f.program(y=y), inputs, weights)["y"]
    assert got.dtype == ml_dtypes.bfloat16
    t = {k: torch.from_numpy(v.astype(np.float64)) for k, v in {**inputs, **weights}.items()}
    want = F.conv2d(t["x"], t["w"], t["b"], padding=1)
    assert_close("conv", got, want, "bf16")
    assert paths == [path]


def test_conv_windows_must_lie_inside_the_input():
    assert conv_windows((1, 3, 9, 8), (4, 3, 3, 3), 2, (1, 4, 4, 3)) == (2, 2)
    assert conv_windows((1, 3, 9, 8), (4, 3, 3, 3), (2, 1), (1, 4, 3, 2)) == (2, 1)  # fewer windows than fit
    for bad in [(1, 4, 5, 3), (1, 4, 4, 4), (2, 4, 4, 3), (1, 5, 4, 3)]:
        with pytest.raises(ValueError, match="do not give"):
            conv_windows((1, 3, 9, 8), (4, 3, 3, 3), 2, bad)


def _compiled_versions(module) -> dict[str, int]:
    """How many machine-code versions (one per argument types) each numba kernel of ``module`` holds."""
    return {name: len(f.signatures) for name, f in vars(module).items() if hasattr(f, "signatures")}


@pytest.mark.parametrize("case", ["direct, padded, bias, batch 2", "winograd, padded, bias, batch 2"])
def test_compiled_convolutions_compile_nothing_at_run_time(case, numpy_runtime, rng):
    """The warm-up (``jit.kernels()``) loads every version a convolution calls: its input and weights are read in
    place through read-only views, a numba type of their own, and a version compiled or loaded in the middle of a
    run cost the medium VAE's first convolution ~45 ms of every run."""
    if not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    module = jit.kernels()
    before = _compiled_versions(module)
    n, c, o, h, w, _, (lo, hi), _, _ = CASES[case]
    g = Graph()
    x = g.input("x", (n, c, h, w))
    wt, b = g.weight("w", (o, c, 3, 3)), g.weight("b", (o,))
    f = Fused(g)
    y = f.add("Conv2d", [x.pad(2, lo, hi).pad(3, lo, hi), wt, b.reshape(1, o, 1, 1).broadcast_to((n, o, h, w))],
              (n, o, h, w), stride=1)
    weights = {"w": rng.standard_normal((o, c, 3, 3)).astype(np.float32),
               "b": rng.standard_normal(o).astype(np.float32)}
    numpy_runtime.run(f.program(y=y), {"x": rng.standard_normal((n, c, h, w)).astype(np.float32)}, weights)
    after = _compiled_versions(module)
    assert after == before, {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}


@pytest.mark.parametrize("band_loop", ["compiled", "python"])
def test_winograd_bands_are_taken_in_turn(band_loop, numpy_runtime, monkeypatch, rng, assert_close):
    """The Winograd convolution's bands of tile rows go to whichever core is free: with two parts and the worker
    held up (a core the OS gives to another job), the calling thread takes the bands the worker has not reached
    (fixed halves made it wait for the worker's whole half), and the result is the same. Both band loops: one
    compiled call per core claiming bands through an atomic counter (``numba_kernels.winograd_bands``, where numpy's
    BLAS is OpenBLAS), and the Python loop over ``cpu_threads.claimed`` (any other BLAS)."""
    import threading
    import time

    from luminal_recipes.runtimes.cpu import threads as cpu_threads

    if not jit.AVAILABLE:
        pytest.skip("numba is not installed (luminal-recipes[jit])")
    if band_loop == "compiled" and cblas.sgemm() is None:
        pytest.skip("numpy's BLAS is not OpenBLAS")
    if band_loop == "python":
        monkeypatch.setattr(cblas, "sgemm", lambda: None)
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    monkeypatch.setattr(conv_kernels, "WINOGRAD_BAND", 16 * 16 * 32)  # one row of tiles per band: 24 bands
    real = jit.kernels("image")
    caller, workers, callers = threading.get_ident(), [], []

    class Delayed:  # the kernels, with one thread held up
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def winograd_input(*args):
            if threading.get_ident() != caller:
                if not workers:
                    time.sleep(0.2)
                workers.append(1)
            return real.winograd_input(*args)

        @staticmethod
        def winograd_bands(*args):  # here the caller is held up: the worker, free, takes the bands
            if threading.get_ident() == caller:
                time.sleep(0.2)
                callers.append(real.winograd_bands(*args))
            else:
                workers.append(real.winograd_bands(*args))

    monkeypatch.setattr(jit, "kernels", lambda family="core": Delayed())
    n, c, o, h, w = 1, 16, 16, 48, 64
    g = Graph()
    x, wt = g.input("x", (n, c, h, w)), g.weight("w", (o, c, 3, 3))
    f = Fused(g)
    y = f.add("Conv2d", [x.pad(2, 1, 1).pad(3, 1, 1), wt], (n, o, h, w), stride=1)
    inputs = {"x": rng.standard_normal((n, c, h, w)).astype(np.float32)}
    weights = {"w": (rng.standard_normal((o, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)}
    got = numpy_runtime.run(f.program(y=y), inputs, weights)["y"]
    if band_loop == "compiled":
        assert sum(callers) + sum(workers) == 24 and len(callers) + len(workers) == 2, (callers, workers)
        # fixed halves would have left 12 bands waiting for the caller (on a machine so loaded that the worker
        # has not started within the caller's sleep, the caller runs both parts: the second finds no band left)
        assert sum(workers) >= 22 if workers else callers[1] == 0, (callers, workers)
    else:
        assert not callers and len(workers) <= 2, workers  # the caller took the other 22-24 of the 24 bands
    want = F.conv2d(torch.from_numpy(inputs["x"].astype(np.float64)),
                    torch.from_numpy(weights["w"].astype(np.float64)), padding=1).numpy()
    assert_close("conv", got, want)


def test_winograd_band_loop_never_waits_for_a_weight_chunk(rng, assert_close):
    """``numba_kernels.winograd_bands`` with every weight-transform chunk taken by another core that never finishes
    (its counter past the chunks, no chunk marked done): the call transforms the chunks itself before its first
    products, instead of spinning on a core the OS may have descheduled, and the result is the convolution."""
    from luminal_recipes.runtimes.cpu import cblas

    if not jit.AVAILABLE or cblas.sgemm() is None:
        pytest.skip("needs numba and numpy's BLAS being OpenBLAS")
    k = jit.kernels()
    c, o, h, w = 8, 40, 8, 8  # two chunks of output channels
    x = rng.standard_normal((1, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((o, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
    u = np.full((16, o, c), np.nan, np.float32)  # a chunk left untransformed would show
    v, m = np.zeros((16, c + 1, 16), np.float32), np.zeros((16, o, 16), np.float32)
    out = np.zeros((1, o, h, w), np.float32)
    chunks = -(-o // k.WEIGHT_CHUNK)
    counter = np.zeros(1 + chunks, np.int64)
    counter[0] = chunks  # the chunks taken, none done
    ran = k.winograd_bands(x, wt.ctypes.data, np.array([s // 4 for s in wt.strides], np.int64), u,
                           np.zeros(o, np.float32), out, v, m, np.array([[0, 0, 4]], np.int64), counter, 4, 1, 1,
                           *cblas.sgemm())
    assert ran == 1 and (counter[1:] >= 1).all()
    want = F.conv2d(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(wt.astype(np.float64)), padding=1)
    assert_close("conv", out, want.numpy())
