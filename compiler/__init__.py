"""The search compiler (imported as ``luminal_recipes.compiler``): HLIR -> egglog -> candidate Programs."""
