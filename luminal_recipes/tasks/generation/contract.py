"""What a model recipe must declare for `run` to generate text with it (recipes/README.md, "Language models").

A language model is a `kind: model` recipe with a `generation:` section, the dims ``seq ctx cache keep`` (and
usually ``batch``), the inputs ``tokens [batch, seq] i32`` and ``positions [seq] i32``, the output ``logits
[batch, keep, vocab]`` and at least one module state (its KV cache). Everything missing is named at once, at the
recipe line it concerns.
"""

from __future__ import annotations

from ...errors import RecipeError
from ...graph.symbolic import Expr
from ...recipe.loader import LoadedRecipe
from ...recipe.schema import ModelRecipe

DIMS = ("seq", "ctx", "cache", "keep")
GUIDE = "see \"Language models\" in recipes/README.md"


def check_static(recipe: LoadedRecipe) -> None:
    """The recipe's declarations (before anything is built)."""
    doc = recipe.doc
    if not isinstance(doc, ModelRecipe) or doc.generation is None:
        where = recipe.origin("kind") if isinstance(doc, ModelRecipe) else recipe.origin("kind")
        what = "a model recipe without a `generation:` section" if isinstance(doc, ModelRecipe) else \
            f"a {getattr(doc, 'kind', 'pipeline')} recipe"
        raise where.error(f"this is {what}, not a language model: text generation (--max-new-tokens, "
                          f"--temperature, --stdio...) runs a model recipe that declares `generation:`; {GUIDE}")
    problems = []
    missing_dims = [d for d in DIMS if d not in doc.dims]
    if missing_dims:
        problems.append(f"{recipe.origin('dims').loc(key=True)}: dims lack {', '.join(missing_dims)} (new tokens, "
                        f"key positions attended, the KV cache's length, logits kept)")
    wants = {"tokens": ("i32", 2, "[batch, seq]"), "positions": ("i32", 1, "[seq]")}
    for name, (dtype, rank, shape) in wants.items():
        spec = doc.inputs.get(name)
        if spec is None:
            problems.append(f"{recipe.origin('inputs').loc(key=True)}: no input '{name}' {shape} {dtype}")
        elif spec.dtype != dtype or len(spec.shape) != rank or str(spec.shape[-1]) != "seq":
            problems.append(f"{recipe.origin('inputs', name).loc(key=True)}: input '{name}' must be {shape} "
                            f"{dtype}")
    others = sorted(set(doc.inputs) - set(wants))
    if others:
        problems.append(f"{recipe.origin('inputs', others[0]).loc(key=True)}: input '{others[0]}' is not one "
                        f"generation provides (it feeds tokens and positions only)")
    if "logits" not in (doc.outputs or []):
        problems.append(f"{recipe.origin('outputs').loc(key=True) if doc.outputs else recipe.origin('kind').loc()}"
                        f": no output 'logits' [batch, keep, vocab]")
    if not any(m.value.states for m in recipe.modules.values()):
        problems.append(f"{recipe.origin('modules').loc(key=True)}: no module declares `states:` (the KV "
                        f"cache generation appends to)")
    if problems:
        raise RecipeError(f"{recipe.source.display} is not a language model `run` can generate with "
                          f"({len(problems)} problem{'s' * (len(problems) != 1)}; {GUIDE}):\n"
                          + "\n".join(f"  - {p}" for p in problems))


def check_built(model) -> None:
    """The built graph: logits of rank 3 ending in the vocabulary, states that exist."""
    recipe = model.recipe
    logits = model.graph.tensor("logits")
    keep = logits.shape[1] if len(logits.shape) == 3 else None
    if len(logits.shape) != 3 or not (isinstance(keep, Expr) and str(keep) == "keep"):
        raise recipe.origin("outputs").error(
            f"output 'logits' has shape {tuple(map(str, logits.shape))}; generation reads [batch, keep, vocab] (the "
            f"last `keep` positions: narrow(h, 1, seq - keep, seq) before the head); {GUIDE}", key=True)
    if not isinstance(logits.shape[2], int):
        raise recipe.origin("outputs").error("output 'logits': its last axis (the vocabulary) must be a fixed size",
                                             key=True)
    if not model.graph.inputs("state"):
        raise recipe.origin("modules").error(f"no state is used by the forward (update_cache writes the KV cache); "
                                             f"{GUIDE}", key=True)
