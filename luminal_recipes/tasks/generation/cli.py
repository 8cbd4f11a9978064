"""`luminal-recipe run` for a language-model recipe: stream replies, print a JSON object per prompt, or serve the
benchmark harness's ``--stdio`` protocol.

``--stdio`` (luminal-benchmarks' protocol, byte for byte): ``READY`` once the model is loaded and compiled; then
for every non-empty stdin line (split at ``\\n`` only; trailing ``\\n`` then ``\\r`` removed; UTF-8) one
``TOK\\t<text>`` line per generated token other than an EOS (its text escaped: backslash, tab, newline, CR as
``\\\\ \\t \\n \\r``; a token that completes no character prints an empty text) and ``EOQ\\t<tokens>\\t<ms>``
(tokens generated, an EOS included; milliseconds from the prompt's arrival, 3 decimals). The KV cache is reset
per prompt; every log goes to stderr. The environment variable ``GEN_TOKENS`` sets the default of ``--max-new-tokens``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ...errors import InputError, LuminalError, NonFiniteError
from ...text.check import check_text
from .length import ContextLengthWarning, beyond_context

DEFAULT_MAX_NEW_TOKENS = 256


def default_max_new_tokens() -> int:
    """``GEN_TOKENS`` when it is a whole number >= 1 (as the harness's ``env_usize`` reads it), else 256."""
    try:
        value = int(os.environ.get("GEN_TOKENS", ""))
    except ValueError:
        return DEFAULT_MAX_NEW_TOKENS
    return value if value >= 1 else DEFAULT_MAX_NEW_TOKENS


def escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


@dataclass
class TextRequest:
    recipe: Path
    prompts: list[str] = field(default_factory=list)
    weights: str | None = None
    sets: list[str] = field(default_factory=list)
    max_memory: int | None = None
    runtime: str = "numpy"
    compile: bool = True
    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    chat: bool | None = None
    system: str | None = None
    chat_vars: dict[str, Any] = field(default_factory=dict)
    context: int | None = None
    started: float = 0.0
    allow_nonfinite: bool = False  # generate even when the logits hold NaN or infinity

    def options(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens or default_max_new_tokens(), "temperature": self.temperature,
                "top_k": self.top_k, "top_p": self.top_p, "repetition_penalty": self.repetition_penalty,
                "seed": self.seed, "stop": list(self.stop), "chat": self.chat, "system": self.system,
                "chat_vars": dict(self.chat_vars)}


def parse_chat_vars(items: Iterable[str]) -> dict[str, Any]:
    """``--chat-var NAME=VALUE`` (VALUE read as YAML: true, 3, [a, b], text), by the recipe loader's bounded YAML
    reader (its size, depth, alias and expansion limits); a value that is not YAML is taken as text."""
    import yaml

    from ...recipe.yaml_source import YamlLimitError, load_value

    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise InputError(f"--chat-var {shorten_arg(item)}: expected NAME=VALUE, e.g. --chat-var "
                             f"enable_thinking=false")
        try:
            out[name.strip()] = load_value(value) if value.strip() else ""
        except YamlLimitError as exc:
            raise InputError(f"--chat-var {name.strip()}: the value is beyond the YAML limits ({exc.problem}); "
                             f"pass a plain value (true, 3, [a, b], text).") from None
        except (yaml.YAMLError, ValueError):  # not YAML (or an integer of more than 4300 digits): the text itself
            out[name.strip()] = value
    return out


def shorten_arg(text: str, limit: int = 80) -> str:
    """``repr(text)`` cut to about ``limit`` characters, for a message quoting a command-line value."""
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[: limit - 25]}... ({len(text)} characters)"


def load_model(req: TextRequest):
    from .model import LanguageModel

    model = LanguageModel(req.recipe, weights=req.weights, sets=req.sets, runtime=req.runtime,
                          max_memory=req.max_memory, compile=req.compile, context=req.context,
                          allow_nonfinite=req.allow_nonfinite)
    return model


def check_request(model, req: TextRequest) -> list[list[int]]:
    """Every prompt encoded and every setting checked before anything is compiled."""
    from .sampling import SamplingSettings

    SamplingSettings(req.temperature, req.top_k, req.top_p, req.repetition_penalty, req.seed)
    if req.max_new_tokens is not None and req.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {req.max_new_tokens}: must be >= 1")
    for text in req.stop:
        check_text(text, "--stop", InputError)
    encoded = [model.encode(p, req.chat, req.system, req.chat_vars) for p in req.prompts]
    limit = model.context or model.max_context
    for prompt, ids in zip(req.prompts, encoded):
        if len(ids) >= limit:
            shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
            raise InputError(f"prompt {shown!r} is {len(ids)} tokens long; {model.name} takes at most {limit} "
                             f"tokens of prompt and reply together, which leaves no room for a reply. Shorten it.")
    if encoded:  # said once, before any work, for the shortest prompt (the one with the most room)
        message = beyond_context(model.name, req.options()["max_new_tokens"], min(map(len, encoded)), limit,
                                 "--context" if model.context else "its generation.context")
        if message is not None:
            print(f"warning: {message.replace('max_new_tokens=', '--max-new-tokens ', 1)}", file=sys.stderr,
                  flush=True)
    return encoded


def run_text(req: TextRequest, out: IO[str] | None = None, err: IO[str] | None = None, as_json: bool = False,
             quiet: bool = False) -> list[dict]:
    """Generate a reply per prompt: streamed to ``out`` (or one JSON object per line with ``as_json``)."""
    out, err = out or sys.stdout, err or sys.stderr
    def log(message: str) -> None:
        if not quiet and not as_json:
            print(message, file=err, flush=True)

    if not req.prompts:
        raise InputError("no prompt: pass --prompt TEXT (repeatable), --prompts-file FILE, or --stdio")
    t0 = time.perf_counter()
    model = load_model(req)
    encoded = check_request(model, req)
    options = req.options()
    longest = max(len(ids) for ids in encoded)
    log(f"{model.name}: compiling and planning ({model.runtime.name} runtime)...")
    model.prepare(longest, options["max_new_tokens"])
    load_s = time.perf_counter() - t0
    results = []
    for prompt, ids in zip(req.prompts, encoded):
        stream = None if as_json else (lambda text: (out.write(text), out.flush()))
        with warnings.catch_warnings():  # said once, by check_request
            warnings.simplefilter("ignore", ContextLengthWarning)
            result = model.generate(ids, **{k: v for k, v in options.items()
                                            if k not in ("chat", "system", "chat_vars")}, on_text=stream)
        if not as_json:
            out.write("\n")
            out.flush()
        row = {"prompt": prompt, **result.summary(), "seed": req.seed, "load_s": round(load_s, 3),
               "compile_s": round(model.stats.compile_s, 3), "memory_plan": model.stats.plans}
        results.append(row)
        if as_json:
            out.write(json.dumps(row) + "\n")
            out.flush()
        else:
            tpot = row["time_per_output_token_ms"]
            log(f"[{row['generated_tokens']} tokens, {row['finish_reason']}; first token "
                f"{row['time_to_first_token_ms']:.0f} ms"
                + (f", {tpot:.1f} ms/token ({row['decode_tokens_per_s']:.1f} tokens/s)" if tpot else "") + "]")
    total = time.perf_counter() - (req.started or t0)
    log(f"done in {total:.1f} s, of which loading, compiling and planning {load_s:.1f} s")
    return results


def serve_stdio(req: TextRequest, stdin: IO[bytes] | None = None, out: IO[bytes] | None = None,
                err: IO[str] | None = None) -> int:
    """The benchmark protocol (module docstring) on binary streams (default: the process's stdin/stdout), so
    lines end at ``\\n`` only and text is UTF-8 whatever the locale. Returns the number of prompts served."""
    stdin = stdin or sys.stdin.buffer
    out = out or sys.stdout.buffer
    err = err or sys.stderr
    from .sampling import SamplingSettings

    def send(line: str) -> None:
        out.write(line.encode("utf-8") + b"\n")
        out.flush()

    SamplingSettings(req.temperature, req.top_k, req.top_p, req.repetition_penalty, req.seed)
    print("loading and compiling...", file=err, flush=True)
    model = load_model(req)
    options = req.options()
    model.prepare(1, options["max_new_tokens"])
    send("READY")
    served = 0
    sample = {k: v for k, v in options.items() if k not in ("chat", "system", "chat_vars")}
    while True:
        raw = stdin.readline()
        if not raw:
            break
        try:  # as the harness's Rust reader: a line that is not UTF-8 ends the session
            prompt = raw.rstrip(b"\n").rstrip(b"\r").decode("utf-8")
        except UnicodeDecodeError as exc:
            print(f"stdio read error: stdin is not UTF-8 ({exc})", file=err, flush=True)
            break
        if not prompt:
            continue
        start = time.perf_counter()

        def tok(token: int, text: str) -> None:
            if token not in model.eos_ids:
                send(f"TOK\t{escape(text)}")

        try:
            ids = model.encode(prompt, req.chat, req.system, req.chat_vars)
            n = len(model.generate(ids, on_token=tok, **sample).ids)
        except NonFiniteError:  # NaN logits: the model (its weights or config) is broken, not the prompt
            raise
        except LuminalError as exc:  # one bad prompt (too long...) ends that query, not the server
            print(f"error: {exc}", file=err, flush=True)
            n = 0
        send(f"EOQ\t{n}\t{(time.perf_counter() - start) * 1e3:.3f}")
        served += 1
    return served


def run_command(req: TextRequest, stdio: bool, as_json: bool, quiet: bool) -> None:
    if stdio:
        if req.prompts:
            raise InputError("--stdio reads the prompts from stdin; drop --prompt/--prompts-file")
        if as_json:
            raise InputError("--stdio prints its own protocol; drop --json")
        serve_stdio(req)
        return
    run_text(req, as_json=as_json, quiet=quiet)


def refuse(flags: Mapping[str, Any], kind: str) -> None:
    """Flags given that this kind of recipe does not take."""
    given = [name for name, value in flags.items() if value not in (None, False, [], ())]
    if given:
        raise InputError(f"{', '.join(given)}: not an option for {kind}")
