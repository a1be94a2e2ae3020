"""scorch: sparse deep learning as easy as dense.

``import scorch as torch``: every torch name works (names scorch does not define are torch's own objects),
and every op that meets a sparse operand (a ``scorch.SparseTensor`` or a torch sparse layout) runs sparse.
"""
import torch as _torch

from . import _forward

_forward.install()

from . import formats  # noqa: E402
from .formats import Format  # noqa: E402
from .sparse_tensor import SparseTensor  # noqa: E402
from .interop import (asformat, from_scipy, from_torch, sparse_bsc_tensor, sparse_bsr_tensor,  # noqa: E402
                      sparse_compressed_tensor, sparse_coo_tensor, sparse_csc_tensor, sparse_csr_tensor,
                      to_scipy, to_torch)
from . import nn, sparse  # noqa: E402
from . import ops  # noqa: E402,F401  (registers the sparse implementations of torch ops)
from .ops.linalg import einsum  # noqa: E402
from .ops.pattern import stored_only  # noqa: E402
from .engine import explain  # noqa: E402
from .compiler.caches import cache_info, clear_caches  # noqa: E402
from .compiler.schedule import Directives  # noqa: E402
from .rearrange import rearrange  # noqa: E402
from .deferred import deferral  # noqa: E402
from .fusion import compile  # noqa: E402
from . import fusion_epilogue  # noqa: E402,F401  (registers scorch.compile's elementwise epilogues)
from . import dynamo, dynamo_sparse  # noqa: E402,F401  (register scorch's custom ops for torch.compile)
from .nn.schedule import schedule  # noqa: E402
from ._stats import (DensifyError, DensifyWarning, fallback_limit, reset_stats, set_fallback_limit,  # noqa: E402
                     stats, strict)

spmm = sparse.routed(_torch.spmm)  # a sparse-only function: torch sparse operands run through scorch too

# ``__version__`` is torch's (forwarded below): version gates in torch code (``torch.__version__ >= "2.0"``) must
# see the torch they run on; scorch's own version is ``__scorch_version__``
__scorch_version__ = "0.1.0"

__getattr__, __dir__ = _forward.forward(globals(), _torch, routed=True)
