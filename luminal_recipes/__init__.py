"""luminal-recipes: run generative models from declarative YAML recipes."""

from importlib.metadata import PackageNotFoundError, version

from .openblas_spin import limit_openblas_spin

# every entry (the CLI, the Python API, the server, the torch backend) imports this package first: OpenBLAS's idle
# spinning is limited here, before numpy loads it (a no-op when the caller imported numpy earlier)
limit_openblas_spin()

try:
    __version__ = version("luminal-recipes")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"


def __getattr__(name: str):
    """``Pipeline`` (the Python API, ``luminal_recipes/api.py``) and ``torch_backend`` (the torch.compile backend
    package, callable with options: docs/torch.md), imported on first use so that ``import luminal_recipes``
    stays light (no torch)."""
    if name in ("Pipeline", "PipelineOutput", "LanguageModelPipeline"):
        from . import api

        return getattr(api, name)
    if name == "torch_backend":
        import importlib

        return importlib.import_module(".torch_backend", __name__)
    raise AttributeError(f"module 'luminal_recipes' has no attribute {name!r}")


__all__ = ["LanguageModelPipeline", "Pipeline", "PipelineOutput", "__version__", "load_recipe"]


def load_recipe(recipe, weights=None, **options):
    """A language-model recipe with its checkpoint, ready to ``.generate(prompt, ...)`` replies and score
    ``.logits(prompt)`` (``luminal_recipes.tasks.generation.LanguageModel``; ``options``: ``sets``, ``runtime``,
    ``max_memory`` (bytes), ``compile``, ``context``, ``chat_template``, ``allow_nonfinite`` (generate even when
    the logits hold NaN or infinity; by default ``NonFiniteError`` stops it)). Compiling and loading happen on the
    first call (or ``.prepare()``)::

        from luminal_recipes import load_recipe
        lm = load_recipe("recipes/llama.yaml", weights="path/to/Llama-3.2-1B-Instruct")
        print(lm.generate("Name three rivers.", max_new_tokens=64).text)
    """
    import inspect

    from .errors import InputError
    from .recipe.suggest import did_you_mean
    from .tasks.generation import LanguageModel

    known = [name for name in inspect.signature(LanguageModel).parameters if name not in ("recipe", "weights")]
    for name in options:
        if name not in known:
            raise InputError(f"load_recipe(..., {name}=...): unknown option{did_you_mean(name, known)}; the options "
                             f"are {', '.join(known)}.")
    return LanguageModel(recipe, weights=weights, **options)

