"""Code generators: loop IR -> source text (``cpp`` for CPU with OpenMP; ``cuda`` later)."""
