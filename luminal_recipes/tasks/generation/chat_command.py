"""The ``luminal-recipe chat`` command (registered in cli.py): its options, and the conversation it runs
(``chat.chat_loop``)."""

from __future__ import annotations

from pathlib import Path

import typer

THREADS_HELP = ("threads for every CPU pool: our kernels' parts, BLAS, OpenMP, numba (default: every core; "
                "LUMINAL_RECIPES_THREADS)")


def chat(
    recipe: Path = typer.Argument(..., help="a language-model recipe (recipes/llama.yaml)"),
    weights: str | None = typer.Option(None, help="checkpoint folder or hf://org/repo[@rev][/subfolder] "
                                       "(overrides the recipe's source)"),
    system: str | None = typer.Option(None, help="a system message before the conversation"),
    max_new_tokens: int | None = typer.Option(None, help="the longest reply in tokens (default: $GEN_TOKENS, else "
                                              "256)"),
    temperature: float = typer.Option(0.0, help="sampling temperature (0 = greedy, the default)"),
    top_k: int = typer.Option(0, help="sample among the k most likely tokens (0 = off)"),
    top_p: float = typer.Option(1.0, help="nucleus sampling, in (0, 1] (1 = off)"),
    repetition_penalty: float = typer.Option(1.0, help="penalise tokens already seen (> 0; 1 = off)"),
    seed: int = typer.Option(0, help="seed of the sampling (turn k uses seed + k)"),
    stop: list[str] = typer.Option([], "--stop", help="end a reply at this text (repeatable)"),
    chat_var: list[str] = typer.Option([], "--chat-var", help="a variable the chat template reads, NAME=VALUE "
                                       "(e.g. enable_thinking=false; repeatable)"),
    context: int | None = typer.Option(None, help="tokens of conversation and reply the KV cache holds (default: "
                                       "the model's context); older turns are dropped to fit"),
    set_: list[str] = typer.Option([], "--set", help="override a recipe parameter: --set name=value (repeatable)"),
    max_memory: str | None = typer.Option(None, help="memory budget, e.g. 8GiB (default: what the process may use)"),
    runtime: str = typer.Option("numpy", "--runtime", help="the runtime (device): numpy, cuda or cuda-emu"),
    no_compile: bool = typer.Option(False, "--no-compile", help="run the naive primitive program (no search)"),
    threads: int | None = typer.Option(None, "--threads", help=THREADS_HELP),
) -> None:
    """Talk with a language model: each line on stdin is your turn, the reply streams back. The conversation goes
    through the checkpoint's chat template and is kept within the context (the oldest turns are dropped, and you
    are told). /reset forgets it, /exit (or Ctrl-D) ends it."""
    if threads is not None:
        from ...threads import set_threads

        set_threads(threads)
    from ...errors import InputError
    from ...pipeline.generate import parse_size
    from ...text.check import check_text
    from .chat import ChatOptions, chat_loop
    from .cli import default_max_new_tokens, parse_chat_vars
    from .model import LanguageModel
    from .sampling import SamplingSettings

    SamplingSettings(temperature, top_k, top_p, repetition_penalty, seed)  # checked before anything loads
    for text in stop:
        check_text(text, "--stop", InputError)
    if max_new_tokens is not None and max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    options = ChatOptions(max_new_tokens or default_max_new_tokens(), temperature, top_k, top_p, repetition_penalty,
                          seed, list(stop))
    model = LanguageModel(recipe, weights=weights, sets=list(set_), runtime=runtime, max_memory=parse_size(max_memory),
                          compile=not no_compile, context=context)
    try:
        typer.echo(f"{model.name}: loading and compiling ({model.runtime.name} runtime)...", err=True)
        model.prepare(1, options.max_new_tokens)
        chat_loop(model, options, system, parse_chat_vars(chat_var))
    finally:
        model.release()
