"""The execution layer: tensors meet compiled plans.

Above the compiler (``scorch.compiler``: operand types in, a plan with a loaded kernel out) and below the torch
front door (``scorch.ops``) and the layers that wrap calls (``_autograd``, ``deferred``, ``fusion``):

- ``evaluate``: an einsum call from operands to result (contraction trees, grouped products, dense torch steps);
- ``run``: one assignment, with the steps its schedule asks for (``run.Steps``: a transposition, the output's
  order, dense operands relaid), applied once and replayed;
- ``prepared``: the prepared call of a repeated call (one record type, ``Prepared``), and where it is found
  again: on the tensor, by signature, on disk; ``direct``: its C form;
- ``args``: kernel arguments from tensors; ``bind``: a plan run on tensors, the output allocated and wrapped;
- ``grouped``: grouped products in torch ops; ``convert``: every format conversion, torch layouts included;
  ``densify``: to_dense by a kernel; ``diagonal``: the diagonals an einsum with a repeated letter takes first.
"""
from .args import SUPPORTED, argument, arguments, level_info, tensor_type  # noqa: F401
from .bind import backend_for, cpu_backend, index_sizes, structural_results  # noqa: F401
from .convert import asformat, convert, from_torch, to_torch  # noqa: F401
from .evaluate import dense_result, einsum, explain, prepare, scaled  # noqa: F401
from .prepared import SDDMM, keep_product, keep_sddmm, kept_product, kept_sddmm, product_operators  # noqa: F401
from .direct import when_ready as when_direct  # noqa: F401
from .run import explaining, row_plan, run  # noqa: F401

from ..rules import RULES  # noqa: E402
from .densify import to_dense  # noqa: E402

RULES.register(to_dense=to_dense, asformat=asformat, to_torch=to_torch)

# the memo tables of the layers below the compiler's cache owner, listed and emptied with the others
from .. import sparse_tensor as _sparse_tensor  # noqa: E402
from ..compiler.caches import register  # noqa: E402
from ..formats import format as _format  # noqa: E402

register("level-bounds", "level bounds per format and shape", _format.BOUNDS.__len__, _format.BOUNDS.clear)
register("formats-by-text", "formats by their text, for unpickling (the named ones known from import)",
         _format.BY_TEXT.__len__, _format.BY_TEXT.clear)
register("pattern-ones", "ones at a pattern's stored positions, per size, dtype and device",
         _sparse_tensor.ONES.__len__, _sparse_tensor.ONES.clear)
