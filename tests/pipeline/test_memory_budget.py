"""Memory budgets of pipelines: every stage planned before any weight is read, a budget no plan meets fails
with exit 2 and no PNG, stages whose weights do not fit stream them with the same bits as an unbounded run,
`--json` reports planned and measured peaks, and `inspect` plans FLUX.2-dev from shapes alone (no network).

The tiny-pipeline runs use `--no-compile` (the naive primitive programs): planning and streaming do not depend
on the search, and a cold search of the three tiny models would take longer than the whole file should."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.errors import BudgetError
from luminal_recipes.pipeline.generate import parse_size
from luminal_recipes.pipeline.plan import StagePlan, check_budget, machine_memory
from luminal_recipes.recipe.builder import BuiltModel
from luminal_recipes.weights.safetensors_io import Checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "flux2-tiny.yaml")
FLUX2 = str(ROOT / "recipes" / "flux2.yaml")
SMALL = ["--no-compile", "--steps", "2", "--width", "32", "--height", "32", "--set", "max_sequence_length=64",
         "--prompt", "a red fox"]
GIB = 2**30


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def generate_json(tmp_path: Path, name: str, *extra: str) -> tuple[dict, np.ndarray]:
    out = tmp_path / f"{name}.png"
    result = cli("run", TINY, *SMALL, "--json", "-o", str(out), *extra)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), np.asarray(Image.open(out))


def test_default_budget_is_the_machine_memory():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < machine_memory() <= physical
    assert parse_size("24GiB") == 24 * GIB and parse_size("1.5GB") == 1_500_000_000


def test_too_small_budget_fails_before_reading_any_weight(tmp_path, monkeypatch):
    def no_reads(*args, **kwargs):
        raise AssertionError("a weight was read before the budget was checked")

    monkeypatch.setattr(BuiltModel, "load_weight", no_reads)
    monkeypatch.setattr(Checkpoint, "load", no_reads)
    out = tmp_path / "never.png"
    result = cli("run", TINY, *SMALL, "--max-memory", "1MiB", "-o", str(out))
    assert result.exit_code == 2, result.output
    message = result.stderr
    assert "Traceback" not in result.output
    assert "--max-memory 1.00 MiB is too small" in message and "Raise --max-memory to at least" in message
    needed = re.search(r"Raise --max-memory to at least ([\d.]+) MiB", message)
    assert needed and float(needed.group(1)) > 1.0
    for stage in ("text_encoder", "transformer", "vae"):
        assert f"stage '{stage}' needs at least" in message  # each stage's need, weights and activations
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_stage_over_the_budget_streams_with_the_same_bits(tmp_path):
    free, image = generate_json(tmp_path, "unbounded")
    plans = free["memory"]["plans"]
    assert free["memory"]["budget_from"] == "machine memory"
    assert not any(p["streamed"] for p in plans.values())
    largest = max(plans, key=lambda s: plans[s]["planned_peak_bytes"])
    budget = plans[largest]["planned_peak_bytes"] - 1  # that stage no longer fits with every weight resident

    bounded, streamed_image = generate_json(tmp_path, "bounded", "--max-memory", str(budget))
    assert np.array_equal(streamed_image, image)
    memory = bounded["memory"]
    assert memory["budget_bytes"] == budget and memory["budget_from"] == "--max-memory"
    for stage, plan in memory["plans"].items():
        assert plan["planned_peak_bytes"] <= budget
        assert plan["streamed"] == (stage == largest)
    plan = memory["plans"][largest]
    assert plan["resident_weight_bytes"] < plan["weight_bytes"]
    measured = bounded["runs"][0]["memory"][largest]
    assert measured["stream"]["loads"] > 0 and measured["stream"]["bytes_copied"] > 0
    assert measured["loaded_peak_bytes"] == plan["planned_peak_bytes"]
    assert 0 < measured["live_peak_bytes"] <= plan["activation_bytes"]
    assert measured["transient_peak_bytes"] is not None and measured["max_rss_bytes"] > 0
    rss = bounded["runs"][0]["rss"]
    assert set(rss) >= {"tokenize", "text_encoder", "denoise", "vae"}
    assert all(r["max_rss_bytes"] >= (r["rss_at_start_bytes"] or 0) for r in rss.values())


def _plan(stage: str, held: int, activations: int) -> StagePlan:
    peak = held + activations
    return StagePlan(stage, stage, {"seq": 8}, 500, 4 * held, 0, activations, True, held, held // 2, 4, peak,
                     4 * held + activations)


def test_budget_error_names_every_stage_over_and_the_least_budget():
    plans = [_plan("encoder", 100, 300), _plan("decoder", 200, 400), _plan("vae", 100, 600)]
    assert plans[0].fits and not plans[1].fits
    with pytest.raises(BudgetError) as err:
        check_budget(plans, 500)
    text = str(err.value)
    assert "encoder" not in text
    assert "stage 'decoder' needs at least 600 B (200 B of weights outside blocks + two streamed blocks + " \
           "400 B of activations and constants at seq=8)" in text
    assert "stage 'vae' needs at least 700 B" in text and "Raise --max-memory to at least 700 B" in text
    check_budget(plans, None)  # no budget: nothing to check


def _row(text: str, stage: str) -> tuple[list[float], str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(stage + " "))
    sizes = [float(v) * {"GiB": GIB, "MiB": 2**20, "KiB": 2**10}[u]
             for v, u in re.findall(r"([\d.]+) (GiB|MiB|KiB)", line)]
    return sizes, line


def test_inspect_plans_flux2_dev_from_shapes_offline(monkeypatch):
    import luminal_recipes.weights.sources as sources

    def offline(*args, **kwargs):
        raise AssertionError("inspect tried to fetch a checkpoint")

    monkeypatch.setattr(sources, "resolve_source", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = cli("inspect", FLUX2, "--max-memory", "24GiB")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "sizes from flux2-dev-configs/" in text
    assert "transformer batch=1, img=4096, txt=512" in text  # 1024x1024: 4096 image + 512 text tokens
    budget = 24 * GIB
    # columns: weights, activations, unbounded peak, held weights, planned peak (+ largest block in notes)
    (weights, act, unbounded, held, planned, block), line = _row(text, "transformer")
    assert abs(weights - 60.02 * GIB) < 0.01 * GIB  # FLUX.2-dev's transformer: ~60 GiB of bf16 weights
    assert unbounded >= weights + act * 0.99 and "streamed block by block (56 blocks" in line
    assert held < 3 * block + 2 * GIB and planned <= budget and planned >= held + act * 0.99
    (weights, act, unbounded, held, planned, _), line = _row(text, "text_encoder")
    assert abs(weights - 32.31 * GIB) < 0.01 * GIB and "streamed" in line and planned <= budget
    (weights, act, unbounded, held, planned), line = _row(text, "vae")
    assert weights < GIB and "weights resident" in line and held == weights and planned <= budget
    assert "DOES NOT FIT" not in text


# ---- the device runtimes: device memory, pinned staging, a GPU planned without one --------------------------------
def test_cuda_emu_streams_through_pinned_staging_and_gives_device_memory_back(tmp_path):
    """--runtime cuda-emu under a device budget below the transformer's weights: its blocks are staged through
    64 KiB of "pinned" host memory in pieces, the image has the numpy runtime's bits, and every stage's device
    memory is measured when it ends and released."""
    _, image = generate_json(tmp_path, "numpy")
    summary, emu_image = generate_json(tmp_path, "emu", "--runtime", "cuda-emu", "--max-memory", "11MiB",
                                       "--max-host-memory", "64KiB")
    assert np.array_equal(emu_image, image)
    memory = summary["memory"]
    assert memory["runtime"] == "cuda-emu" and memory["host_staging_budget_bytes"] == 64 << 10
    plan = memory["plans"]["transformer"]
    assert plan["streamed"] and plan["staging_bytes"] == 64 << 10
    stages = summary["runs"][0]["memory"]
    stream = stages["transformer"]["stream"]
    assert stream["staging_bytes"] == 64 << 10 and stream["uploads"] > stream["loads"]  # blocks in pieces
    for stage, measured in stages.items():
        device = measured["device_memory"]
        assert 0 < device["held_at_stage_end_bytes"] <= memory["plans"][stage]["planned_peak_bytes"]
        assert device["held_after_release_bytes"] == 0, stage


def test_max_host_memory_is_for_device_runtimes(tmp_path):
    """On the numpy runtime --max-host-memory would mean nothing (its device memory is host memory): run and
    inspect refuse it with one line naming the flag and the runtime it is for, exit 2, nothing written."""
    for args in (("run", TINY, *SMALL, "-o", str(tmp_path / "x.png")), ("inspect", TINY)):
        result = cli(*args, "--max-host-memory", "1GiB")
        assert result.exit_code == 2, result.output
        message = result.stderr.strip()
        assert message.startswith("error: --max-host-memory: the numpy runtime's device memory is host memory")
        assert "--runtime cuda" in message and "\n" not in message and "Traceback" not in result.output
    result = cli("run", TINY, *SMALL, "--runtime", "cuda-emu", "--max-host-memory", "lots",
                 "-o", str(tmp_path / "x.png"))
    assert result.exit_code == 2 and "--max-host-memory 'lots': expected a size" in result.stderr
    assert not list(tmp_path.iterdir())


def test_too_small_host_staging_fails_before_reading_any_weight(tmp_path, monkeypatch):
    """A streamed stage on a device runtime needs two pinned staging buffers: a --max-host-memory below them is
    refused while planning (no weight read, no PNG), naming the stage that streams, the flag and the fix."""
    def no_reads(*args, **kwargs):
        raise AssertionError("a weight was read before the staging budget was checked")

    monkeypatch.setattr(BuiltModel, "load_weight", no_reads)
    monkeypatch.setattr(Checkpoint, "load", no_reads)
    result = cli("run", TINY, *SMALL, "--runtime", "cuda-emu", "--max-memory", "11MiB", "--max-host-memory", "1KiB",
                 "-o", str(tmp_path / "never.png"))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.stderr.count("error:") == 1
    message = result.stderr.strip().splitlines()[-1]  # after the planning progress lines
    assert message.startswith("error: stage 'transformer' streams its weights under --max-memory: "
                              "--max-host-memory 1.00 KiB is too small for the pinned staging")
    assert "2 buffers of at least 4.00 KiB (8.00 KiB in all" in message and "give more, e.g. 1GiB" in message
    assert not list(tmp_path.iterdir())


def test_inspect_plans_flux2_dev_for_a_gpu_without_one(monkeypatch):
    """`inspect --runtime cuda --max-memory 24GiB recipes/flux2.yaml` with no GPU (and no network) plans FLUX.2-dev
    for a described GPU (the H200 by default; --device picks another) and says so: the text encoder and the
    transformer stream their blocks through the default 512 MiB of pinned staging, the VAE stays resident, every
    stage fits 24 GiB of device memory."""
    import luminal_recipes.weights.sources as sources
    from luminal_recipes.runtimes.registry import get_runtime

    try:
        get_runtime("cuda")
        pytest.skip("a GPU is here: inspect plans for it")
    except Exception:  # noqa: BLE001 - no CuPy or no GPU: the offline description is used
        pass

    def offline(*args, **kwargs):
        raise AssertionError("inspect tried to fetch a checkpoint")

    monkeypatch.setattr(sources, "resolve_source", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = cli("inspect", "--runtime", "cuda", "--max-memory", "24GiB", FLUX2)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "sizes from flux2-dev-configs/" in text and "DOES NOT FIT" not in text
    assert "planned for NVIDIA H200 (sm_90, 141 GiB) from an offline description" in text
    assert "budget: 24.00 GiB of NVIDIA H200 (sm_90) memory (cuda runtime)" in text
    budget, staging = 24 * GIB, 512 * 2**20  # runtimes.streaming.DEFAULT_STAGING
    (weights, act, unbounded, held, planned, block, staged), line = _row(text, "transformer")
    assert abs(weights - 60.02 * GIB) < 0.01 * GIB and "streamed block by block (56 blocks" in line
    assert staged == staging and held < 3 * block + 2 * GIB and planned <= budget
    (weights, act, unbounded, held, planned, block, staged), line = _row(text, "text_encoder")
    assert abs(weights - 32.31 * GIB) < 0.01 * GIB and "streamed block by block (30 blocks" in line
    assert staged == staging and planned <= budget
    (weights, act, unbounded, held, planned), line = _row(text, "vae")
    assert "weights resident" in line and held == weights and planned <= budget
    result = cli("inspect", FLUX2, "--runtime", "cuda", "--device", "tpu")
    assert result.exit_code == 2 and "--device tpu" in result.stderr and "h200" in result.stderr
