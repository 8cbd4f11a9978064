"""Text generation with language-model recipes: `luminal-recipe run RECIPE --prompt ...` and the Python API
``LanguageModel`` (``luminal_recipes.load_recipe``). See recipes/README.md, "Language models"."""

from .model import Generation, LanguageModel

__all__ = ["Generation", "LanguageModel"]
