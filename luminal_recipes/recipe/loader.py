"""Load a recipe file: safe YAML, schema validation with located errors, extends, includes, module reference
checks.

A pipeline recipe may ``extends: base.yaml``, another pipeline recipe in its own folder: the two documents are
merged before validation (``yaml_source.merge_sources``: mappings key by key, anything else replaced whole), so
the recipe states only what differs; every value keeps the position of the file that wrote it. Bases may extend
further; a cycle is an error.

Includes (``include: [blocks.yaml]``), bases and a pipeline's model recipes may only name files inside the
folder tree of the recipe that was opened: ``../`` escapes, absolute paths elsewhere and symlinks pointing out
are rejected. Modules of included files are merged into one table; a name defined twice, a submodule naming an
unknown module, and modules that contain each other (a cycle) are errors with their positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import RecipeError
from ..files import not_regular
from .config_fields import FieldRule, field_rules
from .located import Located, Origin
from .paths import check_written, is_local
from .schema import DOCUMENT_KINDS, ModelRecipe, ModuleLibrary, ModuleSpec, ParamSpec, PipelineRecipe
from .suggest import did_you_mean, one_of
from .yaml_source import YamlSource, load_yaml, merge_sources


@dataclass
class LoadedRecipe:
    """A validated recipe with every module and parameter traced back to the file that defines it."""

    path: Path
    source: YamlSource
    doc: ModelRecipe | PipelineRecipe | ModuleLibrary
    modules: dict[str, Located[ModuleSpec]] = field(default_factory=dict)
    params: dict[str, Located[ParamSpec]] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)  # this file, the files it extends and every include
    extends: list[Path] = field(default_factory=list)  # the pipeline recipes it extends, nearest first
    # what the recipe (and its includes) do with each config.json field; None: no `config:` section anywhere
    config_fields: dict[str, FieldRule] | None = None
    # parameters a module library declares without a default (its `params:` entries with no `default:`): the
    # including recipe defines them, and each declaration's type, choices and ranges are checked on its value
    param_checks: dict[str, list[Located[ParamSpec]]] = field(default_factory=dict)
    tree: Path | None = None  # the folder tree its includes and local paths must stay in (resolved)

    @property
    def kind(self) -> str:
        return self.doc.kind

    @property
    def folder(self) -> Path:
        return self.path.parent

    def origin(self, *path: Any) -> Origin:
        return Origin(self.source, tuple(path))

    @property
    def root(self) -> str:
        assert isinstance(self.doc, ModelRecipe)
        return self.doc.root or ""


def load_recipe(
    path: str | Path, *, tree_root: Path | None = None, allowed: tuple[str, ...] = ("model", "pipeline")
) -> LoadedRecipe:
    """Load and check a recipe (model or pipeline; ``allowed`` may add ``modules``, a library of shared modules
    as `include:` reads it). ``tree_root`` bounds includes (default: its folder)."""
    path = Path(path)
    root = (tree_root or path.parent).resolve()
    source, bases = _extended(load_yaml(path), root, [path.resolve()])
    doc = validate_document(source, allowed=allowed)
    loaded = LoadedRecipe(path=path, source=source, doc=doc, files=[path, *bases], extends=bases, tree=root)
    _check_paths_as_written(loaded)
    if isinstance(doc, (ModelRecipe, ModuleLibrary)):
        _merge(loaded, doc, source)
        _load_includes(loaded, doc, source, root, [path.resolve()])
        _check_modules(loaded)
        if isinstance(doc, ModelRecipe):
            _choose_root(loaded)
    else:
        for name, spec in doc.params.items():
            loaded.params[name] = Located(spec, Origin(source, ("params", name)))
        for name, model in doc.models.items():
            inside_tree(Origin(source, ("models", name, "recipe")), path.parent, model.recipe, root)
    return loaded


def _extended(source: YamlSource, root: Path, chain: list[Path]) -> tuple[YamlSource, list[Path]]:
    """``source`` merged over the pipeline recipes it extends (nearest first), and their paths."""
    data = source.data
    if not isinstance(data, dict) or "extends" not in data:
        return source, []
    origin = Origin(source, ("extends",))
    relative = data["extends"]
    if not isinstance(relative, str) or not relative:
        raise origin.error(f"`extends` names one pipeline recipe file (e.g. extends: flux2.yaml), got "
                           f"{relative!r}.")
    if data.get("kind", "pipeline") != "pipeline":
        raise origin.error(f"`extends` is for pipeline recipes; a `kind: {data.get('kind')}` file shares modules "
                           f"with `include:` instead.")
    target = inside_tree(origin, source.file.parent, relative, root)
    if target.parent != source.file.resolve().parent:
        raise origin.error(f"'{relative}' is not in this recipe's folder; a recipe extends one beside it, so that "
                           f"the paths written in either mean the same files. Copy it into the folder.")
    if target in chain:
        cycle = " -> ".join(p.name for p in chain[chain.index(target):] + [target])
        raise origin.error(f"extends cycle: {cycle}; remove one of these `extends`.")
    base = load_yaml(target)
    kind = base.data.get("kind") if isinstance(base.data, dict) else None
    if kind != "pipeline":
        raise origin.error(f"'{relative}' is {f'a `kind: {kind}` recipe' if kind else 'not a recipe'}; `extends` "
                           f"takes a pipeline recipe (kind: pipeline).")
    base, further = _extended(base, root, chain + [target])
    # `accepts:` (the checkpoints `run --weights` without a recipe picks it for) is each file's own
    return merge_sources(base, source, not_inherited=("accepts",)), [target, *further]


def inside_tree(origin: Origin, folder: Path, relative: str, root: Path) -> Path:
    """Resolve ``relative`` against ``folder``; reject anything outside the recipe's folder tree."""
    target = Path(relative)
    resolved = (target if target.is_absolute() else folder / target).resolve()
    if not resolved.is_relative_to(root):
        raise origin.error(
            f"'{relative}' is outside this recipe's folder tree ({root}); recipes may only "
            f"include files in their own folder or below it. Copy the file into the folder."
        )
    kind = not_regular(resolved)
    if kind is not None:
        raise origin.error(f"'{relative}' is {kind} ({resolved}), not a YAML file; name a recipe file.")
    if not resolved.is_file():
        raise origin.error(
            f"'{relative}' does not exist (looked for {resolved}); paths are relative to the "
            f"file that names them."
        )
    return resolved


def _check_paths_as_written(loaded: LoadedRecipe) -> None:
    """Local paths the recipe names stay in its folder tree or in the checkpoint folder (``paths``); checked
    here as written, and again with symlinks resolved where they are opened."""
    doc, tree = loaded.doc, "this recipe's folder"
    written: list[tuple[tuple, str | None, str]] = []
    if isinstance(doc, PipelineRecipe):
        written += [(("weights",), doc.weights if is_local(doc.weights) else None, tree),
                    (("configs",), doc.configs, tree)]
        if doc.tokenizer is not None:
            written.append((("tokenizer", "path"), doc.tokenizer.path, "the checkpoint folder"))
        if doc.scheduler is not None:
            written.append((("scheduler", "config"), doc.scheduler.config, "the checkpoint folder"))
        written += [(("models", name, "weights"), model.weights, "the checkpoint folder")
                    for name, model in doc.models.items()]
    elif isinstance(doc, ModelRecipe):
        source = doc.weights.source
        written += [(("weights", "source"), source if is_local(source) else None, tree),
                    (("weights", "config"), doc.weights.config, "the checkpoint folder")]
    for path, text, inside in written:
        if text is not None:
            check_written(loaded.origin(*path), text, inside)


def validate_document(source: YamlSource, allowed: tuple[str, ...]) -> Any:
    """Pick the schema from ``kind`` and validate; pydantic errors become one located RecipeError."""
    data = source.data
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        raise source.error(
            (),
            f"a recipe is a YAML mapping starting with `kind: model` or `kind: pipeline`, "
            f"but this file holds {got}.",
        )
    kind = data.get("kind")
    if kind == "modules" and kind not in allowed:
        raise source.error(
            ("kind",),
            f"this is a `kind: modules` library (shared modules that model recipes `include:`), not a "
            f"{' or '.join(allowed)} recipe; use a recipe that includes it (`luminal-recipe validate` checks "
            f"the library itself).",
        )
    if kind not in allowed:
        where = ("kind",) if "kind" in data else ()
        hint = did_you_mean(str(kind), allowed) if kind is not None else ""
        raise source.error(where, f"`kind` must be one of {', '.join(allowed)}, got {kind!r}{hint}.")
    try:
        return DOCUMENT_KINDS[kind].model_validate(data)
    except ValidationError as exc:
        raise schema_error(source, exc) from None


def schema_error(source: YamlSource, exc: ValidationError) -> RecipeError:
    """Turn pydantic's errors into one paragraph; each problem located at its YAML node."""
    grouped: dict[tuple, list[dict]] = {}
    for err in exc.errors():
        grouped.setdefault(_data_path(source.data, err), []).append(err)
    parts = []
    for path, errors in grouped.items():
        err = errors[0]
        kind = err["type"]
        if kind in ("unknown_key", "removed_key"):
            key_path = path + (err["ctx"]["key"],)
            parts.append(f"{source.loc(key_path, key=True)}: {err['msg']}.")
        elif kind == "missing":
            field_name = err["loc"][-1]
            parts.append(f"{source.loc(path)}: missing required key '{field_name}'.")
        elif len(errors) > 1 and all(
            e["type"].endswith("_type") or e["type"].endswith("_parsing") for e in errors
        ):
            expected = sorted({_expected(e) for e in errors}, key=lambda e: (e == "true/false", e))
            parts.append(
                f"{source.loc(path)}: wrong type: got {_describe(err['input'])}, expected "
                f"{' or '.join(expected)}."
            )
        else:
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{source.loc(path)}: {msg} (got {_describe(err['input'])}).")
    shown = parts[:3]
    more = f" ({len(parts) - 3} more problems after these.)" if len(parts) > 3 else ""
    return RecipeError(" ".join(shown) + more)


def _data_path(data: Any, err: dict) -> tuple:
    """The part of pydantic's ``loc`` that indexes the YAML data (drops union tags such as 'int')."""
    path: list = []
    node = data
    loc = err["loc"]
    if err["type"] == "missing":
        loc = loc[:-1]
    for item in loc:
        key = "with" if item == "with_" else item
        if (
            isinstance(node, dict)
            and key in node
            or isinstance(node, list)
            and isinstance(key, int)
            and 0 <= key < len(node)
        ):
            node = node[key]
            path.append(key)
    return tuple(path)


def _expected(err: dict) -> str:
    names = {
        "int_type": "a number",
        "int_parsing": "a number",
        "float_type": "a number",
        "float_parsing": "a number",
        "bool_type": "true/false",
        "bool_parsing": "true/false",
        "string_type": "a string",
        "list_type": "a list",
        "dict_type": "a mapping",
        "model_type": "a mapping",
    }
    return names.get(err["type"], err["msg"].removeprefix("Input should be "))


def _describe(value: Any) -> str:
    kinds = {
        dict: "a mapping",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "nothing (null)",
    }
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{kinds.get(type(value), type(value).__name__)} {text}" if value is not None else "null"


def _merge(loaded: LoadedRecipe, doc: ModelRecipe | ModuleLibrary, source: YamlSource) -> None:
    for name, spec in doc.params.items():
        origin = Origin(source, ("params", name))
        if isinstance(doc, ModuleLibrary) and "default" not in spec.model_fields_set:
            loaded.param_checks.setdefault(name, []).append(Located(spec, origin))
            continue
        if isinstance(doc, ModuleLibrary) and name in loaded.params and \
                loaded.params[name].origin.source is loaded.source:
            # a library's default, which the including recipe overrides: its type and ranges still hold
            loaded.param_checks.setdefault(name, []).append(Located(spec, origin))
            continue
        if name in loaded.params:
            first = loaded.params[name].origin.loc(key=True)
            raise origin.error(
                f"parameter '{name}' is already defined at {first}; rename one of them.", key=True
            )
        loaded.params[name] = Located(spec, origin)
    for name, spec in doc.modules.items():
        origin = Origin(source, ("modules", name))
        if name in loaded.modules:
            first = loaded.modules[name].origin.loc(key=True)
            raise origin.error(
                f"module '{name}' is already defined at {first}; rename one of them.", key=True
            )
        loaded.modules[name] = Located(spec, origin)
    if doc.config is not None:
        rules = loaded.config_fields if loaded.config_fields is not None else {}
        for rule in field_rules(doc.config, Origin(source, ("config",))):
            if rule.path in rules:
                first = rules[rule.path].origin.loc(key=True)
                raise rule.origin.error(
                    f"config field '{rule.path}' is already declared at {first}; keep one of them.", key=True
                )
            rules[rule.path] = rule
        loaded.config_fields = rules


def _load_includes(
    loaded: LoadedRecipe, doc: ModelRecipe | ModuleLibrary, source: YamlSource, root: Path, stack: list[Path]
) -> None:
    for index, relative in enumerate(doc.include):
        origin = Origin(source, ("include", index))
        target = inside_tree(origin, source.file.parent, relative, root)
        if target in stack:
            chain = " -> ".join(p.name for p in stack[stack.index(target) :] + [target])
            raise origin.error(f"include cycle: {chain}; remove one of these includes.")
        if target in (p.resolve() for p in loaded.files):
            continue  # already merged through another include
        included = load_yaml(target)
        library = validate_document(included, allowed=("modules",))
        loaded.files.append(target)
        _merge(loaded, library, included)
        _load_includes(loaded, library, included, root, stack + [target])


def _check_modules(loaded: LoadedRecipe) -> None:
    """Every submodule names a known module, and no module contains itself (directly or not)."""
    modules = loaded.modules
    for name, located in modules.items():
        for sub_name, sub in located.value.submodules.items():
            if sub.module not in modules:
                origin = located.origin.at("submodules", sub_name)
                where = origin.at("module") if origin.source.has(origin.path + ("module",)) else origin
                raise where.error(
                    f"submodule '{sub_name}' of module '{name}' uses unknown module "
                    f"'{sub.module}'{did_you_mean(sub.module, modules)}; modules defined: "
                    f"{one_of(modules)}."
                )
    state: dict[str, str] = {}

    def visit(name: str, trail: list[tuple[str, str]]) -> None:
        state[name] = "active"
        for sub_name, sub in modules[name].value.submodules.items():
            step = trail + [(name, sub_name)]
            if state.get(sub.module) == "active":
                start = next(i for i, (mod, _) in enumerate(step) if mod == sub.module)
                cycle = (
                    " -> ".join(f"{mod} (submodule '{via}')" for mod, via in step[start:])
                    + f" -> {sub.module}"
                )
                origin = modules[name].origin.at("submodules", sub_name)
                raise origin.error(
                    f"module reference cycle: {cycle}; a module cannot contain itself. Use "
                    f"`repeat:` for repeated layers instead of recursion.",
                    key=True,
                )
            if state.get(sub.module) is None:
                visit(sub.module, step)
        state[name] = "done"

    for name in modules:
        if name not in state:
            visit(name, [])


def _choose_root(loaded: LoadedRecipe) -> None:
    doc = loaded.doc
    assert isinstance(doc, ModelRecipe)
    if not loaded.modules:
        raise loaded.source.error(
            (), "a model recipe needs `modules:` with at least one module (see recipes/README.md)."
        )
    if doc.root is not None:
        if doc.root not in loaded.modules:
            raise loaded.origin("root").error(
                f"root module '{doc.root}' is not defined"
                f"{did_you_mean(doc.root, loaded.modules)}; modules: "
                f"{one_of(loaded.modules)}."
            )
        return
    used = {sub.module for m in loaded.modules.values() for sub in m.value.submodules.values()}
    unused = [name for name in doc.modules if name not in used]
    if len(unused) != 1:
        raise loaded.source.error(
            (),
            f"cannot tell which module is the model; add `root: NAME` (candidates: "
            f"{one_of(unused or loaded.modules)}).",
        )
    doc.root = unused[0]
