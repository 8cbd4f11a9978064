"""The tiny FLUX.2 transformer (bench/torch_backend.py's ``flux2``) through torch.compile, built with and without
the float64 RoPE tables' cast changes (``graph.core.cast`` of a materialised view, ``optable._lift`` casting after
broadcasting), run in one process with turns alternated; prints the CPU time of each and the ratio.

    python bench/torch_rope_tables_ab.py
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["LUMINAL_RECIPES_CACHE"] = tempfile.mkdtemp(prefix="luminal-rope-ab-")
os.environ["LUMINAL_TORCH_TRANSLATION_CACHE"] = "0"  # the sides patch the translator: each lowers its own graph
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch_backend as tb  # noqa: E402

from luminal_recipes.graph import core  # noqa: E402
from luminal_recipes.torch_backend import optable  # noqa: E402

torch.set_num_threads(1)
model, call, _ = tb.flux2_workload(torch)
orig_mat, orig_lift = core._materialised, optable._lift

def old_lift(cx, x, dtype, shape):
    if isinstance(x, optable.Tensor):
        return optable._to(x, dtype).broadcast_to(shape)
    return orig_lift(cx, x, dtype, shape)

def make(new):
    # each side compiles its own function: Dynamo caches compiled graphs on the code object, so two compiles of
    # model.forward itself (even after torch._dynamo.reset()) would both run the graph compiled last
    def side(*args, **kwargs):
        return model.forward(*args, **kwargs)

    side.__code__ = side.__code__.replace(co_name=f"side_{'new' if new else 'old'}")
    core._materialised = orig_mat if new else (lambda x: None)
    optable._lift = orig_lift if new else old_lift
    fn = call(torch.compile(side, backend="luminal"))
    with torch.no_grad():
        for _ in range(6):
            out = fn()
    core._materialised, optable._lift = orig_mat, orig_lift
    return fn, out

with torch.no_grad():
    a, oa = make(False)
    b, ob = make(True)
    print("max |new - old|", (oa - ob).abs().max().item())
    cpu = {"old": [], "new": []}
    for _ in range(15):
        for k, f in (("old", a), ("new", b)):
            c = time.process_time()
            f()
            cpu[k].append(time.process_time() - c)
m = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
print(f"cpu median old {m['old']:.2f} ms new {m['new']:.2f} ms  new/old {m['new']/m['old']:.3f}",
      "rounds", [round(x / y, 2) for x, y in zip(cpu["new"], cpu["old"])])
