"""scorch's kernel benchmark suite: ``python -m benchmarks [--quick] [--threads N] [--repeat N] [--only ...]``.

Nothing here imports torch at package import time: ``__main__`` sets ``OMP_NUM_THREADS`` first.
"""

#: the case groups, in run order (``--only`` picks among them)
KERNEL_GROUPS = ("spmm", "sddmm", "spmv", "spgemm", "addmul", "chain", "mttkrp", "real", "scaling", "linear", "half", "overhead")
APP_GROUPS = ("gnn", "moe", "recsys", "transformer", "sparsify", "compile")
#: pruned models against their dense selves (BERT-base, a Llama-style MLP's projections: ``models.py``)
MODEL_GROUPS = ("models",)
GROUPS = KERNEL_GROUPS + APP_GROUPS + MODEL_GROUPS
#: names for several groups at once in ``--only``
ALIASES = {"kernels": KERNEL_GROUPS, "apps": APP_GROUPS}
