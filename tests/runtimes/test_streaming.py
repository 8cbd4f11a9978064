"""Weights streamed block by block (runtimes/streaming.py): bit-identical to memory-mapped weights, bounded
resident weight memory, file pages dropped, loader errors surfaced.

Checked on the tiny FLUX.2 transformer shipped in recipes/flux2-tiny (naive and compiled programs) and on a
Llama checkpoint saved by transformers, run under a budget smaller than its weights."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from luminal_recipes.compiler.search import SearchOptions, compile_graph
from luminal_recipes.errors import BudgetError, InputError
from luminal_recipes.graph.symbolic import evaluate
from luminal_recipes.pipeline.engine import ModelEngine
from luminal_recipes.pipeline.plan import plan_model, weight_blocks
from luminal_recipes.recipe.builder import build
from luminal_recipes.runtimes.file_pages import PageDropper, file_span
from luminal_recipes.runtimes.program import Program
from luminal_recipes.weights.safetensors_io import Checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "flux2-tiny" / "checkpoint"
DIMS = {"batch": 1, "img": 15, "txt": 32}


@pytest.fixture(scope="module")
def transformer():
    return build(ROOT / "recipes" / "flux2-transformer.yaml", weights=TINY / "transformer")


def random_inputs(model, dims, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, tensor in model.inputs.items():
        shape = tuple(evaluate(d, dims) for d in tensor.shape)
        if tensor.dtype.is_float:
            out[name] = rng.standard_normal(shape).astype(tensor.dtype.np)
        else:
            out[name] = rng.integers(0, 200, size=shape).astype(tensor.dtype.np)
    return out


def program_of(model, dims, kind: str, runtime) -> Program:
    if kind == "naive":
        return Program.from_graph(model.graph)
    options = SearchOptions(time_top=0, use_cache=False)  # fused kernels (MatMul, attention) read the slots
    return compile_graph(model.graph, runtime, dims, options=options).program


@pytest.mark.parametrize("kind", ["naive", "compiled"])
def test_streamed_flux2_transformer_is_bit_identical(transformer, kind, runtime):
    program = program_of(transformer, DIMS, kind, runtime)
    unbounded = runtime.load(program, transformer.load_weight, DIMS)
    streamed = runtime.load(program, transformer.load_weight, DIMS, stream=weight_blocks(transformer.graph))
    try:
        layout = streamed.streamer.layout
        assert [b.name for b in layout.blocks] == list(transformer.graph.blocks)  # 1 double + 2 single blocks
        # the loop re-runs one program: every run (cyclic prefetch included) gives the same bits
        for step in range(3):
            inputs = random_inputs(transformer, DIMS, seed=step)
            want = unbounded.run(inputs)
            got = streamed.run(inputs)
            assert want.keys() == got.keys()
            for name in want:
                assert np.array_equal(got[name], want[name]), f"{kind} run {step}: {name} differs"
        # what is held: weights outside blocks + one slot per parity, each as large as its largest block
        sizes = [b.nbytes for b in layout.blocks]
        assert layout.slot_bytes == (max(sizes[0], sizes[2]), sizes[1])
        assert streamed.memory.weight_bytes == layout.unstreamed_weight_bytes + sum(layout.slot_bytes)
        assert streamed.memory.weight_bytes < unbounded.memory.weight_bytes
        # block weights are never bound to the checkpoint mapping
        ids = {w for b in layout.blocks for w in b.weights}
        streamed_names = {n.name for n in program.nodes if n.id in ids}
        assert streamed_names and not streamed_names & set(streamed.weights)
        assert streamed.streamer.stats.bytes_copied > 0
    finally:
        streamed.close()


def test_device_staging_in_pieces_is_bit_identical(transformer, runtime):
    """On a device runtime, blocks travel through two staging buffers on a copy stream; buffers much smaller
    than a block send it in many pieces, ordered by events, with the same bits as the resident weights."""
    if runtime.backend.host_arrays:
        pytest.skip("a host runtime copies blocks straight into its slots")
    program = Program.from_graph(transformer.graph)
    blocks = weight_blocks(transformer.graph)
    unbounded = runtime.load(program, transformer.load_weight, DIMS)
    streamed = runtime.load(program, transformer.load_weight, DIMS, stream=blocks, staging_bytes=2 * 4096)
    try:
        layout = streamed.streamer.layout
        pieces = sum(-(-b.nbytes // 4096) for b in layout.blocks)
        for step in range(2):
            inputs = random_inputs(transformer, DIMS, seed=step)
            want, got = unbounded.run(inputs), streamed.run(inputs)
            for name in want:
                assert np.array_equal(got[name], want[name]), f"run {step}: {name} differs"
        stats = streamed.streamer.stats
        assert stats.staging_bytes == 2 * 4096 and stats.uploads >= pieces  # every block, in 4 KiB pieces
    finally:
        streamed.close()
    with pytest.raises(BudgetError, match="--max-host-memory"):
        runtime.load(program, transformer.load_weight, DIMS, stream=blocks, staging_bytes=1024)


def test_layout_blocks_are_ordered_and_disjoint(transformer, runtime):
    program = Program.from_graph(transformer.graph)
    exe = runtime.load(program, transformer.load_weight, DIMS, stream=weight_blocks(transformer.graph))
    try:
        blocks = exe.streamer.layout.blocks
        assert all(a.last < b.first for a, b in zip(blocks, blocks[1:]))
        for block in blocks:
            ends = [off + exe.streamer.view(nid).nbytes for nid, off in zip(block.weights, block.offsets)]
            assert all(off % 64 == 0 for off in block.offsets) and max(ends) <= block.nbytes
    finally:
        exe.close()


def test_loader_errors_reach_the_caller(transformer, runtime):
    program = Program.from_graph(transformer.graph)
    blocks = weight_blocks(transformer.graph)
    victim = sorted(name for name, block in blocks.items() if block == "single_transformer_blocks.1")[0]

    def weights(name):
        array = transformer.load_weight(name)
        return array.astype(np.float64) if name == victim else array

    exe = runtime.load(program, weights, DIMS, stream=blocks)
    try:
        with pytest.raises(InputError, match=victim):
            exe.run(random_inputs(transformer, DIMS))
    finally:
        exe.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("weight-prefetch") and t.is_alive()]


def test_file_pages_of_checkpoint_tensors(tmp_path):
    from safetensors.numpy import save_file

    big = np.arange(5 * 4096, dtype=np.float32).reshape(5, 4096)  # 80 KiB: whole pages inside
    save_file({"a": np.ones(3, np.float32), "big": big}, str(tmp_path / "model.safetensors"))
    checkpoint = Checkpoint.open(tmp_path)
    array = checkpoint.load("big")
    span = file_span(array)
    assert span is not None and span.length > 0 and span.map_offset % 4096 == 0
    assert span.length <= array.nbytes and span.filename == str(tmp_path / "model.safetensors")
    assert file_span(array.T) == span  # a transposed view covers the same bytes
    assert file_span(np.ones(8192, np.float32)) is None  # owned memory: nothing to drop
    pages = PageDropper()
    try:
        assert pages.drop(array) == span.length
        assert np.array_equal(array, big)  # dropped pages fault back in from the file
    finally:
        pages.close()


def save_llama(folder: Path, layers: int):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, intermediate_size=128,
                                      initializer_range=0.1)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


@pytest.mark.parametrize("layers", [3, 6])
def test_llama_under_a_budget_below_its_weights_is_bit_identical(tmp_path, layers, runtime):
    save_llama(tmp_path, layers)
    model = build(ROOT / "recipes" / "llama.yaml", weights=tmp_path)
    dims = {"batch": 1, "seq": 6, "ctx": 6, "cache": 6, "keep": 6}  # the whole sequence over an empty KV cache
    full = plan_model(model, dims, None, runtime, compile=False)
    lean = plan_model(model, dims, full.planned_peak - 1, runtime, compile=False)
    assert lean.streamed and lean.fits and lean.blocks == layers
    budget = lean.planned_peak
    if layers > 3:
        assert budget < full.weight_bytes  # the whole stage runs in less memory than its weights
    unbounded = ModelEngine(model, runtime, compile=False)
    bounded = ModelEngine(model, runtime, budget_bytes=budget, compile=False)
    try:
        for seed in range(2):
            inputs = dict(random_inputs(model, dims, seed), positions=np.arange(6, dtype=np.int32))
            extra = {"ctx": 6, "cache": 6, "keep": 6}
            want, got = unbounded(inputs, extra)["logits"], bounded(inputs, extra)["logits"]
            assert np.array_equal(got, want)
        assert bounded.stats.plan.streamed and bounded.stats.planned_peak <= budget
    finally:
        bounded.release()
    assert bounded.stats.stream["loads"] >= layers
