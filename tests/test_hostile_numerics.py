"""Hostile numerics (issue 21): non-finite weights or config values, out-of-range config values, a token id beyond
the vocabulary, and running out of process memory. Each is refused with exit 2 and one located paragraph (or,
for memory, a budget that respects the process's own limits), never a traceback, a SIGABRT or garbage text with
exit 0.

The fixtures are copies of the tiny Llama in tests/golden/checkpoints, poisoned inside the test.
"""

from __future__ import annotations

import io
import json
import math
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_checks import new_workdir, refused  # tests/cli_checks.py
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.errors import NonFiniteError, RecipeError
from luminal_recipes.recipe.builder import BuiltModel

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "recipes" / "llama.yaml"
TINY_LLAMA = ROOT / "tests" / "golden" / "checkpoints" / "llama-tiny"
FAST = ["--no-compile", "--max-new-tokens", "3", "--no-chat", "--quiet"]


@pytest.fixture(autouse=True)
def workdir(tmp_path, monkeypatch):
    return new_workdir(tmp_path, monkeypatch)


def checkpoint(tmp_path: Path, weights: dict | None = None, config: dict | None = None) -> Path:
    """A copy of the tiny Llama with ``weights`` (name -> function of the array, in place) and ``config`` (key ->
    value; a dotted key goes into a nested object) changed."""
    folder = tmp_path / "llama-tiny"
    shutil.copytree(TINY_LLAMA, folder)
    if weights:
        tensors = load_file(folder / "model.safetensors")
        for name, poison in weights.items():
            tensors[name] = np.ascontiguousarray(tensors[name].copy())
            poison(tensors[name])
        save_file(tensors, folder / "model.safetensors")
    if config:
        data = json.loads((folder / "config.json").read_text())
        for key, value in config.items():
            *parents, last = key.split(".")
            node = data
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        (folder / "config.json").write_text(json.dumps(data))  # NaN and Infinity as Python's json writes them
    return folder


def run(*args: object):
    return CliRunner().invoke(app, ["run", str(LLAMA), *map(str, args)])


def fill(value: float):
    def poison(array: np.ndarray) -> None:
        array[...] = value
    return poison


# ---- class 4: non-finite logits stop generation ----------------------------------------------------------------
@pytest.mark.parametrize("tensor,value", [("lm_head.weight", math.nan), ("model.embed_tokens.weight", math.inf)])
def test_nonfinite_weights_stop_generation_naming_the_tensor(tmp_path, tensor, value):
    folder = checkpoint(tmp_path, weights={tensor: fill(value)})
    message = refused(run("--weights", folder, "-p", "hello", *FAST),
                      "llama", str(folder), "prefill", "NaN", tensor, "--allow-nonfinite")
    assert "\n" not in message.strip()
    allowed = run("--weights", folder, "-p", "hello", *FAST, "--allow-nonfinite")
    assert allowed.exit_code == 0, allowed.output


def test_overflow_with_finite_weights_points_at_the_parameters(tmp_path):
    folder = checkpoint(tmp_path, weights={"model.layers.1.mlp.down_proj.weight": fill(1e38)})
    refused(run("--weights", folder, "-p", "hello", *FAST), "weights are finite", "config.json")


def test_a_decode_step_with_nonfinite_logits_stops_python_api_too(tmp_path):
    from luminal_recipes import load_recipe

    clean = load_recipe(LLAMA, weights=TINY_LLAMA, compile=False)
    prompt = [5, 6, 7]
    first = clean.generate(prompt, max_new_tokens=1).ids[0]
    clean.release()

    def poison_row(array: np.ndarray) -> None:  # only the token the reply starts with: the prefill stays finite
        array[first] = np.nan

    folder = checkpoint(tmp_path, weights={"model.embed_tokens.weight": poison_row})
    lm = load_recipe(LLAMA, weights=folder, compile=False)
    with pytest.raises(NonFiniteError, match=f"decode step 1 .*after token {first}.*model.embed_tokens.weight"):
        lm.generate(prompt, max_new_tokens=3)
    lm.release()
    lenient = load_recipe(LLAMA, weights=folder, compile=False, allow_nonfinite=True)
    assert len(lenient.generate(prompt, max_new_tokens=3).ids) == 3
    lenient.release()


def test_stdio_stops_at_nonfinite_logits(tmp_path):
    from luminal_recipes.tasks.generation.cli import TextRequest, serve_stdio

    folder = checkpoint(tmp_path, weights={"lm_head.weight": fill(math.nan)})
    out = io.BytesIO()
    req = TextRequest(LLAMA, weights=str(folder), compile=False, max_new_tokens=3, chat=False)
    with pytest.raises(NonFiniteError, match="lm_head.weight"):
        serve_stdio(req, stdin=io.BytesIO(b"hello\nworld\n"), out=out, err=io.StringIO())
    assert out.getvalue() == b"READY\n"  # no TOK of garbage


# ---- class 4: config values are finite and within their declared ranges -------------------------------------
@pytest.fixture
def no_weights(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a weight was read before the config was checked")

    monkeypatch.setattr(BuiltModel, "load_weight", never)


@pytest.mark.parametrize("key,value,words", [
    ("rms_norm_eps", -1.0, ("parameter 'eps' is out of range", "not greater than 0", "decoder.yaml:")),
    ("rms_norm_eps", 0.0, ("parameter 'eps' is out of range", "decoder.yaml:")),
    # NaN and Infinity are not JSON: the bounded JSON reader refuses them at their line and column, naming the key
    ("rms_norm_eps", math.nan, ('"rms_norm_eps": NaN is not a number JSON allows', "config.json:1:")),
    ("rms_norm_eps", math.inf, ('"rms_norm_eps": Infinity is not a number JSON allows', "config.json:1:")),
    ("num_attention_heads", 0, ("parameter 'heads' is out of range", "below its minimum 1")),
    ("num_key_value_heads", 8, ("parameter 'kv_heads' is out of range", "above its maximum 4")),
    ("rope_parameters.rope_theta", -10.0, ("parameter 'rope_theta' is out of range",)),
    ("vocab_size", 0, ("parameter 'vocab' is out of range", "causal_lm.yaml:")),
])
def test_config_values_out_of_range_are_refused_before_any_weight_is_read(tmp_path, no_weights, key, value, words):
    folder = checkpoint(tmp_path, config={key: value})
    at_recipe_line = () if "JSON" in words[0] else ("llama.yaml:",)  # a value JSON itself refuses has no parameter
    message = refused(run("--weights", folder, "-p", "hello", *FAST), *words, str(folder / "config.json"),
                      *at_recipe_line)
    assert "KeyError" not in message


def test_set_values_meet_the_library_ranges_too(no_weights):
    refused(run("--weights", TINY_LLAMA, "-p", "hello", *FAST, "--set", "eps=-1"), "--set eps=-1",
            "not greater than 0", "decoder.yaml:")


MODEL = """\
kind: model
name: m
params:
  scale: {default: "${config.scale}"%s}
  size: 4
include: [lib.yaml]
dims: [n]
inputs:
  x: {shape: [n], dtype: f32}
outputs: [y]
root: top
modules:
  top:
    inputs: [x]
    forward: return x * scale
"""

LIB = """\
kind: modules
params:
  size: {type: int, min: 1, max: 3, doc: a declared size}
modules: {}
"""


def resolve(tmp_path: Path, config: dict, extra: str = "", sets=()) -> dict:
    from luminal_recipes.recipe.builder import resolve_params
    from luminal_recipes.recipe.loader import load_recipe

    (tmp_path / "lib.yaml").write_text(LIB)
    (tmp_path / "m.yaml").write_text(MODEL % extra)
    return resolve_params(load_recipe(tmp_path / "m.yaml"), config, sets).values


def test_library_declarations_and_finiteness_hold_for_any_recipe(tmp_path):
    with pytest.raises(RecipeError, match=r"parameter 'size' is out of range: 4 is above its maximum 3, declared at "
                                          r".*lib.yaml:3:"):
        resolve(tmp_path, {"scale": 2.0})
    assert resolve(tmp_path, {"scale": 2.0}, sets=["size=2"])["size"] == 2
    with pytest.raises(RecipeError, match=r"m.yaml:4:.*parameter 'scale' is nan .*read from config.json"):
        resolve(tmp_path, {"scale": math.nan}, sets=["size=2"])
    assert math.isnan(resolve(tmp_path, {"scale": math.nan}, ", finite: false", sets=["size=2"])["scale"])
    with pytest.raises(RecipeError, match="parameter 'scale' is out of range: -1.0 .* is not greater than 0"):
        resolve(tmp_path, {"scale": -1.0}, ", positive: true", sets=["size=2"])


def test_nan_constants_in_an_elementwise_expression_are_representable():
    from runtimes.kernels.expression import ElementwiseCode

    f32 = np.dtype(np.float32)
    code = ElementwiseCode.of("(Mul (Sqrt (Add (Mul in0 in0) (Const nan))) (Const nan))", [f32], f32)
    assert code is not None and len(code.consts) == 1 and np.isnan(code.consts[0])
    code = ElementwiseCode.of("(Add (Mul in0 (Const -0.0)) (Const 0.0))", [f32], f32)
    assert [str(v) for v in code.consts] == ["-0.0", "0.0"]


# ---- class 9: a token id beyond the vocabulary ------------------------------------------------------------------
def test_a_token_beyond_the_embedding_is_named_with_its_tokenizer_and_the_table(tmp_path, no_weights):
    folder = checkpoint(tmp_path)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 384, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    refused(run("--weights", folder, "-p", "hi <|extra|> there", *FAST),
            "token 384 '<|extra|>'", str(folder / "tokenizer.json"), "model.embed_tokens.weight [384, 64]",
            "ids 0..383")


def test_prompt_ids_beyond_the_vocabulary_are_named(no_weights):
    from luminal_recipes import load_recipe
    from luminal_recipes.errors import InputError

    lm = load_recipe(LLAMA, weights=TINY_LLAMA, compile=False)
    with pytest.raises(InputError, match=r"token 999 \(at position 2\) .*model.embed_tokens.weight \[384, 64\]"):
        lm.generate([1, 2, 999], max_new_tokens=2)


# ---- class 6 (part): out of process memory -----------------------------------------------------------------------
def limited(mib: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The CLI in a child process whose address space is limited to ``mib`` MiB."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (mib << 20, mib << 20))

    return subprocess.run([sys.executable, "-m", "luminal_recipes", *args], preexec_fn=limit, capture_output=True,
                          text=True, timeout=timeout, cwd=os.getcwd())


TINY_PIPELINE = [str(ROOT / "recipes" / "flux2-tiny.yaml"), "--no-compile", "--steps", "2", "--width", "32",
                 "--height", "32", "--set", "max_sequence_length=64", "-p", "fox", "--quiet"]


@pytest.mark.parametrize("mib", [600, 1200])
def test_runs_under_an_address_space_limit_end_cleanly(tmp_path, mib):
    out = tmp_path / "fox.png"
    result = limited(mib, "run", *TINY_PIPELINE, "-o", str(out))
    assert result.returncode in (0, 2), (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "memory allocation of" not in result.stderr, result.stderr[-2000:]
    if result.returncode == 2:
        assert result.stderr.startswith("error: ") and "RLIMIT_AS" in result.stderr, result.stderr
        assert not out.exists()
    else:
        assert out.exists()


def test_a_max_memory_beyond_the_limit_is_refused_up_front(tmp_path):
    result = limited(900, "run", str(LLAMA), "--weights", str(TINY_LLAMA), "-p", "hi", *FAST, "--max-memory",
                     "64GiB")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: --max-memory 64.00 GiB is more than this process may use"), result.stderr
    assert "RLIMIT_AS" in result.stderr


def test_capacity_honours_rlimit_as():
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
        "from luminal_recipes.runtimes.cpu.backend import NumpyBackend\n"
        "from luminal_recipes import memory_limits as m\n"
        "print(NumpyBackend().capacity(), m.mapped_bytes(), m.address_reserve())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    capacity, mapped, reserve = map(int, result.stdout.split())
    assert 0 < capacity <= (3 << 30) - mapped - reserve + (64 << 20)  # the budget was read a little before
    assert mapped > 0


def test_capacity_honours_the_cgroup_limit_minus_its_use(tmp_path, monkeypatch):
    from luminal_recipes import memory_limits

    (tmp_path / "memory.max").write_text(f"{3 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{2 << 30}\n")
    (tmp_path / "memory.stat").write_text(f"anon {1 << 30}\ninactive_file {1 << 30}\n")
    limit = memory_limits.cgroup_limit(tmp_path)
    assert limit is not None and limit.available == 2 << 30 and str(tmp_path / "memory.max") in limit.how
    (tmp_path / "memory.max").write_text("max\n")
    assert memory_limits.cgroup_limit(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{1 << 30}")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{768 << 20}")
    (v1 / "memory" / "memory.stat").write_text(f"total_inactive_file {512 << 20}\n")
    assert memory_limits.cgroup_limit(v1).available == 768 << 20
    monkeypatch.setattr(memory_limits, "CGROUP", v1)
    assert memory_limits.host_memory() <= 768 << 20


@pytest.mark.parametrize("failure", [
    lambda: np.empty(1 << 60, dtype=np.uint8),  # numpy's _ArrayMemoryError: says how much was asked
    lambda: (_ for _ in ()).throw(OSError(12, "Cannot allocate memory")),
])
def test_an_allocation_failure_is_one_paragraph_exit_2(monkeypatch, failure):
    from luminal_recipes.tasks.generation import cli as text_cli

    def fail(*args, **kwargs):
        failure()

    monkeypatch.setattr(text_cli, "run_command", fail)
    message = refused(run("--weights", TINY_LLAMA, "-p", "hi", *FAST), "out of memory: an allocation failed (",
                      "raise the limit")
    assert "\n" not in message.strip()
    if "Unable to allocate" not in message:
        assert "Cannot allocate memory" in message


def test_a_pipeline_token_beyond_the_text_encoders_embedding_is_refused_before_it_runs(tmp_path):
    folder = tmp_path / "checkpoint"
    shutil.copytree(ROOT / "recipes" / "flux2-tiny" / "checkpoint", folder)
    path = folder / "tokenizer" / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["added_tokens"].append({"id": 200000, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(tokenizer))
    out = tmp_path / "fox.png"
    result = CliRunner().invoke(app, ["run", str(ROOT / "recipes" / "flux2-tiny.yaml"), "--weights", str(folder),
                                      *TINY_PIPELINE[1:-3], "-p", "a <|extra|> fox", "-o", str(out), "--quiet"])
    refused(result, "stage 'text_encoder'", "input 'tokens'", "holds id 131072",
            "language_model.model.embed_tokens.weight (ids 0..131071)")
    assert not out.exists()
