"""Weights sources: local folders and hf:// addresses resolved through huggingface_hub, offline."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from luminal_recipes.errors import CheckpointError
from luminal_recipes.weights.sources import HubSource, parse_source, resolve_source


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty HF_HOME with the hub switched off (the machine has no network either)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def test_parse_source():
    assert parse_source("hf://black-forest-labs/FLUX.2-dev") == HubSource("black-forest-labs/FLUX.2-dev")
    assert parse_source("hf://org/repo@v1.0/transformer") == HubSource("org/repo", "v1.0", "transformer")
    assert parse_source("hf://org/repo/text_encoder/sub") == HubSource("org/repo", None, "text_encoder/sub")
    assert str(HubSource("org/repo", "abc", "vae")) == "hf://org/repo@abc/vae"
    assert parse_source("./weights") == Path("weights")
    with pytest.raises(CheckpointError, match="not a valid hub address"):
        parse_source("hf://just-one-part")
    with pytest.raises(CheckpointError, match="dataset repository"):
        parse_source("hf://datasets/org/data")


def test_offline_and_not_cached_says_what_to_download_and_where(offline_hub):
    with pytest.raises(CheckpointError) as e:
        resolve_source(
            "hf://no-such-org/no-such-model@main/transformer", patterns=["*.json", "*.safetensors"]
        )
    message = str(e.value)
    assert "HF_HUB_OFFLINE" in message and str(offline_hub) in message
    assert (
        "hf download no-such-org/no-such-model --revision main --include 'transformer/*.json' "
        f"'transformer/*.safetensors' --cache-dir {offline_hub}"
    ) in message


def _cache_snapshot(
    cache: Path, repo_id: str, commit: str = "0123456789abcdef0123456789abcdef01234567"
) -> Path:
    """Lay out a hub cache entry as huggingface_hub writes it (refs/main -> snapshots/<commit>)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    return snapshot


def test_offline_cached_snapshot_resolves_to_the_subfolder(offline_hub):
    snapshot = _cache_snapshot(offline_hub, "org/tiny")
    (snapshot / "transformer").mkdir()
    (snapshot / "transformer" / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, snapshot / "transformer" / "diffusion_pytorch_model.safetensors")
    assert resolve_source("hf://org/tiny/transformer") == snapshot / "transformer"


def test_offline_cached_without_weights_is_an_error(offline_hub):
    snapshot = _cache_snapshot(offline_hub, "org/partial")
    (snapshot / "vae").mkdir()
    (snapshot / "vae" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no files matching \*\.safetensors.*hf download org/partial"):
        resolve_source("hf://org/partial/vae")


def test_local_folder(tmp_path):
    assert resolve_source(tmp_path) == tmp_path
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_source(tmp_path / "missing")
