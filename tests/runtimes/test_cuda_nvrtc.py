"""Every CUDA kernel the compiler can emit for the shipped recipes compiles with NVRTC for sm_90 and sm_100, and
ptxas reports no local-memory spills.

The kernels come from the programs ``compile_graph`` makes (numpy runtime, no timing) for the tiny FLUX.2
pipeline's three stages and the Llama recipe, each also rewritten to bf16 and f16 activations, plus the hot
kernels at FLUX.2-dev sizes (norms over 3072, head-dim-128 norms, softmax over 4608 keys, fp8/nvfp4 weight
decoders, the fp8 activation quantizers of the cuBLASLt path, im2col, GroupNorm + SiLU). The stages' symbolic dims are
prepared as the runtime prepares them (``prepare_program``): kernel arguments. All of them form one module per
architecture (NVRTC ~1 s), cached on disk afterwards.
Needs the CUDA wheels of the test extra (cupy, nvidia-cuda-nvrtc/-runtime/-crt); no GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from fused_programs import Fused

from luminal_recipes.compiler.search import SearchOptions, compile_graph
from luminal_recipes.graph import DType, Graph
from luminal_recipes.recipe.builder import build
from luminal_recipes.runtimes.cpu.backend import NumpyRuntime
from luminal_recipes.runtimes.cuda.backend import prepare_program
from luminal_recipes.runtimes.cuda.module import module_source
from luminal_recipes.runtimes.cuda.nodes import CudaOptions
from luminal_recipes.runtimes.program import Program

nvrtc = pytest.importorskip("luminal_recipes.runtimes.cuda.nvrtc")
try:
    nvrtc.nvrtc()
    nvrtc.cuda_include_dir()
except nvrtc.NvrtcError as e:  # the CUDA wheels are part of the test extra; say so if they are missing
    pytest.skip(f"NVRTC unavailable: {e}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "flux2-tiny" / "checkpoint"
STAGES = [("mistral3-text-encoder.yaml", "text_encoder", {"batch": 1, "seq": 16}),
          ("flux2-transformer.yaml", "transformer", {"batch": 1, "img": 15, "txt": 16}),
          ("flux2-vae-decoder.yaml", "vae", {"batch": 1, "h": 4, "w": 4})]


def as_dtype(program: Program, dtype: str) -> Program:
    """The program with every f32 value (inputs, weights, constants, kernel outputs) in ``dtype``."""
    target = DType(dtype)
    nodes = []
    for n in program.nodes:
        if n.dtype != DType.F32:
            nodes.append(n)
            continue
        data = None if n.data is None else n.data.astype(target.np)
        nodes.append(dataclasses.replace(n, dtype=target, data=data))
    return Program(nodes, dict(program.outputs))


def compiled(recipe: str, weights: Path, dims: dict) -> tuple[Program, dict]:
    model = build(ROOT / "recipes" / recipe, weights=weights)
    program = compile_graph(model.graph, NumpyRuntime(), dims, options=SearchOptions(time_top=0)).program
    return program, dims


def dev_size_programs() -> list[tuple[Program, dict]]:
    """Hot kernels at FLUX.2-dev sizes (bf16): modulation LayerNorm over 3072, QK RMSNorm over 128-wide heads (alone,
    and with its weight and the rotation of pairs by f32 tables), a GELU-style Elementwise, softmax over 4608 keys
    with a bias (chunked attention), attention at head dim 128,
    fp8 and nvfp4 weight decoders for K = 3072, GGUF Q4_K/Q6_K/Q8_0/IQ4_NL/IQ4_XS
    decoders, the VAE's 3x3 im2col and GroupNorm + SiLU at 512 channels."""
    g = Graph()
    x = g.input("x", (4608, 3072), "bf16")
    q = g.input("q", (1, 48, 4608, 128), "bf16")
    s = g.input("s", (6, 4608, 4608), "f32")
    bias = g.input("bias", (6, 4608, 4608), "bf16")
    w8, s8 = g.weight("w8", (3072, 3072), "f8e4m3"), g.weight("s8", ())
    w4, s4, s42 = g.weight("w4", (3072, 1536), "u8"), g.weight("s4", (3072, 192), "f8e4m3"), g.weight("s42", ())
    img = g.input("img", (1, 512, 130, 130), "bf16")
    cw = g.weight("cw", (512, 512, 3, 3), "bf16")
    groups = g.input("groups", (1, 32, 16 * 128 * 128), "bf16")  # a [1, 512, 128, 128] image's 32 groups
    qw = g.weight("qw", (128,), "bf16").broadcast_to((1, 48, 4608, 128))
    cos, sin = (g.input(name, (4608, 128)).broadcast_to((1, 48, 4608, 128)).reshape((1, 48, 4608, 64, 2))
                for name in ("cos", "sin"))
    gw = g.weight("gw", (512,), "bf16").reshape((1, 512, 1, 1)).broadcast_to((1, 512, 128, 128))
    # GGUF blocks: a Q4_K and a Q6_K weight for K = 3072, a Q8_0 embedding table
    wq4, wq6 = g.weight("wq4", (3072, 12 * 144), "u8"), g.weight("wq6", (3072, 12 * 210), "u8")
    table, ids = g.weight("table", (1000, 96 * 34), "u8"), g.input("ids", (16,), "i32")
    wnl, wxs = g.weight("wnl", (3072, 96 * 18), "u8"), g.weight("wxs", (3072, 12 * 136), "u8")  # IQ4_NL, IQ4_XS
    f = Fused(g)
    outs = {
        "ln": f.add("LayerNorm", [x], (4608, 3072), "bf16", eps=1e-6),
        "rms": f.add("RMSNorm", [q], (1, 48, 4608, 128), "bf16", eps=1e-6),
        "rms_rope": f.add("RMSNormRoPE", [q, qw, cos, sin], (1, 48, 4608, 64, 2), "bf16", eps=1e-6),
        "gelu": f.add("Elementwise", [x], (4608, 3072), "bf16", expr=(
            "(Mul (Mul in0 (Const 0.5)) (Add (Const 1.0) (Mul (Const 2.0) (Recip (Add (Const 1.0) (Exp2 (Mul in0 "
            "(Const -2.3))))))))")),
        "softmax": f.add("Softmax", [s], (6, 4608, 4608), "bf16"),
        "attn": f.add("Attention", [q, q, q], (1, 48, 4608, 128), "bf16", scale=0.088),
        "attn_bias": f.add("Attention", [q.slice(1, 0, 6), q.slice(1, 0, 6), q.slice(1, 0, 6), bias.unsqueeze(0)],
                           (1, 6, 4608, 128), "bf16", scale=0.088),
        "fp8": f.add("DequantMatMul", [x, w8, s8], (4608, 3072), "bf16", format="fp8", layout="",
                     out_features=3072, in_features=3072),
        "nvfp4": f.add("DequantMatMul", [x, w4, s4, s42], (4608, 3072), "bf16", format="nvfp4", layout="modelopt",
                       out_features=3072, in_features=3072),
        "gguf_q4k": f.add("DequantMatMulGGUF", [x, wq4], (4608, 3072), "bf16", qtype="Q4_K", out_features=3072,
                          in_features=3072),
        "gguf_q6k": f.add("Dequant", [wq6], (3072, 3072), "f32", qtype="Q6_K"),
        "gguf_gather": f.add("GatherDequant", [table, ids], (16, 3072), "f32", qtype="Q8_0"),
        "gguf_iq4nl": f.add("DequantMatMulGGUF", [x, wnl], (4608, 3072), "bf16", qtype="IQ4_NL", out_features=3072,
                            in_features=3072),
        "gguf_iq4xs": f.add("Dequant", [wxs], (3072, 3072), "f32", qtype="IQ4_XS"),
        "conv": f.add("Conv2d", [img, cw], (1, 512, 128, 128), "bf16", stride=1),
        "group_norm_silu": f.add("GroupNorm", [groups, gw, gw], (1, 512, 128, 128), "bf16", eps=1e-6, act="silu"),
    }
    return [(f.program(**outs), {})]


def llama_program(tmp_path_factory) -> tuple[Program, dict]:
    spec = importlib.util.spec_from_file_location("llama_parity", ROOT / "tests" / "recipe" / "test_llama_parity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    folder = tmp_path_factory.mktemp("llama")
    mod.save_tiny_llama(folder, 0)
    return compiled("llama.yaml", folder, {"batch": 1, "seq": 7, "ctx": 7, "cache": 7, "keep": 7})


@pytest.fixture(scope="module")
def module_text(tmp_path_factory) -> tuple[str, int]:
    programs = [compiled(recipe, TINY / folder, dims) for recipe, folder, dims in STAGES]
    programs.append(llama_program(tmp_path_factory))
    variants = [(as_dtype(p, dt), d) for p, d in programs for dt in ("bf16", "f16")]
    sources = []
    # the second set also takes fp8 DequantMatMul through cuBLASLt (its activation quantizer kernels)
    for options in (CudaOptions(attention="flash"), CudaOptions(attention="chunked", fp8_gemm="cublaslt")):
        for program, dims in programs + variants + dev_size_programs():
            for plan, _ in prepare_program(program, dims, options).values():
                sources.extend(plan.sources)
    return module_source(sources), len({s.name for s in sources})


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_every_kernel_compiles_without_spills(module_text, arch):
    text, count = module_text
    assert count > 100  # the stages' distinct kernels, three dtypes, dev sizes
    # the stages' symbolic dims (seq, img, txt, h, w) are kernel arguments, read inside their functor structs too
    assert "long long LRDIM__seq)" in text and "long long LRDIM__img;" in text
    _, log = nvrtc.compile_module(text, arch, extra=("-Xptxas=-v",))
    usage = nvrtc.resource_usage(log)
    assert len(usage) >= count, f"ptxas reported {len(usage)} kernels of {count}"
    spills = {k: u for k, u in usage.items() if u.get("spill_stores") or u.get("spill_loads")}
    assert not spills, f"local-memory spills on {arch}: {spills}"
    frames = {k: u["stack"] for k, u in usage.items() if u.get("stack")}
    assert not frames, f"stack frames (local memory) on {arch}: {frames}"


def test_compile_error_names_the_kernel_and_its_node():
    """A kernel NVRTC rejects is reported with its name and the program node it was generated for."""
    g = Graph()
    x = g.input("x", (4,))
    f = Fused(g)
    y = f.add("Elementwise", [x], (4,), expr="(Add in0 (Const 1.0))")
    program = f.program(y=y)
    (plan, _), = prepare_program(program, {}, CudaOptions()).values()
    broken = [dataclasses.replace(s, code=s.code.replace("out[i] =", "out[i] = undefined_symbol +"))
              for s in plan.sources]
    from luminal_recipes.runtimes.cuda.backend import _line_owner

    text = module_source(broken)
    owner = _line_owner(text, broken, {broken[0].name: [f"Elementwise #{y}"]})
    with pytest.raises(nvrtc.NvrtcError, match=rf"kernel {broken[0].name} of Elementwise #{y}"):
        nvrtc.compile_module(text, "sm_90", describe=owner)
