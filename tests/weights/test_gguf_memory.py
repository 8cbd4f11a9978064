"""A GGUF run holds what it needs, measured from the plans and the loaded buffers (never RSS, never timing): no
quantized tensor is dequantized whole (the token embedding is gathered row by row, a tied LM head is read packed
from the same bytes), and a short run's KV cache is sized to its bucket, not to the model's context. Files made by
llama.cpp's quantizer (``tests/fixtures/gguf_quant/make_quant_fixtures.py``): ``tiny-llama-tied-q4_1.gguf`` keeps
the tied table as Q8_0, as SmolLM2's Q4_1 file does."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

from luminal_recipes.compiler.search import SearchOptions, compile_graph  # noqa: E402
from luminal_recipes.tasks.generation.model import LanguageModel  # noqa: E402
from luminal_recipes.weights import gguf_io  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "llama.yaml"
FIXTURES = ROOT / "tests" / "fixtures" / "gguf_quant"
PROMPT = [1, 17, 250, 33, 901, 5, 77, 412, 9, 640, 18, 3]
TABLE = "model.embed_tokens.weight"


@pytest.fixture
def dense_loads(monkeypatch):
    """The quantized tensors a run asked for dequantized (``GgufCheckpoint.load``: a dense f32 copy)."""
    seen: list[str] = []
    load = gguf_io.GgufCheckpoint.load

    def recording(self, name):
        if self.packed(name).quantized:
            seen.append(name)
        return load(self, name)

    monkeypatch.setattr(gguf_io.GgufCheckpoint, "load", recording)
    return seen


@pytest.mark.parametrize("name", ["tiny-llama-tied-q4_1.gguf", "tiny-llama-q4_k_m.gguf"])
def test_quantized_tensors_are_bound_packed_never_dequantized_whole(name, dense_loads):
    path = FIXTURES / name
    checkpoint = gguf_io.GgufCheckpoint.open(path)
    table = checkpoint.packed(TABLE)
    assert table.quantized
    lm = LanguageModel(RECIPE, weights=path)
    reply = lm.generate(PROMPT, max_new_tokens=4)
    assert reply.ids
    assert dense_loads == []  # no quantized tensor dequantized at load (the table, a tied head, any product)
    # every weight bound once, as the file's bytes: a dense table (4 bytes a value) or a second copy for a tied
    # head would add to this
    stored = sum(r.raw.nbytes for r in checkpoint.records.values())
    assert lm.stats.plans["weight_bytes"] == stored, (lm.stats.plans, stored)
    bound = lm._session.decode.weights
    packed = {n.name for n in lm.model.graph.inputs("weight") if n.dtype.value == "u8"}
    assert TABLE in packed
    tied = checkpoint.config.get("tie_word_embeddings")
    assert ("lm_head.weight" in checkpoint.records) != bool(tied)
    for weight in packed:  # bound as views of the file's map; q/k rows un-permuted once: a packed copy, same size
        array, record = bound[weight], checkpoint.packed(weight)
        assert array.dtype == np.uint8 and array.nbytes == record.raw.nbytes, weight
        assert np.shares_memory(array, checkpoint.reader.data) or "unpermute" in record.ops, weight


@pytest.mark.parametrize("name", ["tiny-llama-tied-q4_1.gguf", "tiny-llama-q4_k_m.gguf"])
def test_the_table_is_gathered_and_the_head_read_packed(name):
    """As the cost model plans decoding and a prompt (no timing): the embedding is a ``GatherDequant`` of the
    picked rows and the LM head (the tied table itself where tied) a packed product; no ``Dequant`` reads the
    table, and the decode program's arena and constants together stay below one dense copy of it."""
    path = FIXTURES / name
    lm = LanguageModel(RECIPE, weights=path)
    table = gguf_io.GgufCheckpoint.open(path).packed(TABLE)
    dense = 4 * math.prod(table.shape)
    graph = lm.model.graph
    for dims in (lm._dims(1, 64, 64), lm._dims(64, 64, 64)):
        program = compile_graph(graph, lm.runtime, dims, options=SearchOptions(time_top=0, use_cache=False)).program
        by_id = {n.id: n for n in program.nodes}
        reads_table = [n for n in program.nodes if any(
            by_id[i].op == "Input" and by_id[i].attr("name") in (TABLE, "lm_head.weight") for i, _ in n.inputs)]
        kinds = sorted({n.op for n in reads_table})
        assert "Dequant" not in kinds, kinds
        assert "GatherDequant" in kinds and "DequantMatMulGGUF" in kinds, kinds
        if dims["seq"] == 1:
            plan = lm.runtime.plan(program, dims)
            assert plan.arena_bytes + plan.constant_bytes < dense, (plan, dense)


def test_a_short_run_sizes_the_kv_cache_to_its_bucket_not_the_models_context():
    lm = LanguageModel(RECIPE, weights=FIXTURES / "tiny-llama-q4_k_m.gguf")
    assert lm.max_context == 256
    lm.generate(PROMPT, max_new_tokens=4)  # 16 tokens: the smallest bucket, 64 rows
    layers, kv_heads, head_dim = 2, 2, 64  # the fixture's config (make_quant_fixtures.py)
    want = 2 * layers * 64 * kv_heads * head_dim * 4  # keys and values, f32
    assert lm.stats.plans["cache_tokens"] == 64 and lm.stats.plans["kv_cache_bytes"] == want, lm.stats.plans
    held = sum(buf.nbytes for _, buf in lm._session.decode._states.values())
    assert held == want  # what the loaded executable holds, not only what was planned
    assert lm._state_bytes(lm.max_context) == 4 * want  # the model's full context would have been 4x this


def test_each_reply_starts_from_a_kv_cache_zeroed_in_the_pages_it_holds(monkeypatch):
    """A reply starts from zeroed states; the reset writes zeros over the pages the states hold (``heap.clear``)
    instead of over the whole cache planned for prompt + max tokens, so the cache holds the rows replies wrote
    (tests/test_heap.py: what that leaves resident)."""
    from luminal_recipes import heap

    zeroed: list[int] = []
    clear = heap.clear
    monkeypatch.setattr(heap, "clear", lambda array: (zeroed.append(array.nbytes), clear(array))[1])
    lm = LanguageModel(RECIPE, weights=FIXTURES / "tiny-llama-q4_k_m.gguf")
    first = lm.generate(PROMPT, max_new_tokens=40)
    states = [buf for _, buf in lm._session.decode._states.values()]
    assert lm.stats.plans["cache_tokens"] == 64 and sorted(zeroed) == sorted(b.nbytes for b in states)
    assert all(np.any(b != 0) for b in states)  # the reply's keys and values
    zeroed.clear()
    again = lm.generate(PROMPT, max_new_tokens=40)
    assert again.ids == first.ids and len(zeroed) == len(states)  # reset through heap.clear, same reply
    lm._reset(lm._session)
    assert all(not np.any(b) for b in states)


def test_unpermuted_rows_are_copied_once_and_their_file_pages_dropped():
    """q/k projections are un-permuted by copying their packed rows; the map's pages they were read from are
    dropped from the process (they would count twice in the resident set: the copy and the file's pages)."""
    checkpoint = gguf_io.GgufCheckpoint.open(FIXTURES / "tiny-llama-q4_k_m.gguf")
    record = checkpoint.packed("model.layers.0.self_attn.q_proj.weight")
    assert record.ops == ("unpermute",)
    raw = np.asarray(record.raw).view(np.uint8).reshape(record.shape[0], -1)
    want = raw[record.row_order]
    got = checkpoint.reordered_rows(raw, record.row_order)
    assert np.array_equal(got, want) and not np.shares_memory(got, raw)
    assert raw.nbytes >= 2 * 4096 and gguf_io._drop_pages(checkpoint.reader.data, raw)  # whole pages inside
    assert np.array_equal(raw[record.row_order], want)  # read again after the drop: mapped back from the file
    assert not gguf_io._drop_pages(checkpoint.reader.data, np.zeros(raw.shape, np.uint8))  # not of this map


def test_a_gguf_run_imports_none_of_what_it_does_not_use():
    """Loading and running a local GGUF file imports neither ``mistral_common`` (gguf's vocab module would: 30
    MiB), nor huggingface_hub's HTTP stack (14 MiB; a hub source needs it), nor ``scipy.linalg`` (29 MiB: numba's
    start-up, only for BLAS in jitted code, which no kernel uses), nor any of ``UNUSED``; and a run whose plans
    are in the plan cache
    imports neither egglog nor the compiler's lowering and extraction (a first run compiles: the second process
    of the two here reads the cache). Checked in fresh processes."""
    import ast
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from luminal_recipes.tasks.generation.model import LanguageModel\n"
        "from luminal_recipes.runtimes.cpu import jit\n"
        f"lm = LanguageModel({str(RECIPE)!r}, weights={str(FIXTURES / 'tiny-llama-q4_1.gguf')!r})\n"
        f"lm.generate({PROMPT!r}, max_new_tokens=2)\n"
        "jit.kernels() if jit.AVAILABLE else None  # numba started, when it runs\n"
        "print(sorted(m for m in ('mistral_common', 'huggingface_hub', 'httpx', 'scipy.linalg', 'gguf', 'egglog', "
        "'luminal_recipes.compiler.lower', 'luminal_recipes.compiler.extract', *UNUSED) "
        "if m in sys.modules))\n").replace("*UNUSED", ", ".join(map(repr, UNUSED)))
    for run in ("compiles (or reads the cache)", "reads the plan cache"):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        imported = ast.literal_eval(done.stdout.strip().splitlines()[-1])
        assert not {"mistral_common", "huggingface_hub", "httpx", "scipy.linalg", *UNUSED} & set(imported), \
            (run, imported)
    assert imported == ["gguf"], imported  # the second run: no egglog, no lowering or extraction


# imported by nothing a GGUF run of ids uses (docs/quantization-gguf.md, peak RSS): ml_dtypes (no bf16/fp8 dtype
# in the graph: ~8 MiB), jinja2 (no chat template rendered), safetensors (no .safetensors file), and what numba's
# start-up imports when installed but no kernel uses: scipy (a version check), cffi, colorama
UNUSED = ("ml_dtypes", "jinja2", "safetensors", "scipy", "cffi", "colorama")


def test_a_vocabulary_is_held_as_one_offset_per_string(tmp_path):
    """A string array of the metadata (a 49k-token vocabulary and its merges) is held by the reader as one offset
    per string into the file map, not a ``bytes`` and an index per string (~9.5 MiB for SmolLM2's); its values
    read back as gguf's own reader reads them. Measured with tracemalloc (Python's allocations, not RSS)."""
    import gc
    import tracemalloc

    gguf = pytest.importorskip("gguf")
    n = 50_000
    tokens = [f"tok{i}\u00e9" * (1 + i % 3) for i in range(n)]
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * n)
    writer.add_tensor("x", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gc.collect()
    tracemalloc.start()
    try:
        reader = gguf_io.read_gguf(path)
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    field = reader.fields["tokenizer.ggml.tokens"]
    assert len(field.data) == n
    assert held < 8 * n + (1 << 20), held  # one int64 offset a string, plus the reader's own few objects
    assert field.contents() == tokens == gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents()
    assert field.contents(n - 1) == tokens[-1] and field.contents(slice(5, 9)) == tokens[5:9]
    assert reader.fields["tokenizer.ggml.token_type"].contents() == [1] * n


def test_llvm_code_pages_are_handed_back_after_each_compilation():
    """libllvmlite's read-only pages (~69 MiB of SmolLM2's resident set, never run while decoding) are dropped from
    this process's page tables when numba lets its compiler lock go: after a compilation here, what is resident of
    them is a small part of what the compilation ran (``runtimes/cpu/jit/code_pages.py``)."""
    import sys

    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.cpu.jit import code_pages

    if not jit.AVAILABLE or not sys.platform.startswith("linux") or not code_pages.enabled():
        pytest.skip("numba not in use, or not Linux")
    if jit._WARMING is not None:
        jit._WARMING.join()
    jit.kernels()  # numba started, the listener installed
    import numba

    ranges = code_pages.read_only_ranges()
    assert ranges  # the library's code and tables, mapped read-only and never written
    before = code_pages.RELEASED[0]
    k = 3 + before % 7  # a function numba has not cached: compiled now, through LLVM's code
    fn = numba.njit(lambda x: x * k + 1)
    assert fn(5) == 5 * k + 1
    assert code_pages.RELEASED[0] > before
    resident = code_pages.resident_kib(ranges)
    assert resident < 4096, resident  # a compilation runs tens of MiB of it; kept, they stayed resident


def test_the_decoding_loops_chains_are_loaded_before_the_first_run_reads_the_weights(monkeypatch):
    """Each load from numba's disk cache faults ~10 MiB of LLVM's loading code back in until the lock is let go
    (``code_pages.py``); the decoding loop's chains, recorded at its fifth step, used to load their interpreters
    and kernel entries after every weight page had been read - on top of the run's resident set, SmolLM2's peak.
    ``LanguageModel`` now works them out when it loads the programs (``Executable.warm``, ``chain.warm``): the
    first ``chain.capture`` comes before any run, the later one finds its interpreters loaded, and the reply is
    the same as without it."""
    from luminal_recipes.runtimes.cpu import jit
    from luminal_recipes.runtimes.executable import Executable

    if not jit.AVAILABLE:
        pytest.skip("numba not in use: no chains")
    from luminal_recipes.runtimes.cpu.jit import chain

    if not chain.enabled():
        pytest.skip("chains are off")
    path = FIXTURES / "tiny-llama-tied-q4_1.gguf"
    events: list[str] = []
    capture, run, interpreter = chain.capture, Executable.run, chain._interpreter

    def capturing(steps, threads, *rest):
        events.append("capture")
        return capture(steps, threads, *rest)

    def running(self, *args, **kwargs):
        events.append("run")
        return run(self, *args, **kwargs)

    def interpreting(opcodes):
        known = len(chain._MEMO)
        out = interpreter(opcodes)
        events.append("interpreter" if len(chain._MEMO) == known else "interpreter loaded")
        return out

    monkeypatch.setattr(chain, "capture", capturing)
    monkeypatch.setattr(chain, "_interpreter", interpreting)
    monkeypatch.setattr(Executable, "run", running)
    lm = LanguageModel(RECIPE, weights=path)
    for role in ("decode", "prefill"):
        lm._program(role)  # compiled first (or from the plan cache): the search's own timing runs left out
    events.clear()
    before = chain.WARMED[0]
    reply = lm.generate(PROMPT, max_new_tokens=8)
    assert chain.WARMED[0] == before + 1  # the decode program's binding, once
    assert len(reply.ids) >= 6 and events.count("capture") == 2, events  # warmed, then recorded at step five
    assert events[0] == "capture" and "run" in events, events  # worked out before the prefill's run
    first_run = events.index("run")
    assert any(e.startswith("interpreter") for e in events[:first_run]), events
    assert "interpreter loaded" not in events[first_run:], events  # the recording found them loaded

    monkeypatch.setattr(Executable, "warm", lambda self: None)  # as before: the same reply
    same = LanguageModel(RECIPE, weights=path).generate(PROMPT, max_new_tokens=8)
    assert same.ids == reply.ids
