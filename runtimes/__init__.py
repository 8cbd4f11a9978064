"""Runtimes (imported as ``luminal_recipes.runtimes``): execute compiled Programs within a memory budget."""
