"""The torch-signature constructors (``sparse_coo_tensor``, ``sparse_csr_tensor``...): the arrays come from the
user, so they are validated (clear errors naming level and position) unless ``check_invariants=False`` is passed;
and, from the execution layer (``engine.convert``), every format conversion under its public names."""
from __future__ import annotations

import torch

from .engine.convert import asformat, coo_from_entries, from_torch, quiet_beta, to_torch  # noqa: F401
from .engine import scipy_interop as _scipy
from .formats import named
from .formats import storage as _storage
from .rules import RULES
from .sparse_tensor import SparseTensor, checking_invariants, needs_grad


def _build(torch_fn, args, values, dtype, device, requires_grad, check_invariants, **extra):
    extra = {k: v for k, v in extra.items() if v is not None}  # (torch's defaults)
    grads = isinstance(values, torch.Tensor) and needs_grad([values])
    if grads:  # (the values' graph is attached below, to the entries as given: duplicates of a COO stay)
        args = tuple(values.detach() if a is values else a for a in args)
    with quiet_beta():
        try:
            t = torch_fn(*args, dtype=dtype, device=device, check_invariants=False, **extra)
        except RuntimeError as e:  # torch reports inconsistent arguments as RuntimeError
            raise ValueError(f"{torch_fn.__name__}: {e}") from None
    check = check_invariants is None or bool(check_invariants)
    s = from_torch(t, check=False)
    # torch hands back new tensor objects for the caller's index arrays: keep the caller's own objects, so
    # that validating the same arrays again (a pattern reused every step) is recognized and skipped
    given = [a for a in args if isinstance(a, torch.Tensor)]
    s._levels = tuple(st.map(lambda a: _same_array(a, given)) for st in s._levels)
    if (check or checking_invariants()) and s.device.type != "meta":  # (meta arrays hold no data to check)
        _storage.validate(s._format, s._shape, s._levels, s._vals)
    if grads:
        # values computed by a graph (attention scores, ...): the result's values are that graph's output
        s = s.with_values(values.to(dtype=s.dtype, device=s.device).reshape(-1))
    return s.requires_grad_() if requires_grad else s


def _same_array(a, given):
    """The caller's tensor that ``a`` is a plain alias of (same memory, dtype, shape, strides), else ``a``."""
    for g in given:
        if g.data_ptr() == a.data_ptr() and g.dtype == a.dtype and g.shape == a.shape and g.stride() == a.stride():
            return g
    return a


def sparse_coo_tensor(indices=None, values=None, size=None, *, dtype=None, device=None, pin_memory=None,
                      requires_grad=False, check_invariants=None, is_coalesced=None):
    """As ``torch.sparse_coo_tensor``, returning a SparseTensor (COO, uncoalesced unless said otherwise), with all
    of torch's arguments. ``sparse_coo_tensor(size)`` (or ``size=``) is an empty tensor; values with trailing
    dimensions (``(nnz, *dense sizes)``) give a hybrid COO tensor: dense levels under the sparse ones."""
    if values is None:  # torch's sparse_coo_tensor(size) form
        if indices is not None and size is not None:
            raise TypeError("sparse_coo_tensor() takes indices and values, or only a size")
        size = indices if size is None else size
        if size is None:
            raise TypeError("sparse_coo_tensor() needs indices and values, or a size")
        args = (size,)
    else:
        args = (indices, values) if size is None else (indices, values, size)
    return _build(torch.sparse_coo_tensor, args, values, dtype, device, requires_grad, check_invariants,
                  pin_memory=pin_memory, is_coalesced=is_coalesced)


def sparse_compressed_tensor(compressed_indices, plain_indices, values, size=None, *, dtype=None, layout=None,
                             device=None, pin_memory=False, requires_grad=False, check_invariants=None):
    """As ``torch.sparse_compressed_tensor`` (``layout`` one of sparse_csr, sparse_csc, sparse_bsr, sparse_bsc),
    returning a scorch SparseTensor that shares its arrays (validated unless ``check_invariants=False``)."""
    args = (compressed_indices, plain_indices, values) + (() if size is None else (size,))
    return _build(torch.sparse_compressed_tensor, args, values, dtype, device, requires_grad, check_invariants,
                  layout=layout, pin_memory=pin_memory)


def _compressed_ctor(torch_fn, compressed: str, plain: str, layout):
    """A constructor with ``torch_fn``'s signature; its index arrays may also be given by torch's keyword names
    (``crow_indices=``, ``col_indices=``...)."""
    def ctor(*args, size=None, dtype=None, device=None, pin_memory=False, requires_grad=False,
             check_invariants=None, **named_arrays):
        names = (compressed, plain, "values")
        given = list(args[:3]) + [named_arrays.pop(n) for n in names[len(args[:3]):] if n in named_arrays]
        if named_arrays or len(given) != 3 or len(args) > 4 or (len(args) == 4 and size is not None):
            raise TypeError(f"{torch_fn.__name__}({compressed}, {plain}, values, size=None, *, dtype=None,"
                            f" device=None, pin_memory=False, requires_grad=False, check_invariants=None): got"
                            f" {len(args)} positional argument(s) and keywords {sorted(named_arrays) or 'as above'}")
        size = args[3] if len(args) == 4 else size
        values = given[2]
        if torch.compiler.is_compiling():  # torch.compile traces: one call in the graph (scorch/dynamo_sparse.py)
            return RULES.traced_tensor(layout, *given, size, dtype, requires_grad)
        return _build(torch_fn, tuple(given) + (() if size is None else (size,)), values, dtype, device,
                      requires_grad, check_invariants, pin_memory=pin_memory)
    ctor.__name__ = torch_fn.__name__
    ctor.__doc__ = (f"As ``torch.{torch_fn.__name__}``, returning a scorch SparseTensor that shares its arrays"
                    " (validated unless ``check_invariants=False``).")
    return ctor


sparse_csr_tensor = _compressed_ctor(torch.sparse_csr_tensor, "crow_indices", "col_indices", torch.sparse_csr)


sparse_csc_tensor = _compressed_ctor(torch.sparse_csc_tensor, "ccol_indices", "row_indices", torch.sparse_csc)


sparse_bsr_tensor = _compressed_ctor(torch.sparse_bsr_tensor, "crow_indices", "col_indices", torch.sparse_bsr)


sparse_bsc_tensor = _compressed_ctor(torch.sparse_bsc_tensor, "ccol_indices", "row_indices", torch.sparse_bsc)


def from_scipy(a, format=None) -> SparseTensor:
    """A SciPy sparse array or matrix (``scipy.sparse``) as a SparseTensor, sharing its index arrays and values
    where it can: csr -> ``"csr"``, csc -> ``"csc"``, coo -> ``"coo"``, bsr -> ``"bsr(bh, bw)"`` with SciPy's
    blocks; dia, lil and dok through SciPy's ``tocsr()``. Shared only when SciPy's arrays are in canonical form
    (sorted, no repeated entry: otherwise they are summed as SciPy does, into new arrays) and of a dtype torch
    can share. Explicit zeros stay stored. ``format``: convert to that format afterwards (``scorch.asformat``).
    Complex values are refused (``TypeError``)."""
    s = _scipy.from_scipy(a)
    return s if format is None else asformat(s, format)


# the SciPy format nearest to each scorch format that has none (``to_scipy`` converts to it first)
_NEAREST_SCIPY = {"dcsr": "csr", "dcsc": "csc", "dense": "csr"}


def to_scipy(s) -> "scipy.sparse.sparray":  # noqa: F821
    """``s`` (a 2-d SparseTensor, or a torch sparse tensor) as a SciPy sparse array: csr, csc, coo and bsr formats
    as the SciPy array of that format, sharing the index arrays and values (torch's ``Tensor.numpy()``: writes
    through one are seen by the other); other formats converted first (bsc to bsr, dcsr to csr, dcsc to csc, any
    other to csr, and a blocked format whose shape is not a multiple of its blocks to csr). As ``Tensor.numpy()``:
    on the CPU, outside autograd (``s.detach().to_scipy()``), values of a dtype scipy.sparse takes (not float16 or bfloat16: ``s.float().to_scipy()``)."""
    if isinstance(s, torch.Tensor) and not isinstance(s, SparseTensor) and s.layout != torch.strided:
        s = from_torch(s)
    if not isinstance(s, SparseTensor):
        raise TypeError(f"scorch.to_scipy takes a SparseTensor (or a torch sparse tensor), got {type(s).__name__}"
                        f"{'' if not isinstance(s, torch.Tensor) else ' (a dense tensor: use scorch.asformat first)'}")
    if s.dim() != 2:
        raise ValueError(f"scorch.to_scipy: SciPy's sparse arrays are 2-d; this tensor has shape {tuple(s.shape)}")
    if s.device.type != "cpu":
        raise TypeError(f"scorch.to_scipy: the tensor is on {s.device}; SciPy reads host memory: use"
                        " s.cpu().to_scipy()")
    if s.requires_grad:
        raise RuntimeError("scorch.to_scipy: the tensor requires grad, and SciPy's array would be outside the"
                           " graph: use s.detach().to_scipy()")
    if s.dtype in (torch.bfloat16, torch.float16):  # (NumPy has no bfloat16; scipy.sparse refuses float16)
        raise TypeError(f"scorch.to_scipy: scipy.sparse has no {s.dtype}: convert first, s.float().to_scipy()")
    fmt, name = s.format, named.name_of(s.format) or ""
    block = named.block_size(fmt)
    if block is not None and (s.shape[0] % block[0] or s.shape[1] % block[1]):
        block = None  # (SciPy's BSR needs the shape to be a multiple of the block: CSR instead)
    if fmt in (named.csr, named.csc) or named.hybrid_coo_dims(fmt) in ((0, True), (0, False)) or \
            (block is not None and name.startswith("bsr")):
        return _scipy.to_scipy(s)
    target = named.bsr(*block) if block is not None else _NEAREST_SCIPY.get(name, "csr")
    return _scipy.to_scipy(asformat(s, target))


RULES.register(to_scipy=to_scipy)
