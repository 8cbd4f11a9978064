"""The ``luminal-recipe`` command line.

User errors (``LuminalError``) print one paragraph and exit with code 2, never a traceback.
"""

from __future__ import annotations

import time


def _process_started() -> float:
    """The ``perf_counter`` value when this command's program started: now less the CPU time the process has used
    so far (the interpreter's start-up and imports, which are CPU-bound), never before the process's start in
    /proc (Linux). The process's start alone would count what it did before it ``exec``ed this program: `bash -c
    'sleep 6 && exec luminal-recipe run ...'` has the shell's pid, and its start, but the sleep used no CPU time."""
    now = time.perf_counter()
    cpu = time.process_time()
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / __import__("os").sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        age = cpu
    # imported long after the start: a process that runs commands later (counted from the command's start then)
    return now - min(cpu, max(age, 0.0)) if cpu < 30.0 else now


_IMPORTED_AT = _process_started()  # before typer and the rest load: `run` reports the whole command's time

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial, wraps  # noqa: E402
from pathlib import Path  # noqa: E402

import typer  # noqa: E402

from . import __version__, memory_limits  # noqa: E402  (memory_limits: the out-of-memory message)
from .errors import LuminalError  # noqa: E402
from .tasks.generation.chat_command import THREADS_HELP  # noqa: E402
from .tasks.generation.chat_command import chat as chat_command  # noqa: E402

_started_at: float | None = None  # set by `entry` (the console script): the process started this command

app = typer.Typer(
    name="luminal-recipe",
    help="Run generative models described by YAML recipes (graph builder, egglog search compiler, numpy/CuPy).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # help texts are plain text: "hf://org/repo[@rev][/subfolder]" must not be parsed as rich markup tags
    rich_markup_mode=None,
)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a closed terminal), raised where the program is (as Ctrl-C raises
    ``KeyboardInterrupt``), so that every cleanup an interruption runs (temporary files of outputs and plan-cache
    entries removed) runs for it too."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # as a shell reports a process ended by that signal: 143 for SIGTERM, 129 SIGHUP


TERMINATED_EXIT = 128 + signal.SIGTERM  # 143
INTERRUPTED_EXIT = 128 + signal.SIGINT  # 130
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def _on_terminate(signum, frame) -> None:
    # a second signal during the cleanup ends the process at once (the default action)
    for each in TERMINATING:
        signal.signal(each, signal.SIG_DFL)
    raise Terminated(signum)


def handle_sigterm() -> dict:
    """Make SIGTERM and SIGHUP raise ``Terminated`` in the main thread (like Ctrl-C); returns the handlers it
    replaced, for ``restore_signals`` once the command is over."""
    return {each: signal.signal(each, _on_terminate) for each in TERMINATING}


def restore_signals(previous: dict) -> None:
    for each, handler in previous.items():
        signal.signal(each, handler if handler is not None else signal.SIG_DFL)


def user_errors(fn: Callable) -> Callable:
    """Turn LuminalError into a clean message and exit code 2; Ctrl-C into exit code 130, SIGTERM 143, SIGHUP 129."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LuminalError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        except Terminated as exc:
            typer.echo("terminated", err=True)
            raise typer.Exit(exc.exit_code) from None
        except (MemoryError, OSError) as exc:  # an allocation failed: one paragraph, as for a user error
            if not memory_limits.is_out_of_memory(exc):
                raise
            typer.echo(f"error: {memory_limits.out_of_memory(exc)}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(INTERRUPTED_EXIT) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"luminal-recipes {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """luminal-recipes: a model is a YAML recipe."""


WEIGHTS_HELP = "checkpoint folder or hf://org/repo[@rev][/subfolder] (overrides the recipe's source)"
SET_HELP = "override a recipe parameter: --set name=value (repeatable)"
PROMPTS_FILE_LIMIT = 16 << 20  # one prompt per line; more than this is not a prompts file
RUNTIME_HELP = ("the runtime (device) to run on: numpy (CPU), cuda (an NVIDIA GPU through CuPy) or cuda-emu (the "
                "CUDA kernels emulated on the CPU, for tests); the memory budget is that device's memory")
HOST_MEMORY_HELP = ("pinned host memory for staging streamed weights on a GPU runtime, e.g. 2GiB (default 512MiB; "
                    "the block being uploaded and the next one)")
COMPUTE_DTYPE_HELP = ("the dtype every model computes in: f32, bf16 or f16 (default: each recipe's "
                      "weights.dtype.compute, f32 for the shipped recipes; bf16 runs tensor-core GEMMs on a GPU)")
IMAGE_HELP = "a reference image to edit or draw from (repeatable, for the pipeline's `images` input)"
LORA_HELP = ("a LoRA .safetensors to apply, PATH or PATH:SCALE (repeatable); diffusers/PEFT, fal/ai-toolkit and "
             "ComfyUI/kohya key formats")


@app.command()
@user_errors
def run(
    recipe: Path | None = typer.Argument(None, help="a pipeline recipe (recipes/flux2.yaml) or a language model "
                                         "(recipes/llama.yaml); omitted: the shipped recipe that accepts --weights "
                                         "(model_index.json, config.json or a GGUF file's architecture)"),
    prompt: list[str] = typer.Option([], "--prompt", "-p", help="text prompt (repeatable: one output each)"),
    prompts_file: Path | None = typer.Option(None, help="a file with one prompt per line"),
    seed: str | None = typer.Option(None, help="seed of the initial noise (language models: of the sampling), a "
                                    "whole number or `random`; default: drawn at random (printed and stored in "
                                    "the output), or $LUMINAL_RECIPES_SEED when set (0: the old default)"),
    num_images: int = typer.Option(1, "--num-images", "-n", min=1, help="images per prompt, with the seeds seed, "
                                   "seed+1, ... (as a ComfyUI batch)"),
    steps: int | None = typer.Option(None, help="denoising steps"),
    guidance: float | None = typer.Option(None, help="guidance scale"),
    width: int | None = typer.Option(None, help="image width (multiple of 16)"),
    height: int | None = typer.Option(None, help="image height (multiple of 16)"),
    init_latents: Path | None = typer.Option(None, help="start latents .npy, shape (1, 128, H/16, W/16)"),
    image: list[Path] = typer.Option([], "--image", help=IMAGE_HELP),
    lora: list[str] = typer.Option([], "--lora", help=LORA_HELP),
    output: Path | None = typer.Option(
        None,
        "--output",
        "-o",
        help="file to write (.png for an image output, .npy for an array, .txt for text); default: a new file "
        "outputs/<recipe>-<seed>-<slug>_00001_.png, numbered past any existing one",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --output file"),
    weights: str | None = typer.Option(None, help=WEIGHTS_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    max_memory: str | None = typer.Option(
        None,
        help="memory budget, e.g. 24GiB (default: what the process may use: physical memory, the container's limit or "
        "ulimit -v, whichever leaves least)",
    ),
    no_compile: bool = typer.Option(False, "--no-compile", help="run the naive primitive program (no search)"),
    allow_nonfinite: bool = typer.Option(
        False, "--allow-nonfinite", help="write the outputs even when a stage output holds NaN or infinity (language "
        "models: generate even when the logits do)"
    ),
    runtime: str = typer.Option("numpy", "--runtime", help=RUNTIME_HELP),
    max_host_memory: str | None = typer.Option(None, "--max-host-memory", help=HOST_MEMORY_HELP),
    compute_dtype: str | None = typer.Option(None, "--compute-dtype", help=COMPUTE_DTYPE_HELP),
    profile: bool = typer.Option(False, "--profile", help="time every kernel call and print the time per model "
                                 "and kernel class (MatMul, Elementwise, Attention...) at the end; with "
                                 "LUMINAL_RECIPES_PROFILE_TOP=N also the N costliest kernel instances"),
    as_json: bool = typer.Option(False, "--json", help="print a machine-readable summary (language models: one "
                                 "JSON object per prompt, one per line)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print only text outputs (no progress, no summary)"),
    max_new_tokens: int | None = typer.Option(
        None, help="language models: the longest reply in tokens (default: $GEN_TOKENS, else 256)"),
    temperature: float | None = typer.Option(None, help="language models: sampling temperature (0 = greedy, the "
                                             "default)"),
    top_k: int | None = typer.Option(None, help="language models: sample among the k most likely tokens (0 = off)"),
    top_p: float | None = typer.Option(None, help="language models: nucleus sampling, in (0, 1] (1 = off)"),
    repetition_penalty: float | None = typer.Option(None, help="language models: penalise tokens already seen "
                                                    "(> 0; 1 = off)"),
    chat: bool | None = typer.Option(None, "--chat/--no-chat", help="language models: apply the checkpoint's chat "
                                     "template (the default when it has one); --no-chat encodes the prompt as "
                                     "tokenizer(prompt) does, special tokens included"),
    system: str | None = typer.Option(None, help="language models: a system message before the prompt (chat)"),
    chat_var: list[str] = typer.Option([], "--chat-var", help="language models: a variable the chat template reads, "
                                       "NAME=VALUE (e.g. enable_thinking=false; repeatable)"),
    stop: list[str] = typer.Option([], "--stop", help="language models: end the reply at this text (repeatable)"),
    context: int | None = typer.Option(None, help="language models: plan the KV cache for this many tokens (prompt "
                                       "+ reply; default: what the prompts need)"),
    stdio: bool = typer.Option(False, "--stdio", help="language models: serve the benchmark protocol on stdin/"
                               "stdout (READY, then TOK lines and EOQ per prompt line)"),
    threads: int | None = typer.Option(None, "--threads", help=THREADS_HELP),
) -> None:
    """Run a recipe: a pipeline writes its outputs (images as PNG, arrays as .npy, text as .txt) for each prompt;
    a language model (a model recipe with `generation:`) streams its reply to each prompt."""
    started = _started_at if _started_at is not None else time.perf_counter()
    given = dict(locals())  # the arguments as parsed (the outputs record the command)
    if threads is not None:  # before the runtimes load: every pool starts at this size
        from .threads import set_threads

        set_threads(threads)
    from .errors import PipelineError
    from .pipeline.seeds import parse_seed

    if recipe is None:
        if weights is None:
            raise PipelineError("no recipe: name one (luminal-recipe run RECIPE ...) or pass --weights DIR|hf://"
                                "org/repo|FILE.gguf to run the shipped recipe that accepts that checkpoint")
        from .recipe.choose import choose_recipe

        recipe = choose_recipe(weights)
        if not quiet and not as_json and not stdio:
            typer.echo(f"recipe: {recipe} (chosen for --weights {weights})", err=True)
    from .files import read_regular_text
    from .pipeline.generate import GenerateRequest, generate, parse_size
    from .pipeline.progress import progress_printer

    prompts = list(prompt)
    if prompts_file is not None:
        try:
            text = read_regular_text(prompts_file, "--prompts-file", PROMPTS_FILE_LIMIT, PipelineError)
        except OSError as exc:
            raise PipelineError(f"--prompts-file {prompts_file}: {exc.strerror or exc}") from None
        prompts += [line.strip() for line in text.splitlines() if line.strip()]
    text_flags = {"--max-new-tokens": max_new_tokens, "--temperature": temperature, "--top-k": top_k,
                  "--top-p": top_p, "--repetition-penalty": repetition_penalty, "--chat/--no-chat": chat,
                  "--system": system, "--chat-var": chat_var, "--stop": stop, "--context": context, "--stdio": stdio}
    if _is_language_model(recipe):
        from .tasks.generation.cli import TextRequest, parse_chat_vars, refuse, run_command

        refuse({"--num-images": num_images if num_images != 1 else None, "--steps": steps, "--guidance": guidance,
                "--width": width, "--height": height, "--init-latents": init_latents, "--image": image, "--lora": lora,
                "--output": output,
                "--overwrite": overwrite, "--compute-dtype": compute_dtype, "--max-host-memory": max_host_memory},
               "a language model (they belong to pipelines)")  # given and ignored, they would change nothing
        from contextlib import nullcontext

        from .runtimes.profile import profiling

        with profiling() if profile else nullcontext() as kernel_times:
            run_command(TextRequest(
                recipe, prompts, weights, list(set_), parse_size(max_memory), runtime, not no_compile,
                max_new_tokens, 0.0 if temperature is None else temperature, top_k or 0,
                1.0 if top_p is None else top_p, 1.0 if repetition_penalty is None else repetition_penalty,
                _text_seed(seed, temperature, quiet or as_json or stdio), list(stop), chat, system,
                parse_chat_vars(chat_var), context, started, allow_nonfinite),
                stdio, as_json, quiet)
        if kernel_times is not None:  # stdout carries the reply (and the --stdio protocol): the table goes to stderr
            typer.echo("kernel time per model and kernel class (--profile):\n" + kernel_times.table(), err=True)
        return
    from .tasks.generation.cli import refuse

    refuse(text_flags, f"{recipe}, which is not a language model (text generation runs a model recipe with a "
                       f"`generation:` section)")
    req = GenerateRequest(
        recipe,
        prompts,
        params={"steps": steps, "guidance": guidance, "width": width, "height": height,
                "seed": None if seed is None else parse_seed(seed)},
        num_images=num_images,
        random_default_seed=True,
        command=_command(run, given),
        files={"init_latents": init_latents, "images": list(image) or None},
        loras=list(lora),
        output=output,
        weights=weights,
        sets=list(set_),
        max_memory=parse_size(max_memory),
        compile=not no_compile,
        overwrite=overwrite,
        started=started,
        allow_nonfinite=allow_nonfinite,
        runtime=runtime,
        max_host_memory=parse_size(max_host_memory, "--max-host-memory"),
        compute_dtype=compute_dtype,
        profile=profile,
    )
    with progress_printer(enabled=not quiet and not as_json) as progress:
        summary = generate(req, progress)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    for item in summary["runs"]:
        for out in item["outputs"].values():
            if out["type"] == "text":  # the result itself: printed even with --quiet
                typer.echo(out["text"])
        if not quiet:
            paths = ", ".join(out["path"] for out in item["outputs"].values())
            seed_note = f"seed {item['seed']}, " if item.get("seed") is not None else ""
            typer.echo(f"wrote {paths} ({seed_note}{item['seconds']:.1f} s)")
    if not quiet:
        timing = summary["timing"]
        typer.echo(f"done in {timing['total_seconds']:.1f} s, of which compiling and planning "
                   f"{timing['compile_seconds']:.1f} s ({100 * timing['compile_share']:.0f}%) and loading models "
                   f"{timing['load_seconds']:.1f} s")
    if profile and not quiet:
        from .runtimes.profile import KernelProfile

        typer.echo("kernel time per model and kernel class (--profile):\n"
                   + KernelProfile.from_json(summary["profile"], summary.get("profile_instances")).table())


def _command(fn: Callable, given: dict) -> str:
    """The command (for the outputs' provenance) as parsed: ``luminal-recipe <command>``, its arguments and every
    option given a value other than its default, each under its first name (``given``: the command function's
    arguments)."""
    import inspect
    import shlex

    from typer.models import ArgumentInfo, OptionInfo

    words = ["luminal-recipe", fn.__name__]
    for name, param in inspect.signature(fn).parameters.items():
        info, value = param.default, given.get(name)
        if isinstance(info, ArgumentInfo):
            words += [str(value)] if value is not None else []
            continue
        if not isinstance(info, OptionInfo) or value is None or value == info.default or value in ([], ()):
            continue
        decls = [d for d in (info.param_decls or ()) if d.startswith("--")]
        flag_name = decls[0].split("/")[0] if decls else "--" + name.rstrip("_").replace("_", "-")
        if isinstance(value, bool):
            negative = decls[0].split("/")[1] if decls and "/" in decls[0] else None
            words.append(flag_name if value else negative or flag_name)
            continue
        for item in value if isinstance(value, list) else [value]:
            words += [flag_name, str(item)]
    return shlex.join(words)


def _text_seed(seed: str | None, temperature: float | None, quiet: bool) -> int:
    """The sampling seed of a language model: as for images (``pipeline/seeds.py``); a drawn one is printed (on
    stderr) when it matters, i.e. when sampling (--temperature above 0)."""
    from .pipeline.seeds import parse_seed

    value = parse_seed(seed)
    if seed is None and temperature and not quiet:
        typer.echo(f"sampling seed {value} (pass --seed {value} to repeat this reply)", err=True)
    return value


def _is_language_model(recipe: Path) -> bool:
    """A model recipe runs as a language model (it is refused, located, when it lacks `generation:`)."""
    from .recipe.loader import load_recipe
    from .recipe.schema import ModelRecipe

    loaded = load_recipe(recipe)
    if isinstance(loaded.doc, ModelRecipe):
        from .tasks.generation.contract import check_static

        check_static(loaded)
        return True
    return False


app.command("chat")(user_errors(chat_command))


@app.command()
@user_errors
def validate(
    recipe: Path = typer.Argument(..., help="a model or pipeline recipe, or a `kind: modules` library"),
    weights: str | None = typer.Option(None, help=WEIGHTS_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="also list config.json fields: required values met, and unknown fields"
    ),
    draft_config: str | None = typer.Option(
        None, "--draft-config", help="print a `config:` section for this model recipe drafted from a transformers "
        "config class (Phi3Config, or a model_type such as phi3) instead of validating"),
) -> None:
    """Check a recipe (schema, expressions, forwards) and its checkpoint: the recipe's own when it is a local
    folder, or --weights (a Hub checkpoint is only downloaded and checked when passed as --weights)."""
    from .pipeline.plugins import check_steps_known
    from .recipe import validate as validate_recipe
    from .recipe.commands import ALL_KINDS
    from .recipe.loader import load_recipe

    if draft_config is not None:
        from .errors import InputError
        from .recipe.draft_config import draft_config as draft

        loaded = load_recipe(recipe, allowed=ALL_KINDS)
        if loaded.kind != "model":
            raise InputError(f"--draft-config drafts a model recipe's `config:` section; {recipe} is a "
                             f"{loaded.kind} recipe")
        typer.echo(draft(loaded, draft_config), nl=False)
        return
    loaded = load_recipe(recipe, allowed=ALL_KINDS)
    if loaded.kind == "pipeline":
        check_steps_known(loaded)  # every `run:` names a step of a task plug-in (the recipe layer knows none)
    typer.echo(validate_recipe(recipe, weights, set_).render(verbose))


@app.command()
@user_errors
def inspect(
    recipe: Path = typer.Argument(..., help="a model or pipeline recipe, or a `kind: modules` library"),
    weights: str | None = typer.Option(None, help=WEIGHTS_HELP),
    config: Path | None = typer.Option(None, help="a config.json giving sizes without weights"),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    max_memory: str | None = typer.Option(
        None, help="plan pipeline stages under this budget, e.g. 24GiB (default: unbounded, every weight resident)"
    ),
    runtime: str = typer.Option("numpy", "--runtime", help=RUNTIME_HELP),
    device: str | None = typer.Option(
        None, "--device", help="plan for this GPU when none is here (--runtime cuda): h200 (default), h100, b200, "
        "a100, l40s, rtx4090"),
    max_host_memory: str | None = typer.Option(None, "--max-host-memory", help=HOST_MEMORY_HELP),
    compute_dtype: str | None = typer.Option(None, "--compute-dtype", help=COMPUTE_DTYPE_HELP),
    image: list[Path] = typer.Option([], "--image", help=IMAGE_HELP + "; parameters and plans follow from it"),
) -> None:
    """Resolved parameters, modules, weight bytes by dtype, graph sizes (and memory plans for pipelines)."""
    from .pipeline.generate import derived_sets, parse_size
    from .pipeline.memory_report import inspect_memory
    from .recipe import inspect as inspect_recipe

    sets = derived_sets(recipe, weights, list(set_), {"images": list(image)}) if image else list(set_)
    typer.echo(inspect_recipe(recipe, weights, sets, config, parse_size(max_memory),
                              memory_plan=partial(inspect_memory, runtime=runtime, device=device,
                                                  max_host_memory=parse_size(max_host_memory, "--max-host-memory"),
                                                  compute_dtype=compute_dtype)))


@app.command()
@user_errors
def schema() -> None:
    """Print the recipe JSON Schema (for editors): luminal-recipe schema > recipe.schema.json"""
    from .recipe import json_schema

    typer.echo(json.dumps(json_schema(), indent=2))


@app.command()
@user_errors
def quantize(
    src: Path = typer.Argument(..., help="checkpoint folder (bf16/f32 safetensors)"),
    dst: Path = typer.Argument(..., help="output folder (must not exist)"),
    format: str = typer.Option(..., "--format", help="nvfp4 or fp8"),
    layout: str = typer.Option("modelopt", help="nvfp4 layout: modelopt or comfy"),
    exclude: list[str] = typer.Option([], help="glob of module names kept in full precision (repeatable)"),
    fp8_scale: str = typer.Option("per_tensor", help="fp8 scale granularity: per_tensor or per_channel"),
) -> None:
    """Convert a checkpoint to NVFP4 (ModelOpt or ComfyUI layout) or FP8, writing hf_quant_config.json."""
    from .weights.quantize import quantize_checkpoint

    typer.echo(str(quantize_checkpoint(src, dst, format, layout, exclude, fp8_scale)))


golden_app = typer.Typer(help="Golden checks: regenerate images and replies and compare with what was recorded.",
                         no_args_is_help=True, rich_markup_mode=None)
app.add_typer(golden_app, name="golden")
GOLDEN_MANIFEST = Path("tests/golden/goldens.yaml")
TEXT_MANIFEST = Path("tests/golden/texts.yaml")
MANIFEST_HELP = ("a golden manifest: images (goldens.yaml) or replies of language models (texts.yaml); default: "
                 f"{GOLDEN_MANIFEST} and {TEXT_MANIFEST}")


from .serving.command import serve as _serve  # noqa: E402  (the command's code: luminal_recipes/serving/)

app.command(name="serve")(user_errors(_serve))


def _manifests(manifest: Path | None) -> list[Path]:
    return [manifest] if manifest is not None else [GOLDEN_MANIFEST, TEXT_MANIFEST]


@golden_app.command("check")
@user_errors
def golden_check(
    manifest: Path | None = typer.Argument(None, help=MANIFEST_HELP),
    min_psnr: float = typer.Option(45.0, help="minimum PSNR in dB against each golden image"),
    weights: str | None = typer.Option(None, help=WEIGHTS_HELP + "; images only"),
) -> None:
    """Regenerate every golden image (a failing one gets a .diff.png beside it) and every golden reply (token ids
    exact on tiny checkpoints, concept groups on real ones; skipped when the weights are not here); exit 1 on a
    failure."""
    from .pipeline.golden import check
    from .tasks.generation import golden as text_golden

    failed = False
    for path in _manifests(manifest):
        if text_golden.is_text_manifest(path):
            for t in text_golden.check(path):
                typer.echo(f"{t.status:<4} {t.case.name}: {t.message}")
                failed |= not t.ok
            continue
        for r in check(path, min_psnr, weights):
            typer.echo(f"{'ok  ' if r.ok else 'FAIL'} {r.case.file}: {r.message}")
            failed |= not r.ok
    if failed:
        raise typer.Exit(1)


@golden_app.command("update")
@user_errors
def golden_update(
    manifest: Path | None = typer.Argument(None, help=MANIFEST_HELP),
    weights: str | None = typer.Option(None, help=WEIGHTS_HELP + "; images only"),
) -> None:
    """Rewrite the golden images and recorded token ids from the current code (review the change before
    committing it)."""
    from .pipeline.golden import update
    from .tasks.generation import golden as text_golden

    for path in _manifests(manifest):
        written = text_golden.update(path) if text_golden.is_text_manifest(path) else update(path, weights)
        for out in written:
            typer.echo(f"wrote {out}")


cache_app = typer.Typer(
    help="The plan cache: compiled programs kept on disk so a second run skips the search.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(cache_app, name="cache")


@cache_app.command("info")
@user_errors
def cache_info() -> None:
    """Where the plan cache is ($LUMINAL_RECIPES_CACHE, else $XDG_CACHE_HOME/luminal-recipes, else
    ~/.cache/luminal-recipes), how many entries it holds and their size."""
    from .compiler import cache

    folder = cache.cache_dir()
    found = cache.entries(folder)
    size = sum(p.stat().st_size for p in found)
    typer.echo(f"plan cache: {folder} ({cache.cache_dir_source()})")
    if not folder.exists():
        typer.echo("  (the folder does not exist yet: nothing compiled here so far)")
    typer.echo(f"  {len(found)} entries, {_human_bytes(size)} ({size} bytes)")
    typer.echo(f"  entries are signed with the key in {cache.key_path()} (only entries signed with it are used)")


@cache_app.command("clear")
@user_errors
def cache_clear() -> None:
    """Remove the plan cache's entries (only files it recognises as its own); the next run compiles again."""
    from .compiler import cache

    folder = cache.cache_dir()
    removed, freed = cache.clear(folder)
    others = sum(1 for p in folder.iterdir()) if folder.is_dir() else 0
    typer.echo(f"removed {removed} files ({_human_bytes(freed)}) from {folder}"
               + (f"; {others} other files there left alone" if others else ""))


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def entry() -> None:
    """The console script (and ``python -m luminal_recipes``): times commands from the program's start, and ends
    the process as soon as the command is done: the interpreter's teardown (freeing every module, the e-graph,
    numba's LLVM) took 0.4-2.5 s after the printed total, so the printed time would not be the whole time. Every
    output is written (atomically) before the command returns; the standard streams are flushed here."""
    global _started_at
    _started_at = _IMPORTED_AT
    previous = handle_sigterm()  # SIGTERM and SIGHUP clean up like Ctrl-C: no temporary file left behind
    try:
        app(prog_name="luminal-recipe")
        code = 0
    except SystemExit as exc:
        code = exc.code
    except Terminated as exc:  # outside a command (while the arguments are parsed)
        code = exc.exit_code
    except KeyboardInterrupt:
        code = INTERRUPTED_EXIT
    finally:
        restore_signals(previous)
    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
