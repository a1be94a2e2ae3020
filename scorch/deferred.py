"""Deferred einsum results: a large dense ``scorch.einsum`` result stays an expression until its values are needed.

``y = scorch.einsum("bd,ndh->bnh", x, E)`` with dense operands may return a ``Deferred``: a ``torch.Tensor`` of the
right shape, dtype and device whose values are not computed yet. Two things can happen to it:

- it meets a sparse operand in another scorch einsum (``einsum("bnh,bn->bh", y, gates)``): the consumer
  substitutes ``y``'s expression (``"bd,ndh,bn->bh"``) and the compiler evaluates the combined expression, its
  loops driven by the sparse operand, so that only the entries the sparse operand keeps are computed;
- anything else touches it (any torch function or method, printing, ``.item()``, ``.numpy()``, an operator,
  autograd): ``__torch_function__`` computes the value exactly as the eager call would have (the same
  ``torch.einsum``), puts it into the tensor in place (``.data``) and turns the object into a plain
  ``torch.Tensor``; from then on it costs nothing.

Metadata reads (shape, dtype, device, ``requires_grad``, ``grad_fn``) are answered without computing; the
placeholder is one element repeated (stride 0), so a deferred result occupies no memory until it is computed.
Errors are the eager call's: equations and shapes are checked when the einsum is
called, and anything the check cannot vouch for runs eagerly. An operand modified in place between the einsum and
the computation of its value is detected (``_version``, and a fingerprint of a CPU operand's bytes for writes
through ``.data`` or a NumPy view) and raises, as autograd does for its saved tensors.

Which einsums are deferred (``mode``): ``"auto"`` (the default) defers all-dense einsums of at least ``MIN_WORK``
multiply-adds, whose run time makes the bookkeeping unmeasurable (a deferral costs 15 us in a tight loop, but
40-140 us right after a large kernel, when the code it runs is out of the caches: 5% of a 512^3 product, 1% of a
2^31 one, below measurement from 2^32); ``"all"`` defers every
all-dense einsum (the test suite runs with it, to show deferral is invisible); ``"off"`` none. The environment
variable ``SCORCH_DEFER`` sets the initial mode; ``scorch.deferral(mode)`` changes it within a ``with`` block.

Autograd: a deferred einsum of operands that require grad is the output of an autograd Function whose backward is
the eager einsum's (``_autograd._Einsum.backward``), so ``y.grad_fn`` exists before ``y`` is computed. A consumer
that substitutes ``y``'s expression differentiates the combined expression with respect to ``y``'s operands
directly.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import threading

import torch

from . import sparse_tensor as _sparse_tensor
from .compiler.caches import cache
from .rules import RULES
from .formats.storage import array_version
from .compiler.einsum import equation as einsum_string
from .compiler.einsum import parse

MODES = ("auto", "all", "off")

#: an all-dense einsum doing at least this many multiply-adds is deferred in the ``auto`` mode
MIN_WORK = 1 << 32


class _Mode(threading.local):
    def __init__(self):
        value = os.environ.get("SCORCH_DEFER", "auto").lower()
        self.value = value if value in MODES else "auto"


_mode = _Mode()
#: the thread-local holder of the mode (``current.value``): ``mode()``'s value, read without a call on the hot path
#: of ``S @ X`` (``ops.linalg._operator``), where each function a cold call enters costs microseconds
current = _mode


def mode() -> str:
    """The current deferral mode: ``"auto"``, ``"all"`` or ``"off"``."""
    return _mode.value


@contextlib.contextmanager
def deferral(new_mode: str):
    """``with scorch.deferral("off"):`` ... runs the block with that deferral mode (``auto``, ``all``, ``off``)."""
    if new_mode not in MODES:
        raise ValueError(f"deferral mode must be one of {', '.join(MODES)}, got {new_mode!r}")
    old = _mode.value
    _mode.value = new_mode
    try:
        yield
    finally:
        _mode.value = old


# reads answered from the placeholder's metadata, without computing the value
_METADATA = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndimension, torch.Tensor.numel, torch.Tensor.nelement,
    torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device,
    torch.Tensor.__len__, torch.Tensor.__hash__, torch.is_floating_point, torch.is_complex, torch.numel,
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.grad_fn.__get__,
    torch.Tensor.is_leaf.__get__, torch.Tensor.layout.__get__, torch.Tensor.is_cuda.__get__,
    torch.Tensor.is_sparse.__get__, torch.Tensor._version.__get__,
}


# layout reads, answered from the placeholder where it has the value's layout (``exact_layout``)
_LAYOUT = {torch.Tensor.is_contiguous, torch.Tensor.stride}


class Deferred(torch.Tensor):
    """A dense einsum result not computed yet (see the module's documentation). Becomes a plain
    ``torch.Tensor`` holding the value the first time anything needs it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _sparse_tensor.SparseTensor in types:
            return NotImplemented  # the sparse operand's implementation decides (products substitute this one)
        if func in _METADATA or (func in _LAYOUT and args[0]._expr.exact_layout):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if _mode.value == "all" and RULES.lazy_epilogue is not None:  # scorch.compile: an epilogue stays lazy
            lazy = RULES.lazy_epilogue(func, args, kwargs)
            if lazy is not None:
                return lazy
        compute_all(args)
        compute_all(kwargs.values())
        return func(*args, **kwargs)

    def compute(self) -> torch.Tensor:
        """Compute the value (once) and become a plain tensor holding it; returns ``self``."""
        if type(self) is not Deferred:
            return self
        check_versions(self)
        with torch.no_grad():
            value = self._expr.compute()
        return self.fill(value)

    def fill(self, value: torch.Tensor) -> torch.Tensor:
        """Become a plain tensor holding ``value`` (computed elsewhere: a fused kernel's intermediate)."""
        with torch._C.DisableTorchFunctionSubclass():
            self.data = value
        self.__class__ = torch.Tensor
        del self._expr, self._versions, self._prints
        return self


class EinsumExpr:
    """A deferred einsum: index letters, operands (dense tensors, and SparseTensors for a product with a dense
    result), the requested output format."""
    exact_layout = False  # the eager result may be a permuted view: layout reads compute it

    def __init__(self, inputs, out, operands, format=None):
        self.inputs, self.out, self.ops, self.format = inputs, out, tuple(operands), format
        self.operands = tuple(x._vals if type(x) is _sparse_tensor.SparseTensor else x for x in operands)
        self.dense = not any(type(x) is _sparse_tensor.SparseTensor for x in operands)

    def describe(self):
        return f"einsum {einsum_string(self.inputs, self.out)!r}"

    def compute(self):
        eq = einsum_string(self.inputs, self.out)
        if self.dense:
            return torch.einsum(eq, *self.ops)
        from . import engine
        return engine.einsum(eq, *self.ops, format=self.format)


def check_versions(d):
    """Raise where an operand of the deferred result ``d`` changed since the einsum was called: its version
    counter, or (a CPU operand in one piece) its bytes' fingerprint, which sees writes through ``.data`` or a
    NumPy view (``p.data -= lr * p.grad``) that leave the version counter as it was."""
    for t, v in zip(d._expr.operands, d._versions):
        if type(v) is int and t._version != v:  # (an inference tensor's has none: not checked)
            raise RuntimeError(f"scorch: an operand of a deferred result was modified in place before the result"
                               f" was used ({d._expr.describe()}); use the result before modifying its operands,"
                               " or run under scorch.deferral('off')")
    if d._prints != fingerprints(d._expr.operands):
        raise RuntimeError(f"scorch: an operand of a deferred result was written (through .data, a NumPy view, or"
                           f" in place under torch.inference_mode) before the result was used"
                           f" ({d._expr.describe()}); use the result before writing"
                           " its operands, or run under scorch.deferral('off')")


def fingerprints(operands) -> tuple:
    """The fingerprints of the operands that are CPU strided tensors (``relayout.fingerprint_span``: the bytes
    each spans, so a transposed view ``W.t()`` is covered: a write through ``W.data``, or any write under
    ``torch.inference_mode``, where tensors have no version counter, went unseen); None for the others (their
    version counters alone are checked)."""
    from .compiler.relayout import fingerprint_span
    return tuple(fingerprint_span(t) if isinstance(t, torch.Tensor) and t.layout == torch.strided and
                 t.device.type == "cpu" else None for t in operands)


def compute_all(items):
    """Compute every deferred result among ``items`` (nested in lists, tuples and dicts too)."""
    for a in items:
        if type(a) is Deferred:
            a.compute()
        elif isinstance(a, (list, tuple)):
            compute_all(a)
        elif isinstance(a, dict):
            compute_all(a.values())




def pending(x) -> bool:
    """Whether ``x`` is a deferred einsum result whose value is not computed yet."""
    return type(x) is Deferred


#: placeholders of deferred values by (shape, dtype, device, exact layout): never written (anything but a
#: metadata or layout read computes the value first, and computing replaces the storage), so deferred values of
#: one shape share one
_PLACEHOLDERS = cache("placeholders", "placeholder tensors of deferred values, by shape, dtype, device and layout",
                      limit=32)


def make(expr, shape, dtype, device):
    """A ``Deferred`` of ``shape`` computed by ``expr`` (``compute()``, ``operands``, ``exact_layout``)."""
    key = (tuple(shape), dtype, device, expr.exact_layout)
    placeholder = _PLACEHOLDERS.get(key)  # (each torch call here costs 10-25 us right after a large kernel)
    if placeholder is None:
        if expr.exact_layout:  # allocated, never written: untouched pages (CPU) hold no memory
            placeholder = torch.empty(shape, dtype=dtype, device=device)
        else:  # one element repeated: no memory on any device (layout reads compute the value)
            placeholder = torch.empty((), dtype=dtype, device=device).expand(shape)
        _PLACEHOLDERS[key] = placeholder
    d = torch.Tensor._make_subclass(Deferred, placeholder)
    d._expr = expr
    d._versions = tuple(array_version(t) for t in expr.operands)
    d._prints = fingerprints(expr.operands)
    return d


def lazy_einsum(equation, operands):
    """A ``Deferred`` for the all-dense einsum, or None where it is not deferred (the caller runs it eagerly).
    Operands that are deferred themselves are computed first (no chains: the value is exactly the eager one)."""
    m = _mode.value
    if m == "off":
        return None
    if m == "auto":  # a cheap upper bound of the work first: small einsums leave at once
        bound = 1
        for t in operands:
            bound *= t.numel()
        if bound < MIN_WORK:
            return None
    planned = _planned(equation, tuple(t.shape for t in operands))
    if planned is None:
        return None  # the eager call raises its own error
    inputs, out, shape, work = planned
    if m == "auto" and work < MIN_WORK:
        return None
    dtype, device = operands[0].dtype, operands[0].device
    for t in operands[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
        if t.device != device:
            return None
    if any(t.layout != torch.strided for t in operands):
        return None
    compute_all(operands)
    return _defer(inputs, out, operands, None, shape, dtype)


@functools.lru_cache(maxsize=1024)
def _planned(equation, shapes):
    """``(inputs, out, output shape, multiply-adds)`` of an einsum on operands of these shapes (cached: a model
    repeats its einsums), or None where the eager call would raise."""
    from . import engine
    try:
        inputs, out = parse(equation, [len(s) for s in shapes])
        sizes, _ = engine.index_sizes(inputs, [torch.empty(s, device="meta") for s in shapes], "einsum")
    except (ValueError, TypeError):
        return None
    return inputs, out, [sizes[v] for v in out], math.prod(sizes.values())


def product(equation, operands, format):
    """A ``Deferred`` for a product with a sparse operand and a dense result (``S @ X``), in the ``all`` mode
    only (and so inside ``scorch.compile``); None otherwise. Where the product's checks would fail, None: the
    eager call raises its own error."""
    if _mode.value != "all" or len(operands) != 2 or any(
            type(x) is Deferred or (type(x) is _sparse_tensor.SparseTensor and type(x._vals) is Deferred) or
            (type(x) is torch.Tensor and torch._C._functorch.is_functorch_wrapped_tensor(x)) for x in operands):
        # (a deferred operand is substituted by the product instead; lazy values fuse with it; a torch.func
        # transform's tensor has no storage to fingerprint: the eager call takes the dense form)
        return None
    from . import engine
    try:
        ops = engine.prepare(operands)
        if not any(type(x) is _sparse_tensor.SparseTensor for x in ops):
            return None
        plan = engine.dense_result(equation, ops, format)
    except Exception:  # noqa: BLE001  (any problem: the eager call reports it)
        return None
    if plan is None:
        return None
    inputs, out, shape, dtype = plan
    return _defer(inputs, out, ops, format, shape, dtype)


def _defer(inputs, out, ops, format, shape, dtype):
    from ._autograd import _Spec, _tensors
    from .sparse_tensor import needs_grad
    device = _sparse_tensor.device_of(ops[0])
    if needs_grad(ops):
        spec = _Spec(inputs, out, format, ops)
        return _Deferral.apply((spec, shape, dtype, device), *_tensors(ops))
    return make(EinsumExpr(inputs, out, ops, format), shape, dtype, device)


def _deferral_function():
    from ._autograd import _Einsum

    class _DeferralFn(_Einsum):
        """The deferred einsum as an autograd node: forward computes nothing; backward is the einsum's."""

        @staticmethod
        def forward(ctx, what, *tensors):
            spec, shape, dtype, device = what
            ctx.spec = spec
            ctx.save_for_backward(*tensors)
            expr = EinsumExpr(spec.inputs, spec.out, spec.operands(tensors), spec.format)
            return make(expr, shape, dtype, device)

    return _DeferralFn


class _LazyFn:
    fn = None

    def apply(self, *args):
        if self.fn is None:
            self.fn = _deferral_function()
        return self.fn.apply(*args)


_Deferral = _LazyFn()


def substitute(inputs, out, operands):
    """``(inputs, operands)`` with every pending deferred operand replaced by its expression: its operands, its
    output letters renamed to the consumer's, its contracted letters to fresh ones. None where a deferred
    operand cannot be substituted (a repeated letter in the consumer, letters run out)."""
    used = {v for idx in inputs for v in idx} | set(out)
    free = [c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in used]
    new_inputs, new_ops = [], []
    for idx, x in zip(inputs, operands):
        if type(x) is not Deferred:
            new_inputs.append(tuple(idx))
            new_ops.append(x)
            continue
        e = x._expr
        if len(set(idx)) != len(idx) or not isinstance(e, EinsumExpr):
            return None
        check_versions(x)
        rename = dict(zip(e.out, idx))
        for v in {w for i in e.inputs for w in i}:
            if v not in rename:
                if not free:
                    return None
                rename[v] = free.pop(0)
        new_inputs += [tuple(rename[v] for v in i) for i in e.inputs]
        new_ops += e.ops
    return new_inputs, new_ops


def substitute_einsum(equation, operands):
    """``(equation, operands, format)`` of an einsum with its deferred dense operands replaced by their expressions,
    where a sparse operand is there to drive the combined expression's loops (``format``: the one the eager call
    would give); else None, the deferred operands computed (the rule ``substitute_lazy``)."""
    from .engine.bind import result_dtype
    from .engine.evaluate import inferred_format, prepare
    from .sparse_tensor import SparseTensor, shape_of
    if not any(isinstance(x, SparseTensor) or (isinstance(x, torch.Tensor) and x.layout != torch.strided)
               for x in operands):
        compute_all(operands)
        return None
    inputs, out = parse(equation, [len(shape_of(x)) for x in operands])
    ops = [x if type(x) is Deferred else prepare([x])[0] for x in operands]
    # only all-dense deferred expressions, into a consumer of one kernel: its output format stays the eager one
    sub = None
    if len(ops) <= 2 and all(type(x) is not Deferred or x._expr.dense for x in ops):
        dtype = result_dtype(ops, f"einsum({equation!r})")
        fmt = inferred_format(inputs, out, ops, dtype)
        sub = substitute(inputs, out, ops)
    if sub is None:
        compute_all(operands)
        return None
    return einsum_string(sub[0], out), sub[1], fmt


RULES.register(lazy_type=Deferred, compute_lazy=compute_all, substitute_lazy=substitute_einsum)
