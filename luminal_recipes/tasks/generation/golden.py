"""Golden-text checks: regenerate the replies a manifest lists and compare them with what was recorded.

A text manifest (``tests/golden/texts.yaml``) lists ``texts:``, each with a ``name``, the ``recipe`` and
``weights`` (relative to the manifest, ``hf://...`` or ``python://...``; a folder or a GGUF file), the ``prompt``
and the generation settings (``chat``, ``system``, ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``,
``repetition_penalty``, ``seed``, ``stop``). A case is checked in one or both ways:

- **token ids** (``ids: true``; the tiny checkpoints): the reply's ids must equal those recorded in
  ``<manifest folder>/texts/<name>.json`` exactly (greedy decoding on one machine and program is exact);
  ``update`` rewrites that file.
- **concept groups** (``concepts: [[paris], [france, french]]``; real models): every group must have at least one
  of its terms in the normalised reply (ANSI escapes stripped, whitespace collapsed, case-folded); a failure lists
  the groups expected and the ones missing.

A case whose weights cannot be had here (a Hub checkpoint offline, a package not installed) is reported as skipped,
not passed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, LuminalError, PipelineError
from ...files import MAX_JSON_BYTES, present, read_json
from ...pipeline.atomic_file import atomic_write

SETTINGS = ("chat", "system", "max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop")
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


@dataclass
class TextCase:
    name: str
    recipe: Path
    weights: str
    prompt: str
    settings: dict[str, Any] = field(default_factory=dict)
    ids: bool = False
    concepts: list[list[str]] = field(default_factory=list)
    record: Path | None = None  # where the expected ids are kept


@dataclass
class TextResult:
    case: TextCase
    status: str  # "ok" | "FAIL" | "skip"
    message: str
    ids: list[int] | None = None
    text: str | None = None

    @property
    def ok(self) -> bool:
        return self.status != "FAIL"


def normalise(text: str) -> str:
    return " ".join(ANSI.sub("", text).split()).casefold()


def missing_concepts(text: str, groups: list[list[str]]) -> list[list[str]]:
    """The groups none of whose terms appears in the normalised ``text``."""
    norm = normalise(text)
    return [g for g in groups if not any(normalise(term) in norm for term in g)]


def is_text_manifest(path: Path) -> bool:
    """Whether ``path`` is a text manifest (one that cannot be read is left to the image manifest's reader to
    report)."""
    from ...pipeline.golden import read_manifest

    try:
        data = read_manifest(Path(path)).data
    except LuminalError:
        return False
    return isinstance(data, dict) and "texts" in data


def load_manifest(path: Path) -> list[TextCase]:
    """The cases of a text manifest; each one's record (``texts/<name>.json``, read and written) lies inside the
    manifest's folder, checked here at the entry's ``name`` line, before any model is loaded."""
    from ...pipeline.golden import golden_file, read_manifest

    path = Path(path)
    source = read_manifest(path)
    data = source.data
    try:
        cases = []
        for index, item in enumerate(data["texts"]):
            unknown = set(item) - {"name", "recipe", "weights", "prompt", "ids", "concepts", *SETTINGS}
            if unknown:
                raise ValueError(f"entry '{item.get('name')}' has unknown keys {sorted(unknown)}")
            weights = str(item["weights"])
            if not weights.startswith(("hf://", "python://")):
                weights = str((path.parent / weights).resolve())
            concepts = [[str(t) for t in (g if isinstance(g, list) else [g])] for g in item.get("concepts", [])]
            record = golden_file(source, ("texts", index, "name"), f"texts/{item['name']}.json")
            case = TextCase(str(item["name"]), (path.parent / item["recipe"]).resolve(), weights, str(item["prompt"]),
                            {k: item[k] for k in SETTINGS if k in item}, bool(item.get("ids", False)), concepts,
                            record)
            if not case.ids and not case.concepts:
                raise ValueError(f"entry '{case.name}' checks nothing: give `ids: true` or `concepts:`")
            cases.append(case)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PipelineError(f"{path}: invalid text golden manifest ({exc}); it needs `texts:` entries with name, "
                            f"recipe, weights, prompt and `ids: true` or `concepts:`") from None
    return cases


def generate(case: TextCase, models: dict) -> tuple[list[int], str]:
    from .model import LanguageModel

    key = (str(case.recipe), case.weights)
    if key not in models:
        models[key] = LanguageModel(case.recipe, weights=case.weights)
    settings = dict(case.settings)
    settings.setdefault("max_new_tokens", 32)
    reply = models[key].generate(case.prompt, **settings)
    return reply.ids, reply.text


def _unavailable(case: TextCase, exc: LuminalError) -> bool:
    return case.weights.startswith(("hf://", "python://")) and isinstance(exc, CheckpointError)


def check(manifest: Path) -> list[TextResult]:
    models: dict = {}
    results = []
    for case in load_manifest(manifest):
        try:
            ids, text = generate(case, models)
        except LuminalError as exc:
            if _unavailable(case, exc):
                results.append(TextResult(case, "skip", f"weights not available here ({str(exc)[:120]})"))
                continue
            raise
        problems = []
        if case.ids:
            if not present(case.record):
                problems.append(f"no recorded ids ({case.record}); run `luminal-recipe golden update`")
            else:
                want = _recorded_ids(case.record)
                if ids != want:
                    at = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
                    problems.append(f"token ids differ from {case.record.name} at position {at} (got {ids[at:at + 4]}, "
                                    f"expected {want[at:at + 4]}; {len(ids)} vs {len(want)} tokens)")
        missing = missing_concepts(text, case.concepts)
        if missing:
            problems.append(f"concept groups missing: {missing} (expected all of {case.concepts}) in {text[:200]!r}")
        ok_message = ", ".join(filter(None, [f"{len(ids)} token ids identical" if case.ids else "",
                                             f"{len(case.concepts)} concept groups present" if case.concepts else ""]))
        results.append(TextResult(case, "FAIL" if problems else "ok", "; ".join(problems) or ok_message, ids, text))
    return results


def _recorded_ids(record: Path) -> list[int]:
    try:
        data = read_json(record, "a golden record", MAX_JSON_BYTES, PipelineError,
                         fix="run `luminal-recipe golden update` to record it again")
    except OSError as exc:
        raise PipelineError(f"{record}: cannot read the golden record ({exc.strerror or exc}); run "
                            f"`luminal-recipe golden update`") from None
    ids = data.get("ids") if isinstance(data, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise PipelineError(f"{record}: 'ids' is not a list of token ids; run `luminal-recipe golden update`")
    return ids


def update(manifest: Path) -> list[Path]:
    """Record the current replies' ids of the ``ids: true`` cases."""
    models: dict = {}
    replies = [(case, *generate(case, models)) for case in load_manifest(manifest) if case.ids]
    written = []  # every reply made before any record is replaced: a case that fails changes nothing
    for case, ids, text in replies:
        case.record.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps({"prompt": case.prompt, "settings": case.settings, "ids": ids, "text": text},
                          ensure_ascii=False) + "\n"
        atomic_write(case.record, lambda handle, data=data: handle.write(data.encode("utf-8")), overwrite=True,
                     what="golden")
        written.append(case.record)
    return written
