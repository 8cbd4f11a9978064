"""GGUF Q4_0 / Q4_1 / Q8_0 products on weights repacked into tiles of 16 rows (runtimes/cpu/jit/gguf_tiles.py):
against gguf-py's dequantized weight times x rounded per block of 32 (the integers ``gguf_q8.quantize`` makes),
for 1..64 rows of x, row counts past the last whole tile and the threads' parts; the repack made once per
read-only buffer (gguf_tile_cache.py), and its file pages released only where they lie on a read-only file map."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest

from luminal_recipes import ops
from luminal_recipes.graph import Graph, dequant, gguf_blocks, run_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_data import packed  # noqa: E402

gguf = pytest.importorskip("gguf")
jit_module = pytest.importorskip("luminal_recipes.runtimes.cpu.jit")
if not jit_module.AVAILABLE:
    pytest.skip("numba is not installed", allow_module_level=True)

from luminal_recipes.runtimes.cpu.jit import gguf_kernels as gk  # noqa: E402
from luminal_recipes.runtimes.cpu.jit import gguf_q8, gguf_tile_cache, gguf_tiles  # noqa: E402

needs_tiles = pytest.mark.skipif(not gguf_tiles.AVAILABLE, reason="numba's target lacks avx512vnni + avx512bw")
TYPES = ("Q4_0", "Q4_1", "Q8_0")


def _want(raw: np.ndarray, qtype: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)


def _rounded(x):
    rows, k = x.shape
    xq = np.zeros((rows, 2 * k), np.int8)
    xd, xs = np.zeros((rows, k // 32), np.float32), np.zeros((rows, k // 32), np.float32)
    gguf_q8.quantize(x, xq, xd, xs)
    return xq, xd, xs, gguf_q8.codes(xq) * np.repeat(xd, 32, axis=1)


@needs_tiles
@pytest.mark.parametrize("qtype", TYPES)
def test_tiled_products_are_the_dequantized_weight_times_the_rounded_x(qtype):
    """Every count of rows of x from 1 to 64 (each remainder of the 4-row pass), 53 weight rows (3 tiles and 5 rows
    past them), computed as two threads' parts (tiles 0..1, then tile 1..3 and the 5 rows left) and whole, with
    random codes and the f16 scales at their edges: a code byte, nibble or scale out of place fails."""
    kind = gk.KINDS[qtype]
    rng = np.random.default_rng(sum(map(ord, qtype)))
    k, n = 320, 53
    raw = packed(rng, qtype, n, k // 32, edge=True)
    w = _want(raw, qtype)
    tiles = gguf_tiles.repack(raw, kind)
    assert tiles.nbytes == 3 * gguf_tiles.tile_bytes(kind, k // 32) and tiles.ctypes.data % 64 == 0
    f16 = gk.f16_table()
    x_all = (rng.standard_normal((64, k)) * 0.05).astype(np.float32)
    x_all[0, :32] = 0.0  # an all-zero block of x: step 0
    for rows in list(range(1, 10)) + [15, 31, 33, 64]:
        x = x_all[:rows]
        xq, xd, xs, xr = _rounded(x)
        want = xr @ w.T
        out = np.full((rows, n), np.nan, np.float32)
        for t0, t1, tail in ((0, 1, n), (1, 3, 48)):  # a part without rows past the tiles, one with them
            gguf_tiles.quant_tiles(x, xq, xd, xs, tiles, raw, out, t0, t1, tail, kind, f16)
        err = np.abs(out - want).max()
        assert err <= 1e-6 * np.abs(want).max(), (qtype, rows, err)
        whole = np.full((rows, n), np.nan, np.float32)
        gguf_tiles.quant_tiles(x, xq, xd, xs, tiles, raw, whole, 0, 3, 48, kind, f16)
        assert np.array_equal(whole, out)  # the parts compute each row as the whole does


@needs_tiles
def test_a_part_writes_only_its_rows():
    rng = np.random.default_rng(3)
    k, n = 64, 40
    raw = packed(rng, "Q4_1", n, k // 32)
    tiles = gguf_tiles.repack(raw, 1)
    x = rng.standard_normal((2, k)).astype(np.float32)
    xq, xd, xs, _ = _rounded(x)
    out = np.zeros((2, n), np.float32)
    gguf_tiles.quant_tiles(x, xq, xd, xs, tiles, raw, out, 1, 2, n, 1, gk.f16_table())
    assert out[:, 16:32].all() and not out[:, :16].any() and not out[:, 32:].any()


@needs_tiles
def test_the_runtime_uses_the_tiles_of_a_read_only_weight_and_repacks_it_once(numpy_runtime, assert_close,
                                                                            monkeypatch):
    """A read-only weight (as a GGUF checkpoint hands out) is tiled at the first bind and found again at the next
    (a new sequence length binds again); two threads' parts cut at whole tiles give the same product; a writable
    weight keeps the per-row loops (its bytes may change between runs)."""
    from luminal_recipes.compiler.search import SearchOptions, search_segment
    from luminal_recipes.compiler.segments import assemble, split
    from luminal_recipes.runtimes.cpu import threads as cpu_threads

    rng = np.random.default_rng(7)
    k, n = 256, 37
    raw = packed(rng, "Q8_0", n, k // 32)
    frozen = raw.copy()
    frozen.flags.writeable = False
    g = Graph()
    x = g.input("x", ("s", k))
    g.mark_output("y", ops.linear(x, dequant(g.weight("w", raw.shape, "u8"), "Q8_0")))
    segments = split(g)
    found = {sg.key: search_segment(sg, numpy_runtime.capabilities().__contains__, {}, SearchOptions(time_top=0))[0]
             for sg in segments}
    program = assemble(g, segments, [found[sg.key][0] for sg in segments])
    assert program.kernel_counts().get("DequantMatMulGGUF") == 1, program.kernel_counts()
    for threads in (1, 2):
        monkeypatch.setattr(cpu_threads, "THREADS", threads)
        gguf_tile_cache.clear()
        before = gguf_tile_cache.STATS.repacks
        exe = numpy_runtime.load(program, {"w": frozen}, dims={"s": 3})
        for s in (3, 5, 1):
            xv = (rng.standard_normal((s, k)) * 0.1).astype(np.float32)
            got = exe.run({"x": xv}, dims={"s": s})["y"]
            want = run_reference(g, {"x": xv}, {"w": raw}, mode="f64", dims={"s": s})["y"]
            assert_close("xint15", got, want.astype(np.float32), "f32")
        assert gguf_tile_cache.STATS.repacks == before + 1, threads
    before = gguf_tile_cache.STATS.repacks
    exe = numpy_runtime.load(program, {"w": raw}, dims={"s": 2})  # writable: not tiled
    exe.run({"x": np.ones((2, k), np.float32)})
    assert gguf_tile_cache.STATS.repacks == before


@needs_tiles
def test_tiles_are_kept_per_buffer_and_dropped_with_it():
    gguf_tile_cache.clear()
    rng = np.random.default_rng(5)
    raw = packed(rng, "Q4_0", 32, 4).copy()  # owning its bytes, read-only: a weight the cache tiles
    raw.flags.writeable = False
    before = gguf_tile_cache.STATS.repacks
    view = raw[:]  # another view of the same bytes: the same tiles
    first = gguf_tile_cache.tiles_for(raw, 0)
    assert first is not None and gguf_tile_cache.tiles_for(view, 0) is first
    assert gguf_tile_cache.STATS.repacks == before + 1
    assert gguf_tile_cache.tiles_for(raw[:16], 0) is not first  # other rows: other tiles
    writable = packed(rng, "Q4_0", 32, 4)
    assert gguf_tile_cache.tiles_for(writable, 0) is None
    del raw, view
    gc.collect()
    assert not gguf_tile_cache._TILES  # the buffer's owner gone: its tiles too


def _map(path: Path, data: np.ndarray, mode: str) -> np.ndarray:
    data.tofile(path)
    return np.memmap(path, dtype=np.uint8, mode=mode).reshape(data.shape)


def test_file_pages_are_released_only_on_a_read_only_file_map(tmp_path):
    """MADV_DONTNEED unmaps a read-only file map's pages (the next read faults them back: the same bytes); on
    anonymous memory it would zero the data, on a copy-on-write map drop the changes: never done there."""
    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, (64, 4096), dtype=np.uint8)
    anonymous = data.copy()
    anonymous.flags.writeable = False
    assert gguf_tile_cache.read_only_file_map(anonymous) is None
    assert gguf_tile_cache.release_file_pages(anonymous) == 0 and np.array_equal(anonymous, data)
    cow = _map(tmp_path / "c.bin", data, "c")
    cow[0, 0] ^= 1
    assert gguf_tile_cache.release_file_pages(cow) == 0 and cow[0, 0] == data[0, 0] ^ 1
    writable = _map(tmp_path / "w.bin", data, "r+")
    assert gguf_tile_cache.release_file_pages(writable) == 0
    mapped = _map(tmp_path / "r.bin", data, "r")
    part = mapped[8:40]  # whole pages inside the view only: 32 rows of 4096 bytes
    assert gguf_tile_cache.read_only_file_map(part) is not None
    assert gguf_tile_cache.release_file_pages(part) == 32 * 4096
    assert np.array_equal(mapped, data)  # faulted back in from the file


@needs_tiles
def test_tiling_a_mapped_weight_releases_its_pages_and_keeps_its_bytes(tmp_path):
    gguf_tile_cache.clear()
    rng = np.random.default_rng(13)
    raw = packed(rng, "Q4_1", 64, 64)  # 64 rows of 1280 bytes: 20 whole pages
    mapped = _map(tmp_path / "q.bin", raw, "r")
    before = gguf_tile_cache.STATS.released_bytes
    tiles = gguf_tile_cache.tiles_for(mapped, 1)
    assert tiles is not None and gguf_tile_cache.STATS.released_bytes - before == 20 * 4096
    assert np.array_equal(mapped, raw)
    assert np.array_equal(tiles, gguf_tiles.repack(raw, 1))
    assert gguf_blocks.row_bytes("Q4_1", 64 * 32) == raw.shape[1]


def _scratch(rows, k):
    scales = (rows, k // 32)
    return np.zeros((rows, 2 * k), np.int8), np.zeros(scales, np.float32), np.zeros(scales, np.float32)


@needs_tiles
@pytest.mark.parametrize("qtype", TYPES)
def test_parts_sharing_the_tiles_give_the_fixed_parts_bits(qtype):
    """Two threads taking chunks of tiles from one ticket (``quant_tiles_shared``), run after run, write what
    the fixed parts write, bit for bit; a run where one part was never called (a chain aborted between them)
    leaves the next runs exact."""
    import threading

    kind = gk.KINDS[qtype]
    rng = np.random.default_rng(sum(map(ord, qtype)) + 1)
    k, n = 320, 16 * 37 + 5  # 37 tiles (odd: a chunk's pass of one tile) and 5 rows past them
    raw = packed(rng, qtype, n, k // 32, edge=True)
    tiles = gguf_tiles.repack(raw, kind)
    f16 = gk.f16_table()
    flags = gguf_tiles.counter()
    for rows in (1, 3):
        x = (rng.standard_normal((rows, k)) * 0.05).astype(np.float32)
        want = np.full((rows, n), np.nan, np.float32)
        for t0, t1, tail in ((0, 18, n), (18, 37, 37 * 16)):
            gguf_tiles.quant_tiles(x, *_scratch(rows, k), tiles, raw, want, t0, t1, tail, kind, f16)
        assert not np.isnan(want).any()

        def part(out, i, parts=2, x=x, rows=rows):
            gguf_tiles.quant_tiles_shared(x, *_scratch(rows, k), tiles, raw, out, 37 * 16 if i == parts - 1 else n,
                                          kind, f16, flags, parts, 4)

        for _ in range(6):
            out = np.full((rows, n), np.nan, np.float32)
            threads = [threading.Thread(target=part, args=(out, i)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert np.array_equal(out, want), (qtype, rows)
        part(np.zeros((rows, n), np.float32), 0)  # a run aborted after its first part
        for _ in range(3):
            out = np.full((rows, n), np.nan, np.float32)
            part(out, 0)
            part(out, 1)
            assert np.array_equal(out, want), (qtype, rows, "after an aborted run")


def test_chunks_are_even_and_several_per_part():
    assert gguf_tiles.chunk_tiles(128, 34_816, 2) == 4  # ~1B Q8_0 2048 x 2048: 139 KB chunks, 32 of them
    assert gguf_tiles.chunk_tiles(12, 5_760, 2) == 2  # SmolLM2's 192 x 576 k: the smallest chunk
    assert all(gguf_tiles.chunk_tiles(t, b, p) % 2 == 0 for t in (1, 9, 100, 4000) for b in (100, 10_000, 1 << 20)
               for p in (1, 2, 4))


@needs_tiles
def test_a_lockstep_chain_shares_the_tiles_bit_identically(numpy_runtime, monkeypatch):
    """Two products of one x (q/k-like, Q8_0 and Q4_1) in a chain run in lockstep on two threads take their tiles
    in shared chunks; every replayed output equals the steps' own (fixed parts, no chain), bit for bit."""
    from luminal_recipes.compiler.search import SearchOptions, search_segment
    from luminal_recipes.compiler.segments import assemble, split
    from luminal_recipes.runtimes.cpu import threads as cpu_threads
    from luminal_recipes.runtimes.cpu.jit import chain

    if not gguf_tiles.SHARED:
        pytest.skip(f"{gguf_tiles.SHARED_ENV}=0")
    rng = np.random.default_rng(17)
    k, n = 256, 16 * 9 + 5
    raws = {"wa": packed(rng, "Q8_0", n, k // 32), "wb": packed(rng, "Q4_1", n, k // 32)}
    frozen = {}
    for name, raw in raws.items():
        frozen[name] = raw.copy()
        frozen[name].flags.writeable = False
    g = Graph()
    x = g.input("x", ("s", k))
    g.mark_output("a", ops.linear(x, dequant(g.weight("wa", raws["wa"].shape, "u8"), "Q8_0")))
    g.mark_output("b", ops.linear(x, dequant(g.weight("wb", raws["wb"].shape, "u8"), "Q4_1")))
    segments = split(g)
    found = {sg.key: search_segment(sg, numpy_runtime.capabilities().__contains__, {}, SearchOptions(time_top=0))[0]
             for sg in segments}
    program = assemble(g, segments, [found[sg.key][0] for sg in segments])
    assert program.kernel_counts().get("DequantMatMulGGUF") == 2, program.kernel_counts()
    xs = [(rng.standard_normal((1, k)) * 0.1).astype(np.float32) for _ in range(8)]
    monkeypatch.setattr(cpu_threads, "THREADS", 2)
    monkeypatch.setattr(cpu_threads, "MIN_PART", 64)
    monkeypatch.setattr(chain, "MIN_SPLIT_PHASES", 1)
    monkeypatch.setattr(chain, "ADAPTIVE", False)  # lockstep even on a loaded machine
    monkeypatch.setattr(gguf_tiles, "SHARED_MIN_BYTES", 0)  # products this small keep the fixed parts otherwise
    got = {}
    for on in ("0", "1"):
        monkeypatch.setenv(chain.ENV, on)
        gguf_tile_cache.clear()
        exe = numpy_runtime.load(program, frozen, dims={"s": 1})
        got[on] = [{k_: np.array(v, copy=True) for k_, v in exe.run({"x": xv}).items()} for xv in xs]
        if on == "1":
            assert exe.replaying and exe._replay.lockstep >= 1
            shared = [c for ch in exe._replay.relocation.args[0] for s in ch.steps
                      for phase in chain.finer(s, 64) for c in phase if c.fn is gguf_tiles.quant_tiles_shared]
            assert len(shared) == 4  # two products, two parts each
    monkeypatch.setattr(gguf_tiles, "SHARED_MIN_BYTES", 1 << 40)
    exe = numpy_runtime.load(program, frozen, dims={"s": 1})
    for xv in xs[:6]:
        exe.run({"x": xv})
    assert exe.replaying and not any(c.fn is gguf_tiles.quant_tiles_shared for ch in exe._replay.relocation.args[0]
                                     for s in ch.steps for phase in chain.finer(s, 64) for c in phase)
    for run, (a, b) in enumerate(zip(got["1"], got["0"])):
        for name in a:
            assert np.array_equal(a[name], b[name]), (run, name)
