"""Run compiled conformance programs on the numpy runtime under the instruction-set path this process was started
with (``LUMINAL_RECIPES_ISA``), for ``test_isa_paths.py``: ``python isa_child.py CASES.npz OUT.npz``.

CASES.npz holds, per case ``i``: ``program_i`` (the Program as JSON text), ``dims_i`` (JSON), ``input_i_<name>``
and ``weight_i_<name>``. OUT.npz gets ``out_i`` per case and ``path`` (JSON): what this process selected and what
numba and OpenBLAS actually target, read from them rather than from our own settings."""

from __future__ import annotations

import json
import sys

import ml_dtypes  # noqa: F401 - registers bfloat16 and the float8 types with numpy's dtype names
import numpy as np


def pack(arrays: dict) -> dict:
    """``arrays`` for ``np.savez``, which keeps ml_dtypes' types only as raw bytes: those as unsigned integers of
    their width, their dtype names under ``dtypes`` (JSON)."""
    out: dict = {}
    names = {}
    for key, arr in arrays.items():
        if isinstance(arr, np.ndarray) and arr.dtype.kind == "V":
            names[key] = arr.dtype.name
            arr = arr.view(f"u{arr.dtype.itemsize}")
        out[key] = arr
    return {**out, "dtypes": json.dumps(names)}


def unpack(data) -> dict[str, np.ndarray]:
    names = json.loads(str(data["dtypes"]))
    return {k: data[k].view(names[k]) if k in names else data[k] for k in data.files if k != "dtypes"}


def main(cases_path: str, out_path: str) -> None:
    from luminal_recipes.runtimes.cpu import amx, isa, jit
    from luminal_recipes.runtimes.cpu.backend import NumpyRuntime
    from luminal_recipes.runtimes.program import Program

    runtime = NumpyRuntime()
    data = unpack(np.load(cases_path))
    count = int(data["count"])
    out = {}
    for i in range(count):
        program = Program.from_json(json.loads(str(data[f"program_{i}"])))
        dims = json.loads(str(data[f"dims_{i}"]))
        inputs = {k[len(f"input_{i}_"):]: v for k, v in data.items() if k.startswith(f"input_{i}_")}
        weights = {k[len(f"weight_{i}_"):]: v for k, v in data.items() if k.startswith(f"weight_{i}_")}
        out[f"out_{i}"] = runtime.run(program, inputs, weights, dims)["out"]
    path = {"selected": isa.selected(), "jit": jit.AVAILABLE, "amx": amx.available(), "numba": None, "blas": None}
    if jit.AVAILABLE:
        jit.kernels()
        name, features = isa.numba_codegen_target()
        path["numba"] = {"cpu": name, "avx512": "+avx512f" in features.split(",")}
    try:
        from threadpoolctl import threadpool_info

        path["blas"] = next((i.get("architecture") for i in threadpool_info() if i.get("internal_api") == "openblas"),
                            None)
    except ImportError:
        pass
    np.savez(out_path, path=json.dumps(path), **pack(out))


if __name__ == "__main__":
    main(*sys.argv[1:3])
