"""fp8 DequantMatMul through cuBLASLt FP8 (opt-in: ``CudaOptions.fp8_gemm="cublaslt"`` / $LUMINAL_FP8_GEMM), the
fallbacks, and bf16 GEMMs below sm_80 - all on the CPU: cuda-emu runs the same quantizer kernels and the numpy
model of the very ``cublasLtMatmul`` descriptor the GPU gets (``runtimes/cuda/cublaslt.py``).

The FP8 path quantizes activations to e4m3 with a per-tensor scale, so it is checked against a reference that
does the same in numpy/ml_dtypes (amax, ``s = amax / 448``, ``e4m3(x * (448 / amax))``, f32 products and sums),
not against the reference interpreter's weight-only dequantization (which it differs from by ~2%: why it is not
the default). Faking the device's compute capability (the emulator's ``arch``) checks that below sm_89, or
without the library, the weight-decoding path runs instead with a one-line notice.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes import ops
from luminal_recipes.errors import InputError, LuminalError
from luminal_recipes.graph import Graph, run_reference
from luminal_recipes.runtimes.cuda import CudaEmuBackend, CudaOptions, CudaRuntime, CudaUnavailableError, cublaslt
from luminal_recipes.runtimes.cuda.backend import check_architecture, lt_call, prepare_program
from luminal_recipes.runtimes.cuda.devices import DEVICES
from luminal_recipes.runtimes.cuda.gemm import GemmLayoutError
from luminal_recipes.runtimes.cuda.plan import Gemm, LtGemm

E4M3, BF16 = ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16
needs_gxx = pytest.mark.skipif(not shutil.which("g++"), reason="cuda-emu needs g++")


def emu(mode: str = "cublaslt", arch: str = "sm_90", check=None) -> CudaRuntime:
    return CudaRuntime(CudaEmuBackend(CudaOptions(max_blocks=64, fp8_gemm=mode, arch=arch, fp8_check=check)))


def quantized_reference(x: np.ndarray, w: np.ndarray, scale: np.ndarray, bias=None) -> np.ndarray:
    """What the FP8 path computes, in f32: per-tensor e4m3 activations, exact e4m3 products, f32 sums, then the
    two scales (per channel: in the epilogue) and the bias."""
    xf = x.astype(np.float32).reshape(-1, x.shape[-1])
    amax = np.abs(xf).max()
    s_x, inv = (np.float32(amax) / np.float32(448), np.float32(448) / np.float32(amax)) if amax else (1, 1)
    xq = (xf * np.float32(inv)).astype(E4M3).astype(np.float32)
    acc = xq @ w.astype(np.float32).T
    sw = scale.astype(np.float32).reshape(-1)
    out = acc * np.float32(s_x * sw[0]) if sw.size == 1 else (acc * np.float32(s_x)) * sw
    if bias is not None:
        out = out + bias.astype(np.float32)
    return out.reshape(*x.shape[:-1], w.shape[0])


def fp8_linear(m_shape, n, k, scale_shape=(), bias=False, dtype="bf16", w_view=None):
    g = Graph()
    x = g.input("x", (*m_shape, k), dtype)
    w = g.weight("w", (n, k) if w_view is None else w_view[0], "f8e4m3")
    wv = w if w_view is None else w_view[1](w)
    s = g.weight("s", scale_shape)
    inputs = [x, wv, s]
    if bias:
        inputs.append(g.weight("b", (n,), dtype).broadcast_to((*m_shape, n)))
    f = Fused(g)
    y = f.add("DequantMatMul", inputs, (*m_shape, n), dtype, format="fp8", layout="", out_features=n, in_features=k)
    g.mark_output("y", ops.linear(x, ops.dequant_fp8(wv, s)))  # the weight-only reference, for comparison
    return g, f.program(y=y)


def lt_steps(runtime, program) -> list:
    """Every step the backend prepares for the program's kernels (what it would bind and run)."""
    plans = prepare_program(program, {}, runtime.backend.options)
    return [s for plan, _ in plans.values() for s in plan.steps]


# ---- the descriptor and its model ---------------------------------------------------------------------------
def lt_desc(**changes) -> cublaslt.LtDesc:
    base = dict(trans_a=True, trans_b=False, m=32, n=5, k=48, lda=64, ldb=48, ldd=32, a_type=np.dtype(E4M3),
                b_type=np.dtype(E4M3), d_type=np.dtype(BF16), a_scale=True, b_scale=True, workspace=1 << 20)
    base.update(changes)
    return cublaslt.LtDesc(**base)


def test_model_reads_tn_operands_with_padded_leading_dimension_and_both_scales(rng):
    d = lt_desc()
    w = (rng.standard_normal((d.m, d.lda)) * 8).astype(E4M3)  # A: W [m, lda] row-major = K x m column-major
    xq = (rng.standard_normal((d.n, d.k)) * 8).astype(E4M3)  # B: x [n, k] row-major = k x n column-major
    out = np.zeros((d.n, d.ldd), BF16)
    scales = np.array([0.5, 0.03125], np.float32)
    cublaslt.run_model(d, (w, 0), (xq, 0), (out, 0), (scales, 0), (scales, 4))
    want = (xq.astype(np.float32) @ w[:, : d.k].astype(np.float32).T) * np.float32(0.5 * 0.03125)
    np.testing.assert_array_equal(out.astype(np.float32), want.astype(BF16).astype(np.float32))


@pytest.mark.parametrize(("change", "message"), [
    ({"trans_a": False}, "TN"), ({"trans_b": True}, "TN"), ({"k": 40, "lda": 40, "ldb": 40}, "multiple of 16"),
    ({"lda": 56}, "A's leading dimension"), ({"ldd": 36}, "D's leading dimension"),
    ({"d_type": np.dtype(E4M3)}, "output"), ({"ldb": 32}, "too small"),
    ({"a_type": np.dtype(ml_dtypes.float8_e5m2), "b_type": np.dtype(ml_dtypes.float8_e5m2)}, "e5m2")])
def test_descriptor_refuses_what_cublaslt_fp8_refuses(change, message):
    with pytest.raises(GemmLayoutError, match=message):
        lt_desc(**change).check()


def test_model_refuses_reading_past_a_buffer():
    d = lt_desc()
    w = np.zeros((d.m - 1) * d.lda + d.k - 1, E4M3)  # one element short
    with pytest.raises(GemmLayoutError, match="past its buffer"):
        cublaslt.run_model(d, (w, 0), (np.zeros(d.n * d.k, E4M3), 0), (np.zeros(d.n * d.ldd, BF16), 0),
                           (np.ones(1, np.float32), 0), (np.ones(1, np.float32), 0))


def test_heuristic_result_has_the_c_layout():
    # cublasLtMatmulHeuristicResult_t: algo (8 x u64), size_t workspaceSize, status, float wavesCount, int[4]
    assert ctypes.sizeof(cublaslt.HeuristicResult) == 96
    assert cublaslt.HeuristicResult.workspaceSize.offset == 64


def test_library_not_found_is_a_clear_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(cublaslt, "_candidates", lambda major: [str(tmp_path / "libcublasLt.so.13")])
    with pytest.raises(cublaslt.LtUnavailable, match="LUMINAL_CUBLASLT"):
        cublaslt.find_library(13)
    reason = cublaslt.fp8_unsupported("sm_90", lambda: cublaslt.find_library(13))
    assert reason.startswith("cuBLASLt is unavailable (libcublasLt not found")
    assert cublaslt.fp8_unsupported("sm_80") == "sm_80 has no FP8 tensor cores (cuBLASLt FP8 GEMMs need sm_89 or newer)"
    assert cublaslt.fp8_unsupported("sm_89") is None and cublaslt.fp8_unsupported("sm_100a") is None


def test_candidates_put_the_explicit_path_first(monkeypatch):
    monkeypatch.setenv("LUMINAL_CUBLASLT", "/opt/x/libcublasLt.so.13")
    assert cublaslt._candidates(13)[0] == "/opt/x/libcublasLt.so.13"


def test_a_wrong_mode_is_refused():
    with pytest.raises(InputError, match="LUMINAL_FP8_GEMM='fast'"):
        CudaOptions(fp8_gemm="fast")


# ---- the FP8 path on cuda-emu -------------------------------------------------------------------------------
@needs_gxx
@pytest.mark.parametrize(("case", "m_shape", "n", "k", "scale_shape", "bias"), [
    ("per tensor, bf16 D straight into the output", (2, 3), 40, 64, (), False),
    ("per channel and a bias: f32 D, epilogue", (7,), 24, 32, (24, 1), True),
    ("one row, [1] scale", (1,), 16, 48, (1,), False),
])
def test_fp8_gemm_matches_the_quantized_reference(case, m_shape, n, k, scale_shape, bias, rng):
    g, program = fp8_linear(m_shape, n, k, scale_shape, bias)
    runtime = emu()
    assert sum(isinstance(s, LtGemm) for s in lt_steps(runtime, program)) == 1, case
    weights = {"w": (rng.standard_normal((n, k)) * 4).astype(E4M3),
               "s": (rng.random(scale_shape) * 0.02 + 0.01).astype(np.float32)}
    if bias:
        weights["b"] = rng.standard_normal(n).astype(BF16)
    x = (rng.standard_normal((*m_shape, k)) * 3).astype(BF16)
    got = runtime.run(program, {"x": x}, weights)["y"].astype(np.float32)
    want = quantized_reference(x, weights["w"], weights["s"], weights.get("b"))
    # one bf16 rounding of the same f32 value (the bias add rounds once more in the epilogue)
    np.testing.assert_allclose(got, want.astype(BF16).astype(np.float32), rtol=2**-7, atol=1e-6)
    dense = run_reference(g, {"x": x}, weights)["y"].astype(np.float32)  # x @ dequant(W).T, no bias
    if bias:
        dense = dense + weights["b"].astype(np.float32)
    rel = np.abs(got - dense).max() / np.abs(dense).max()
    assert 1e-3 < rel < 0.08, f"{case}: {rel:.3g} from the weight-only result (e4m3 activations: ~2-4%)"


@needs_gxx
def test_quantizer_kernels_round_like_ml_dtypes(rng):
    """x spanning e4m3's range, subnormals and exact ties after scaling: the quantized activations (read back
    through the model's B operand) equal ml_dtypes' e4m3 of x * (448 / amax), bit for bit."""
    k, rows = 64, 33
    x = (rng.standard_normal((rows, k)) * np.exp2(rng.integers(-12, 4, (rows, k)))).astype(BF16)
    x[0, 0] = -7.5  # the amax, negative
    g, program = fp8_linear((rows,), 16, k)
    w = np.zeros((16, k), E4M3)
    w[np.arange(16), np.arange(16)] = 1.0  # picks x's first 16 columns: out = xq[:, :16] * s_x
    got = emu().run(program, {"x": x}, {"w": w, "s": np.float32(1.0)})["y"].astype(np.float32)
    want = quantized_reference(x, w, np.float32(1.0))
    np.testing.assert_array_equal(got, want.astype(BF16).astype(np.float32))


@needs_gxx
def test_weight_with_padded_rows_is_read_in_place_and_a_transposed_one_is_copied(rng):
    n, k = 16, 32
    for w_shape, view, in_place in [((n, 48), lambda w: w.slice(1, 0, k), True),
                                    ((k, n), lambda w: w.T, False)]:
        g, program = fp8_linear((5,), n, k, w_view=(w_shape, view))
        runtime = emu()
        steps = lt_steps(runtime, program)
        lt = next(s for s in steps if isinstance(s, LtGemm))
        assert (lt.a.kind == "in") == in_place and lt.desc.lda == (48 if in_place else k)
        raw = (rng.standard_normal(w_shape) * 4).astype(E4M3)
        x = rng.standard_normal((5, k)).astype(BF16)
        got = runtime.run(program, {"x": x}, {"w": raw, "s": np.float32(0.05)})["y"].astype(np.float32)
        dense_w = raw[:, :k] if in_place else raw.T
        want = quantized_reference(x, dense_w, np.float32(0.05))
        np.testing.assert_allclose(got, want.astype(BF16).astype(np.float32), rtol=2**-7, atol=1e-6)


@needs_gxx
def test_all_zero_activations_give_zeros_and_a_nan_poisons_the_output(rng):
    g, program = fp8_linear((4,), 16, 32)
    weights = {"w": rng.standard_normal((16, 32)).astype(E4M3), "s": np.float32(0.1)}
    runtime = emu()
    zeros = runtime.run(program, {"x": np.zeros((4, 32), BF16)}, weights)["y"]
    assert not np.any(zeros.astype(np.float32))
    x = rng.standard_normal((4, 32)).astype(BF16)
    x[2, 5] = np.nan
    out = runtime.run(program, {"x": x}, weights)["y"].astype(np.float32)
    assert np.isnan(out).all()  # loud, never finite values from a wrong scale


# ---- fallbacks --------------------------------------------------------------------------------------------------
@needs_gxx
@pytest.mark.parametrize(("arch", "check", "reason"), [
    ("sm_80", None, "sm_80 has no FP8 tensor cores"),
    ("sm_86", None, "sm_86 has no FP8 tensor cores"),
    ("sm_90", lambda: "cuBLASLt is unavailable (libcublasLt not found)", "cuBLASLt is unavailable"),
])
def test_without_fp8_support_the_weights_are_decoded_with_one_notice(arch, check, reason, rng, capsys, assert_close):
    g, program = fp8_linear((3,), 16, 32)
    runtime = emu("cublaslt", arch, check)
    steps = lt_steps(runtime, program)
    assert not any(isinstance(s, LtGemm) for s in steps) and any(isinstance(s, Gemm) for s in steps)
    weights = {"w": rng.standard_normal((16, 32)).astype(E4M3), "s": np.float32(0.25)}
    inputs = {"x": rng.standard_normal((3, 32)).astype(BF16)}
    got = runtime.run(program, inputs, weights)["y"]
    runtime.run(program, inputs, weights)
    notes = [ln for ln in capsys.readouterr().err.splitlines() if "fp8 DequantMatMul" in ln]
    assert len(notes) == 1 and reason in notes[0] and "decoding the weights to bf16" in notes[0]
    assert_close("runtime", got, run_reference(g, inputs, weights)["y"], "bf16")  # the weight-only result


def test_by_default_fp8_weights_are_decoded_without_notice(monkeypatch, capsys):
    monkeypatch.delenv("LUMINAL_FP8_GEMM", raising=False)
    assert CudaOptions().fp8_gemm == "dequant"
    g, program = fp8_linear((3,), 16, 32)
    steps = lt_steps(CudaRuntime(CudaEmuBackend()), program)
    assert not any(isinstance(s, LtGemm) for s in steps)
    assert "note:" not in capsys.readouterr().err


def test_the_environment_opts_in(monkeypatch):
    monkeypatch.setenv("LUMINAL_FP8_GEMM", "cublaslt")
    g, program = fp8_linear((3,), 16, 32)
    assert any(isinstance(s, LtGemm) for s in lt_steps(CudaRuntime(CudaEmuBackend()), program))


@pytest.mark.parametrize(("what", "kwargs", "reason"), [
    ("K not a multiple of 16", {"k": 40}, "in_features 40"),
    ("f32 activations", {"dtype": "f32"}, "activations are f32"),
    ("unaligned output rows", {"n": 10, "scale_shape": (10,)}, "out_features 10"),
])
def test_shapes_cublaslt_cannot_take_fall_back(what, kwargs, reason, capsys):
    args = {"m_shape": (3,), "n": 16, "k": 32, **kwargs}
    g, program = fp8_linear(**args)
    assert not any(isinstance(s, LtGemm) for s in lt_steps(emu(), program)), what
    assert reason in capsys.readouterr().err


# ---- bf16 GEMMs below sm_80; architectures below sm_75 ------------------------------------------------------
@needs_gxx
def test_bf16_gemm_on_turing_runs_with_a_notice(rng, capsys):
    g = Graph()
    x, w = g.input("x", (8, 32), "bf16"), g.weight("w", (16, 32), "bf16")
    f = Fused(g)
    y = f.add("MatMul", [x, w.T], (8, 16), "bf16")
    runtime = CudaRuntime(CudaEmuBackend(planned_as="t4"))
    assert runtime.backend.options.arch == "sm_75"
    inputs = {"x": rng.standard_normal((8, 32)).astype(BF16)}
    weights = {"w": rng.standard_normal((16, 32)).astype(BF16)}
    got = runtime.run(f.program(y=y), inputs, weights)["y"].astype(np.float32)
    want = inputs["x"].astype(np.float32) @ weights["w"].astype(np.float32).T  # f32 accumulation, one rounding
    np.testing.assert_allclose(got, want.astype(BF16).astype(np.float32), rtol=2**-7, atol=1e-6)
    err = capsys.readouterr().err
    assert err.count("sm_75 has no bf16 tensor cores") == 1
    CudaRuntime(CudaEmuBackend()).run(f.program(y=y), inputs, weights)  # an H200: no notice
    assert "bf16 tensor cores" not in capsys.readouterr().err


def test_architectures_below_turing_are_refused():
    v100 = DEVICES["a100"].__class__("v100", "Tesla V100-SXM2-32GB", "sm_70", 32 << 30, 80, 0.7e12, 10e12, 14e12)
    with pytest.raises(CudaUnavailableError, match=r"7\.5 \(Turing\) or newer; Tesla V100-SXM2-32GB is sm_70"):
        check_architecture(v100)
    check_architecture(DEVICES["t4"])  # Turing is served


def test_the_fp8_gemm_error_at_binding_names_the_node(rng):
    """An operand cuBLASLt cannot take at run time (here: a misaligned workspace, faked) is an error naming the
    node and the way back to the decoding path, never a wrong result."""
    if not shutil.which("g++"):
        pytest.skip("cuda-emu needs g++")
    g, program = fp8_linear((3,), 16, 32)
    runtime = emu()
    backend = runtime.backend
    original = backend.lt_gemm

    def misaligned(desc, a, b, d, sa, sb, ws):
        return original(desc, a, b, d, sa, sb, (ws[0], ws[1] + 8))

    backend.lt_gemm = misaligned
    weights = {"w": rng.standard_normal((16, 32)).astype(E4M3), "s": np.float32(0.25)}
    with pytest.raises(LuminalError, match=r"DequantMatMul #\d+: the cuBLASLt FP8 GEMM cannot run: .*aligned.*"
                                           r"LUMINAL_FP8_GEMM=dequant"):
        runtime.run(program, {"x": np.zeros((3, 32), BF16)}, weights)


# ---- the ctypes binding, against a stand-in libcublasLt -----------------------------------------------------
class Seen(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in ("transa", "transb", "a_type", "b_type", "d_type", "had_sa", "had_sb")] + \
               [(n, ctypes.c_uint64) for n in ("a_rows", "a_cols", "b_rows", "b_cols", "d_rows", "d_cols")] + \
               [(n, ctypes.c_int64) for n in ("lda", "ldb", "ldd")] + \
               [(n, ctypes.c_uint64) for n in ("workspace_pref", "workspace_given")] + \
               [(n, ctypes.c_int) for n in ("compute", "scale")]


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> str:
    """tests/runtimes/cublaslt_shim.cpp built as a shared library: cublasLt.h's entry points on host memory."""
    src = Path(__file__).with_name("cublaslt_shim.cpp")
    out = tmp_path_factory.mktemp("shim") / "libcublasLt.so.13"
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return str(out)


@needs_gxx
@pytest.mark.parametrize(("m_shape", "n", "k", "scale_shape", "bias"), [((2, 3), 48, 64, (), False),
                                                                         ((5,), 32, 32, (32,), True)])
def test_the_ctypes_binding_makes_the_call_the_model_runs(shim, m_shape, n, k, scale_shape, bias, rng):
    """The binding's descriptors, layouts, scale pointers, heuristic and launch, through a stand-in library that
    computes what the descriptor says: the same outputs as cuda-emu's model, and the TN layout it was given."""
    lt = cublaslt.CublasLt(shim)
    assert lt.version == 130000

    class ShimBackend(CudaEmuBackend):  # cuda-emu, with every FP8 GEMM made as the cuda backend makes it
        def lt_gemm(self, desc, *operands):
            desc.check()
            return lt_call(self, lt, desc, operands, stream=0)

    g, program = fp8_linear(m_shape, n, k, scale_shape, bias)
    weights = {"w": (rng.standard_normal((n, k)) * 4).astype(E4M3),
               "s": (rng.random(scale_shape) * 0.02 + 0.01).astype(np.float32)}
    if bias:
        weights["b"] = rng.standard_normal(n).astype(BF16)
    inputs = {"x": (rng.standard_normal((*m_shape, k)) * 3).astype(BF16)}
    options = {"max_blocks": 64, "fp8_gemm": "cublaslt", "arch": "sm_90"}
    got = CudaRuntime(ShimBackend(CudaOptions(**options))).run(program, inputs, weights)["y"].astype(np.float32)
    want = CudaRuntime(CudaEmuBackend(CudaOptions(**options))).run(program, inputs, weights)["y"].astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)  # sums in another order: one bf16 ulp at most
    seen = Seen.in_dll(lt.lib, "lt_shim_seen")
    rows = int(np.prod(m_shape))
    assert (seen.transa, seen.transb, seen.a_type, seen.b_type, seen.compute, seen.scale) == (1, 0, 28, 28, 68, 0)
    assert (seen.a_rows, seen.a_cols, seen.lda) == (k, n, k)  # W [N, K] row-major: K x N column-major, op T
    assert (seen.b_rows, seen.b_cols, seen.ldb) == (k, rows, k)  # e4m3 x [rows, K]: K x rows, op N
    assert (seen.d_rows, seen.d_cols, seen.ldd) == (n, rows, n)
    assert seen.d_type == (0 if bias or scale_shape else 14)  # f32 D for the epilogue, else bf16 straight out
    assert (seen.had_sa, seen.had_sb) == (int(not scale_shape), 1)  # a per-channel scale is the epilogue's
    assert seen.workspace_given == seen.workspace_pref == cublaslt.workspace_bytes(n, rows)


def test_the_binding_reports_a_refused_layout(shim):
    lt = cublaslt.CublasLt(shim)
    buf = np.zeros(1 << 16, np.uint8)
    base = buf.ctypes.data + (-buf.ctypes.data % 256)
    with pytest.raises(GemmLayoutError, match="TN"):
        lt.matmul(lt_desc(trans_a=False), base, base, base, None, None, base, 0)
    with pytest.raises(GemmLayoutError, match="aligned"):
        lt.matmul(lt_desc(), base + 8, base, base, None, None, base, 0)
