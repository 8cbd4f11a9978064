"""Inputs read where the caller holds them and outputs written into fresh memory (``runtimes/direct_io.py``, over
``chain.Relocation``): a chain re-pointed at other memory computes there what it computes on its slots (addresses
held in int64 tables patched too) and puts its addresses back after; it refuses regions it cannot move (a step
outside the chains, an address passed as a number, a write into an input, an address two regions claim). Through
torch.compile, a decode step over transformers' KV cache reads the cache in place and hands its concatenations out
without a copy, bit for bit the copying path's results, the caller's cache untouched; ``LUMINAL_RECIPES_DIRECT_IO=0``
turns it off."""

from __future__ import annotations

import copy

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from luminal_recipes.runtimes import direct_io  # noqa: E402
from luminal_recipes.runtimes.cpu import jit  # noqa: E402

if not jit.AVAILABLE:
    pytest.skip("numba is off (LUMINAL_RECIPES_JIT=0 or LUMINAL_RECIPES_ISA=numpy): no chains", allow_module_level=True)

from luminal_recipes.runtimes.cpu.jit import chain  # noqa: E402

RNG = np.random.default_rng(5)


def _copy(dst: np.ndarray, src: np.ndarray, access: bool = True):
    """``dst = src`` as one described call (``copy_region``)."""

    def step():
        dst[...] = src

    return chain.tag(step, [chain.Call(chain.copy_region, (dst, dst, src, False), None,
                                       access=((src,), (dst,)) if access else None)])


def _region(a: np.ndarray, steps, read_only: bool) -> tuple:
    start = a.__array_interface__["data"][0]
    return start, start + a.nbytes, set(steps), read_only


def _start(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_relocated_chain_reads_and_writes_elsewhere_then_restores():
    x, a, b = (np.zeros((8, 16), np.float32) for _ in range(3))
    x[...] = RNG.standard_normal(x.shape)
    steps = [_copy(a, x), _copy(b, a)]  # x (an input) -> a -> b (an output)
    replay = chain.capture(steps, 1)
    reloc = replay.relocation([_region(x, [0], True), _region(b, [1], False)])
    assert reloc.ok == [True, True]
    given = RNG.standard_normal(x.shape).astype(np.float32)
    kept = given.copy()
    fresh = np.zeros_like(b)
    reloc.apply(np.array([_start(given) - _start(x), _start(fresh) - _start(b)], np.int64))
    replay()
    reloc.restore()
    assert np.array_equal(fresh, given) and np.array_equal(given, kept)  # read in place, never written
    assert not b.any()  # the slot of the output was not written
    replay()  # restored: the slots again
    assert np.array_equal(b, x)


@numba.njit(nogil=True)
def _copy_via_table(dst, table):
    """``dst = *table``: a kernel reaching its operand through an address in an int64 table (as
    ``elementwise_tiles`` does)."""
    src = chain._view(table, 0, 0, "f4:1:C:rw")
    for i in range(dst.shape[0]):
        dst[i] = src[i]


def _via_table(dst: np.ndarray, src: np.ndarray, access: bool):
    table = np.array([[_start(src), src.shape[0], src.strides[0]]], np.int64)

    def step():
        dst[...] = src

    return chain.tag(step, [chain.Call(_copy_via_table, (dst, table), None,
                                       access=((src,), (dst,)) if access else None)]), table


def test_addresses_held_in_tables_are_patched_too():
    x, a, b = (np.zeros(64, np.float32) for _ in range(3))
    x[...] = RNG.standard_normal(x.shape)
    through, table = _via_table(a, x, access=True)
    replay = chain.capture([through, _copy(b, a)], 1)
    reloc = replay.relocation([_region(x, [0], True)])
    assert reloc.ok == [True]
    given = RNG.standard_normal(x.shape).astype(np.float32)
    reloc.apply(np.array([_start(given) - _start(x)], np.int64))
    assert table[0, 0] == _start(given)
    replay()
    reloc.restore()
    assert table[0, 0] == _start(x)
    assert np.array_equal(b, given)
    # a call reaching an input through a table without saying what it writes: the input is not moved
    through, _ = _via_table(a, x, access=False)
    assert chain.capture([through, _copy(b, a)], 1).relocation([_region(x, [0], True)]).ok == [False]


def test_regions_it_cannot_move_are_refused():
    x, a, b, idx_out = (np.zeros((8, 16), np.float32) for _ in range(4))

    def plain():
        a[...] = x

    # a step outside the chains touches the region
    replay = chain.capture([plain, _copy(b, a), _copy(idx_out, b)], 1)
    refused = replay.relocation([_region(x, [0], True)])
    assert refused.ok == [False] and refused.why == ["a step outside the chains"]
    # an address inside the region passed as a number
    idx = np.zeros(1, np.int64)
    rows = np.zeros((1, 16), np.float32)

    def scatter():
        pass

    steps = [_copy(a, x), _copy(b, a),
             chain.tag(scatter, [chain.Call(chain.scatter_rows, (idx_out, idx, rows, _start(b) + 64), None,
                                            checked=True)]),
             _copy(idx_out, b)]
    replay = chain.capture(steps, 1)
    assert replay.relocation([_region(b, [1, 2, 3], False), _region(b, [1, 3], False)]).ok == [False, True]
    # an input one of its readers writes into
    steps = [_copy(a, x), _copy(x, a)]
    replay = chain.capture(steps, 1)
    assert replay.relocation([_region(x, [0, 1], True)]).ok == [False]
    assert replay.relocation([_region(x, [0], True)]).ok == [True]
    # an array reaching past the region (a view of more than the slot)
    half = x[:4]
    assert chain.capture([_copy(a, x), _copy(b, a)], 1).relocation([_region(half, [0], True)]).ok == [False]


def _decode_setup():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from luminal_recipes.torch_backend import compiled

    torch.manual_seed(3)
    config = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(config).eval()
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return torch, compiled, model, cache


def _engine_executable(compiled_graphs):
    engine = compiled_graphs[-1].engine
    return next(iter(engine._executables.values()))


@pytest.mark.parametrize("direct", [True, False])
def test_decode_step_reads_cache_in_place_bit_identical(monkeypatch, direct):
    torch, compiled, model, cache = _decode_setup()
    monkeypatch.setenv(direct_io.ENV, "1" if direct else "0")
    monkeypatch.setattr(direct_io, "MIN_BYTES", 0)  # the tiny model's cache layers are 1.5 KiB
    graphs = []
    call = compiled.CompiledGraph.__call__

    def spy(self, *args):
        if self not in graphs:
            graphs.append(self)
        return call(self, *args)

    monkeypatch.setattr(compiled.CompiledGraph, "__call__", spy)
    fn = torch.compile(model.forward, backend="luminal")
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    with torch.no_grad():
        for step in range(7):  # past the chains' recording (the fifth run)
            fn(input_ids=torch.tensor([[5 + step]]), past_key_values=copy.deepcopy(cache), use_cache=True)
        exe = _engine_executable(graphs)
        assert exe.replaying
        if not direct:
            assert exe._direct is None and not exe.fresh_outputs
            return
        assert exe._direct is not None and exe._direct.inputs and exe._direct.outputs
        seen = {}
        run = exe.run

        def recording(inputs, **kwargs):
            seen["inputs"] = dict(inputs)
            return run(inputs, **kwargs)

        exe.run = recording
        stepped = copy.deepcopy(cache)
        out = fn(input_ids=torch.tensor([[9]]), past_key_values=stepped, use_cache=True)
        del exe.run
        assert exe.fresh_outputs and exe.stats.bytes_in < 64  # the cache read in place: ids and positions copied
        inputs = seen["inputs"]
        kept = {k: np.array(v, copy=True) for k, v in inputs.items()}
        got = exe.run(inputs)
        assert exe.stats.bytes_out < sum(v.nbytes for v in got.values())
        views = exe.run(inputs, copy_outputs=False)  # views asked for: views of the arena, nothing allocated
        assert not exe.fresh_outputs and all(not v.flags.writeable for v in views.values())
        assert exe.stats.bytes_in < 64  # the inputs are still read in place
        saved, exe._direct = exe._direct, None  # the same executable copying every input and output
        want = exe.run(inputs)
        exe._direct = saved
        for name in want:
            assert np.array_equal(got[name].view(np.uint8), want[name].view(np.uint8)), name
        for name, value in kept.items():
            assert np.array_equal(inputs[name], value), f"input {name} was written"
        for layer, (k, v) in zip(cache.layers, before):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        # the torch outputs: the new cache holds the old one and one row more, the logits are the copying path's
        assert stepped.layers[0].keys.shape[-2] == cache.layers[0].keys.shape[-2] + 1
        assert torch.equal(stepped.layers[0].keys[..., :-1, :], cache.layers[0].keys)
        assert out.logits.shape[-1] == 96
        # an input in memory the run writes (the arena), or not C-contiguous, is copied, not read in place
        direct = exe._direct
        k = next(iter(direct.inputs))
        _, _, slot, shape, dtype, _ = exe._input_specs[k]
        in_arena = exe.arena[:slot.nbytes].view(dtype).reshape(shape)
        strided = np.zeros((*shape[:-1], 2 * shape[-1]), dtype)[..., ::2]
        direct.begin()
        assert not direct.read_in_place(k, in_arena) and not direct.read_in_place(k, strided)
        assert direct.read_in_place(k, np.array(in_arena))
        direct.begin()


def test_an_address_two_regions_claim_moves_neither():
    x, a, b = (np.zeros((8, 16), np.float32) for _ in range(3))
    replay = chain.capture([_copy(a, x), _copy(b, a)], 1)
    assert replay.relocation([_region(a, [0, 1], False), _region(a, [0], False),
                              _region(x, [0], True)]).ok == [False, False, True]


def test_small_slots_are_copied(monkeypatch):
    """Below ``MIN_BYTES`` a slot is copied: patching would cost more than the copy."""
    torch, compiled, model, cache = _decode_setup()
    graphs = []
    call = compiled.CompiledGraph.__call__

    def spy(self, *args):
        if self not in graphs:
            graphs.append(self)
        return call(self, *args)

    monkeypatch.setattr(compiled.CompiledGraph, "__call__", spy)
    fn = torch.compile(model.forward, backend="luminal")
    with torch.no_grad():
        for step in range(6):
            fn(input_ids=torch.tensor([[5 + step]]), past_key_values=copy.deepcopy(cache), use_cache=True)
    exe = _engine_executable(graphs)
    assert exe.replaying and exe._direct is None and not exe.fresh_outputs


def test_fresh_outputs_are_the_views_strided_gives(monkeypatch):
    """``fresh_outputs`` builds each output's view with ``np.ndarray`` from a layout worked out once: the same
    shape, strides and placement in the fresh buffer (on a cache line) that ``views.strided`` gives, bf16 included;
    a masked view keeps the ``strided`` path."""
    import ml_dtypes

    from luminal_recipes.graph.view import BoundView
    from luminal_recipes.runtimes.views import strided

    class Relocation:
        ok = [True, True, True]

    plain = BoundView((4, 6), (6, 1), 0, None)
    permuted = BoundView((6, 2, 2), (1, 12, 6), 2, None)  # a transposed, offset view of the same 26 elements
    masked = BoundView((4, 6), (6, 1), 0, ((0, 2), (0, 6)))
    outputs = [(0, 1000, 26 * 4, np.float32, [("a", plain), ("b", permuted)]),
               (1, 5000, 24 * 2, ml_dtypes.bfloat16, [("c", plain)]),
               (2, 9000, 24 * 4, np.float32, [("d", masked)])]
    direct = direct_io.DirectIO(Relocation(), {}, outputs, [])
    assert direct._layouts[2] is None  # masked: built by ``strided`` each run
    direct.begin()
    got = direct.fresh_outputs()
    for region, slot_start, nbytes, dtype, views in outputs:
        for name, bv in views:
            arr = got[name]
            if bv is masked:  # gathered elsewhere, as before: ``strided`` gives no view
                assert arr is None
                continue
            base = arr.base if arr.base is not None else arr
            while getattr(base, "base", None) is not None:
                base = base.base
            start = slot_start + direct.deltas[region]  # the fresh buffer the chains are pointed at
            assert start % 64 == 0 and arr.flags.writeable and arr.dtype == dtype
            flat = np.ndarray((nbytes // np.dtype(dtype).itemsize,), dtype,
                              base, start - base.__array_interface__["data"][0])
            want = strided(flat, bv, writeable=True)
            assert arr.shape == want.shape and arr.strides == want.strides
            assert arr.__array_interface__["data"][0] == want.__array_interface__["data"][0]


def test_an_arrays_address_read_from_the_array_object():
    """``direct_io._start`` (each input read in place, each fresh output: ~50 a decode step) reads the data pointer
    from the array object where NumPy's layout allows (CPython here): the address ``__array_interface__`` gives,
    for arrays, views at offsets, strided and transposed views, 0-dim and empty arrays, and a subclass."""
    import sys

    if sys.implementation.name == "cpython":
        assert direct_io._start is not direct_io._start_of
    base = np.arange(4096, dtype=np.float32)
    arrays = [base, base[7:], base[1:].reshape(-1, 5)[::3].T, base.view(np.uint8)[3:], np.zeros(()),
              np.empty((0, 4)), base.reshape(64, 64)[5:9, 10:20], np.empty(1 << 22, np.uint8),
              base.view(np.ma.MaskedArray).view(np.ndarray), np.ones(3).view(np.recarray)]
    for a in arrays:
        assert direct_io._start(a) == a.__array_interface__["data"][0]
