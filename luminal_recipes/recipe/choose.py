"""Which shipped recipe runs a checkpoint, from what the checkpoint says it is (``run --weights W`` with no recipe,
``Pipeline.from_pretrained(W)``).

What the checkpoint says: a diffusers pipeline folder its ``model_index.json`` ``_class_name``; a transformers
folder its ``config.json`` ``architectures`` (then ``model_type``); a single ``.gguf`` file its
``general.architecture`` key (read alone, with the ``gguf`` package's ``GGUFReader``). What a recipe runs is data
in the recipe: its ``accepts:`` block (``recipe/schema.py`` ``AcceptsSpec``), the recipe file's own (``extends:``
does not pass it on: a variant declares its own, or is chosen only by name or by its default checkpoint).

The choice, in order: a recipe whose own default checkpoint (``weights:``) is the one given (the tiny checkpoints
shipped in the repository pick their tiny recipes); else the one recipe whose ``accepts:`` matches (architectures
before model types). None or several: ``RecipeError`` listing the recipes that exist for what was found."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, RecipeError
from ..files import MAX_JSON_BYTES, present, read_json

#: the recipes shipped with the package (the repository's recipes/ folder)
RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


@dataclass(frozen=True)
class Identity:
    """What a checkpoint says it is: ``kind`` is ``model_index``, ``config`` or ``gguf``; ``names`` the values
    found (pipeline class; architectures; GGUF architecture); ``model_type`` from a config.json."""

    kind: str
    names: tuple[str, ...]
    model_type: str | None
    where: str  # the file read

    def describe(self) -> str:
        what = {"model_index": "_class_name", "config": "architectures", "gguf": "general.architecture"}[self.kind]
        found = f"{what} {', '.join(self.names) if self.names else '(none)'}"
        if self.model_type is not None:
            found += f", model_type {self.model_type}"
        return f"{self.where}: {found}"


def identify(weights: str | Path) -> Identity:
    """What ``weights`` (a folder, ``hf://org/repo[@rev][/sub]``, ``python://...`` or a ``.gguf`` file) says it
    is; CheckpointError when it says nothing (no model_index.json, config.json or GGUF file)."""
    text = str(weights)
    if text.lower().endswith(".gguf") and not text.startswith("hf://"):
        return _gguf_identity(Path(text))
    from ..weights.sources import resolve_source

    folder = Path(resolve_source(text, patterns=("model_index.json", "config.json")))
    if folder.is_file():
        raise CheckpointError(f"--weights {text}: a file, not a checkpoint folder; give a folder (diffusers or "
                              f"transformers layout) or a .gguf file")
    index = folder / "model_index.json"
    if present(index):
        data = read_json(index, "model_index.json", MAX_JSON_BYTES, CheckpointError)
        name = data.get("_class_name") if isinstance(data, dict) else None
        return Identity("model_index", (name,) if isinstance(name, str) else (), None, str(index))
    config = folder / "config.json"
    if present(config):
        data = read_json(config, "config.json", MAX_JSON_BYTES, CheckpointError)
        data = data if isinstance(data, dict) else {}
        archs = data.get("architectures")
        archs = tuple(a for a in archs if isinstance(a, str)) if isinstance(archs, list) else ()
        model_type = data.get("model_type") if isinstance(data.get("model_type"), str) else None
        return Identity("config", archs, model_type, str(config))
    raise CheckpointError(f"--weights {text}: {folder} holds neither model_index.json (a diffusers pipeline) nor "
                          f"config.json (a transformers model), so the recipe cannot be chosen from it; name the "
                          f"recipe: luminal-recipe run RECIPE --weights {text} ...")


def _gguf_identity(path: Path) -> Identity:
    if not path.is_file():
        raise CheckpointError(f"--weights {path}: no such GGUF file")
    from ..weights.gguf_io import read_gguf

    try:
        reader = read_gguf(path)  # the one GGUF reader (light on a large vocabulary; damaged files located)
    except ImportError:  # declared in pyproject.toml; a broken install
        raise CheckpointError(f"--weights {path}: reading a GGUF file needs the `gguf` package "
                              f"(pip install gguf)") from None
    try:
        field = reader.fields.get("general.architecture")
        value = field.contents() if field is not None else None
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise CheckpointError(f"--weights {path}: cannot read it as a GGUF file ({exc})") from None
    if not isinstance(value, str):
        raise CheckpointError(f"--weights {path}: the GGUF file has no `general.architecture` key, so the recipe "
                              f"cannot be chosen from it; name the recipe")
    return Identity("gguf", (value,), None, str(path))


def _shipped(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.yaml") if p.is_file())


def _default_checkpoint_matches(recipe: Path, weights: str) -> bool:
    """Whether the recipe file's own default checkpoint (`weights:` of a pipeline, `weights.source` of a model)
    is ``weights`` (the same folder, or the same hub repository)."""
    from .yaml_source import load_yaml

    data = load_yaml(recipe).data
    default = data.get("weights") if isinstance(data, dict) else None
    if isinstance(default, dict):
        default = default.get("source")
    if not isinstance(default, str) or not default:
        return False
    if default.startswith(("hf://", "python://")) or weights.startswith(("hf://", "python://")):
        return default.rstrip("/") == weights.rstrip("/")
    try:
        return (recipe.parent / default).resolve() == Path(weights).resolve()
    except OSError:
        return False


def choose_recipe(weights: str | Path, folder: Path = RECIPES_DIR) -> Path:
    """The recipe of ``folder`` (the shipped recipes by default) that runs ``weights``; RecipeError naming what
    the checkpoint says and the recipes that exist for it when none or several fit."""
    from .loader import load_recipe

    text = str(weights)
    recipes = _shipped(folder)
    own = [r for r in recipes if _loads(r) and _default_checkpoint_matches(r, text)]
    if len(own) == 1:
        return own[0]
    found = identify(text)
    accepting = {}
    for path in recipes:
        if not _loads(path):
            continue
        accepts = load_recipe(path).doc.accepts
        if accepts is not None:
            accepting[path] = accepts
    if found.kind == "model_index":
        matches = [p for p, a in accepting.items() if set(found.names) & set(a.model_index)]
    elif found.kind == "gguf":
        matches = [p for p, a in accepting.items() if set(found.names) & set(a.gguf)]
    else:
        matches = [p for p, a in accepting.items() if set(found.names) & set(a.architectures)]
        if not matches and found.model_type is not None:
            matches = [p for p, a in accepting.items() if found.model_type in a.model_types]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise RecipeError(f"--weights {text}: {found.describe()} fits several recipes: "
                          f"{', '.join(str(p) for p in matches)}; name one: luminal-recipe run RECIPE --weights "
                          f"{text} ...")
    field = {"model_index": "model_index", "gguf": "gguf", "config": "architectures"}[found.kind]
    known = sorted({f"{name} ({p.name})" for p, a in accepting.items() for name in getattr(a, field)})
    raise RecipeError(f"--weights {text}: {found.describe()}; no recipe in {folder} accepts it (recipes declare "
                      f"what they run in `accepts:`). Recipes exist for {field}: {', '.join(known) or 'none'}. "
                      f"Name a recipe (luminal-recipe run RECIPE --weights {text}), or write one "
                      f"(recipes/README.md).")


def _loads(path: Path) -> bool:
    """A shipped file that is a model or pipeline recipe (not a module library)."""
    from .yaml_source import load_yaml

    data = load_yaml(path).data
    return isinstance(data, dict) and data.get("kind") in ("model", "pipeline")
