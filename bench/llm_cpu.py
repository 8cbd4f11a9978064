"""CPU text generation: our compiled prefill + decode programs (recipes/qwen3.yaml, numpy runtime, KV cache as
persistent state) vs transformers eager (``Qwen3ForCausalLM.generate``), same weights, same threads.

A Qwen3-shaped model of about 100M parameters (default: hidden 768, 12 layers, 12 query / 4 kv heads of 64,
MLP 2048, vocabulary 32000, tied embeddings) is created by transformers from a seeded random initialisation and
saved with ``save_pretrained`` (plus a word-level tokenizer, which generation loads but the benchmark bypasses:
prompts are token ids). Each side then runs in its own process (so each peak RSS is its own): greedy generation
of ``--new`` tokens after a random ``--prompt``-token prompt, ``--repeats`` times. Printed per side: time to first
token (prefill + first sampling), decode tokens/s and time per output token over the remaining tokens, peak RSS,
and the ratios ours / transformers (decode-time target <= 1.0, goal 0.7); then the per-token decode time at
several context lengths (``--contexts``: prompts of that many tokens, ``--probe`` new tokens each), which stays
flat when the cache is written in place and never copied (attention's own work grows with the context, a small
share at these sizes). Both sides' ids are compared (they agree unless two logits tie within rounding), and the
last prompt position's logits must agree to 1e-4 (the script exits 1 otherwise).

    python bench/llm_cpu.py                        # ~3-5 minutes on 2 cores
    python bench/llm_cpu.py --threads 1 --repeats 2 --contexts 128,1024

The BLAS library, its CPU kernel and thread count are printed first (see bench/README.md for the environment).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flux2_transformer_cpu import blas_threads  # noqa: E402  (same folder)
from matmul import blas_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen3.yaml"

SIZES = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=4096,
             tie_word_embeddings=True)


def save_model(folder: Path, seed: int) -> int:
    """A seeded random Qwen3ForCausalLM (and a word-level tokenizer) saved by transformers; its parameter count."""
    import tokenizers
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**SIZES, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(SIZES["vocab_size"])},
                                                             unk_token="t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def peak_rss() -> int:
    """This process's peak resident memory: VmHWM (per address space, so not inherited from the parent the way
    getrusage's maximum survives exec), else getrusage."""
    for line in Path("/proc/self/status").read_text().splitlines() if Path("/proc/self/status").exists() else []:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- one side, in its own process -------------------------------------------------------------------------
def run_ours(folder: Path, prompt: list[int], new: int, repeats: int, contexts: list[int], probe: int) -> dict:
    from luminal_recipes import load_recipe

    t0 = time.perf_counter()
    lm = load_recipe(RECIPE, weights=folder, context=max(contexts + [len(prompt)]) + max(new, probe))
    lm.prepare(len(prompt), new)
    load_s = time.perf_counter() - t0
    runs = [lm.generate(prompt, max_new_tokens=new) for _ in range(repeats)]
    per_context, moved = {}, {}
    for n in contexts:
        ids = list(np.random.default_rng(n).integers(0, SIZES["vocab_size"], n))
        reply = lm.generate(ids, max_new_tokens=probe)
        stats = lm._session.decode.stats  # the last decode step's transfers: inputs, logits, device copies
        per_context[n] = reply.decode_s / max(1, len(reply.ids) - 1)
        moved[n] = [stats.bytes_in, stats.bytes_out, stats.bytes_device]
    return {"load_s": load_s, "ttft_s": [r.first_token_s for r in runs], "decode_s": [r.decode_s for r in runs],
            "ids": runs[0].ids, "last_logits": lm.logits(prompt)[-1].tolist(), "per_context": per_context,
            "moved": moved, "peak_rss": peak_rss()}


def run_torch(folder: Path, prompt: list[int], new: int, repeats: int, contexts: list[int], probe: int,
              threads: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0

    class Clock(transformers.generation.BaseStreamer):
        """Timestamps of generate's streamed tokens (the first put() is the prompt)."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def generate(ids: list[int], n: int) -> tuple[list[int], float, float]:
        clock = Clock()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=n, min_new_tokens=n, streamer=clock,
                                 pad_token_id=0)
        first, last = clock.times[1], clock.times[-1]
        return out[0, len(ids):].tolist(), first - start, last - first

    runs = [generate(prompt, new) for _ in range(repeats)]
    per_context = {}
    for n in contexts:
        ids = list(np.random.default_rng(n).integers(0, SIZES["vocab_size"], n))
        _, _, decode = generate(ids, probe)
        per_context[n] = decode / max(1, probe - 1)
    with torch.no_grad():
        last = model(torch.tensor([prompt])).logits[0, -1].tolist()
    return {"load_s": load_s, "ttft_s": [r[1] for r in runs], "decode_s": [r[2] for r in runs], "ids": runs[0][0],
            "last_logits": last, "per_context": per_context, "peak_rss": peak_rss()}


def side(args) -> None:
    prompt = [int(i) for i in np.random.default_rng(args.seed).integers(0, SIZES["vocab_size"], args.prompt)]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    threads = blas_threads(args.threads)
    if args.side == "ours":
        result = run_ours(args.folder, prompt, args.new, args.repeats, contexts, args.probe)
    else:
        result = run_torch(args.folder, prompt, args.new, args.repeats, contexts, args.probe, threads)
    print(json.dumps(result))


# ---- the comparison ---------------------------------------------------------------------------------------------
def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="BLAS and torch threads (default: BLAS's own)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="generated tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contexts", default="128,512,1024", help="context lengths of the per-token probe")
    parser.add_argument("--probe", type=int, default=16, help="new tokens generated per probed context")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side", choices=["ours", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side(args)
        return

    threads = blas_threads(args.threads)
    print("\n".join(blas_report()))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-100m"
        params = save_model(folder, args.seed)
        print(f"Qwen3-shaped model: {params / 1e6:.1f}M parameters ({SIZES}), {args.prompt} tokens in, {args.new} "
              f"out, {args.repeats} repeats, {threads} thread(s)")
        results = {}
        for name in ("ours", "torch"):
            command = [sys.executable, __file__, "--side", name, "--folder", str(folder), "--prompt",
                       str(args.prompt), "--new", str(args.new), "--repeats", str(args.repeats), "--contexts",
                       args.contexts, "--probe", str(args.probe), "--seed", str(args.seed), "--threads",
                       str(threads)]
            env = {**__import__("os").environ, "LUMINAL_RECIPES_CACHE": str(Path(tmp) / "plans")}
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                sys.exit(f"{name} side failed:\n{done.stderr[-4000:]}")
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    ours, ref = results["ours"], results["torch"]

    a, b = np.array(ours["last_logits"]), np.array(ref["last_logits"])
    rel = float(np.abs(a - b).max() / np.abs(b).max())
    same = next((i for i, (x, y) in enumerate(zip(ours["ids"], ref["ids"])) if x != y), len(ref["ids"]))
    print(f"last prompt logits: max |ours - torch| / max |torch| = {rel:.2e}; generated ids identical for "
          f"{same} of {len(ref['ids'])} tokens")
    print(f"our load + compile + plan: {ours['load_s']:.1f} s; transformers load: {ref['load_s']:.1f} s")
    rows = []
    for label, key, scale in (("time to first token", "ttft_s", 1e3), ("decode (all but the first token)",
                                                                      "decode_s", 1.0)):
        o, t = statistics.median(ours[key]), statistics.median(ref[key])
        unit = "ms" if scale == 1e3 else "s"
        rows.append(f"  {label:34s} ours {o * scale:8.2f} {unit}  transformers {t * scale:8.2f} {unit}  "
                    f"ours / transformers {o / t:.3f}")
    o, t = statistics.median(ours["decode_s"]), statistics.median(ref["decode_s"])
    steps = args.new - 1
    rows.append(f"  {'decode tokens/s':34s} ours {steps / o:8.1f}     transformers {steps / t:8.1f}     "
                f"(time per output token {1e3 * o / steps:.2f} vs {1e3 * t / steps:.2f} ms)")
    rows.append(f"  {'peak RSS':34s} ours {mib(ours['peak_rss']):>11s}  transformers {mib(ref['peak_rss']):>11s}  "
                f"ours / transformers {ours['peak_rss'] / ref['peak_rss']:.3f}")
    print("medians over repeats:\n" + "\n".join(rows))
    print(f"per-token decode time by context length ({args.probe} tokens each):")
    for n in ours["per_context"]:
        moved = ours["moved"][n]
        print(f"  context {int(n):5d}: ours {1e3 * ours['per_context'][n]:7.2f} ms   transformers "
              f"{1e3 * ref['per_context'][n]:7.2f} ms   (our decode step moved {moved[0]} B in, {moved[1]} B out, "
              f"{moved[2]} B device-side: the cache is written in place, never copied)")
    print(f"load average (1 min): {__import__('os').getloadavg()[0]:.2f}")
    if rel > 1e-4:
        sys.exit(f"the last prompt position's logits differ by {rel:.2e} (relative): a wrong result")


if __name__ == "__main__":
    main()
