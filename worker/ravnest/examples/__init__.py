"""Built-in example models and datasets (no download needed: they ship with installed packages)."""
