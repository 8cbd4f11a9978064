"""The Runtime protocol on every registered runtime: determinism, the timing hook, clear errors for bad programs,
inputs, weights and dims; and, on numpy, zero-copy weights and outputs and no allocation in the hot loop."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from fused_programs import Fused

from luminal_recipes import ops
from luminal_recipes.errors import InputError, LuminalError, UnboundDimError
from luminal_recipes.graph import Graph
from luminal_recipes.runtimes.executable import BackendRuntime
from luminal_recipes.runtimes.program import Program
from luminal_recipes.runtimes.protocol import Executable, Runtime, UnsupportedKernelError
from luminal_recipes.runtimes.registry import runtime_names


def randn(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def block_graph(width: int = 64):
    """A small transformer-like block: norm, attention, MLP."""
    g = Graph()
    x = g.input("x", ("s", width))
    h = ops.rms_norm(x, g.weight("n1", (width,)))
    q, k, v = (ops.linear(h, g.weight(f"w{c}", (width, width))) for c in "qkv")
    heads = [t.reshape(1, x.shape[0], 4, width // 4).transpose(1, 2) for t in (q, k, v)]
    a = ops.scaled_dot_product_attention(*heads, causal=True).transpose(1, 2).reshape(x.shape[0], width)
    x = x + ops.linear(a, g.weight("wo", (width, width)))
    m = ops.linear(ops.silu(ops.linear(ops.layer_norm(x), g.weight("w1", (2 * width, width)))),
                   g.weight("w2", (width, 2 * width)))
    g.mark_output("y", x + m)
    return g


def block_weights(rng, width: int = 64):
    w = {"n1": randn(rng, width)}
    for name, shape in (("wq", (width, width)), ("wk", (width, width)), ("wv", (width, width)),
                        ("wo", (width, width)), ("w1", (2 * width, width)), ("w2", (width, 2 * width))):
        w[name] = randn(rng, *shape) / np.float32(np.sqrt(shape[1]))
    return w


def test_runtime_and_executable_follow_the_protocol(runtime, rng):
    assert isinstance(runtime, Runtime)
    assert runtime.name in runtime_names() and runtime.device == runtime.backend.device
    assert runtime.capacity() > 0
    exe = runtime.load(Program.from_graph(block_graph()), block_weights(rng), {"s": 3})
    assert isinstance(exe, Executable)


def test_same_inputs_same_bits(runtime, rng):
    g = block_graph()
    program, weights, x = Program.from_graph(g), block_weights(rng), randn(rng, 7, 64)
    exe = runtime.load(program, weights, {"s": 7})
    first = exe.run({"x": x})["y"]
    again = exe.run({"x": x})["y"]
    other = BackendRuntime(runtime.backend).load(program, weights, {"s": 7}).run({"x": x})["y"]
    assert first.tobytes() == again.tobytes() == other.tobytes()


def test_weights_from_a_memory_mapped_checkpoint_are_not_copied(numpy_runtime, rng, tmp_path):
    import json

    from luminal_recipes.weights.safetensors_io import Checkpoint

    g = Graph()
    x = g.input("x", (2, 16))
    g.mark_output("y", ops.linear(x.cast("bf16"), g.weight("w", (8, 16), "bf16")).cast("f32"))
    w = randn(rng, 8, 16, dtype=ml_dtypes.bfloat16)
    # safetensors layout: u64 header length, JSON header, raw little-endian bytes (no numpy BF16 writer)
    header = json.dumps({"w": {"dtype": "BF16", "shape": [8, 16], "data_offsets": [0, w.nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + w.tobytes())
    with Checkpoint.open(tmp_path / "model.safetensors") as ckpt:
        exe = numpy_runtime.load(Program.from_graph(g), ckpt)
        bound = exe.weights["w"]
        assert _is_mapped(bound)  # the runtime reads the file's pages, it holds no copy
        assert np.array_equal(bound, w)
        xv = randn(rng, 2, 16)
        want = (xv.astype(ml_dtypes.bfloat16).astype(np.float32) @ w.astype(np.float32).T)
        np.testing.assert_allclose(exe.run({"x": xv})["y"], want, rtol=2e-2, atol=2e-2)


def _is_mapped(arr: np.ndarray) -> bool:
    base = arr
    while base is not None:
        if isinstance(base, np.memmap):
            return True
        base = getattr(base, "base", None)
    return False


def test_caller_weights_are_bound_zero_copy(numpy_runtime, rng):
    g = Graph()
    x = g.input("x", (2, 16))
    g.mark_output("y", ops.linear(x, g.weight("w", (8, 16))))
    w = randn(rng, 8, 16)
    exe = numpy_runtime.load(Program.from_graph(g), lambda name: {"w": w}[name])
    assert np.shares_memory(exe.weights["w"], w)
    assert not np.shares_memory(exe.arena, w)


def test_the_hot_loop_does_not_allocate(numpy_runtime, rng):
    """Beyond numpy's own iterator buffers (``np.getbufsize()`` elements per operand, for strided or broadcast
    operands), a run allocates nothing: every activation lives in the arena, whatever the sequence length."""
    g = block_graph(128)
    weights = block_weights(rng, 128)
    numpy_buffers = 4 * np.getbufsize() * 8 + 16 * 1024
    for s in (32, 128):
        exe = numpy_runtime.load(Program.from_graph(g), weights, {"s": s})
        x = randn(rng, s, 128)
        exe.run({"x": x})
        exe.run({"x": x}, trace=True)
        assert exe.memory.transient_peak < numpy_buffers < exe.memory.arena_bytes / 8, exe.memory


def test_timing_hook_returns_the_median_of_runs(runtime, rng):
    g = block_graph()
    seconds = runtime.time(Program.from_graph(g), {"x": randn(rng, 5, 64)}, block_weights(rng), {"s": 5},
                           repeats=3)
    assert 0 < seconds < 5


def test_a_kernel_outside_the_capabilities_is_refused(runtime):
    g = Graph()
    x = g.input("x", (4,))
    f = Fused(g)
    y = f.add("FlashAttention3", [x], (4,))
    with pytest.raises(UnsupportedKernelError, match="FlashAttention3") as err:
        runtime.load(f.program(y=y))
    assert isinstance(err.value, LuminalError)


def test_bad_inputs_name_the_input(runtime, rng):
    g = Graph()
    x = g.input("tokens", ("s", 4))
    g.mark_output("y", x * 2.0)
    exe = runtime.load(Program.from_graph(g), dims={"s": 3})
    with pytest.raises(InputError, match=r"'tokens' has shape \(2, 4\).*\(s, 4\) = \(3, 4\)"):
        exe.run({"tokens": randn(rng, 2, 4)})
    with pytest.raises(InputError, match="'tokens' has dtype float64.*f32"):
        exe.run({"tokens": np.zeros((3, 4))})
    with pytest.raises(InputError, match="'tokens'.*not provided"):
        exe.run({})
    with pytest.raises(InputError, match="did you mean 'tokens'"):
        exe.run({"tokens": randn(rng, 3, 4), "token": randn(rng, 3, 4)})


def test_bad_weights_name_the_weight(runtime, rng):
    g = Graph()
    x = g.input("x", (2, 4))
    g.mark_output("y", ops.linear(x, g.weight("proj.weight", (3, 4))))
    program = Program.from_graph(g)
    with pytest.raises(InputError, match="'proj.weight' was not provided"):
        runtime.load(program, {"other": np.zeros((3, 4), np.float32)})
    with pytest.raises(InputError, match="'proj.weight' has dtype bfloat16"):
        runtime.load(program, {"proj.weight": np.zeros((3, 4), ml_dtypes.bfloat16)})
    with pytest.raises(InputError, match=r"'proj.weight' has shape \(4, 3\)"):
        runtime.load(program, {"proj.weight": np.zeros((4, 3), np.float32)})
    with pytest.raises(InputError, match="no weights were given"):
        runtime.load(program)


def test_unbound_dims_are_reported_before_anything_runs(runtime):
    g = Graph()
    x = g.input("x", ("s", "p"))
    g.mark_output("y", x * 2.0)
    with pytest.raises(UnboundDimError, match="p, s"):
        runtime.load(Program.from_graph(g), dims={})


def test_outputs_can_be_read_in_place(numpy_runtime, rng):
    """``copy_outputs=False`` hands out read-only views of the arena: no copy, overwritten by the next run."""
    g = Graph()
    x = g.input("x", (3, 5))
    g.mark_output("y", x * 2.0)
    exe = numpy_runtime.load(Program.from_graph(g))
    first_x, second_x = randn(rng, 3, 5), randn(rng, 3, 5)
    view = exe.run({"x": first_x}, copy_outputs=False)["y"]
    assert np.shares_memory(view, exe.arena) and not view.flags.writeable
    assert np.array_equal(view, first_x * 2)
    copied = exe.run({"x": second_x})["y"]
    assert not np.shares_memory(copied, exe.arena)
    assert np.array_equal(view, second_x * 2) and np.array_equal(copied, second_x * 2)
