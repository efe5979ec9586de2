"""Recipes: runnable jobs written over the library (the main job)."""
