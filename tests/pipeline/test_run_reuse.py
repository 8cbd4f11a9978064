"""What a run makes once and reuses: each model's graph is built once (to plan, then run), compiled once, and
loaded once for all its loop iterations and, when every stage fits the budget at once, for all prompts; a second
prompt builds, compiles and loads nothing (its `--json` compile figures are 0). Counted with the instrumentation
counters (``luminal_recipes.instrument``), not timed. Reuse must not change results: the second prompt's image is
the one a run of that prompt alone writes.

The runs use `--no-compile` (the naive programs) at 32x32, 2 steps: what is counted does not depend on the
search, and a cold search would dominate the file's time."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from luminal_recipes import instrument
from luminal_recipes.cli import app
from luminal_recipes.pipeline.driver import Pipeline

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "flux2-tiny.yaml")
SETS = ["steps=2", "width=32", "height=32", "max_sequence_length=64"]
SMALL = ["--no-compile", *(arg for s in SETS for arg in ("--set", s))]
MODELS = ("text_encoder", "transformer", "vae")


def run_json(tmp_path: Path, *args: str) -> tuple[dict, dict]:
    """The `--json` summary of a run in ``tmp_path`` (outputs/ lands there), and what it counted."""
    before = instrument.snapshot()
    result = CliRunner().invoke(app, ["run", TINY, *SMALL, "--json", *args])
    assert result.exit_code == 0, result.output
    counted = instrument.snapshot()
    counted.subtract(before)
    return json.loads(result.stdout), dict(counted)


def image(summary: dict, index: int) -> np.ndarray:
    return np.asarray(Image.open(summary["runs"][index]["path"]))


def test_a_second_prompt_builds_compiles_and_loads_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    both, counted = run_json(tmp_path, "--prompt", "a red fox", "--prompt", "a blue cat")
    # three models, two prompts, two denoising steps: one graph build and one load per model
    assert counted.get(instrument.GRAPH_BUILD) == len(MODELS)
    assert counted.get(instrument.LOAD) == len(MODELS)
    first, second = both["runs"]
    # (seconds rounded to 1 ms: a tiny model's load can round to 0, so the counts above are the proof)
    assert set(first["compile_seconds"]) == set(MODELS)
    assert second["compile_seconds"] == {name: 0.0 for name in MODELS}
    assert both["timing"]["load_seconds"] == round(sum(first["compile_seconds"].values()), 3)
    # nothing of the first prompt leaks into the second: the same image as that prompt alone
    alone, _ = run_json(tmp_path, "--prompt", "a blue cat")
    assert np.array_equal(image(both, 1), image(alone, 0))


def test_models_are_released_between_prompts_when_they_do_not_fit_together(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plans = Pipeline(TINY, sets=SETS, compile=False).prepare()
    # every stage fits on its own, not all three at once
    budget = sum(p.planned_peak for p in plans) - 1
    assert all(p.planned_peak <= budget for p in plans)
    bounded, counted = run_json(tmp_path, "--prompt", "a red fox", "--prompt", "a blue cat",
                                "--max-memory", str(budget))
    assert {name: p["planned_peak_bytes"] for name, p in bounded["memory"]["plans"].items()} == \
        {p.model: p.planned_peak for p in plans}
    assert counted.get(instrument.GRAPH_BUILD) == len(MODELS)  # graphs and programs are kept all the same
    assert counted.get(instrument.LOAD) == 2 * len(MODELS)
    assert set(bounded["runs"][1]["compile_seconds"]) == set(MODELS)
