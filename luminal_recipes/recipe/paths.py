"""Paths written in a recipe stay inside the recipe's folder tree or inside the checkpoint folder.

A recipe is data that may come from anyone, so it must not make the tool open files elsewhere
(``scheduler: {config: /etc/passwd}``, ``tokenizer: {path: /etc}``, ``weights: ../../../../etc``). Each path is
checked twice: when the recipe is loaded, as written (relative, never climbing out with ``..``), at its YAML
line; and when it is used, with symbolic links resolved, against the folder its author controls: the recipe's
tree for the recipe's own files and for a checkpoint the recipe names (``weights: checkpoint``), the
repository's cache folder for a hub checkpoint (snapshots are symlinks into its ``blobs/``). A checkpoint given
on the command line (``--weights``) is the user's own choice, and so are the links inside it (a folder
assembled from symlinks to components elsewhere is fine): paths into it are checked as written only.

Beyond the paths the recipe writes, every file read from a checkpoint the recipe names (tokenizer files, chat
templates, configs, safetensors files...) obeys the same rule: ``guard_checkpoint``, called where such a
checkpoint is resolved, fences the folder (``files.fence``): a link under it leading out is refused then, before
any work, and every file opened under it later is checked again as it is opened.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from .located import Origin

HUB = "hf://"


def check_written(origin: Origin, text: str, inside: str) -> None:
    """Refuse, at ``origin``, a path that is absolute or climbs out of the folder it is relative to."""
    path = PurePosixPath(text.replace("\\", "/"))
    if text.startswith("~") or path.is_absolute():
        raise origin.error(f"'{text}' is an absolute path; paths in a recipe are relative to {inside} and stay "
                           f"inside it. Copy the file into {inside}.")
    depth = 0
    for part in path.parts:
        depth += -1 if part == ".." else (0 if part == "." else 1)
        if depth < 0:
            raise origin.error(f"'{text}' climbs out of {inside} with '..'; paths in a recipe stay inside "
                               f"{inside}. Copy the file into it.")


def confined(origin: Origin, base: Path, text: str, inside: str, roots: Iterable[Path] | None) -> Path:
    """``base / text``, after checking it as written and, unless ``roots`` is None (a folder the user chose,
    links and all), that with symlinks resolved it lies inside one of ``roots``; a located error otherwise."""
    check_written(origin, text, inside)
    target = Path(base) / text
    if roots is None:
        return target
    resolved = target.resolve()
    allowed = [Path(r).resolve() for r in roots]
    if not any(resolved.is_relative_to(root) for root in allowed):
        raise origin.error(f"'{text}' resolves to {resolved} through a symbolic link, outside {inside} "
                           f"({allowed[0]}); paths in a recipe stay inside it. Copy the file into it.")
    return target


def guard_checkpoint(origin: Origin | None, folder: Path, user_given: bool, tree: Path | None,
                     source: str | None = None) -> list[Path] | None:
    """``checkpoint_roots``, and the checkpoint folder fenced to them (``files.fence``; a fence lifted for a folder
    the user named): a symbolic link under it leading out is refused now, at ``origin`` (the recipe line naming
    the checkpoint), and every file opened under it later is checked as it is opened."""
    from ..files import fence

    roots = checkpoint_roots(folder, user_given, tree, source)
    if roots is None:
        fence(folder, None)
        return None
    if source is not None and str(source).startswith("python://"):
        inside = "the package's checkpoint folder"
    elif roots[0].name.startswith("models--"):
        inside = "the repository's folder in the hub cache"
    else:
        inside = "the recipe's folder tree"
    where = f"{origin.loc()}: the checkpoint the recipe names" if origin is not None else "the recipe's checkpoint"
    fence(folder, roots, where, inside, ", or pass the checkpoint with --weights to use it, links and all")
    return roots


def checkpoint_roots(folder: Path, user_given: bool, tree: Path | None,
                     source: str | None = None) -> list[Path] | None:
    """Where links under a checkpoint folder may lead: anywhere (None) when the user named the folder; else
    inside the recipe's ``tree`` (a local checkpoint the recipe names), inside the folder itself for one shipped
    in an installed package (``source`` ``python://...``) or, for a snapshot in the hub cache
    (``models--org--name/snapshots/<rev>/...``), inside the repository's cache folder that holds ``blobs/``."""
    if user_given:
        return None
    resolved = Path(folder).resolve()
    if source is not None and str(source).startswith("python://"):
        return [resolved]
    for parent in resolved.parents:
        if parent.name == "snapshots" and parent.parent.name.startswith("models--"):
            return [parent.parent]
    return [tree if tree is not None else resolved]


def is_local(source: str | None) -> bool:
    """A folder path (relative to the recipe), not a Hub repository or an installed package."""
    from ..weights.sources import is_named

    return source is not None and not is_named(source)
