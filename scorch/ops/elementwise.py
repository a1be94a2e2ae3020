"""Elementwise ops. Zero-preserving maps and products with a dense or scalar operand keep the sparse
operand's pattern (its index arrays are shared, only values are computed); a sum with a dense operand is
dense. Sums and products of two sparse operands arrive with co-iteration. Operands of different shapes broadcast
as torch's: a sparse operand that the other operand's shape enlarges is broadcast first (its entries repeated,
``scorch.ops.indexing.broadcast_to``). Arguments these rules do not cover (a nonzero scalar added, division by a
tensor, ``inplace=True``) run on the dense form (``NoSparseRule``: the dense fallback, warned and counted)."""
from __future__ import annotations

import numbers

import torch

from .. import engine
from ..compiler.ir import Access, Add, Map, Mul, Scalar
from ..formats import storage
from ..sparse_tensor import NoSparseRule, ShapeError, SparseTensor, implements
from ..unary_maps import MAPS
from .entries import mapped_values, paired_values
from .indexing import broadcast_to
from .pattern import same_pattern, stored_only_active
from .sparse_api import coalesce

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _map(torch_fn, linear):
    def apply(x, *args, **kwargs):
        # (``out=`` and any other argument: torch's own op on the dense form, which writes into a dense ``out``
        # and refuses a sparse one)
        if args or any(v is not None and v is not False for v in kwargs.values()) or type(x) is not SparseTensor:
            raise NoSparseRule(f"{torch_fn.__name__} with extra arguments on a sparse operand")
        if not linear:
            x = coalesce(x)  # f(a) + f(b) != f(a + b): duplicates are summed first
        return x.with_values(mapped_values(x, torch_fn))
    apply.__doc__ = (f"``{torch_fn.__name__}`` maps 0 to 0: applied to the stored values, the pattern and format kept"
                     f"{'' if linear else ' (an uncoalesced COO is coalesced first)'}.")
    return apply


# the maps without arguments, f(0) = 0 always: f on the stored values (``activation`` has the checked ones)
for _m in MAPS:
    if not _m.probe:
        implements(*_m.funcs)(_map(_m.funcs[0], _m.linear))


def _elementwise_eq(a, b):
    """``"ab,ab->ab"`` with broadcasting of the dense side aligned right, as torch broadcasts."""
    n = max(a.dim(), b.dim())
    out = _LETTERS[:n]
    return f"{out[n - a.dim():]},{out[n - b.dim():]}->{out}"


@implements(torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.multiply,
            torch.Tensor.multiply)
def mul(a, b):
    """Elementwise product. With a scalar or a dense operand: the sparse operand's pattern and format (an einsum
    driven by it); two sparse operands: their intersection, by co-iteration (same pattern: values multiplied)."""
    if isinstance(b, SparseTensor) and not isinstance(a, SparseTensor):
        a, b = b, a
    if isinstance(b, numbers.Number) or (isinstance(b, torch.Tensor) and b.dim() == 0 and
                                         not isinstance(b, SparseTensor)):
        # (a 0-d tensor as it is: its gradient, and torch's promotion, which lets a 0-d float64 make float64)
        return a.with_values(mapped_values(a, lambda v: v * b))
    if not isinstance(b, torch.Tensor):
        raise NoSparseRule(f"a {type(b).__name__} operand")
    if isinstance(b, SparseTensor) and same_pattern(a, b) and not a.format.keeps_duplicates:
        return a.with_values(paired_values(a, b, torch.mul))
    shape = tuple(torch.broadcast_shapes(a.shape, b.shape))
    a = broadcast_to(a, shape)
    if isinstance(b, SparseTensor):
        b = broadcast_to(b, shape)
    elif b.layout != torch.strided:
        raise NoSparseRule("a torch sparse layout operand")
    return engine.einsum(_elementwise_eq(a, b), a, b)


@implements(torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.true_divide, torch.Tensor.true_divide,
            torch.divide, torch.Tensor.divide)
def div(a, b, *, rounding_mode=None):
    """Division by a scalar (a number or a 0-d tensor): the values divided, pattern and format kept; as in
    torch.sparse, positions not stored stay zero (also for ``x / 0``). By a dense tensor with no 0 and no nan
    (``F.normalize``'s norms, a row scaling; broadcast as torch broadcasts): the values divided by the divisor
    at their coordinates, pattern and format kept (0 / d is 0 for such d). Anything else goes dense."""
    if isinstance(a, SparseTensor) and rounding_mode is None and (isinstance(b, numbers.Number) or (
            isinstance(b, torch.Tensor) and b.dim() == 0 and not isinstance(b, SparseTensor))):
        return a.with_values(mapped_values(a, lambda v: v / b))
    if isinstance(a, SparseTensor) and isinstance(b, torch.Tensor) and not _sparse(b) and b.dim() > 0:
        return _div_by_dense(a, b, rounding_mode)
    raise NoSparseRule("division keeps the pattern by a scalar, or by a dense tensor without 0 or nan, only (0 / 0"
                       " and 0 / nan are nan: the implicit zeros would not stay zero)")


def _div_by_dense(a: SparseTensor, b: torch.Tensor, rounding_mode):
    """``a / b`` for a dense ``b`` with no 0 and no nan: the implicit zeros stay 0, the stored values are divided
    by ``b`` at their coordinates (differentiable in both)."""
    if bool((b == 0).any()) or (b.is_floating_point() and bool(b.isnan().any())):
        raise NoSparseRule("division by a dense tensor holding 0 or nan (0 / 0 and 0 / nan are nan, not zero)")
    shape = tuple(torch.broadcast_shapes(a.shape, b.shape))
    a = broadcast_to(a, shape)
    leaf, dims, inside = storage.coordinates(a._format, shape, a._levels)
    at = b.expand(shape)[tuple(torch.where(inside, dims[d], 0) for d in range(len(shape)))]
    # the divisor for every stored position (1 for padding and positions outside the shape: masked to 0 below)
    divisor = torch.ones(a._vals.shape, dtype=at.dtype, device=at.device).index_put((leaf,), at)
    return a.with_values(mapped_values(a, lambda v: torch.div(v, divisor, rounding_mode=rounding_mode)))


def _sparse(x):
    return isinstance(x, SparseTensor) or (isinstance(x, torch.Tensor) and x.layout != torch.strided)


def _scattered(s):
    """A sparse tensor's entries scattered into a dense tensor, by a compiled kernel."""
    letters = _LETTERS[:s.dim()]
    return engine.einsum(f"{letters}->{letters}", s, format="dense")


def _sparse_sum(a, b, alpha):
    """``a + alpha * b`` of two sparse operands: a union merge, the result sparse where both are (operands of
    different shapes broadcast first)."""
    if tuple(a.shape) != tuple(b.shape):
        if not (isinstance(a, SparseTensor) and isinstance(b, SparseTensor)):
            raise NoSparseRule("torch sparse layouts of different shapes")
        try:
            shape = tuple(torch.broadcast_shapes(a.shape, b.shape))
        except RuntimeError as e:
            raise ShapeError(f"add: shapes {tuple(a.shape)} and {tuple(b.shape)} do not broadcast ({e})") from None
        a, b = broadcast_to(a, shape), broadcast_to(b, shape)
    if isinstance(a, SparseTensor) and isinstance(b, SparseTensor) and same_pattern(a, b) \
            and not a.format.keeps_duplicates:
        # one pattern (a parameter and its gradient, optimizer state): the values add, the pattern stays
        return a.with_values(paired_values(a, b, lambda u, v: torch.add(u, v, alpha=alpha)))
    idx = tuple(_LETTERS[:a.dim()])
    second = Access(1, idx)
    scalars = {}
    if alpha == -1:
        second = Map("neg", second)
    elif alpha != 1:
        second, scalars = Mul((Scalar("alpha"), second)), {"alpha": alpha}
    rhs = Add((Access(0, idx), second))
    return engine.run((idx, idx), idx, engine.prepare([a, b]), rhs=rhs, scalars=scalars, name="add")


@implements(torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__)
def add(a, b, *, alpha=1):
    """``a + alpha * b``. Two sparse operands: their union by co-iteration, sparse (same pattern: values added,
    pattern and format kept). With a dense operand the union is dense: the sparse entries are scattered in."""
    if _sparse(a) and _sparse(b):
        return _sparse_sum(a, b, alpha)
    if isinstance(b, numbers.Number) or isinstance(a, numbers.Number):
        return _zero_term(torch.add, a, b, alpha)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise NoSparseRule("a non-tensor operand")
    if _sparse(a):
        return torch.add(_scattered(a), b, alpha=alpha)
    return torch.add(a, _scattered(b), alpha=alpha)


@implements(torch.sub, torch.Tensor.sub, torch.Tensor.__sub__, torch.subtract, torch.Tensor.subtract)
def sub(a, b, *, alpha=1):
    """``a - alpha * b``, as ``add``."""
    if isinstance(b, numbers.Number) or isinstance(a, numbers.Number):
        return _zero_term(torch.sub, a, b, alpha)
    return add(a, b, alpha=-alpha)


def _zero_term(op, a, b, alpha):
    """``op(a, b, alpha=alpha)`` (add or sub) of a sparse operand and a number: where the number is zero, the
    sparse operand's values through torch's ``op`` (its checks, such as no bool subtraction, and its type
    promotion: int + 0.0 is float), pattern and format kept, a new tensor; any other number makes it dense."""
    if (b if isinstance(b, numbers.Number) else a) != 0:
        if isinstance(b, numbers.Number) and not a._format.padded and stored_only_active():
            # inside an optimizer step (Adadelta's ``square_avg.add(eps)``) or ``stored_only()``: the stored
            # entries, as the in-place ops there (a dense copy of the state had been made every step). Not for a
            # padded format: a zero-valued state's padding cannot be told from an entry at coordinate 0
            s = engine.prepare([a])[0].clone()
            return getattr(s, op.__name__ + "_")(b, alpha=alpha)
        raise NoSparseRule("adding a nonzero scalar makes the result dense")
    if isinstance(b, numbers.Number):
        s = engine.prepare([a])[0]
        return s.with_values(op(s.values(), b, alpha=alpha))
    s = engine.prepare([b])[0]
    return s.with_values(op(a, s.values(), alpha=alpha))


@implements(torch.positive, torch.Tensor.positive, torch.Tensor.__pos__)
def positive(x):
    """``+x``: ``x`` itself, as torch returns it."""
    if not isinstance(x, SparseTensor):
        raise NoSparseRule("a sparse argument other than the input")
    return x


@implements(torch.Tensor.__rsub__)
def rsub(a, b):
    """``b - a``, as ``add``."""
    return sub(b, a)
