"""recipes/llama.yaml against transformers.LlamaForCausalLM, on tiny random checkpoints it saved itself."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from luminal_recipes.graph import run_reference  # noqa: E402
from luminal_recipes.graph.symbolic import evaluate  # noqa: E402
from luminal_recipes.recipe.builder import build  # noqa: E402
from luminal_recipes.recipe.commands import validate  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "llama.yaml"


def full_forward(model, tokens: np.ndarray) -> np.ndarray:
    """Logits at every position of ``tokens`` [batch, seq] (transformers' forward): the whole sequence as new
    tokens at positions 0..seq-1 over an empty KV cache of its length, every position's logits kept."""
    batch, seq = tokens.shape
    dims = {"batch": batch, "seq": seq, "ctx": seq, "cache": seq, "keep": seq}
    states = {n.name: np.zeros([int(evaluate(d, dims)) for d in n.shape], n.dtype.np)
              for n in model.graph.inputs("state")}
    inputs = {"tokens": tokens, "positions": np.arange(seq, dtype=np.int32), **states}
    return run_reference(model.graph, inputs, model.load_weight, dims)["logits"]


def save_tiny_llama(folder: Path, seed: int, **overrides) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        intermediate_size=128,
        initializer_range=0.1,
        **overrides,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize(
    "seed, overrides",
    [
        (0, {}),
        (1, {"tie_word_embeddings": True, "attention_bias": True, "rope_theta": 500000.0}),
        # Llama 3.1's frequency scaling: wavelengths of the 16 frequencies span all three branches
        (4, {"max_position_embeddings": 64, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ],
)
def test_logits_match_transformers(tmp_path, seed, overrides):
    reference = save_tiny_llama(tmp_path, seed, **overrides)
    model = build(RECIPE, weights=tmp_path)
    assert model.params["kv_heads"] == 2 and model.params["head_dim"] == 16
    assert model.params["tie_embeddings"] == overrides.get("tie_word_embeddings", False)
    rng = np.random.default_rng(seed)
    for batch, seq in ((1, 7), (2, 3)):
        tokens = rng.integers(0, 256, size=(batch, seq), dtype=np.int32)
        logits = full_forward(model, tokens)
        with torch.no_grad():
            expected = reference(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        assert logits.shape == expected.shape == (batch, seq, 256)
        rel = np.abs(logits - expected).max() / np.abs(expected).max()
        assert rel <= 1e-4, f"relative error {rel:.2e} (batch {batch}, seq {seq})"


def test_bf16_checkpoint_stays_bf16_and_computes_in_f32(tmp_path):
    save_tiny_llama(tmp_path / "f32", 3).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    model = build(RECIPE, weights=tmp_path / "bf16")
    assert {str(b.dtype) for b in model.weights.values()} == {"bf16"}
    assert str(model.graph.tensor("logits").dtype) == "f32"
    tokens = np.array([[7, 8, 9, 10]], dtype=np.int32)
    logits = full_forward(model, tokens)
    with torch.no_grad():
        expected = reference(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(logits - expected).max() / np.abs(expected).max() <= 1e-4


def test_decoder_layers_are_one_repeated_block(tmp_path, block_signature):
    save_tiny_llama(tmp_path, 0)
    model = build(RECIPE, weights=tmp_path)
    layers = [c for c in model.calls if c.module == "decoder_layer"]
    assert [c.path for c in layers] == ["model.layers.0", "model.layers.1"]
    first, second = (block_signature(model.graph, c) for c in layers)
    assert first == second and len(first) > 50


def _readme_blocks() -> list[str]:
    text = (RECIPE.parent / "README.md").read_text()
    return re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)


def test_readme_example_is_a_working_llama(tmp_path):
    """The example the language reference explains line by line builds the same logits as transformers."""
    example = next(block for block in _readme_blocks() if block.startswith("kind: model"))
    (tmp_path / "example.yaml").write_text(example)
    reference = save_tiny_llama(tmp_path / "ckpt", 2)
    model = build(tmp_path / "example.yaml", weights=tmp_path / "ckpt")
    tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6]], dtype=np.int32)
    dims = {"batch": 1, "seq": 8}
    logits = run_reference(model.graph, {"tokens": tokens}, model.load_weight, dims)["logits"]
    with torch.no_grad():
        expected = reference(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(logits - expected).max() / np.abs(expected).max() <= 1e-4


def test_readme_pipeline_example_validates(tmp_path):
    pipeline = next(block for block in _readme_blocks() if block.startswith("kind: pipeline"))
    (tmp_path / "flux2.yaml").write_text(pipeline)
    stub = "kind: model\nname: {name}\nparams: {{out_layers: [1]}}\nmodules:\n  m:\n    forward: return 1\n"
    for name in ("mistral3-text-encoder", "flux2-transformer"):
        (tmp_path / f"{name}.yaml").write_text(stub.format(name=name))
    assert "valid pipeline recipe 'flux2'" in str(validate(tmp_path / "flux2.yaml"))


def test_every_readme_yaml_example_parses(tmp_path):
    from luminal_recipes.recipe.yaml_source import parse_yaml

    blocks = _readme_blocks()
    assert len(blocks) >= 5
    for index, block in enumerate(blocks):
        parse_yaml(block, tmp_path / f"block{index}.yaml")
