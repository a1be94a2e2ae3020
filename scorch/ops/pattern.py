"""Ops on a fixed pattern: in-place arithmetic and ``*_like`` constructors, as optimizers use them.

In-place ops update a SparseTensor's stored values where every sparse operand has its pattern (the gradient
of a sparse parameter, its optimizer state made by ``zeros_like``, and the parameter itself share their index
arrays, so the check is an identity test in the common case). Scalars that keep an implicit zero zero apply to
the stored values (``S.mul_(2)``, ``S.clamp_(-1, 1)``; ``S.mul_(inf)`` and ``S.div_(0)`` too, as torch.sparse
and the out-of-place ops leave what is not stored). A scalar that would not (``S += 1``, ``S.clamp_(min=0.5)``,
``S.reciprocal_()``) raises: the dense result cannot be written in place, and changing the stored values only
would be a wrong answer. Inside a ``torch.optim`` step, or ``with scorch.stored_only():``, it is what is meant:
``torch.optim.Adam``'s ``denom.add_(eps)`` adds ``eps`` to each stored value of its state, shaped as the
parameter (``_in_optimizer_step``: a ``torch.optim`` function or an optimizer's method on the stack).

A sparse operand with another pattern (``S.add_(S2)``, as torch allows for sparse tensors): the result, whose
pattern is the union (the intersection for ``mul_``), is computed out of place and replaces ``S``'s arrays, in
``S``'s format (add_, sub_, mul_, lerp_, addcmul_ and their operators; other ops raise a ValueError). Views of
``S`` taken before (``S.t()``) keep the old arrays, as torch's sparse tensors reallocate in that case too.

Formats with padding (``nm(n, m)``, ``ell``): the padding (``padding_of``: read off the coordinates; a stored
zero of a real slot is an entry) holds 0 after the op (``S.add_(1.0)`` in an optimizer step adds to the entries
only). Gradients are 0 at padding, so optimizer steps keep it zero.

A dense operand of the same shape is taken at the pattern where that loses nothing: a factor of a product whose other
factor is sparse with the pattern (``addcmul_``, ``addcdiv_``'s divisor, ``mul_``), or a tensor that is 0 off the
pattern (checked), as the dense optimizer state that ``full_like`` makes gives (Adagrad, Adadelta, LBFGS's flat
update).

``torch.optim`` SGD, Adam, AdamW, RMSprop, Adagrad, NAdam, RAdam, Adamax, Adadelta, ASGD and LBFGS (for-loop and
``foreach``) run on SparseTensor parameters through these ops and update the values in place
(``tests/nn/test_optimizers.py``); Rprop raises (it sets its step sign to 1 where the gradient is 0, off the
pattern too). ``load_state_dict`` copies into a sparse parameter with ``copy_``.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import threading

import torch

from ..rules import RULES
from ..compiler.caches import register
from ..formats import storage
from ..formats.named import short_name
from ..sparse_tensor import NoSparseRule, SparseTensor, implements, needs_grad, padding_of
from ..unary_maps import MAPS
from .sparse_api import coalesce


def same_pattern(a: SparseTensor, b: SparseTensor) -> bool:
    """The same entries at the same value positions: the same format and shape (a transposed view shares the
    arrays but not the pattern) over equal index arrays."""
    if a._format is not b._format and a._format != b._format or a._shape != b._shape:
        return False
    if a._levels is b._levels:
        return True
    if a._vals.shape != b._vals.shape:
        return False
    for x, y in zip(a._levels, b._levels):  # (the same arrays: a parameter, its gradient and its optimizer state)
        if x is not y and (x.pos is not y.pos or x.stored_crd is not y.stored_crd):
            break
    else:
        return True
    # (an optimizer's state made by ``clone`` holds copies of its parameter's arrays, compared with the gradient's
    #  on every step: the answer kept while both sets of arrays are alive and unmodified. ResNet-18 2:4 training,
    #  batch 1, 1 thread: 170 ms of a step's index comparisons)
    return _EQUAL.lookup(("same pattern",), a._levels + b._levels, lambda: _equal_levels(a._levels, b._levels))


def _index_pairs(la, lb):
    """The index arrays of two patterns' levels side by side, as held (a packed level's narrow coordinates, not its
    wide view): each level's positions, then its coordinates."""
    for x, y in zip(la, lb):
        yield x.pos, y.pos
        yield x.stored_crd, y.stored_crd


def _equal_levels(la, lb) -> bool:
    return all(p is q or (p is not None and q is not None and torch.equal(p, q.to(p.dtype)))
               for p, q in _index_pairs(la, lb))


#: whether two patterns' index arrays are equal, per pair of array sets (``same_pattern``)
_EQUAL = storage.PatternMemo(256)
register("equal patterns", "whether two sparse tensors' index arrays are equal, per pair of array sets",
         _EQUAL.__len__, _EQUAL.clear)


def _values(x, like: SparseTensor, name: str, sampled: bool = False):
    """The operand's values on ``like``'s pattern: a number or 0-d tensor stays as it is. A dense tensor of
    ``like``'s shape gives its entries at the pattern where that loses nothing: when ``sampled`` (the caller knows
    the term is 0 off the pattern: a factor of a product with a sparse operand of the pattern), or when it is 0
    off the pattern (checked: optimizers' dense state, e.g. Adadelta's update ``delta``, is 0 where the gradient
    is)."""
    if isinstance(x, SparseTensor):
        if not same_pattern(x, like):
            raise ValueError(f"scorch: {name} of SparseTensors with different patterns (in-place ops keep the"
                             " pattern; use out-of-place ops, whose result pattern is the union)")
        return x._vals
    if isinstance(x, numbers.Number) or (isinstance(x, torch.Tensor) and x.dim() == 0):
        return x
    if isinstance(x, torch.Tensor) and tuple(x.shape) == tuple(like._shape):
        vals = at_pattern(x, like)
        if sampled or int(torch.count_nonzero(x)) == int(torch.count_nonzero(vals)):
            return vals
    raise NotImplementedError(f"scorch: {name} of a SparseTensor with a dense tensor of shape {tuple(x.shape)}"
                              " that is not 0 off its pattern (in place, the result could not keep the pattern)")


def at_pattern(dense: torch.Tensor, like: SparseTensor) -> torch.Tensor:
    """``dense``'s entries at ``like``'s stored positions, in ``like``'s value order (0 at padding)."""
    from ..formats import storage
    leaf, dims, inside = storage.coordinates(like._format, like._shape, like._levels)
    if like._format.padded:
        inside &= ~padding_of(like)[leaf]
    out = torch.zeros(like._vals.shape, dtype=dense.dtype, device=dense.device)
    out[leaf[inside]] = dense.detach()[tuple(dims[:, inside])]
    return out


def _sampled_factors(self: SparseTensor, name: str, args) -> list:
    """Which positional operands of ``name`` may be taken at ``self``'s pattern unchecked: a product's dense factor
    beside a sparse factor of the pattern (``addcmul_``'s either, ``addcdiv_``'s divisor) and ``mul_``'s operand."""
    def patterned(a):
        return isinstance(a, SparseTensor) and same_pattern(a, self)
    if name == "addcmul_" and len(args) >= 2:
        return [patterned(args[1]), patterned(args[0])] + [False] * (len(args) - 2)
    if name == "addcdiv_" and len(args) >= 2:
        return [False, patterned(args[0])] + [False] * (len(args) - 2)
    if name in ("mul_", "__imul__"):
        return [True] * len(args)
    return [False] * len(args)


# in-place ops with a sparse operand of another pattern: the out-of-place result that replaces the storage
_OUT_OF_PLACE = {
    "add_": lambda s, other, alpha=1: torch.add(s, other, alpha=alpha),
    "sub_": lambda s, other, alpha=1: torch.sub(s, other, alpha=alpha),
    "mul_": lambda s, other: torch.mul(s, other),
    "lerp_": lambda s, end, weight: s + (end - s) * weight,
    "addcmul_": lambda s, t1, t2, value=1: s + t1 * t2 * value,
}
for _op, _same in (("__iadd__", "add_"), ("__isub__", "sub_"), ("__imul__", "mul_")):
    _OUT_OF_PLACE[_op] = _OUT_OF_PLACE[_same]


#: in-place ops whose scalar keeps an implicit zero zero by the sparse rule (``S * inf``, ``S / 0``: as
#: torch.sparse and the out-of-place ops, the stored values only)
_SCALING = frozenset({"mul_", "__imul__", "div_", "__itruediv__"})


def _scalar(a) -> bool:
    return isinstance(a, numbers.Number) or (isinstance(a, torch.Tensor) and not isinstance(a, SparseTensor)
                                             and a.dim() == 0)


def _refuse_densifying_scalars(self: SparseTensor, name: str, args, kwargs, sparse) -> None:
    """Raise where ``name`` with these scalars would map an implicit zero to something else (``S += 1``,
    ``S.clamp_(min=0.5)``, ``S.reciprocal_()``): the dense result cannot be written into a sparse tensor, and
    updating the stored values only would be a wrong answer. Inside a ``torch.optim`` optimizer's step that is
    what the step means (Adam's ``denom.add_(eps)`` on its state, shaped as the parameter): allowed there."""
    if sparse or name in _SCALING or name in _DRAWS or not all(_scalar(a) for a in (*args, *kwargs.values())):
        return
    if _STORED_ONLY.depth or _in_optimizer_step():  # (before the probe: an optimizer's add_(eps) each step)
        return
    with torch.no_grad():
        probe = torch.zeros(1, dtype=self._vals.dtype, device=self._vals.device)
        at_zero = getattr(probe, name)(*args, **kwargs)
    if bool((at_zero == 0).all()):
        return
    raise NotImplementedError(
        f"scorch: in-place {name} on a sparse tensor would make every implicit zero {at_zero.item()!r}: the"
        " result is dense and a sparse tensor cannot become dense in place; use the out-of-place op (its dense"
        " result), or run it inside `with scorch.stored_only():` to change the stored entries only (as optimizer"
        " steps do)")


class _Depth(threading.local):
    depth = 0


_STORED_ONLY = _Depth()


@contextlib.contextmanager
def stored_only():
    """In-place ops on SparseTensors inside the block apply their scalars to the stored entries only (``S.add_(1)``
    adds 1 to each stored value; padding stays 0), as inside a ``torch.optim`` step; outside, a scalar that
    would change an implicit zero raises. Per thread."""
    _STORED_ONLY.depth += 1
    try:
        yield
    finally:
        _STORED_ONLY.depth -= 1


def stored_only_active() -> bool:
    """Whether scalars apply to the stored entries only here: inside ``stored_only()`` or an optimizer step."""
    return bool(_STORED_ONLY.depth) or _in_optimizer_step(start=3)


def _in_optimizer_step(depth: int = 48, start: int = 2) -> bool:
    """Whether a ``torch.optim`` function or an optimizer's method (any ``torch.optim.Optimizer``) is on the
    call stack."""
    import sys
    frame = sys._getframe(start)
    optimizer = torch.optim.Optimizer
    while frame is not None and depth > 0:
        if frame.f_globals.get("__name__", "").startswith("torch.optim") or \
                isinstance(frame.f_locals.get("self"), optimizer):
            return True
        frame, depth = frame.f_back, depth - 1
    return False


def _inplace(method):
    name = method.__name__

    def op(self, *args, **kwargs):
        if not isinstance(self, SparseTensor):
            raise NoSparseRule(f"scorch: {name} into a dense tensor")  # the dense form serves (dense self += S)
        sparse = [a for a in (*args, *kwargs.values()) if isinstance(a, SparseTensor)]
        if any(not same_pattern(a, self) for a in sparse):
            return _with_new_pattern(self, name, args, kwargs)
        _refuse_densifying_scalars(self, name, args, kwargs, sparse)
        if self._format.keeps_duplicates and not _distributes(name, args, kwargs):
            # an uncoalesced COO: sqrt(4) + sqrt(5) is not sqrt(9): its duplicates summed first (in place)
            _replace_storage(self, coalesce(self.detach()), fresh=True)
            if any(not same_pattern(a, self) for a in sparse):
                return _with_new_pattern(self, name, args, kwargs)
        # padding, and slots outside the shape (a DIA diagonal's ends), stay 0 (``padding_of``, ``storage.outside``:
        # Adagrad's step divided 0 by a dense state read as 0 there, writing nan)
        if self._format.padded:
            zero = padding_of(self, *sparse) if name != "zero_" else None
        else:
            zero = storage.outside(self._format, self._shape, self._levels, self._vals.numel())
        args = [_values(a, self, name, sampled) if isinstance(a, torch.Tensor) or isinstance(a, numbers.Number)
                else a for a, sampled in zip(args, _sampled_factors(self, name, args))]
        kwargs = {k: _values(v, self, name) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        getattr(self._vals, name)(*args, **kwargs)
        if zero is not None and bool((self._vals.detach()[zero] != 0).any()):  # (only where the op wrote there:
            if self._vals.requires_grad and torch.is_grad_enabled():    # ``relu_`` on a tensor in a graph keeps
                self._vals = self._vals.masked_fill(zero, 0)            # relu's saved output as it is)
            else:
                self._vals.masked_fill_(zero, 0)
        return self
    op.__name__ = name
    op.__doc__ = (f"``{name}`` on the stored values, in place: the pattern is fixed, sparse operands must share"
                  " it, scalars apply to each stored value.")
    return implements(method)(op)


#: in-place ops that distribute over an uncoalesced COO's duplicates (f(a) + f(b) = f(a + b)): the others sum
#: them first; mul_ / div_ distribute by a number only
_DISTRIBUTES = {"add_", "sub_", "__iadd__", "__isub__", "neg_", "zero_", "lerp_"}


def _distributes(name, args, kwargs) -> bool:
    if name in _DISTRIBUTES:
        return True
    return name in ("mul_", "div_", "__imul__", "__itruediv__") and not kwargs and all(
        isinstance(a, numbers.Number) or (isinstance(a, torch.Tensor) and type(a) is not SparseTensor and a.dim() == 0)
        for a in args)


for _m in (torch.Tensor.add_, torch.Tensor.sub_, torch.Tensor.mul_, torch.Tensor.div_, torch.Tensor.addcdiv_,
           torch.Tensor.addcmul_, torch.Tensor.lerp_, torch.Tensor.clamp_, torch.Tensor.__iadd__,
           torch.Tensor.__isub__, torch.Tensor.__imul__, torch.Tensor.__itruediv__, torch.Tensor.clamp_min_,
           torch.Tensor.clamp_max_, torch.Tensor.zero_, torch.Tensor.reciprocal_, torch.reciprocal_,
           *(f for m in MAPS if not m.probe for f in m.inplace)):  # (relu_, neg_...: the plain maps' in-place forms)
    _inplace(_m)  # (reciprocal_ maps the stored values, as add_(eps) adds to them: RAdam's foreach state)

#: random fills draw each stored value (padding stays 0, an uncoalesced COO's duplicates are summed first): the
#: pattern is the tensor's structure, as a sparse weight's (``nn.init.normal_`` / ``kaiming_uniform_`` /
#: ``trunc_normal_`` on a sparsified model's weights raised; implicit zeros made random would be a dense tensor)
_DRAWS = {"normal_", "uniform_", "bernoulli_", "exponential_", "log_normal_", "cauchy_", "geometric_", "random_"}
for _name in sorted(_DRAWS):
    _inplace(getattr(torch.Tensor, _name))


def _with_new_pattern(self: SparseTensor, name, args, kwargs):
    """``self.<name>(*args, **kwargs)`` where a sparse operand has another pattern: computed out of place, the
    result replaces ``self``'s arrays (in ``self``'s format)."""
    compute = _OUT_OF_PLACE.get(name)
    if compute is None:
        raise ValueError(f"scorch: {name} of SparseTensors with different patterns is not supported in place"
                         f" (supported: {', '.join(sorted(_OUT_OF_PLACE))}); use the out-of-place op")
    for a in (*args, *kwargs.values()):
        if isinstance(a, SparseTensor) and a._shape != self._shape:
            raise ValueError(f"scorch: {name}: shapes {tuple(self._shape)} and {tuple(a._shape)} differ (an"
                             " in-place op keeps its tensor's shape)")
    # in a graph (``T = S * 2; T.add_(U)``), the result's values take ``self``'s place in it, as torch's in-place
    # ops do (they were computed detached: ``T`` became a leaf and ``S`` got no gradient); a leaf that requires
    # grad is refused, as torch refuses it
    graph = needs_grad((self, *args, *kwargs.values()))
    if graph and self._vals.is_leaf and self._vals.requires_grad:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    with torch.set_grad_enabled(graph):
        result = compute(self if graph else self.detach(), *args, **kwargs)  # (dense for some mixes of formats)
    _replace_storage(self, result, fresh=True)
    return self


def _replace_storage(self: SparseTensor, src: torch.Tensor, fresh: bool) -> None:
    """Give ``self`` the pattern and values of ``src`` in ``self``'s format, dtype, device and grad flag; the
    arrays are copied unless ``fresh`` (``src`` is a result nothing else holds)."""
    from ..interop import asformat
    src = asformat(src.to(self._vals.device), self._format)  # the destination keeps its format
    grad = self._vals.requires_grad
    self._levels = src._levels if fresh else tuple(st.map(torch.clone) for st in src._levels)
    self._index_dtype = src._index_dtype
    if src._vals.requires_grad and torch.is_grad_enabled():  # (differentiable: ``self`` continues ``src``'s graph)
        self._vals = src._vals.to(self._vals.dtype, copy=not fresh)
    else:
        self._vals = src._vals.detach().to(self._vals.dtype, copy=not fresh).requires_grad_(grad)
    self.__dict__.pop("_conversions", None)  # conversions kept for the old pattern


# --- x.data ------------------------------------------------------------------------------------------------
def _data(self):
    """``x.data``: the same arrays, values detached (writes through it reach ``x``, as torch's ``.data``)."""
    return self.detach()


def _set_data(self, value):
    """``x.data = y``: ``x`` holds ``y``'s format, arrays and (detached) values, keeping its own ``requires_grad``;
    ``y`` must be a SparseTensor of ``x``'s shape and dtype (the wrapper's metadata cannot change), or a dense
    tensor of them that is 0 off ``x``'s pattern, whose values at ``x``'s entries become the stored values
    (``nn.utils.vector_to_parameters`` writes each parameter back from a flat dense vector this way)."""
    same = isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(self._shape) and \
        value.dtype == self.dtype and value.device == self.device
    if same and type(value) is not SparseTensor and value.layout == torch.strided and \
            not self._format.keeps_duplicates:
        vals = at_pattern(value, self)
        n = int(torch.count_nonzero(value)) - int(torch.count_nonzero(vals))
        if n:
            raise ValueError(f"scorch: x.data = y for a SparseTensor x ({short_name(self._format)} {tuple(self._shape)})"
                             f" takes a SparseTensor of the same shape, dtype and device, got a dense tensor with {n}"
                             " nonzeros off x's pattern (a dense y that is 0 off the pattern sets the stored values)")
        self._vals = vals.requires_grad_() if self._vals.requires_grad else vals
        return
    if type(value) is not SparseTensor or not same:
        raise ValueError(f"scorch: x.data = y for a SparseTensor x of shape {tuple(self._shape)} and dtype {self.dtype}"
                         f" takes a SparseTensor of the same shape, dtype and device, got {_kind_of(value)}")
    vals = value._vals.detach()
    if self._vals.requires_grad:
        vals = vals.requires_grad_()
    self._format, self._levels, self._vals, self._index_dtype = value._format, value._levels, vals, value._index_dtype


def _kind_of(v) -> str:
    if type(v) is SparseTensor:
        return f"a SparseTensor ({short_name(v._format)} {tuple(v._shape)}, {v.dtype}, {v.device})"
    if isinstance(v, torch.Tensor):
        return f"a dense tensor ({tuple(v.shape)}, {v.dtype}, {v.device})"
    return type(v).__name__


implements(torch.Tensor.data.__get__)(_data)
implements(torch.Tensor.data.__set__)(_set_data)


@implements(torch.Tensor.copy_)
def copy_(self, src, non_blocking=False):
    """Values from ``src``; a SparseTensor of another pattern (``load_state_dict``) replaces the pattern. Into a
    dense tensor (a dense model loading a sparse one's state dict): ``src``'s dense form, which is what the
    destination holds (no fallback: nothing sparse is computed densely)."""
    if not isinstance(self, SparseTensor):
        if isinstance(src, SparseTensor):
            return self.copy_(src.to_dense(), non_blocking)
        raise NoSparseRule("scorch: copy_ into a dense tensor")  # the dense form serves
    if isinstance(src, SparseTensor) and not same_pattern(src, self):
        if src._shape != self._shape:
            raise ValueError(f"copy_: shapes {tuple(src._shape)} and {tuple(self._shape)} differ")
        _replace_storage(self, src, fresh=False)
        return self
    self._vals.copy_(_values(src, self, "copy_"), non_blocking)
    return self


def _like(fill):
    def like(x, dtype=None, *, layout=None, device=None, requires_grad=False, memory_format=None, **kw):
        v = x._vals
        vals = fill(v, dtype) if device is None else fill(v, dtype).to(device)
        s = SparseTensor(x._format, x._shape, x._levels if device is None else
                         tuple(st.map(lambda a: a.to(device)) for st in x._levels), vals, check=False)
        if x._format.padded and device is None:  # (``padding_of``: the zeros keep x's reading of its padding)
            s.__dict__["_padding"] = (s._levels, padding_of(x))
        return s.requires_grad_() if requires_grad else s
    like.__doc__ = "The same pattern and format (shared index arrays), zero values: optimizer state for a sparse parameter."
    return like


_zeros_like = _like(lambda v, dt: torch.zeros_like(v, dtype=dt))
implements(torch.zeros_like)(_zeros_like)


@implements(torch.full_like)
def full_like(x, fill_value, *, dtype=None, layout=None, device=None, requires_grad=False, memory_format=None):
    """``full_like(S, 0)``: zeros on S's pattern, as ``zeros_like`` (Adagrad's state: a dense one took the full
    size of a sparse parameter). Inside an optimizer step or ``stored_only()`` any value fills the stored entries
    of a format without padding; elsewhere (or padded: a zero-valued tensor's padding cannot be told from an
    entry at coordinate 0, ``storage.padding``) another value makes every element that value: the dense form."""
    if not isinstance(x, SparseTensor) or not isinstance(fill_value, numbers.Number):
        raise NoSparseRule("scorch: full_like of a sparse tensor with a tensor fill value")
    if fill_value != 0 and (x._format.padded or not stored_only_active()):
        raise NoSparseRule("scorch: full_like with a nonzero value is dense")
    out = _zeros_like(x, dtype, device=device, requires_grad=False)
    if fill_value != 0:
        with stored_only():
            out.add_(fill_value)
    return out.requires_grad_() if requires_grad else out
implements(torch.empty_like)(_zeros_like)  # zeros: padding must stay 0


@implements(torch.Tensor.conj, torch.conj, torch.Tensor.resolve_conj, torch.resolve_conj)
def conj(x):
    """Real values: the tensor itself."""
    if x.is_complex():
        raise NotImplementedError("scorch: complex SparseTensors are not supported")
    return x


# ``torch.nn.init``'s functions that hand a tensor subclass to ``__torch_function__`` (the others call the random
# fills above on the tensor): the same fills of the stored values (``nn.Linear.reset_parameters`` on a sparse weight)
@implements(torch.nn.init.uniform_)
def _init_uniform(tensor, a=0.0, b=1.0, generator=None):
    """``nn.init.uniform_``: each stored value drawn from U(a, b); the pattern kept."""
    with torch.no_grad():
        return tensor.uniform_(a, b, generator=generator)


@implements(torch.nn.init.normal_)
def _init_normal(tensor, mean=0.0, std=1.0, generator=None):
    """``nn.init.normal_``: each stored value drawn from N(mean, std**2); the pattern kept."""
    with torch.no_grad():
        return tensor.normal_(mean, std, generator=generator)


@implements(torch.nn.init.kaiming_uniform_)
def _init_kaiming_uniform(tensor, a=0.0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    """``nn.init.kaiming_uniform_``: torch's bound from the dense shape's fan, each stored value drawn within it."""
    if 0 in tensor.shape:
        return tensor
    fan = torch.nn.init._calculate_correct_fan(tensor, mode)
    bound = math.sqrt(3.0) * torch.nn.init.calculate_gain(nonlinearity, a) / math.sqrt(fan)
    with torch.no_grad():
        return tensor.uniform_(-bound, bound, generator=generator)


def _coalesce_leaf(s: SparseTensor) -> None:
    """An uncoalesced COO about to become a leaf that requires grad (``requires_grad_``, ``nn.Parameter``) gets its
    duplicates summed in place, as ``from_torch`` does for a torch tensor that requires grad: each entry then
    takes one gradient, as in torch (each duplicate took the entry's whole gradient: ``S.grad.to_dense()`` read
    twice torch's, an SGD step moved the entry twice as far, and Adam's step raised on the mixed patterns)."""
    if s._vals.is_leaf and not s._vals.requires_grad:
        summed = coalesce(s.detach())
        _replace_storage(s, summed, fresh=True)
        s.__dict__["_format"] = summed._format


RULES.register(coalesce_leaf=_coalesce_leaf)
