"""``ml_dtypes`` is imported on the first use of a bf16/fp8/fp4 dtype, not with the graph (its extension keeps ~8
MiB resident): the E2M1 table written from its bits equals ml_dtypes' decoding, every graph dtype still maps to
the same numpy dtype and back, and importing the graph, the op library, the checkpoint readers and the CPU
kernels imports no ml_dtypes (checked in a fresh process)."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from luminal_recipes.graph.dtypes import E2M1_VALUES, E4M3_VALUES, DType, is_float_storage, to_dtype


def test_the_e2m1_table_is_ml_dtypes_decoding_bit_for_bit():
    want = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert E2M1_VALUES.dtype == np.float32 and not E2M1_VALUES.flags.writeable
    assert np.array_equal(E2M1_VALUES.view(np.uint32), want.view(np.uint32))  # -0.0 at code 8 included


def test_the_e4m3_table_is_ml_dtypes_decoding_bit_for_bit():
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert E4M3_VALUES.dtype == np.float32 and not E4M3_VALUES.flags.writeable
    assert np.array_equal(E4M3_VALUES.view(np.uint32), want.view(np.uint32))  # -0.0 and both nans' signs included


@pytest.mark.parametrize("dtype", list(DType))
def test_every_dtype_maps_to_its_numpy_dtype_and_back(dtype):
    want = {DType.BF16: ml_dtypes.bfloat16, DType.F8E4M3: ml_dtypes.float8_e4m3fn,
            DType.F8E5M2: ml_dtypes.float8_e5m2, DType.F4E2M1: ml_dtypes.float4_e2m1fn}.get(dtype)
    if want is not None:
        assert dtype.np == np.dtype(want)
    assert to_dtype(dtype.np) is dtype
    assert is_float_storage(dtype.np) == dtype.is_float


def test_importing_the_graph_readers_and_cpu_kernels_imports_no_ml_dtypes():
    code = ("import sys\n"
            "import luminal_recipes.graph, luminal_recipes.ops, luminal_recipes.recipe.builder\n"
            "import luminal_recipes.weights.gguf_io, luminal_recipes.weights.safetensors_io\n"
            "import luminal_recipes.weights.formats, luminal_recipes.runtimes.cpu.kernels\n"
            "from luminal_recipes.graph.dtypes import DType\n"
            "assert DType.F32.np == 'float32' and 'ml_dtypes' not in sys.modules\n"
            "DType.BF16.np\n"
            "print('ml_dtypes' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"  # and imported on the first use of a bf16 dtype


def test_a_float32_torch_compile_path_imports_no_ml_dtypes():
    """The torch backend's tensor boundary (f32 in and out) and the CPU runtime's start-up check of the NVFP4
    product on AMX (run by the jit warm-up in every process, where AMX runs) import no ml_dtypes (~0.55 s of CPU
    in every start before); a bf16 tensor still crosses, importing it then."""
    code = ("import sys\n"
            "import torch\n"
            "from luminal_recipes.graph.dtypes import DType\n"
            "from luminal_recipes.torch_backend.params import to_numpy, to_torch\n"
            "from luminal_recipes.runtimes.cpu.amx import dequant\n"
            "dequant._check_kernels()\n"
            "a = to_numpy(torch.ones(2, 3), DType.F32, 'x')\n"
            "assert to_torch(a, torch.float32, (2, 3)).equal(torch.ones(2, 3))\n"
            "print('ml_dtypes' in sys.modules)\n"
            "b = to_numpy(torch.ones(2, 3, dtype=torch.bfloat16), DType.BF16, 'x')\n"
            "assert to_torch(b, torch.bfloat16, (2, 3)).equal(torch.ones(2, 3, dtype=torch.bfloat16))\n"
            "print('ml_dtypes' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-2:] == ["False", "True"]
