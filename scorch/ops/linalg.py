"""Products: einsum, matmul, mm, mv, bmm, addmm, and torch.sparse's mm/addmm/sampled_addmm."""
from __future__ import annotations

import math
import warnings

import torch

from .. import deferred, fusion
from .._autograd import _einsum_grad, differentiable_einsum, pattern_ones
from .._traceable import adopt
from ..deferred import Deferred
from .. import engine
from ..engine import weights as weight_kernels
from ..engine import weights_grad as weight_grads
from ..rules import RULES
from ..formats import Mod, named, storage
from ..sparse_tensor import (NoSparseRule, ShapeError, SparseTensor, dense_fallback, device_of, dtype_of, implements,
                             needs_grad, padding_of, shape_of)
from .sparse_api import coalesce
from . import directed


#: operand types an all-dense einsum may defer (a model's weights are Parameters)
_DEFERRABLE = (torch.Tensor, torch.nn.Parameter, Deferred)


_any_autocast = torch._C._is_any_autocast_enabled


def autocast(*operands):
    """``operands`` as torch's autocast casts a product's (``matmul``, ``mm``, ``linear``, ``addmm``...: inside
    ``torch.autocast``, each floating tensor but a float64 one to the autocast dtype; a SparseTensor's values, on
    the same arrays); as they are outside it."""
    if not _any_autocast():
        return operands
    device = next((device_of(x).type for x in operands if isinstance(x, torch.Tensor)), "cpu")
    if not torch.is_autocast_enabled(device):
        return operands
    to = torch.get_autocast_dtype(device)
    return tuple(x.to(to) if isinstance(x, torch.Tensor) and dtype_of(x).is_floating_point and
                 dtype_of(x) not in (to, torch.float64) else x for x in operands)


@implements(torch.einsum)
def einsum(equation, *operands, format=None, schedule=None):
    """``torch.einsum`` over any mix of dense and sparse operands (``format=`` sets the output format;
    ``schedule=`` directs the kernel: a loop order, or a dict of ``scorch.Directives`` fields).
    A large all-dense einsum may return a deferred result (``scorch.deferred``)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    operands = autocast(*operands)
    if schedule is None:
        schedule = directed.of(operands)  # (a layer's, from scorch.schedule)
    if torch.compiler.is_compiling() and format is None and schedule is None:  # torch.compile traces: the graph's
        return torch.einsum(equation, *operands)                               # call (scorch/dynamo.py)
    if schedule is not None:
        return engine.einsum(equation, *operands, format=format, schedule=schedule)
    if format is None and all(type(x) in _DEFERRABLE for x in operands) and operands:
        d = deferred.lazy_einsum(equation, operands)
    else:
        d = deferred.product(equation, operands, format)
    return d if d is not None else engine.einsum(equation, *operands, format=format)


def _is_sparse(x):
    return isinstance(x, SparseTensor) or (isinstance(x, torch.Tensor) and x.layout != torch.strided)


def _product_format(a, b):
    """torch's convention: a product with a dense operand is dense; sparse x sparse is sparse (inferred)."""
    return None if (_is_sparse(a) and _is_sparse(b)) else "dense"


@implements(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
def matmul(a, b, *, out=None):
    """``a @ b`` with torch's broadcasting rules, as an einsum: dense result when an operand is dense, sparse
    (inferred format) for sparse @ sparse. ``out=``: a dense tensor the result is written into, as torch's."""
    if out is not None:
        return into(out, matmul(a, b), "matmul")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"matmul: operands must be tensors, got {type(a).__name__} and {type(b).__name__}")
    a, b = autocast(a, b)
    sa, sb = shape_of(a), shape_of(b)
    da, db = len(sa), len(sb)
    if da == 0 or db == 0:
        raise ValueError("matmul: both arguments need at least one dimension")
    eq = matmul_equation(da, db)
    if sa[-1] != sb[-2 if db > 1 else 0]:
        _check_inner(a, b, -1, -2 if db > 1 else 0, "matmul")
    return _deferred_or_now(eq, a, b, _product_format(a, b))


def matmul_equation(da: int, db: int) -> str:
    """The einsum of ``a @ b`` for operands of ``da`` and ``db`` (>= 1) dimensions, with torch's broadcasting."""
    if da == 1 and db == 1:
        return "j,j->"
    if da == 2 and db == 1:
        return "ij,j->i"
    if da == 1 and db == 2:
        return "j,jk->k"
    if da == 2 and db == 2:
        return "ij,jk->ik"
    if da == 1:
        return "j,...jk->...k"
    return "...ij,...jk->...ik" if db > 1 else "...ij,j->...i"


def _deferred_or_now(eq, a, b, fmt):
    """The product, deferred where the deferral mode asks for it (``deferred.product``), else computed now; with
    the directives a layer gave an operand (``directed``), now, with them."""
    schedule = directed.of((a, b))
    if schedule is not None:
        return engine.einsum(eq, a, b, format=fmt, schedule=schedule)
    d = deferred.product(eq, (a, b), fmt)
    return d if d is not None else engine.einsum(eq, a, b, format=fmt)


@implements(torch.Tensor.__rmatmul__)
def rmatmul(b, a):
    """``a @ b`` for a dense ``a``, as ``matmul``."""
    return matmul(a, b)


def _check_inner(a, b, da, db, name):
    if shape_of(a)[da] != shape_of(b)[db]:
        raise ShapeError(f"{name}: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied"
                         f" ({a.shape[da]} != {b.shape[db]})")


def _product(name, eq, a, b, ranks, inner):
    """A product of fixed ranks (``mm``, ``mv``, ``bmm``): check ranks and the contracted extent, then einsum."""
    a, b = autocast(a, b)
    sa, sb = shape_of(a), shape_of(b)
    if (len(sa), len(sb)) != ranks:
        raise ValueError(f"{name}: expected a {ranks[0]}-d and a {ranks[1]}-d tensor, got shapes {tuple(sa)} and"
                         f" {tuple(sb)}")
    _check_inner(a, b, *inner, name)
    return _deferred_or_now(eq, a, b, _product_format(a, b))


@implements(torch.mm, torch.Tensor.mm, torch.sparse.mm, torch.spmm)
def mm(a, b, *args, reduce=None, out=None):
    """Matrix product, as ``matmul`` for 2-d operands (``torch.sparse.mm``, ``torch.spmm`` too; ``out=`` as
    ``matmul``'s). ``torch.sparse.mm(S, X, reduce)`` with ``"mean"``, ``"amax"`` or ``"amin"`` (PyG's SAGEConv
    mean aggregation) runs torch's own CSR kernel on ``S``'s arrays (CSR, converted where ``S`` is another
    format; gradients reach its values)."""
    if args:
        if len(args) > 1 or reduce is not None:
            raise TypeError("mm: takes one reduce argument")
        reduce = args[0]
    if reduce not in (None, "sum"):
        if type(a) is not SparseTensor or isinstance(b, SparseTensor) or len(a._shape) != 2:
            raise NotImplementedError(f"scorch: torch.sparse.mm(..., reduce={reduce!r}) takes a 2-d sparse and a"
                                      " dense operand")
        t = (a if a._format == named.csr else a.asformat("csr")).to_torch()
        with torch._C.DisableTorchFunctionSubclass():
            r = torch.sparse.mm(t, b, reduce)
        return r if out is None else into(out, r, "mm")
    r = _product("mm", "ij,jk->ik", a, b, (2, 2), (1, 0))
    return r if out is None else into(out, r, "mm")


@implements(torch.mv, torch.Tensor.mv)
def mv(a, v, *, out=None):
    """Matrix-vector product: a dense vector (``out=`` as ``matmul``'s)."""
    r = _product("mv", "ij,j->i", a, v, (2, 1), (1, 0))
    return r if out is None else into(out, r, "mv")


def into(out, r, name):
    """``out=`` as torch has it: ``r`` (a result; a sparse one densified) copied into the dense ``out``, resized
    where its shape differs (torch warns where a non-empty one is), of ``r``'s dtype and device; refused where
    ``r`` records a gradient (torch's functions with ``out=`` do not differentiate)."""
    if isinstance(r, Deferred):
        r = r.compute()
    if isinstance(out, SparseTensor) or not isinstance(out, torch.Tensor) or out.layout != torch.strided:
        raise TypeError(f"scorch {name}: out= must be a dense (strided) tensor, got {type(out).__name__}")
    if isinstance(r, SparseTensor):  # (sparse @ sparse: its values, densified, as a dense out= asks)
        r = r.to_dense()
    if r.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{name}(): functions with out=... arguments don't support automatic differentiation, "
                           "but one of the arguments requires grad.")
    if out.dtype != r.dtype or out.device != r.device:
        raise RuntimeError(f"scorch {name}: expected out= of dtype {r.dtype} on {r.device}, got {out.dtype} on "
                           f"{out.device}")
    if out.shape != r.shape:
        if out.numel():
            warnings.warn(f"An output with one or more elements was resized since it had shape {list(out.shape)}, "
                          f"which does not match the required output shape {list(r.shape)}.", UserWarning,
                          stacklevel=3)
        out.resize_(r.shape)
    return out.copy_(r)


@implements(torch.bmm, torch.Tensor.bmm)
def bmm(a, b):
    """Batched matrix product ``bij,bjk->bik``: dense with a dense operand."""
    return _product("bmm", "bij,bjk->bik", a, b, (3, 3), (2, 1))


@implements(torch.addmm, torch.Tensor.addmm, torch.sparse.addmm)
def addmm(input, mat1, mat2, *, beta=1, alpha=1, out=None):
    """``beta * input + alpha * (mat1 @ mat2)``; dense ``input``. With ``beta`` 0, as torch has it, ``input``'s
    nan and inf are not propagated (its gradient is zero); ``out=`` as ``matmul``'s."""
    input, mat1, mat2 = autocast(input, mat1, mat2)
    prod = mm(mat1, mat2)
    if isinstance(prod, SparseTensor):
        prod = prod.to_dense()
    if isinstance(input, SparseTensor):
        input = input.to_dense()
    if not (prod.dtype.is_floating_point or prod.dtype.is_complex or input.dtype.is_floating_point or
            input.dtype.is_complex):
        beta, alpha = int(beta), int(alpha)  # (integer operands: torch takes the scalars as integers, 0.5 as 0)
    if beta == 0:
        scaled = torch.nan_to_num(input * 0, nan=0.0, posinf=0.0, neginf=0.0)
    else:
        scaled = input * beta if beta != 1 else input
    r = torch.add(scaled, prod, alpha=alpha)
    return r if out is None else into(out, r, "addmm")


#: rows of the input per SpMM call of a sparse-weight ``linear`` with a blocked weight (half that otherwise):
#: the kernel keeps X^T's tile (in x rows) in the L2 cache, where a wider batch would stream X^T from memory
#: once per row of W. A blocked weight reads each row of the tile once per block row, so it takes a wider tile
#: (measured on 4096 x 4096 weights at 90% sparsity: CSR fastest at 32 rows, BSR at 64)
BATCH_TILE = 64
#: batch tiles only where X^T is larger than this (bytes) and W has at least ``TILE_MIN_ROWS`` rows
#: (``_batch_tiles``)
TILE_MIN_BYTES, TILE_MIN_ROWS = 2 << 20, 1024


def _batch_tiles(weight, x, rows: int) -> bool:
    """Whether ``linear`` runs the batch in tiles of ``rows``: not where X^T fits in the L2 cache anyway or W has
    few rows to stream past it (forward, CSR 256 -> 2048 at batch 1024: 6.0 ms tiled against 4.0 whole;
    2048 -> 256: 7.0 against 6.2; 4096 x 4096 at batch 512: 32 against 59)."""
    n, n_in = x.shape
    return n > 2 * rows and n * n_in * x.element_size() > TILE_MIN_BYTES and shape_of(weight)[0] >= TILE_MIN_ROWS


def _tiled_product(weight, x, rows: int):
    """``einsum("oi,bi->ob", weight, x)`` in batch tiles of ``rows``: each tile's rows of X^T stay in cache while
    W streams past."""
    return torch.cat([engine.einsum("oi,bi->ob", weight, tile, format="dense") for tile in x.split(rows)], 1)


def _linear_gradient(k, ops, gout):
    """The gradients of ``linear``'s product ``einsum("oi,bi->ob", W, X)`` by the weight family's kernels:
    ``dX = dY @ W`` and ``dW = dY^T X`` at W's stored positions (0 at a padded format's padding), ``dY`` being
    the transposed output gradient (row-major where the result was used row-major)."""
    w, x = ops
    dy = gout.t()
    if type(dy) is not torch.Tensor or dy.dtype != x.dtype:
        return None
    if k == 1:
        return weight_grads.input_grad(w, dy)
    g = weight_grads.weight_grad(w, x, dy)
    return torch.where(padding_of(w), 0, g) if w._format.padded else g


class _WeightLinear(torch.autograd.Function):
    """``linear(x, W, bias)`` with a sparse weight the family's kernels read (``engine.weights``), as one node of
    the graph: the forward kernel with the bias in its store, ``dX = dY @ W`` and ``dW`` on the pattern by the
    family's backward kernels (``_linear_gradient``'s), the bias's gradient the sum of ``dY``. The weight is held
    by its structure and the saved values (the einsum node's checks: an in-place change of the values between the
    forward and the backward is torch's error). Inputs: ``(holder, x, values, bias)``, ``holder`` a one-element
    list of the weight (a SparseTensor is not an input of the node: its values are). A double backward (the
    backward itself recording a graph) takes the einsum's differentiable gradients."""

    @staticmethod
    def forward(ctx, holder, x, vals, bias):
        w = holder[0]
        ctx.weight, ctx.structure = w, (w._format, w._shape, w.__dict__["_levels"])
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x, vals)
        return weight_kernels.linear(w, x, bias)

    @staticmethod
    def backward(ctx, dy):
        x, vals = ctx.saved_tensors
        fmt, shape, levels = ctx.structure
        w = ctx.weight
        if w.__dict__.get("_vals") is not vals or w.__dict__.get("_levels") is not levels:
            w = SparseTensor(fmt, shape, levels, vals, check=False)
        gx = gw = gb = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            if torch.is_grad_enabled() or type(dy) is not torch.Tensor or dy.dtype != x.dtype:
                gw, gx = (_einsum_grad(k, [("o", "i"), ("b", "i")], ("o", "b"), [w, x], dy.t())  # (differentiable)
                          if ctx.needs_input_grad[2 - k] else None for k in (0, 1))
            else:
                gx = _linear_gradient(1, (w, x), dy.t()) if ctx.needs_input_grad[1] else None
                gw = _linear_gradient(0, (w, x), dy.t()) if ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[3]:
            gb = dy.sum(0).to(ctx.bias_dtype)
        return None, gx, gw, gb


def _fused_bias(bias, n_out: int) -> bool:
    """Whether ``linear``'s bias goes into the weight kernel's store: a plain float tensor of the output's width on
    the CPU (a scalar or broadcast bias, a SparseTensor, is added after)."""
    return type(bias) in (torch.Tensor, torch.nn.Parameter) and bias.layout == torch.strided and \
        bias.dim() == 1 and bias.shape[0] == n_out and bias.device.type == "cpu" and bias.is_floating_point()


def _pack_parameter(w: SparseTensor) -> None:
    """A sparse ``nn.Parameter`` the weight kernels read is packed on its first use, in place: its columns held in 16
    bits where they fit (``storage.packed_coordinates``), which the kernels read natively, its wide ones freed where
    nothing else holds them. A weight made by ``asformat`` then takes the bytes of one made by ``scorch.nn``'s
    sparsifiers (packed already). Looked at once per pattern."""
    d = w.__dict__
    if not d.get("_is_param") or d.get("_packing_seen") == id(d["_levels"]):
        return
    with torch.inference_mode(False):  # (arrays with a version counter: the pattern memos key on them)
        packed = storage.packed_coordinates(w._format, w._shape, d["_levels"])
    if any(a is not b for a, b in zip(packed, d["_levels"])):
        d["_levels"] = packed
    d["_packing_seen"] = id(d["_levels"])  # (an id reused by a new pattern only skips its packing)


@implements(torch.nn.functional.linear)
def linear(input, weight, bias=None):
    """``input @ weight.T + bias`` with a sparse weight (out x in) or a sparse input (... x in).

    A sparse weight computes ``(W @ X^T)^T``: the SpMM walks W's rows and reads X^T's rows contiguously; the
    result is the transposed view of that product, as torch returns non-contiguous results elsewhere."""
    if weight.dim() != 2:
        raise ValueError(f"linear: weight must be 2-d, got shape {tuple(shape_of(weight))}")
    input, weight, bias = autocast(input, weight, bias)
    n_in = shape_of(weight)[1]
    if shape_of(input)[-1] != n_in:
        raise ValueError(f"linear: input of shape {tuple(shape_of(input))} and weight of shape"
                         f" {tuple(shape_of(weight))} cannot be multiplied ({shape_of(input)[-1]} != {n_in})")
    schedule = directed.of((weight, input))
    if schedule is not None and _is_sparse(weight) != _is_sparse(input):
        out = _directed_linear(input, weight, schedule)
    elif _is_sparse(weight) and not _is_sparse(input):
        lead = tuple(input.shape[:-1])
        x = input.reshape(math.prod(lead), n_in)  # (not -1: no row count follows from 0 elements when n_in is 0)
        n, w = x.shape[0], engine.prepare([weight])[0]
        if weight_kernels.applies(w, x):
            _pack_parameter(w)
            # the activation read in its own layout, the result written row-major (``engine.weights``)
            if needs_grad((weight, x, bias)) and (bias is None or _fused_bias(bias, shape_of(weight)[0])):
                out, bias = _WeightLinear.apply([w], x, w._vals, bias), None  # (one node, the bias in the store)
            elif needs_grad((weight, x)):
                out = differentiable_einsum("oi,bi->ob", (weight, x), "dense",
                                            compute=lambda w_, x_: weight_kernels.linear(w_, x_).t(),
                                            gradient=_linear_gradient).t()
            elif needs_grad((bias,)):  # (only a bias the store does not take records: added after, by torch)
                out = weight_kernels.kept_linear(w, x)
            else:
                out, bias = weight_kernels.kept_linear(w, x, bias), None
            out = out if len(lead) == 1 else out.reshape(*lead, shape_of(weight)[0])  # (a 2-d input: no view node)
            return out if bias is None else out + bias
        rows = BATCH_TILE if any(isinstance(e, Mod) for e in w.format.exprs) else BATCH_TILE // 2
        if not _batch_tiles(weight, x, rows):
            out = engine.einsum("oi,bi->ob", weight, x, format="dense")
        elif needs_grad((weight, x)):
            # one node of the graph: its backward is the whole batch's (W's gradient one SDDMM, not one a tile
            # and their sum: a 2-layer BSR feed-forward step 99 -> 26 ms)
            out = differentiable_einsum("oi,bi->ob", (weight, x), "dense",
                                        compute=lambda w_, x_: _tiled_product(w_, x_, rows))
        else:
            out = _tiled_product(weight, x, rows)
        out = out.t().reshape(*lead, shape_of(weight)[0])
    elif _is_sparse(input) and not _is_sparse(weight):
        out = engine.einsum("...i,oi->...o", input, weight, format="dense")
    elif _is_sparse(input):
        out = engine.einsum("...i,oi->...o", input, weight)
    else:  # (only the bias is sparse)
        out = torch.nn.functional.linear(input, weight)
    return out if bias is None else out + bias


def _directed_linear(input, weight, schedule):
    """``F.linear``'s product with a layer's directives (``scorch.schedule``'s ``.schedule(...)``), through the
    general lowering, which they direct: a sparse weight's as ``einsum("oi,bi->ob", W, X)`` (the letters an order
    names: ``o`` output feature, ``i`` input feature, ``b`` token, the input's leading dimensions flattened), a
    sparse 2-d input's as ``einsum("bi,oi->bo", X, W)``. Not the weight family's kernels (``engine.weights``):
    they are hand-tiled, with no loop order or parallel loop of this kind to direct (docs/design-notes.md)."""
    if engine.explaining():
        print(f"directives:   {directed.describe(schedule)} (the layer's, from scorch.schedule): F.linear through"
              " the general lowering")
    if _is_sparse(input):
        if len(shape_of(input)) != 2:
            raise ValueError(f"scorch: F.linear with directives and a sparse input of shape {tuple(shape_of(input))}:"
                             " only a 2-d sparse input (einsum 'bi,oi->bo') takes a schedule")
        return engine.einsum("bi,oi->bo", input, weight, format="dense", schedule=schedule)
    lead, (n_out, n_in) = tuple(input.shape[:-1]), shape_of(weight)
    x = input.reshape(math.prod(lead), n_in)
    return engine.einsum("oi,bi->ob", weight, x, format="dense", schedule=schedule).t().reshape(*lead, n_out)


@implements(torch.sparse.sampled_addmm)
def sampled_addmm(input, mat1, mat2, *, beta=1.0, alpha=1.0, out=None):
    """SDDMM: ``beta * input + alpha * (mat1 @ mat2)`` at the stored entries of the sparse ``input``.
    The result has ``input``'s pattern and format (its index arrays are shared)."""
    if out is not None:
        raise NotImplementedError("scorch: sampled_addmm(out=...) is not supported")
    kept = engine.kept_sddmm(input, mat1, mat2) if type(input) is SparseTensor and alpha == 1 and \
        (beta != 0 or not fusion.active()) else None
    if kept:  # a repeated call: the prepared call kept on the input (its checks passed when it was kept)
        vals = kept[0]((kept[1], mat1, mat2), None).__dict__["_vals"]
        if beta != 0:
            vals.add_(input.values(), alpha=beta)
        if input._format.padded:  # (as below)
            vals.masked_fill_(padding_of(input), 0)
        return input.with_values(vals)
    if not _is_sparse(input):
        raise ValueError("sampled_addmm: input must be sparse")
    s = engine.prepare([input])[0]
    if s._format.keeps_duplicates:  # (an uncoalesced COO: each position once, its duplicates summed)
        s = coalesce(s)
    if mat1.dim() != 2 or mat2.dim() != 2 or mat1.shape[0] != s._shape[0] or mat2.shape[1] != s._shape[1]:
        raise ValueError(f"sampled_addmm: shapes {tuple(s._shape)}, {tuple(mat1.shape)}, {tuple(mat2.shape)}"
                         " do not match (input m x n, mat1 m x k, mat2 k x n)")
    _check_inner(mat1, mat2, 1, 0, "sampled_addmm")
    if beta == 0 and fusion.active():  # inside scorch.compile: the scores stay lazy, to fuse with what follows
        lazy = fusion.lazy_sddmm(s, mat1, mat2, alpha)
        if lazy is not None:
            return lazy
    pad = padding_of(s) if s._format.padded else None  # (padding: not sampled, and 0 in the result)
    pattern = s.with_values(pattern_ones(s, s.dtype) if pad is None else (~pad).to(s.dtype))
    # (the dispatcher gives mat2 a k-last copy, so that the loop over k reads it contiguously)
    # (the product on the input's own positions, requested: its values align with the input's, also where a
    # differentiable result would otherwise leave a padded format)
    # (alpha inside the kernel, so that a 16-bit product is rounded once, where no gradient is taken)
    fmt = None if s.format.is_dense else s.format
    prod = engine.scaled(engine.SDDMM, alpha, pattern, mat1, mat2, format=fmt)
    if type(prod) is SparseTensor and type(prod._vals) is torch.Tensor and prod._vals.dtype == s.dtype and \
            not needs_grad((s, mat1, mat2)):
        # the product's values are its own new array: added to in place (one pass, no new arrays; three passes
        # with two new arrays took a quarter of the kernel's time)
        vals = prod._vals
        if beta != 0:
            vals.add_(s.values(), alpha=beta)
        if pad is not None:  # (padding, at a real entry's coordinates, stays 0: not 0 times an inf product)
            vals.masked_fill_(pad, 0)
        if alpha == 1 and s is input:
            engine.keep_sddmm(s, pattern, mat1, mat2, fmt)
        return s.with_values(vals)
    # a dense-format input gives a dense product, whose row-major values are the format's values
    vals = prod.values() if isinstance(prod, SparseTensor) else prod.reshape(-1)
    if beta != 0:
        vals = vals + beta * s.values()
    if pad is not None:
        vals = torch.where(pad, 0, vals)
    # (operands of mixed dtypes: the promoted one, as scorch's products give; rounding a float32 product to a
    # 16-bit input's dtype lost it silently)
    out = torch.promote_types(s.dtype, torch.promote_types(mat1.dtype, mat2.dtype))
    return s.with_values(vals.to(out) if vals.dtype != out else vals)


for _fn in (einsum, matmul, rmatmul, mm, mv, bmm):
    _fn.fuses = True  # deferred dense operands are substituted into the product (``engine.einsum``)


_is_compiling = torch.compiler.is_compiling  # (bound once: two module lookups fewer a call, each costly cold)


def _operator(s, other, left: bool = True):
    """``s @ other`` (``left``) or ``other @ s`` for the SparseTensor ``s`` (``SparseTensor.__matmul__``, through
    ``RULES.product_operator``): a repeated product with a dense matrix or vector straight to the prepared call kept
    on ``s`` (``engine.kept_product``), else ``matmul`` (and the call it prepared kept for next time). It reads the
    deferral mode without ``deferred.mode()``: on a call with the caches cold each function entered costs
    microseconds. After the first product kept, the operators are its C form (``_install``), which calls this for
    every product it does not take itself."""
    if _is_compiling():  # (torch.matmul: ``SparseTensor.__torch_function__`` puts a custom op in the graph)
        return torch.matmul(s, other) if left else torch.matmul(other, s)
    operands = (s, other) if left else (other, s)
    fast = engine.kept_product(s, other, left)
    if fast and _deferral.value != "all":
        return fast(operands, None)
    adopt(operands)  # (the long way only: a kept call's test refuses values that require grad)
    try:
        result = matmul(*operands)
    except NoSparseRule as why:  # (as through torch.matmul: the dense form's product, warned and counted)
        return dense_fallback(torch.matmul, operands, {}, why)
    if fast is None and len(s._shape) == 2 and type(other) is torch.Tensor and 1 <= other.dim() <= 2 and \
            deferred.mode() != "all" and (s._vals.requires_grad or not torch._C._any_requires_grad(s)):
        # (not for a wrapper with a history its values lack, met under no_grad: a kept call would skip ``adopt``)
        engine.keep_product(s, other, left, matmul_equation(2, other.dim()) if left else
                            matmul_equation(other.dim(), 2))
        if not _installed:
            _install()
    return result


_installed: list = []
#: the operators SparseTensor declares (``sparse_tensor``): ``_install`` replaces only these
_DECLARED = (SparseTensor.__dict__["__matmul__"], SparseTensor.__dict__["__rmatmul__"])


def _install():
    """Once a process, at the first product kept: ``SparseTensor.__matmul__`` and ``__rmatmul__`` become their C
    form (``engine.product_operators``), which takes a kept call as ``_operator`` would and hands every other
    product to ``_operator``. Where there is no C helper, or the operators were replaced since import (a user's
    or a tool's wrapper), the operators stay as they are."""
    _installed.append(True)
    engine.when_direct(_put_operators)


def _put_operators():
    """``_install``'s work, once the C helper is there (``engine.when_direct``: at once, or when its build in the
    background ends)."""
    if (SparseTensor.__dict__.get("__matmul__"), SparseTensor.__dict__.get("__rmatmul__")) != _DECLARED:
        return  # (replaced by someone else since import: theirs stays)
    methods = engine.product_operators(_operator, deferred.current)
    if methods is not None:
        SparseTensor.__matmul__, SparseTensor.__rmatmul__ = methods


_deferral = deferred.current  # (``deferred.mode()``'s holder)
RULES.register(product_operator=_operator)
