"""Seeds and batches (``pipeline/seeds.py``): an omitted seed is drawn (printed, in the file name and in the PNG),
unless ``$LUMINAL_RECIPES_SEED`` pins the default; ``--seed random`` draws one; ``--num-images N`` makes the seeds
seed, seed+1, ... (a ComfyUI batch), from ``--seed``, ``--set seed=`` or the recipe's default; image k of a batch
is the image ``--seed seed+k`` makes alone."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.errors import InputError
from luminal_recipes.image_io import read_png
from luminal_recipes.pipeline.seeds import MAX_SEED, SEED_ENV, batch_seeds, parse_seed

TINY = Path(__file__).resolve().parents[2] / "recipes" / "flux2-tiny.yaml"
SMALL = ["--no-compile", "--steps", "1", "--width", "32", "--height", "32", "--set", "max_sequence_length=32",
         "-p", "a fox"]


def test_parse_seed(monkeypatch):
    assert parse_seed(7) == 7 and parse_seed("12") == 12 and parse_seed(np.int64(3)) == 3
    assert 0 <= parse_seed("random") < 2**32
    monkeypatch.delenv(SEED_ENV, raising=False)
    drawn = {parse_seed(None) for _ in range(8)}
    assert len(drawn) > 1 and all(0 <= s < 2**32 for s in drawn)
    monkeypatch.setenv(SEED_ENV, "0")
    assert parse_seed(None) == 0
    monkeypatch.setenv(SEED_ENV, "random")
    assert len({parse_seed(None) for _ in range(8)}) > 1
    monkeypatch.setenv(SEED_ENV, "zero")
    with pytest.raises(InputError, match=rf"\${SEED_ENV} 'zero'"):
        parse_seed(None)
    for bad in (-1, MAX_SEED + 1, "1.5", True, 2.0):
        with pytest.raises(InputError, match="--seed"):
            parse_seed(bad)


def test_batch_seeds():
    assert batch_seeds(5, 3) == [5, 6, 7] and batch_seeds([9, 2], None) == [9, 2] and batch_seeds(4, None) == [4]
    with pytest.raises(InputError, match="2 seeds for --num-images 3"):
        batch_seeds([1, 2], 3)
    with pytest.raises(InputError, match="pass"):
        batch_seeds(MAX_SEED, 2)
    with pytest.raises(InputError, match="--num-images 0"):
        batch_seeds(1, 0)


def run(tmp_path: Path, *args: str, env: dict | None = None):
    result = CliRunner(env=env).invoke(app, ["run", str(TINY), *SMALL, *args])
    assert result.exit_code == 0, result.output
    written = re.findall(r"wrote (\S+) \(seed (\d+),", result.stdout)
    return [(tmp_path / path, int(seed)) for path, seed in written]


def test_omitted_seed_is_drawn_and_a_batch_counts_up(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(SEED_ENV)
    batch = run(tmp_path, "--num-images", "2")
    assert len(batch) == 2 and batch[1][1] == batch[0][1] + 1
    for path, seed in batch:
        pixels, meta = read_png(path)
        assert meta["seed"] == str(seed) and f"-{seed}-a-fox_" in path.name
        assert f"Seed: {seed}," in meta["parameters"]
    alone = run(tmp_path, "--seed", str(batch[1][1]))  # image 2 of the batch, made alone
    assert read_png(alone[0][0])[0].tobytes() == read_png(batch[1][0])[0].tobytes()
    drawn = run(tmp_path, "--seed", "random")
    assert 0 <= drawn[0][1] < 2**32


def test_pinned_default_and_set_seed_batches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(SEED_ENV, "0")  # the old default
    assert [s for _, s in run(tmp_path)] == [0]
    assert [s for _, s in run(tmp_path, "--set", "seed=7", "--num-images", "2")] == [7, 8]
    result = CliRunner().invoke(app, ["run", str(TINY), *SMALL, "--seed", "3", "--num-images", "2", "-o",
                                      str(tmp_path / "one.png")])
    assert result.exit_code == 2 and "--num-images 2 was given" in result.stderr
