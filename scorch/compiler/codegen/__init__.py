"""Code generators: loop IR -> source text (``cpp``: C++ with OpenMP for the CPU; ``cuda``: CUDA, whose
source also runs on the CPU under an emulation for tests)."""
