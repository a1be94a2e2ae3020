"""scorch: sparse deep learning as easy as dense.

``import scorch as torch``: every torch name works (names scorch does not define are torch's own objects, read
through this module), and every op that meets a sparse operand (a ``scorch.SparseTensor`` or a torch sparse
layout) runs sparse, through a compiler that generates, builds and caches C++ kernels. ``__all__`` and this
page list scorch's own names only; ``dir(scorch)`` has torch's too.

Sparse tensors
    asformat(x, "csr")              any tensor stored in a format: csr, csc, coo, dcsr, bsr(2, 4), ell, dia,
                                    nm(2, 4), ... or format text "(i, j) -> (i : dense, j : compressed)"
    SparseTensor, Format, formats   the tensor type (a torch.Tensor), formats and their levels
    sparse_csr_tensor(...) ...      torch's constructors (coo, csr, csc, bsr, bsc, compressed)
    from_torch(t), to_torch(s)      torch's sparse layouts <-> SparseTensor, sharing the arrays
    from_scipy(a), to_scipy(s)      SciPy sparse arrays <-> SparseTensor, sharing the arrays where they can
Computing
    einsum(eq, *ops, format=)       any expression; the result's format is inferred (or asked for)
    explain(eq, *ops)               the plan as a report: output format and why, loops, kernel (source=True);
                                    explain(layer, x): every compiled product of a call, a layer's directives
    Directives                      a schedule to pass as einsum(..., schedule=...)
    rearrange(x, "i j -> j i")      einops patterns on dense and sparse tensors
    spmm, sparse                    torch.sparse's functions, sparse operands through scorch
    compile(fn)                     fuses a function's sparse ops (a module goes to torch.compile)
    deferral("off"|"auto"|"all")    when a large dense einsum result waits to be fused
    stored_only()                   in-place scalars touch the stored entries only (as an optimizer step)
Models
    schedule(model)                 which parameters / activations are sparse, pruned how, stored how
    sparsified_op(op, out_fmt=...)  an op whose outputs and gradients are sparsified into formats (STen's)
    nn                              torch.nn plus SparseLinear, patch_model, sparsifiers (ScalarFraction, NM...)
    save_portable, load_portable    checkpoints plain torch loads (to_portable / from_portable in memory)
When something runs dense
    stats(), reset_stats()          which ops densified or fell back to torch (DensifyWarning once per op)
    strict()                        raise DensifyError instead; fallback_limit(), set_fallback_limit(n)
    cache_info(), clear_caches()    the compiler's memo tables

Every torch function and method on sparse operands: docs/sparse-api.md; design: docs/design-notes.md.
"""
import torch as _torch

from ._versions import check_torch as _check_torch

_check_torch(_torch.__version__)

from . import _forward  # noqa: E402

_forward.install()

# Python's full garbage collection walks every object torch made (0.2 s, half of what importing scorch added to
# importing torch), and the ~300k objects scorch makes at import set one off: none of them is garbage
with _forward.no_collection():
    from . import formats
    from .formats import Format
    from .sparse_tensor import SparseTensor
    from .interop import (asformat, from_scipy, from_torch, sparse_bsc_tensor, sparse_bsr_tensor,
                          sparse_compressed_tensor, sparse_coo_tensor, sparse_csc_tensor, sparse_csr_tensor,
                          to_scipy, to_torch)
    from . import nn, sparse
    from . import ops  # noqa: F401  (registers the sparse implementations of torch ops)
    from .ops.linalg import einsum
    from .ops.pattern import stored_only
    from .engine import explain
    from .compiler.caches import cache_info, clear_caches
    from .compiler.schedule import Directives
    from .rearrange import rearrange
    from .deferred import deferral
    from .fusion import compile
    from . import fusion_epilogue  # noqa: F401  (registers scorch.compile's elementwise epilogues)
    from .nn.schedule import schedule
    from .nn.sparsified import sparsified_op
    from .portable import from_portable, load_portable, save_portable, to_portable
    from ._stats import (DensifyError, DensifyWarning, fallback_limit, reset_stats, set_fallback_limit,
                         stats, strict)

spmm = sparse.routed(_torch.spmm)  # a sparse-only function: torch sparse operands run through scorch too

# ``__version__`` is torch's (forwarded below): version gates in torch code (``torch.__version__ >= "2.0"``) must
# see the torch they run on; scorch's own version is ``__scorch_version__``
__scorch_version__ = "0.1.0"

# scorch's own API: what ``from scorch import *`` takes and ``help(scorch)`` documents (torch's 900 names stay
# reachable as attributes, and in ``dir(scorch)`` for completion)
__all__ = ["SparseTensor", "Format", "formats", "asformat", "from_torch", "to_torch", "from_scipy", "to_scipy",
           "sparse_coo_tensor",
           "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor",
           "sparse_compressed_tensor", "einsum", "explain", "Directives", "rearrange", "spmm", "sparse", "compile",
           "deferral", "stored_only", "schedule", "sparsified_op", "nn", "save_portable", "load_portable",
           "to_portable", "from_portable", "stats", "reset_stats", "strict", "DensifyError", "DensifyWarning",
           "fallback_limit", "set_fallback_limit", "cache_info", "clear_caches"]

__getattr__, __dir__ = _forward.forward(globals(), _torch, routed=True)

from . import _compile_hook  # noqa: E402  (scorch's custom ops for torch.compile: once torch._dynamo is imported)

_compile_hook.install()
