"""The execution layer: tensors meet compiled plans.

Above the compiler (``scorch.compiler``: operand types in, a plan with a loaded kernel out) and below the torch
front door (``scorch.ops``) and the layers that wrap calls (``_autograd``, ``deferred``, ``fusion``):

- ``evaluate``: an einsum call from operands to result (contraction trees, grouped products, dense torch steps);
- ``run``: one assignment, with the operand changes its schedule asks for, through the prepared-call cache;
- ``bind``: kernel arguments from tensors, the output allocated and wrapped, prepared calls;
- ``grouped``: grouped products in torch ops; ``convert``: format conversion by kernels; ``densify``: to_dense.
"""
from .bind import (SUPPORTED, argument, arguments, backend_for, cpu_backend, index_sizes,  # noqa: F401
                   level_info, structural_results, tensor_type)
from .convert import convert  # noqa: F401
from .evaluate import dense_result, einsum, explain, prepare  # noqa: F401
from .run import row_plan, run  # noqa: F401
