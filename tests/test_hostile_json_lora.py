"""Hostile JSON and LoRA files (issue 21, classes 3, 6 and 9): every JSON reader is bounded (nesting depth, size,
NaN/Infinity, duplicate keys) and refuses with a located message, exit 2, no traceback; a LoRA's config values are
checked, its rank/alpha patterns are matched as PEFT matches them but in linear time (no ReDoS), its matrices must
be floating point and its path a regular file.

The hostile fixtures are built in each test; the pattern ReDoS runs in a child process bounded by a timeout and an
address-space limit.
"""

from __future__ import annotations

import json
import re
import resource
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from cli_checks import cli, empty_workdir, refused  # tests/cli_checks.py
from safetensors.numpy import save_file

from luminal_recipes.errors import CheckpointError, LoraError
from luminal_recipes.files import MAX_JSON_DEPTH, parse_json, read_json
from luminal_recipes.weights.lora import read_lora
from luminal_recipes.weights.lora_patterns import PatternError, PeftPattern
from luminal_recipes.weights.safetensors_io import Checkpoint

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
TINY = RECIPES / "flux2-tiny.yaml"
CHECKPOINT = RECIPES / "flux2-tiny" / "checkpoint"
SMALL = ["--no-compile", "--steps", "2", "--width", "32", "--height", "32", "--set", "max_sequence_length=64",
         "--quiet"]
DEEP = "[" * 100_000 + "]" * 100_000  # Python's json recurses: RecursionError near 1,000
WHERE = "--lora x.safetensors"


@pytest.fixture(autouse=True)
def workdir(tmp_path, monkeypatch):
    yield from empty_workdir(tmp_path, monkeypatch)


def checkpoint_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, folder)
    return folder


def safetensors_with_header(path: Path, header: str) -> Path:
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


def lora(path: Path, layers: dict[str, tuple[tuple[int, int], tuple[int, int]]] | None = None,
         metadata: dict | None = None, dtype=np.float32, alpha: float | None = None) -> Path:
    """A LoRA of diffusers' keys (``transformer.<layer>.lora_A/B.weight``; kohya's with ``alpha``)."""
    layers = layers or {"x_embedder": ((4, 8), (8, 4))}
    state = {}
    for layer, (down, up) in layers.items():
        if alpha is None:
            state[f"transformer.{layer}.lora_A.weight"] = np.ones(down, dtype)
            state[f"transformer.{layer}.lora_B.weight"] = np.ones(up, dtype)
        else:
            state[f"lora_unet_{layer}.lora_down.weight"] = np.ones(down, dtype)
            state[f"lora_unet_{layer}.lora_up.weight"] = np.ones(up, dtype)
            state[f"lora_unet_{layer}.alpha"] = np.array(alpha, np.float32)
    save_file(state, path, metadata=metadata)
    return path


# ---- one bounded JSON reader -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "words"), [
    (DEEP, ["f.json:1: ", f"more than {MAX_JSON_DEPTH} deep"]),
    ('{"a": {"b":\n' + '[' * 200 + ']' * 200 + "}}", ["f.json:2: ", "more than"]),
    ('{"rms_norm_eps": NaN}', ["f.json:1:18: ", '"rms_norm_eps": NaN is not a number JSON allows']),
    ('{"x": [1, -Infinity]}', ["f.json:1:11: ", "-Infinity"]),
    ('{"r": 1e400}', ["f.json:1:7: ", '"r": 1e400 is beyond a double']),
    ('{"a": 1,\n "a": 2}', ["f.json:2:2: ", 'key "a" appears twice']),
    ('{"n": ' + "9" * 5000 + "}", ["f.json: ", "more than 4300 digits"]),
    ('{"a": 1,}', ["f.json:1:9: ", "not valid JSON"]),
], ids=["deep", "deep-located", "nan", "infinity", "1e400", "duplicate", "long-int", "syntax"])
def test_parse_json_refuses_hostile_json_located(text, words):
    with pytest.raises(CheckpointError) as info:
        parse_json(text, "f.json", CheckpointError, fix="restore it")
    message = str(info.value)
    for word in words:
        assert word in message, message
    assert message.endswith("; restore it.")


def test_parse_json_reads_what_is_within_bounds():
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json(nested, "f", CheckpointError) == eval(nested)  # exactly the limit is read
    with pytest.raises(CheckpointError):
        parse_json("[" + nested + "]", "f", CheckpointError)
    brackets = '{"a": "' + "[" * 10_000 + '\\"{", "b": [1.5, 2]}'  # brackets in strings are not nesting
    assert parse_json(brackets, "f", CheckpointError) == {"a": "[" * 10_000 + '"{', "b": [1.5, 2]}
    assert parse_json('{"x": NaN}', "f", CheckpointError, nonfinite=True)["x"] != 0  # when the caller allows it
    wide = json.dumps({f"t{i}": {"dtype": "F32", "shape": [i, 2], "data_offsets": [0, 0]} for i in range(20_000)})
    assert len(parse_json(wide, "f", CheckpointError)) == 20_000  # many shallow brackets are fine


def test_read_json_names_the_file_and_refuses_a_folder(tmp_path):
    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match=r"config\.json:1: the JSON nests"):
        read_json(tmp_path / "config.json", "the config", error=CheckpointError)
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(CheckpointError, match="must be a regular file, but this is a folder"):
        read_json(tmp_path / "folder.json", "the config", error=CheckpointError)


def test_a_deep_safetensors_header_is_refused_located(tmp_path):
    path = safetensors_with_header(tmp_path / "x.safetensors", '{"t": ' + DEEP + "}")
    with pytest.raises(CheckpointError, match=r"x\.safetensors: the header:1: the JSON nests"):
        Checkpoint.open(path)
    path = safetensors_with_header(tmp_path / "y.safetensors",
                                   '{"t": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, '
                                   '"t": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}')
    with pytest.raises(CheckpointError, match='key "t" appears twice'):
        Checkpoint.open(path)


@pytest.mark.parametrize("name", [
    "transformer/config.json", "vae/config.json", "transformer/diffusion_pytorch_model.safetensors",
])
def test_every_checkpoint_json_is_bounded_in_validate(tmp_path, name):
    checkpoint = checkpoint_copy(tmp_path)
    target = checkpoint / name
    if name.endswith(".safetensors"):
        safetensors_with_header(target, DEEP)
    else:
        target.write_text(DEEP)
    refused(cli("validate", TINY, "--weights", checkpoint), name, "nests arrays/objects more than")


@pytest.mark.parametrize("name", [
    "tokenizer/tokenizer_config.json", "text_encoder/config.json", "vae/config.json",
    "scheduler/scheduler_config.json", "model_index.json",
])
def test_every_checkpoint_json_is_bounded_in_run(tmp_path, name):
    checkpoint = checkpoint_copy(tmp_path)
    (checkpoint / name).write_text('{"a": ' + DEEP + "}")
    out = tmp_path / "x.png"
    refused(cli("run", TINY, "--weights", checkpoint, *SMALL, "-p", "fox", "-o", out), name, "nests")
    assert not out.exists()


def test_generation_configs_are_bounded(tmp_path):
    from luminal_recipes.text.tokenizer import eos_token_ids

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": ' + DEEP + "}")
    with pytest.raises(CheckpointError, match=r"generation_config\.json:1: the JSON nests .*; restore it from the"):
        eos_token_ids(tmp_path)


def test_inspect_config_is_bounded(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(DEEP)
    refused(cli("inspect", RECIPES / "llama.yaml", "--config", config), f"--config {config}:1:",
            "nests arrays/objects")
    config.write_text('{"hidden_size": 64, "rms_norm_eps": NaN}')
    refused(cli("inspect", RECIPES / "llama.yaml", "--config", config), f"--config {config}:1:",
            '"rms_norm_eps": NaN')


# ---- LoRA files --------------------------------------------------------------------------------------------------
def test_run_refuses_a_lora_with_deep_json(tmp_path):
    deep = lora(tmp_path / "deep.safetensors", metadata={"lora_adapter_metadata": DEEP})
    out = tmp_path / "x.png"
    refused(cli("run", TINY, *SMALL, "-p", "fox", "--lora", deep, "-o", out),
            f"--lora {deep}: its lora_adapter_metadata header:1: the JSON nests")
    assert not out.exists()
    peft = tmp_path / "peft"
    peft.mkdir()
    state = {"base_model.model.x_embedder.lora_A.weight": np.ones((4, 8), np.float32),
             "base_model.model.x_embedder.lora_B.weight": np.ones((8, 4), np.float32)}
    save_file(state, peft / "adapter_model.safetensors")
    (peft / "adapter_config.json").write_text(DEEP)
    refused(cli("run", TINY, *SMALL, "-p", "fox", "--lora", peft / "adapter_model.safetensors", "-o", out),
            "adapter_config.json:1: the JSON nests")
    deep_header = safetensors_with_header(tmp_path / "header.safetensors", DEEP)
    refused(cli("run", TINY, *SMALL, "-p", "fox", "--lora", deep_header, "-o", out), "header.safetensors",
            "nests")
    assert not out.exists()


@pytest.mark.parametrize(("config", "words"), [
    ({"r": "abc"}, ['r is "abc"', "a LoRA rank is a positive integer"]),
    ({"r": None}, ["r is null", "positive integer"]),
    ({"r": 0}, ["r is 0", "positive integer"]),
    ({"r": True}, ["r is true", "positive integer"]),
    ({"r": 4.0}, ["r is 4.0", "positive integer"]),
    ({"r": 4, "lora_alpha": [8]}, ["lora_alpha is [8]", "a LoRA alpha is a finite number"]),
    ({"r": 4, "lora_alpha": None}, ["lora_alpha is null", "finite number"]),
    ({"r": 4, "lora_alpha": "8"}, ['lora_alpha is "8"', "finite number"]),
    ({"r": 4, "lora_alpha": 10 ** 400}, ["lora_alpha is 1000", "finite number"]),
    ({"r": 4, "use_rslora": "yes"}, ['use_rslora is "yes"', "true or false"]),
    ({"r": 4, "alpha_pattern": ["x"]}, ['alpha_pattern is ["x"]', "must be an object"]),
    ({"r": 4, "alpha_pattern": {"(": 8}}, ["alpha_pattern: the key '(' is not a regular expression"]),
    ({"r": 4, "rank_pattern": {"x_embedder": "4"}}, ["rank_pattern['x_embedder'] is \"4\"", "positive integer"]),
    ({"r": 4, "alpha_pattern": {"x_embedder": float("nan")}}, ["NaN is not a number JSON allows"]),
    ({"r": 4, "alpha_pattern": {r"(a)\1": 8}}, ["uses a backreference"]),
    ('{"r": 1e400}', ['header:1:7: "r": 1e400 is beyond a double']),
    ('{"r": 4, "r": 8}', ['key "r" appears twice']),
], ids=["r-text", "r-null", "r-zero", "r-bool", "r-float", "alpha-list", "alpha-null", "alpha-text", "alpha-huge",
        "rslora", "pattern-list", "pattern-not-regex", "rank-text", "alpha-nan", "backreference", "r-1e400",
        "r-twice"])
def test_lora_config_values_are_checked(tmp_path, config, words):
    text = config if isinstance(config, str) else json.dumps(config)
    path = lora(tmp_path / "x.safetensors", metadata={"lora_adapter_metadata": text})
    with pytest.raises(LoraError) as info:
        read_lora(path, WHERE)
    message = str(info.value)
    assert message.startswith(f"{WHERE}: its lora_adapter_metadata header"), message
    for word in words:
        assert word in message, message


def test_a_peft_adapter_config_value_is_located(tmp_path):
    state = {"base_model.model.x_embedder.lora_A.weight": np.ones((4, 8), np.float32),
             "base_model.model.x_embedder.lora_B.weight": np.ones((8, 4), np.float32)}
    save_file(state, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": [8]}))
    with pytest.raises(LoraError, match=r"adapter_config\.json: lora_alpha is \[8\]; a LoRA alpha is a finite"):
        read_lora(tmp_path / "adapter_model.safetensors", WHERE)
    (tmp_path / "adapter_config.json").unlink()
    (tmp_path / "adapter_config.json").mkdir()
    with pytest.raises(LoraError, match="adapter_config.json must be a regular file, but this is a folder"):
        read_lora(tmp_path / "adapter_model.safetensors", WHERE)


def test_rank_zero_and_bad_alphas_are_refused(tmp_path):
    path = lora(tmp_path / "x.safetensors", {"img_in": ((0, 8), (8, 0))}, alpha=4.0)
    with pytest.raises(LoraError, match=r"layer 'lora_unet_img_in' has rank 0 \(down \[0, 8\], up \[8, 0\]\)"):
        read_lora(path, WHERE)
    path = lora(tmp_path / "y.safetensors", {"img_in": ((4, 8), (8, 4))}, alpha=float("inf"))
    with pytest.raises(LoraError, match=r"'lora_unet_img_in.alpha' is inf; an alpha is a finite number"):
        read_lora(path, WHERE)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.uint8, np.complex64])
def test_lora_matrices_must_be_floating_point(tmp_path, dtype):
    path = lora(tmp_path / "x.safetensors", dtype=dtype)
    with pytest.raises(LoraError) as info:
        read_lora(path, WHERE)
    message = str(info.value)
    assert "tensor 'transformer.x_embedder.lora_A.weight' is " in message
    assert "LoRA matrices are floating point (F32, F16, BF16, F64)" in message


def test_lora_floating_point_dtypes_are_read(tmp_path):
    for dtype in (np.float16, np.float32, np.float64):
        path = lora(tmp_path / f"{np.dtype(dtype).name}.safetensors", dtype=dtype,
                    metadata={"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 8})})
        assert read_lora(path, WHERE).layers[0].scale == 2.0


def test_a_lora_path_must_be_a_regular_file(tmp_path):
    folder = tmp_path / "style.safetensors"
    folder.mkdir()
    lora(folder / "diffusion_pytorch_model.safetensors")  # a loadable checkpoint folder: still not a LoRA file
    out = tmp_path / "x.png"
    refused(cli("run", TINY, *SMALL, "-p", "fox", "--lora", folder, "-o", out),
            f"--lora {folder}: a LoRA is a .safetensors file, but {folder} is a folder")
    assert not out.exists()


# ---- rank/alpha patterns: PEFT's meaning, linear time ---------------------------------------------------------
KEYS = ["to_q", "attn.to_q", "transformer_blocks.0.attn.to_q", r"transformer_blocks\.\d+\.attn\.to_[qkv]",
        "to_q|to_k", ".*to_out.0", "0.attn", r"single_transformer_blocks\.(1|2|3)\..*", "^to_q", "blocks.1",
        r"(?i:TO_Q)", r"[a-z_]+\.\d{1,2}\.attn\.to_q", r"\bto_q", r"attn\.to_q\Z", "", "a*", r"(?:to_q){1,2}",
        r"[^.]*q", r"attn.to_[^q]", "to_q$", ".", ".*", "(a|aa)+", r"q\n?", r"(?s:.)*q", r"\w+", r"\Bo_q",
        r"ff\.net\.[02].*", r"x?to_q", "proj_out"]
NAMES = ["transformer_blocks.0.attn.to_q", "transformer_blocks.10.attn.to_q", "transformer_blocks.1.attn.to_k",
         "single_transformer_blocks.2.attn.to_out.0", "single_transformer_blocks.12.proj_out", "to_q", "xto_q",
         "a.to_q", "attn.TO_Q", "transformer_blocks.0.ff.net.2", "to_q\n", "a.to_q\n", "", "aaaa", "x.y\n.to_q",
         "blocks.1", "blocks.10", "ab.blocks.1", "transformer_blocks.1.attn.to_q.x", "a.aaaa"]


def test_patterns_match_as_peft_does():
    other = pytest.importorskip("peft.utils.other")
    for key in KEYS:
        pattern = PeftPattern(key)
        for name in NAMES:
            expected = re.match(rf"(.*\.)?({key})$", name) is not None
            # PEFT's own function: the key that matched, else the name itself
            assert (other.get_pattern_key([key], name) == key) == expected or key == name
            assert pattern.matches(name) == expected, (key, name)


@pytest.mark.parametrize(("key", "words"), [
    (r"(a)\1", "a backreference"), ("(?=a)a", "a lookahead"), ("(?>a)", "an atomic group"),
    ("a++", "a possessive repeat"), ("(", "is not a regular expression"), ("(a{100}){100}", "automaton states"),
    ("(?:){1000000000}", "automaton states"), ("a" * 501, "at most 500"),
])
def test_patterns_that_need_backtracking_or_are_too_big_are_refused(key, words):
    with pytest.raises(PatternError, match=re.escape(words)):
        PeftPattern(key)


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def test_a_redos_pattern_returns_at_once(tmp_path):
    """``(a|aa)+`` against a 41-character layer name took 16 s with ``re`` (each character doubles it)."""
    name = "a" * 400 + "b"
    metadata = {"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 4, "alpha_pattern": {"(a|aa)+": 8}})}
    path = lora(tmp_path / "x.safetensors", {name: ((4, 8), (8, 4))}, metadata=metadata)
    script = textwrap.dedent(f"""
        import time
        from luminal_recipes.weights.lora import read_lora
        start = time.perf_counter()
        layer, = read_lora({str(path)!r}, "x").layers
        print(layer.scale, time.perf_counter() - start)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            preexec_fn=_limit_memory, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    scale, seconds = map(float, result.stdout.split())
    assert scale == 1.0  # the pattern does not match: lora_alpha / r
    assert seconds < 1.0, seconds
    matched = lora(tmp_path / "y.safetensors", {"blocks.aaaa": ((4, 8), (8, 4))}, metadata=metadata)
    assert read_lora(matched, "x").layers[0].scale == 2.0
