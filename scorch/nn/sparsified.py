"""Sparsified operators (STen's operator model): any function whose outputs, and the gradients flowing back through
it, are sparsified and stored in chosen formats.

    add_nm = scorch.sparsified_op(torch.add, out_fmt=[(scorch.nn.NM(2, 4), "nm(2, 4)")])
    z = add_nm(x, y)                                  # x + y, 2:4 by magnitude, a SparseTensor in nm(2, 4)

    linear = scorch.sparsified_op(F.linear, grad_inp_fmt=[None, (scorch.nn.ScalarFraction(0.9), "coo")])
    out = linear(x, layer.weight, layer.bias)        # layer.weight.grad: the top 10% of the gradient, sparse COO

A **spec** says what happens to one tensor: ``(inline, tmp_format, external, final_format)``. The inline
sparsifier is applied to the tensor as the op produced it, giving a temporary tensor in ``tmp_format``; the external
sparsifier is applied to that temporary (its values: zero where the inline sparsifier dropped an entry), giving the
tensor in ``final_format`` that the caller (or the optimizer) receives. ``(sparsifier, format)`` is short for
``(sparsifier, format, KeepAll(), format)``; ``None`` in a spec list leaves that tensor as it is. In STen the inline
sparsifier runs inside the operator's own implementation; scorch has no kernel that fuses one, so it runs on the
op's result, and the two stages differ in where the masks are computed and which formats the tensor passes through
(``(ScalarThreshold(0.1), "coo", NM(2, 4), "nm(2, 4)")``: the entries above 0.1, then 2:4 of those).

In a spec, a sparsifier is a ``scorch.nn.Sparsifier`` instance (``None``: ``KeepAll()``); a format is a name
(``"csr"``, ``"coo"``, ``"nm(2, 4)"``...), format text or a ``scorch.Format`` (a SparseTensor in it),
``torch.Tensor`` (a plain dense tensor, STen's spelling) or ``None`` (the tensor's own form: dense stays dense, a
SparseTensor keeps its format). A sparsifier only keeps entries the tensor stores: an entry a SparseTensor does
not store is 0 and stays unstored (so ``KeepAll()`` keeps a sparse result's pattern; on a dense tensor, every
entry).

``sparsified_op(op, out_fmt=None, grad_out_fmt=None, grad_inp_fmt=None)``
    ``out_fmt``: one spec per tensor output of ``op`` (in order; a function returning one tensor has one).
    ``grad_out_fmt``: one spec per tensor output, for the gradient with respect to that output, as it enters the
    op's backward (STen's ``grad_out_fmt``). ``grad_inp_fmt``: one spec per positional argument (``None`` for
    those left as they are), or a dict ``{position or keyword name: spec}``, for the gradient the op's backward
    gives that argument: a dense parameter's gradient (what STen's ``SparsityBuilder.set_weight_grad`` sets; as a
    schedule rule, without touching the model's code: ``scorch.schedule(model).grad(name)``, ``GradSelection``).

Semantics, as dense torch computes them:

- An output is the op's result times the spec's masks (mask constant): its gradient is zero at the dropped
  entries (STen passes the gradient straight through its sparsifiers; scorch differentiates what it computed, as
  ``scorch.schedule``'s sparse activations do).
- A gradient spec masks the gradient's values as the spec's sparsifiers choose (computed on the gradient itself).
  A gradient that flows on into other backward functions is handed on in dense form with those values (torch's
  backward formulas take dense gradients); the gradient of a dense **leaf** (a parameter) is stored in
  ``param.grad`` as the spec's final form: ``"coo"`` gives torch's sparse COO gradient (what ``torch.optim.SGD``
  and ``torch.optim.SparseAdam`` apply to a dense parameter, touching the entries the gradient (and SGD's sparse
  momentum buffer) stores; ``torch.optim.Adam`` refuses it, as torch does, naming SparseAdam, and SGD's
  ``weight_decay`` fails on it in torch), ``torch.Tensor``/``None``/``"dense"`` a dense gradient. Other sparse
  formats are refused for a dense leaf (torch stores no other sparse gradient of a dense tensor), and a gradient
  spec for a SparseTensor argument is refused (its gradient is already sparse, on its own pattern).
- The op itself runs as it would be called: on SparseTensor operands it goes through scorch (sparse rules or the
  visible dense fallback), on dense ones through torch.
"""
from __future__ import annotations

import numbers

import torch

from ..formats import Format, named, storage
from ..formats.expr import Var
from ..sparse_tensor import SparseTensor
from .sparsify import KeepAll, Sparsifier, masked

__all__ = ["sparsified_op", "SparsifiedOp", "Spec", "GradSelection"]

_DENSE = torch.Tensor  # the format that means "a plain dense tensor" (STen's spelling)


def _check_sparsifier(s, where: str):
    if s is None:
        return KeepAll()
    if isinstance(s, type) and issubclass(s, Sparsifier):
        raise TypeError(f"{where}: pass a sparsifier instance, not the class {s.__name__} (e.g. {s.__name__}(...))")
    if not isinstance(s, Sparsifier):
        raise TypeError(f"{where}: a sparsifier is a scorch.nn.Sparsifier instance or None, got {type(s).__name__}")
    return s


def _check_format(f, where: str):
    if f is None or f is _DENSE:
        return f
    if not isinstance(f, (str, Format)):
        raise TypeError(f"{where}: a format is a name, format text, a scorch.Format, torch.Tensor (dense) or None,"
                        f" got {type(f).__name__}")
    try:
        named.resolve(f)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return f


class Spec:
    """What happens to one tensor: the inline sparsifier and temporary format, then the external sparsifier and
    final format (see the module docstring). ``Spec.of(obj)`` reads a 4-tuple, a ``(sparsifier, format)`` pair,
    or a ``Spec``."""

    __slots__ = ("inline", "tmp_format", "external", "final_format")

    def __init__(self, inline=None, tmp_format=None, external=None, final_format=None, *, where: str = "spec"):
        self.inline = _check_sparsifier(inline, f"{where}: the inline sparsifier")
        self.tmp_format = _check_format(tmp_format, f"{where}: the temporary format")
        self.external = _check_sparsifier(external, f"{where}: the external sparsifier")
        self.final_format = _check_format(final_format, f"{where}: the final format")

    @classmethod
    def of(cls, obj, where: str = "spec") -> "Spec | None":
        if obj is None or isinstance(obj, Spec):
            return obj
        if isinstance(obj, (tuple, list)) and len(obj) == 4:
            return cls(*obj, where=where)
        if isinstance(obj, (tuple, list)) and len(obj) == 2:
            return cls(obj[0], obj[1], None, obj[1], where=where)
        raise TypeError(f"{where}: a spec is (inline sparsifier, temporary format, external sparsifier, final"
                        f" format), a pair (sparsifier, format), or None; got {obj!r}")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` through both stages (differentiable in ``x``'s values)."""
        tmp = _stage(x, self.inline, self.tmp_format)
        return _stage(tmp, self.external, self.final_format)

    def __repr__(self):
        return f"Spec({self.inline!r}, {self.tmp_format!r}, {self.external!r}, {self.final_format!r})"


def _stored(x: SparseTensor) -> torch.Tensor:
    """A bool tensor of ``x``'s shape: True at the entries ``x`` stores (not padding, not outside the shape)."""
    leaf, dims, inside = storage.coordinates(x.format, x.shape, x.levels)
    pad = storage.padding(x.format, x.shape, x.levels, x.values().detach())
    real = inside if pad is None else inside & ~pad[leaf]
    out = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    out[tuple(dims[:, real])] = True
    return out


def _masking(x: torch.Tensor, sparsifier: Sparsifier):
    """``(dense, mask)``: ``x``'s dense form (differentiable) and the entries ``sparsifier`` keeps among those ``x``
    stores (``None``: every entry of a dense ``x``)."""
    sparse = isinstance(x, SparseTensor)
    dense = x.to_dense() if sparse else x
    with torch.no_grad():
        mask = None if type(sparsifier) is KeepAll else sparsifier.checked_mask(dense.detach())
        if sparse:
            mask = _stored(x) if mask is None else mask & _stored(x)
    return dense, mask


def _stage(x: torch.Tensor, sparsifier: Sparsifier, fmt) -> torch.Tensor:
    """One stage of a spec: ``x``'s entries that ``sparsifier`` keeps (and ``x`` stores), in ``fmt``."""
    sparse = isinstance(x, SparseTensor)
    if type(sparsifier) is KeepAll and (fmt is None or (fmt is _DENSE and not sparse)
                                        or (sparse and fmt is not _DENSE and named.resolve(fmt, x.dim()) == x.format)):
        return x  # (a one-stage spec's second stage: the temporary is the final tensor)
    dense, mask = _masking(x, sparsifier)
    if fmt is None:
        fmt = x.format if sparse else _DENSE
    if fmt is _DENSE:
        return dense if mask is None else dense * mask
    if mask is None:
        mask = torch.ones(dense.shape, dtype=torch.bool, device=dense.device)
    return masked(dense, mask, named.resolve(fmt, dense.dim()))


def _leaf_layout(spec: Spec, x: torch.Tensor, where: str) -> str:
    """How the gradient of the dense leaf ``x`` is stored under ``spec``: ``"coo"`` or ``"dense"`` (a format torch
    cannot store as a dense tensor's gradient raises)."""
    fmt = spec.final_format
    if fmt is None or fmt is _DENSE:
        return "dense"
    resolved = named.resolve(fmt, x.dim())
    if resolved == named.resolve("coo", x.dim()):
        return "coo"
    if resolved == named.resolve("dense", x.dim()):
        return "dense"
    raise ValueError(f"{where}: the gradient of a dense leaf tensor (a parameter) is stored in its .grad, where torch"
                     f" keeps a sparse gradient of a dense tensor only as sparse COO (torch.optim.SGD and SparseAdam"
                     f" apply it): use the final format 'coo' (or torch.Tensor for a dense gradient), not {fmt!r}")


def _final_mask(spec: Spec, g: torch.Tensor):
    """``(values, mask)`` of the dense ``g`` through ``spec``, the final format aside: the dense tensor the external
    sparsifier sees and the entries the final tensor stores. Where the temporary is dense, or in a format that
    stores exactly its mask (plain levels, no padding: coo, csr...), the masks are combined without building it."""
    tmp = spec.tmp_format
    fmt = None if tmp is None or tmp is _DENSE else named.resolve(tmp, g.dim())
    if fmt is not None and (fmt.padded or not all(isinstance(e, Var) for e in fmt.exprs)):
        return _masking(_stage(g, spec.inline, tmp), spec.external)  # (blocks, padding: what it stores decides)
    with torch.no_grad():
        first = None if type(spec.inline) is KeepAll else spec.inline.checked_mask(g)
        values = g if first is None else g * first
        second = None if type(spec.external) is KeepAll else spec.external.checked_mask(values)
    if fmt is None or first is None:  # a dense temporary stores every entry
        return values, second
    return values, first if second is None else first & second


class _GradSpec(torch.autograd.Function):
    """The identity forward; backward gives the incoming gradient through a spec (to a dense leaf as its
    ``layout``: torch's sparse COO or dense; to anything else dense, since torch's backward formulas take dense
    gradients)."""

    @staticmethod
    def forward(ctx, x, spec, layout):
        ctx.spec, ctx.layout = spec, layout
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if isinstance(g, SparseTensor):
            g = g.to_dense()
        spec = ctx.spec
        if ctx.layout == "coo":  # torch's COO made straight from the final mask (row-major: canonical order)
            dense, mask = _final_mask(spec, g)
            if mask is None:
                mask = torch.ones(dense.shape, dtype=torch.bool, device=dense.device)
            return torch.sparse_coo_tensor(mask.nonzero().t(), dense[mask], dense.shape, is_coalesced=True,
                                           check_invariants=False), None, None
        r = spec.apply(g)
        return (r.to_dense() if isinstance(r, SparseTensor) else r), None, None


def _with_grad_spec(x, spec: Spec | None, where: str):
    if spec is None or not isinstance(x, torch.Tensor) or not x.requires_grad:
        if spec is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{where} has a gradient spec, but the argument is a {type(x).__name__}, not a tensor")
        return x
    if isinstance(x, SparseTensor) or x.layout != torch.strided:
        raise ValueError(f"{where} has a gradient spec, but the argument is sparse: its gradient is already sparse,"
                         " on its own pattern (gradient specs are for dense tensors)")
    layout = _leaf_layout(spec, x, where) if x.is_leaf else "dense"
    return _GradSpec.apply(x, spec, layout)


def _output(y, out: Spec | None, grad: Spec | None):
    if not isinstance(y, torch.Tensor):
        return y
    if grad is not None and y.requires_grad:
        if isinstance(y, SparseTensor):
            stored = _stored(y)
            y = masked(_GradSpec.apply(y.to_dense(), grad, "dense"), stored, y.format)
        else:
            y = _GradSpec.apply(y, grad, "dense")
    return y if out is None else out.apply(y)


def _spec_list(obj, what: str):
    if obj is None:
        return None
    if isinstance(obj, (Spec, Sparsifier)) or not isinstance(obj, (tuple, list)) or \
            (obj and isinstance(obj[0], Sparsifier)):
        raise TypeError(f"{what} is a list with one spec per tensor output, e.g. {what}=[(scorch.nn.NM(2, 4),"
                        f" 'nm(2, 4)')]; got {obj!r}")
    return tuple(Spec.of(s, f"{what}[{i}]") for i, s in enumerate(obj))


def _input_specs(obj):
    if obj is None:
        return {}
    if isinstance(obj, dict):
        specs = {}
        for k, s in obj.items():
            if isinstance(k, bool) or not isinstance(k, (numbers.Integral, str)) or \
                    (isinstance(k, numbers.Integral) and k < 0):
                raise TypeError(f"grad_inp_fmt's keys are argument positions (>= 0) or keyword names, got {k!r}")
            specs[k if isinstance(k, str) else int(k)] = Spec.of(s, f"grad_inp_fmt[{k!r}]")
        return specs
    if isinstance(obj, (tuple, list)) and not (obj and isinstance(obj[0], Sparsifier)):
        return {i: Spec.of(s, f"grad_inp_fmt[{i}]") for i, s in enumerate(obj)}
    raise TypeError("grad_inp_fmt is a list with one spec (or None) per positional argument, or a dict {position"
                    f" or keyword name: spec}}; got {obj!r}")


class SparsifiedOp:
    """``op`` with its outputs and gradients sparsified (``scorch.sparsified_op``; see ``scorch.nn.sparsified``)."""

    def __init__(self, op, out_fmt=None, grad_out_fmt=None, grad_inp_fmt=None):
        if not callable(op):
            raise TypeError(f"sparsified_op: op must be callable, got {type(op).__name__}")
        self.op = op
        self.out_fmt = _spec_list(out_fmt, "out_fmt")
        self.grad_out_fmt = _spec_list(grad_out_fmt, "grad_out_fmt")
        if self.out_fmt is not None and self.grad_out_fmt is not None and \
                len(self.out_fmt) != len(self.grad_out_fmt):
            raise ValueError(f"out_fmt has {len(self.out_fmt)} specs and grad_out_fmt {len(self.grad_out_fmt)}: both"
                             " have one per tensor output")
        self.grad_inp_fmt = _input_specs(grad_inp_fmt)
        self.__name__ = f"sparsified_{getattr(op, '__name__', 'op')}"

    def __call__(self, *args, **kwargs):
        name = self.__name__
        positional = [k for k in self.grad_inp_fmt if isinstance(k, int)]
        if positional and max(positional) >= len(args):
            raise ValueError(f"{name}: grad_inp_fmt has a spec for positional argument {max(positional)}, but the call"
                             f" passes {len(args)}")
        unknown = [k for k in self.grad_inp_fmt if isinstance(k, str) and k not in kwargs]
        if unknown:
            raise ValueError(f"{name}: grad_inp_fmt names keyword argument {unknown[0]!r}, which the call does not"
                             " pass")
        args = tuple(_with_grad_spec(a, self.grad_inp_fmt.get(i), f"{name}: argument {i}")
                     for i, a in enumerate(args))
        kwargs = {k: _with_grad_spec(v, self.grad_inp_fmt.get(k), f"{name}: argument {k!r}")
                  for k, v in kwargs.items()}
        result = self.op(*args, **kwargs)
        if self.out_fmt is None and self.grad_out_fmt is None:
            return result
        many = isinstance(result, (tuple, list))
        items = list(result) if many else [result]
        where = [i for i, y in enumerate(items) if isinstance(y, torch.Tensor)]
        count = len(self.out_fmt if self.out_fmt is not None else self.grad_out_fmt)
        if len(where) != count:
            raise ValueError(f"{name}: the op returned {len(where)} tensor(s), but the specs are for {count}")
        for n, i in enumerate(where):
            items[i] = _output(items[i], self.out_fmt[n] if self.out_fmt else None,
                               self.grad_out_fmt[n] if self.grad_out_fmt else None)
        if not many:
            return items[0]
        if hasattr(type(result), "_fields"):  # a collections.namedtuple
            return type(result)(*items)
        return type(result)(items)  # tuple, list, torch's named results (torch.return_types) take a sequence

    def __repr__(self):
        return (f"sparsified_op({getattr(self.op, '__name__', self.op)!r}, out_fmt={self.out_fmt},"
                f" grad_out_fmt={self.grad_out_fmt}, grad_inp_fmt={self.grad_inp_fmt or None})")


def sparsified_op(op, out_fmt=None, grad_out_fmt=None, grad_inp_fmt=None) -> SparsifiedOp:
    """``op`` (any function of tensors: ``torch.add``, ``F.linear``...) whose outputs and gradients are sparsified
    and stored as the specs say (STen's ``sparsified_op``): ``out_fmt`` one spec per tensor output,
    ``grad_out_fmt`` one per tensor output for the gradient with respect to it, ``grad_inp_fmt`` one per positional
    argument (or ``{position or name: spec}``) for the gradient the op gives it. A spec is ``(inline sparsifier,
    temporary format, external sparsifier, final format)`` or ``(sparsifier, format)``; see
    ``scorch.nn.sparsified``."""
    return SparsifiedOp(op, out_fmt, grad_out_fmt, grad_inp_fmt)


# --- a dense parameter's gradient format as a schedule rule (``scorch.schedule(model).grad(name)``) ----------

class GradSelection:
    """Parameters whose gradient a ``Schedule`` sparsifies (``s.grad(name)``, STen's ``set_weight_grad``): each
    method applies to all of them and returns the selection. The spec starts as ``(KeepAll(), "coo")``:
    ``.sparsify(sparsifier)`` sets its sparsifier, ``.set_format(format)`` its format (``"coo"``, torch's sparse
    gradient, or ``torch.Tensor``, a dense one), ``.spec(inline, tmp_format, external, final_format)`` both stages.
    From ``apply()`` on, every forward of the owning module uses the parameter through the spec, so ``.grad``
    receives each use's gradient as the spec stores it."""

    def __init__(self, specs: dict, params: dict):
        self._specs, self._params, self.names = specs, params, tuple(params)
        for n in self.names:
            specs.setdefault(n, Spec(None, "coo", None, "coo", where=f"the gradient of {n!r}"))

    def _edit(self, change):
        new = {}
        for n in self.names:  # all checked before any is changed
            old = self._specs[n]
            stages = change((old.inline, old.tmp_format, old.external, old.final_format))
            new[n] = Spec(*stages, where=f"the gradient of {n!r}")
            _leaf_layout(new[n], self._params[n], f"the gradient of {n!r}")
        self._specs.update(new)
        return self

    def sparsify(self, sparsifier: Sparsifier) -> "GradSelection":
        """Keep the gradient entries ``sparsifier`` chooses (on each backward)."""
        return self._edit(lambda st: (sparsifier,) + st[1:])

    def set_format(self, format) -> "GradSelection":
        """Store the gradient as ``"coo"`` (torch's sparse COO ``.grad``) or ``torch.Tensor`` (dense)."""
        return self._edit(lambda st: (st[0], format, st[2], format))

    def spec(self, inline=None, tmp_format=None, external=None, final_format="coo") -> "GradSelection":
        """Both stages of the spec (see ``scorch.nn.sparsified``)."""
        return self._edit(lambda st: (inline, tmp_format, external, final_format))

    def __repr__(self):
        return f"GradSelection({list(self.names)}: {self._specs[self.names[0]]!r})"


def install_grad_spec(model, param, spec: Spec, name: str) -> list:
    """Hooks on every module of ``model`` that holds ``param``: during the module's forward its attribute is
    ``param`` through ``spec`` (an identity whose backward gives ``param`` the spec's gradient), and ``param``
    again afterwards, even when the forward raises (as ``torch.func.functional_call`` swaps parameters)."""
    if isinstance(param, SparseTensor) or param.layout != torch.strided:
        raise ValueError(f"the gradient of {name!r}: the parameter is sparse, so its gradient is already sparse on"
                         " its pattern (a gradient format is for dense parameters)")
    layout = _leaf_layout(spec, param, f"the gradient of {name!r}")
    handles = []
    for module in model.modules():  # (each module once, however often the model holds it)
        for attr in [a for a, p in module._parameters.items() if p is param]:
            state = {"depth": 0, "view": None}  # (a module called inside its own forward: the outer call swaps)

            def swap_in(mod, args, attr=attr, state=state):
                state["depth"] += 1
                if state["depth"] == 1 and mod._parameters.get(attr) is param and param.requires_grad and \
                        torch.is_grad_enabled():
                    state["view"] = mod._parameters[attr] = _GradSpec.apply(param, spec, layout)

            def swap_out(mod, args, output, attr=attr, state=state):
                state["depth"] -= 1
                if state["depth"] == 0 and state["view"] is not None:
                    if mod._parameters.get(attr) is state["view"]:  # (not a Parameter assigned meanwhile)
                        mod._parameters[attr] = param
                    state["view"] = None
            handles += [module.register_forward_pre_hook(swap_in),
                        module.register_forward_hook(swap_out, always_call=True)]
    return handles
