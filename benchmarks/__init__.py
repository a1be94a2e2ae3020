"""scorch's kernel benchmark suite: ``python -m benchmarks [--quick] [--threads N] [--repeat N] [--only ...]``.

Nothing here imports torch at package import time: ``__main__`` sets ``OMP_NUM_THREADS`` first.
"""

#: the case groups, in run order (``--only`` picks among them)
GROUPS = ("spmm", "sddmm", "spmv", "spgemm", "addmul", "chain", "mttkrp", "overhead")
