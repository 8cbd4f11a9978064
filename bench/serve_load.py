"""Load test of `luminal-recipe serve` with a language model: 1, 4 and 8 concurrent chat streams (OpenAI's
streaming protocol over httpx, one thread per stream) against a server this script starts on 127.0.0.1,
bounded in requests and time.

For each concurrency C it sends ``--requests-per-stream`` streamed chat requests on each of C streams (greedy,
``--max-tokens`` tokens each, a different prompt per request) and reports:

- aggregate decode tokens/s: tokens received by all streams / wall time of the round;
- time to first token (request sent -> first content chunk), p50 and p99;
- per-token latency (the gaps between a stream's content chunks after the first), p50 and p99;
- completeness: every request answered with a finish_reason and usage, or with an error (counted); each reply
  is compared with the same request answered alone (C = 1): none lost, duplicated or mixed up.

The ratio aggregate(C) / aggregate(1) is what continuous batching raises (the target: >= 3x at 8; `serve
--max-batch`, docs/serving.md "Concurrency"); ``--max-batch 1`` measures one reply at a time for comparison.

    python bench/serve_load.py                                   # the tiny Llama shipped in tests/golden
    python bench/serve_load.py --no-http                         # the batcher alone, in this process
    python bench/serve_load.py --recipe recipes/llama.yaml --weights DIR --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "luminal_recipes", "serve", args.recipe, "--host", "127.0.0.1", "--port", "0",
           "--max-queue", "64", "--max-batch", str(args.max_batch), "--log-level", "warning"]
    if args.weights:
        cmd += ["--weights", args.weights]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + args.start_timeout
    for line in proc.stderr:
        sys.stderr.write(line)
        match = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, f"http://127.0.0.1:{match[1]}"
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("the server did not start")


def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat request over OpenAI's protocol (httpx, the SSE lines parsed here: a light client, so
    that 8 client threads measure the server rather than their own parsing)."""
    t0 = time.perf_counter()
    stamps, text, finish, usage, error = [], [], None, None, None
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:200]!r}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", ()):
                    piece = choice["delta"].get("content")
                    if piece:
                        stamps.append(time.perf_counter())
                        text.append(piece)
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
    except Exception as exc:  # noqa: BLE001 - counted and reported
        error = f"{type(exc).__name__}: {exc}"
    return {"prompt": prompt, "text": "".join(text), "finish": finish, "tokens": usage, "error": error,
            "ttft": stamps[0] - t0 if stamps else None,
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "end": time.perf_counter()}


def round_of(client, model: str, streams: int, per_stream: int, max_tokens: int, deadline: float) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def worker(s: int) -> None:
        for r in range(per_stream):
            if time.monotonic() > deadline:
                return
            out = one_request(client, model, f"Request {s}-{r}: tell me about the number {7 * s + r}.", max_tokens)
            with lock:
                results.append(out)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] or 0 for r in results)
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"streams": streams, "requests": len(results), "errors": sum(r["error"] is not None for r in results),
            "incomplete": sum(r["error"] is None and (r["finish"] is None or r["tokens"] is None) for r in results),
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "ttft_p50_ms": 1000 * percentile(ttfts, 50), "ttft_p99_ms": 1000 * percentile(ttfts, 99),
            "token_p50_ms": 1000 * percentile(gaps, 50), "token_p99_ms": 1000 * percentile(gaps, 99),
            "results": results}


def scheduler_rounds(args, levels: list[int]) -> None:
    """``--no-http``: the same rounds straight on the scheduler (``serving.batching.TextBatcher``, or one reply
    at a time with ``--max-batch 1``) in this process: what the model and the batching give without HTTP."""
    import asyncio

    from luminal_recipes.serving.backends import ModelOptions, TextBackend, TextJob
    from luminal_recipes.serving.batching import Scheduler, TextBatcher
    from luminal_recipes.tasks.generation.sampling import SamplingSettings

    batching = args.max_batch > 1
    scheduler = TextBatcher(64, args.max_batch) if batching else Scheduler(64)

    def load():
        backend = TextBackend(ModelOptions(Path(args.recipe), args.weights or None))
        backend.prepare(args.max_tokens, args.max_batch)
        if batching:
            scheduler.engine, scheduler.lm = backend.batched, backend.model
        return backend

    backend = scheduler.call(load)

    def submit(ids):
        if batching:
            return scheduler.submit_text(TextJob(ids, args.max_tokens, SamplingSettings(), ()))
        return scheduler.submit(lambda h: backend.run(ids, args.max_tokens, on_text=h.emit))

    async def rounds():
        await submit(backend.prompt_ids("warm-up")).wait()
        base = None
        for c in levels:
            async def stream(s: int) -> list:
                out = []
                for r in range(args.requests_per_stream):  # one request after the other, as a client does
                    ids = backend.prompt_ids(f"Request {s}-{r}: tell me about the number {7 * s + r}.")
                    out.append(await submit(ids).wait())
                return out

            t0 = time.perf_counter()
            results = [r for each in await asyncio.gather(*(stream(s) for s in range(c))) for r in each]
            rate = sum(len(r.ids) for r in results) / (time.perf_counter() - t0)
            base = base or rate
            print(f"{c:>7} {len(results):>5} {sum(len(r.ids) for r in results):>7} {rate:>8.1f} "
                  f"{rate / base:>5.2f}")

    print(f"\n{args.recipe}: the scheduler without HTTP, --max-batch {args.max_batch}, {args.max_tokens} tokens")
    print(f"{'streams':>7} {'reqs':>5} {'tokens':>7} {'tok/s':>8} {'x1':>5}")
    asyncio.run(rounds())
    scheduler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "llama.yaml"))
    parser.add_argument("--weights", default=str(ROOT / "tests" / "golden" / "checkpoints" / "llama-tiny"))
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds for all rounds together")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    parser.add_argument("--no-http", action="store_true", help="run the rounds on the scheduler in this process, "
                        "without the server")
    args = parser.parse_args()
    import httpx

    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 or c > 64 for c in levels) or not 1 <= args.requests_per_stream <= 50:
        raise SystemExit("concurrency in 1..64 and --requests-per-stream in 1..50 (the run is bounded)")
    if args.no_http:
        scheduler_rounds(args, levels)
        return
    proc, url = start_server(args)
    try:
        client = httpx.Client(base_url=url, timeout=300, limits=httpx.Limits(max_connections=64))
        model = client.get("/v1/models").json()["data"][0]["id"]
        one_request(client, model, "warm-up", 4)
        deadline = time.monotonic() + args.time_limit
        rounds = [round_of(client, model, c, args.requests_per_stream, args.max_tokens, deadline) for c in levels]
        # the same request alone, for the replies of every round: none lost, duplicated or mixed up
        alone = {}
        mismatched = 0
        for rnd in rounds:
            for r in rnd["results"]:
                if r["error"] is not None:
                    continue
                if r["prompt"] not in alone:
                    alone[r["prompt"]] = one_request(client, model, r["prompt"], args.max_tokens)["text"]
                mismatched += r["text"] != alone[r["prompt"]]
    finally:
        proc.terminate()
        proc.wait(60)
    base = rounds[0]["tokens_per_s"] if rounds and rounds[0]["tokens_per_s"] > 0 else float("nan")
    print(f"\n{args.recipe} ({args.weights}), serve --max-batch {args.max_batch}, {args.max_tokens} tokens per "
          f"request, {args.requests_per_stream} requests per stream")
    print(f"{'streams':>7} {'reqs':>5} {'err':>4} {'tokens':>7} {'tok/s':>8} {'x1':>5} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'tok p50':>8} {'tok p99':>8}  (ms)")
    for r in rounds:
        print(f"{r['streams']:>7} {r['requests']:>5} {r['errors'] + r['incomplete']:>4} {r['tokens']:>7} "
              f"{r['tokens_per_s']:>8.1f} {r['tokens_per_s'] / base:>5.2f} {r['ttft_p50_ms']:>9.1f} "
              f"{r['ttft_p99_ms']:>9.1f} {r['token_p50_ms']:>8.2f} {r['token_p99_ms']:>8.2f}")
    print(f"replies that differ from the same request answered alone: {mismatched} "
          f"(of {sum(len(r['results']) for r in rounds)})")
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "results"} for r in rounds], indent=2))
    if mismatched or any(r["errors"] or r["incomplete"] for r in rounds):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
