"""torch.compile(backend="luminal") vs eager PyTorch vs torch.compile's default backend (inductor), on CPU.

Workloads (random weights, float32):

- ``flux2``: the tiny FLUX.2 transformer of recipes/flux2-tiny (diffusers' ``Flux2Transformer2DModel``, 1 double
  + 2 single blocks, 4 heads x 16, 128 latent channels) on a 32x32 latent grid (1024 image tokens) and 64 text
  tokens: one denoising forward;
- ``qwen3-prefill``: a ~100M-parameter Qwen3-shaped decoder (transformers' ``Qwen3ForCausalLM``: hidden 768, 12
  layers, 12 heads x 64, 4 kv heads, MLP 2048, vocabulary 32000, tied embeddings) forward at 512 tokens;
- ``qwen3-decode``: the same model's decode step: one token over transformers' KV cache of 512 (the cache is
  copied before each timed step, outside the timing, so every step sees the same 512 entries);
- ``qwen3-generate``: the same model in transformers' ``generate`` (greedy, 32 new tokens after a 32-token
  prompt, its default cache growing a row a step: a new length every step); the time of the whole call and,
  printed beside it, per new token.
- ``qwen3-generate-static``: the same with ``cache_implementation="static"`` (transformers' recommended path for
  compiled generation): a ``StaticCache``, so one fixed-shape decode graph updating the cache in place.

Each side is compiled by its first call (the compile time printed: Dynamo + AOTAutograd + our search and load,
with a cold plan cache, then once more with the plan cache warm; inductor's with its own on-disk caches as they
are: warm after a first run; then each side after its own ``torch._dynamo.reset()``, twice, in both orders, "after
reset": the start of a model compiled before, as in a second process, where both sides skip AOTAutograd's
lowering), then the sides run in turns (ours, eager, inductor; ``--repeats`` rounds; in its turn each side is
called ``--untimed`` times before its timed call: PyTorch's OpenMP threads spin on after a call) on
the same threads (torch.set_num_threads = our kernels' and numpy BLAS's threads), so a slow phase of a shared
machine falls on all of them alike. The median per side and the ratios ours/eager and ours/inductor are
printed, with each round's ratio range. Outputs are compared (max abs difference to eager) to show all
sides computed the same thing. Each call's process CPU time is printed too (``time.process_time``, every thread
of the process): on a machine other jobs load, a 1-thread run's CPU time is its wall time without the time it
waited for a core, so its ratios are the steadier ones (with 2 threads it is the work of both, not the latency).

    python bench/torch_backend.py                             # all workloads, 3 rounds
    python bench/torch_backend.py --workloads flux2 --repeats 5 --threads 2
    python bench/torch_backend.py --plan-cache DIR --start ours   # one side's start in a new process
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from luminal_recipes.openblas_spin import limit_openblas_spin

limit_openblas_spin()  # as the CLI does, before numpy loads OpenBLAS

BENCH = Path(__file__).resolve().parent


def flux2_workload(torch):
    import diffusers

    torch.manual_seed(0)
    model = diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=48, timestep_guidance_channels=256, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=True).eval()
    side, txt = 32, 64
    grid = torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), torch.zeros(1),
                          indexing="ij")
    img_ids = torch.stack(grid, -1).reshape(1, -1, 4)
    txt_ids = torch.zeros(1, txt, 4)
    txt_ids[..., 3] = torch.arange(float(txt))
    args = (torch.randn(1, side * side, 128), torch.randn(1, txt, 48), torch.tensor([0.5]), img_ids, txt_ids,
            torch.tensor([4.0]))

    def call(fn):
        return lambda: fn(*args, return_dict=False)[0]

    return model, call, None


def qwen3_model(torch):
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                      num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                                      head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
    return transformers.Qwen3ForCausalLM(config).eval()


def qwen3_prefill_workload(torch):
    model = qwen3_model(torch)
    ids = torch.randint(0, 32000, (1, 512), generator=torch.Generator().manual_seed(1))

    def call(fn):
        return lambda: fn(input_ids=ids).logits

    return model, call, None


def qwen3_decode_workload(torch):
    import transformers

    model = qwen3_model(torch)
    ids = torch.randint(0, 32000, (1, 512), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    token = torch.tensor([[7]])
    position = torch.tensor([[512]])
    state = {}

    tensors = [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]

    def prepare():  # outside the timing: every step sees the same 512 cached entries
        # copied by numpy (one thread): torch's own copy of the 12.6 MB runs on its OpenMP threads, whose workers
        # then spin ~3 ms into the timed call, on a core a runtime with threads of its own needs (ours measured
        # 21.6 vs 18.5 ms a step behind it); the cache's other fields by deepcopy, as before
        memo = {id(t): torch.from_numpy(t.numpy().copy()) for t in tensors}
        state["cache"] = copy.deepcopy(cache, memo)

    def call(fn):
        return lambda: fn(input_ids=token, position_ids=position, past_key_values=state["cache"],
                          use_cache=True).logits

    return model, call, prepare


GENERATE_TOKENS = 32


def qwen3_generate_workload(torch, cache: str | None = None):
    """transformers' ``generate`` (greedy, ``GENERATE_TOKENS`` new tokens after a 32-token prompt) with the
    compiled forward: its default ``DynamicCache`` grows by a row every step, so every step is a new length - for
    us a re-binding of the symbolic dims (``Executable.bind``), for inductor its dynamic-shape kernels. With
    ``cache="static"`` (``qwen3-generate-static``) a ``StaticCache`` of the prompt plus the new tokens: every
    decode step is one fixed-shape graph updating the cache in place (``index_copy_``)."""
    model = qwen3_model(torch)
    ids = torch.randint(0, 32000, (1, 32), generator=torch.Generator().manual_seed(1))
    extra = {} if cache is None else {"cache_implementation": cache}

    def call(fn):
        def run():
            model.forward = fn  # (an instance attribute: the model's __call__ then calls the compiled forward)
            try:
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GENERATE_TOKENS,
                                      min_new_tokens=GENERATE_TOKENS, do_sample=False, **extra)
            finally:
                del model.forward
        return run
    return model, call, None


def qwen3_generate_static_workload(torch):
    return qwen3_generate_workload(torch, cache="static")


WORKLOADS = {"flux2": flux2_workload, "qwen3-prefill": qwen3_prefill_workload, "qwen3-decode": qwen3_decode_workload,
             "qwen3-generate": qwen3_generate_workload, "qwen3-generate-static": qwen3_generate_static_workload}


CAPTURE_RUNS = 5  # calls of each side before the timed rounds, past the CPU runtime's chain capture
# calls of a side in each turn before its timed call: after a call, PyTorch's OpenMP threads (libgomp) spin on
# for milliseconds (measured 3-4 ms of a core after a 2-thread op), so the side timed right after eager or
# inductor found one core taken; each side's timed call now follows a call of its own, as in a model's loop
UNTIMED_CALLS = 1


def timed(fn, prepare, cpu: list | None = None):
    """Wall seconds of one call and its output; its process CPU seconds appended to ``cpu`` when given."""
    if prepare is not None:
        prepare()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return seconds, out


def bench(name: str, repeats: int) -> None:
    import torch

    from luminal_recipes import instrument

    # a fresh Dynamo state per workload: the generate workloads compile the same code (``forward``), and the
    # entries an earlier workload left count towards Dynamo's recompile limit (8), past which it runs eagerly
    torch._dynamo.reset()
    model, call, prepare = WORKLOADS[name](torch)
    sides = {"eager": model.forward}
    compile_s = {}
    outputs = {}
    with torch.no_grad():
        for side, backend in (("ours", "luminal"), ("inductor", "inductor")):
            fn = torch.compile(model.forward, backend=backend)
            seconds, out = timed(call(fn), prepare)
            compile_s[side] = seconds
            sides[side] = fn
            outputs[side] = out
        # ours once more on a fresh Dynamo state: the plan cache is warm now
        torch._dynamo.reset()
        warm = torch.compile(model.forward, backend="luminal")
        before = instrument.snapshot()
        compile_s["ours (warm plan cache)"], _ = timed(call(warm), prepare)
        moved = instrument.snapshot() - before
        hits = (f"translations read {moved['torch_translation_hit']}, plans read {moved[instrument.PLAN_CACHE_HIT]}, "
                f"searches {moved[instrument.SEARCH]}")
        # each side again after its own reset, in both orders (a second trace of the same code in a process is
        # cheaper for Dynamo, whichever backend asked first): a model compiled before, as in a new process
        after = {"ours": [], "inductor": []}
        for order in (("ours", "inductor"), ("inductor", "ours")):
            for side in order:
                torch._dynamo.reset()
                fn = torch.compile(model.forward, backend="luminal" if side == "ours" else "inductor")
                after[side].append(timed(call(fn), prepare)[0])
        for side, seconds in after.items():
            compile_s[f"{side} (after reset)"] = statistics.mean(seconds)
        torch._dynamo.reset()
        sides["ours"] = torch.compile(model.forward, backend="luminal")
        sides["inductor"] = torch.compile(model.forward, backend="inductor")
        for side in ("ours", "inductor"):  # recompiles from the caches, outside the timing
            timed(call(sides[side]), prepare)
        # the CPU runtime records its chains at the fifth run of a binding (NumpyBackend.capture_after), which
        # compiles the generated chain interpreters with numba: seconds, cold in a fresh plan cache folder (their
        # numba cache lives there). Outside the timing, as inductor's compilation is; reported with the compiles
        capture = [timed(call(sides["ours"]), prepare)[0] for _ in range(CAPTURE_RUNS)]
        compile_s["ours (chain capture runs)"] = sum(capture)
        for _ in range(CAPTURE_RUNS):
            timed(call(sides["inductor"]), prepare)
        _, outputs["eager"] = timed(call(sides["eager"]), prepare)
        times = {side: [] for side in ("ours", "eager", "inductor")}
        cpu = {side: [] for side in times}
        for _ in range(repeats):
            for side in times:
                for _ in range(UNTIMED_CALLS):
                    timed(call(sides[side]), prepare)
                seconds, _ = timed(call(sides[side]), prepare, cpu[side])
                times[side].append(seconds)
    med = {side: statistics.median(v) for side, v in times.items()}
    cpu_med = {side: statistics.median(v) for side, v in cpu.items()}
    print(f"\n{name}  (torch {torch.__version__}, {torch.get_num_threads()} threads, {repeats} rounds)")
    print(f"  (load average {os.getloadavg()[0]:.2f})")
    for side, seconds in compile_s.items():
        rounds = f"  ({' / '.join(f'{t:.2f}' for t in after[side.split()[0]])} s)" if "after reset" in side else ""
        print(f"  compile+first call  {side:<26} {seconds:8.2f} s{rounds}")
    print(f"  ours (warm plan cache): {hits}")
    for side in ("ours", "eager", "inductor"):
        per_token = f"  ({med[side] * 1e3 / GENERATE_TOKENS:.1f} ms a new token)" \
            if name.startswith("qwen3-generate") else ""
        print(f"  run (median)        {side:<24} {med[side] * 1e3:8.1f} ms{per_token}")
    for ref in ("eager", "inductor"):
        rounds = [a / b for a, b in zip(times["ours"], times[ref])]
        print(f"  ours / {ref:<9} {med['ours'] / med[ref]:6.2f}x   (rounds {min(rounds):.2f}x .. {max(rounds):.2f}x)")
    for side in ("ours", "eager", "inductor"):
        print(f"  cpu time (median)   {side:<24} {cpu_med[side] * 1e3:8.1f} ms")
    for ref in ("eager", "inductor"):
        rounds = [a / b for a, b in zip(cpu["ours"], cpu[ref])]
        print(f"  ours / {ref:<9} {cpu_med['ours'] / cpu_med[ref]:6.2f}x cpu time (rounds {min(rounds):.2f}x .. "
              f"{max(rounds):.2f}x)")
    for side in ("ours", "inductor"):
        diff = (outputs[side].double() - outputs["eager"].double()).abs().max().item()
        print(f"  max |{side} - eager| = {diff:.3g}")


def start(name: str, side: str) -> None:
    """One side's compile and first call, the first in this process (``--start``): with ``--plan-cache`` of an
    earlier run, the start of a model run again in a new process."""
    import torch

    model, call, prepare = WORKLOADS[name](torch)
    with torch.no_grad():
        fn = torch.compile(model.forward, backend="luminal" if side == "ours" else "inductor")
        cpu: list = []
        seconds, _ = timed(call(fn), prepare, cpu)
    print(f"{name}: {side} compile+first call in a new process {seconds:.2f} s, CPU {cpu[0]:.2f} s (load average "
          f"{os.getloadavg()[0]:.2f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (each side once per round)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for every side (default: numpy's BLAS threads, normally the CPU count)")
    parser.add_argument("--plan-cache", type=Path, default=None,
                        help="plan cache folder (default: a fresh temporary one, so the compile time is cold)")
    parser.add_argument("--start", choices=("ours", "inductor"), default=None,
                        help="only time this side's compile and first call in this process (see start())")
    parser.add_argument("--untimed", type=int, default=UNTIMED_CALLS,
                        help="calls of a side before its timed call in each turn (0: the sides back to back)")
    args = parser.parse_args(argv)
    globals()["UNTIMED_CALLS"] = max(0, args.untimed)
    os.environ["LUMINAL_RECIPES_CACHE"] = str(args.plan_cache or tempfile.mkdtemp(prefix="luminal-torch-bench-"))
    sys.path.insert(0, str(BENCH))
    from flux2_transformer_cpu import blas_threads

    threads = blas_threads(args.threads)
    import torch

    torch.set_num_threads(threads)
    for name in args.workloads.split(","):
        if args.start:
            start(name.strip(), args.start)
        else:
            bench(name.strip(), args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
