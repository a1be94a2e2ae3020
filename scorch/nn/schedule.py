"""The scheduling language: which parameters and activations of an existing model are sparse, how they are
sparsified, and in which format they are stored.

    s = scorch.schedule(model)
    s["encoder.0.linear1.weight"].sparsify(scorch.nn.ScalarFraction(0.9)).set_format("csr")
    s.glob("encoder.*.linear2.weight").sparsify(scorch.nn.NM(2, 4), dynamic=True)
    s.regex(r"head\\.\\d+\\.weight").block(16, 16).set_format("ell", axes=[0, 1]).set_format("coo", axes=[2, 3])
    s.output("encoder.0.linear1").sparsify(scorch.nn.ScalarThreshold(0.1)).set_format("coo")
    s.grad("decoder.weight").sparsify(scorch.nn.ScalarFraction(0.9))   # a dense weight's top-10% gradient, COO
    s.apply()                     # rewrites the model in place
    opt = torch.optim.Adam(model.parameters()); s.attach(opt)   # dynamic patterns follow every opt.step()
    s.summary()

Selection
    ``s[name]``: a parameter by its exact name (``model.named_parameters()``), or a submodule by its exact
    name (``model.named_modules()``), which selects that module's output (activations). ``s[re.compile(r)]``
    and ``s.regex(r)`` select the parameters whose whole name matches ``r`` (``re.fullmatch``); ``s.glob(p)``
    those matching the shell pattern ``p`` (``fnmatch``: ``*`` also matches dots); ``s.output(name)`` (or
    ``s.output(re.compile(r))``) selects module outputs. Selecting nothing raises ``KeyError``. ``s.grad(key)``
    selects the gradients of dense parameters (``scorch.nn.sparsified.GradSelection``: sparsified into ``.grad``).

Chained calls (each returns the selection; later calls override earlier ones)
    ``.sparsify(sparsifier, dynamic=False)``: the rule choosing the kept entries (default: the nonzeros,
    ``ScalarThreshold(0)``). ``dynamic=True`` re-applies it after every optimizer step (``step``/``attach``).
    ``.block(bh, bw)``: view a 2-d tensor as 4 axes ``(i / bh, j / bw, i % bh, j % bw)`` for ``set_format``.
    ``.set_format(fmt, axes=None)``: ``fmt`` is a name (``"csr"``, ``"coo"``, ``"ell"``, ``"dense"``,
    ``"bsr(16, 16)"``, ``"dia"``...), format text or a ``scorch.Format``. With ``axes``, the format's levels
    are applied to those axes of the (blocked) view: its dimension ``d`` becomes axis ``axes[d]`` and its
    levels keep their own order (``csc`` on ``[a, b]`` stores ``b`` then ``a``). The groups are laid out
    outermost first by their smallest axis; axes no call names are dense levels. So after ``.block(16, 16)``,
    ``.set_format("ell", axes=[0, 1]).set_format("coo", axes=[2, 3])`` is
    ``(i, j) -> (i / 16 : dense, j / 16 : fixed, i % 16 : compressed(nonunique), j % 16 : singleton)``.
    Without ``axes`` and after ``.block``, a format whose levels store plain dimensions (csr, coo, ell...)
    applies to the block axes with dense blocks inside (``"csr"`` gives ``bsr(bh, bw)``); any other format
    (``"bsr(8, 8)"``, ``"dia"``, format text) is used as it is. Default format: ``csr`` (2-d), ``coo``
    (other ranks), ``bsr(bh, bw)`` after ``.block``. A composed format the parser rejects raises its
    ``ValueError`` at the ``set_format``/``block`` call.

Applying
    ``s.apply()`` replaces every selected parameter, on its owning module(s), by an
    ``nn.Parameter(SparseTensor)`` holding the kept values (``requires_grad`` preserved; a parameter shared by
    several modules is replaced everywhere). The modules' code is unchanged: their forward reaches scorch
    because ``F.linear``, ``F.conv*d``, ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``'s projection
    weights) etc. dispatch on the SparseTensor. A parameter whose module calls a torch function scorch does not
    implement for sparse operands (transposed convolutions, norms) raises ``NotImplementedError`` at ``apply``
    naming it, before anything is replaced. Create the optimizer after ``apply`` (it must hold the
    new Parameters).

Kernel schedules
    ``.schedule(order=..., parallel=..., workspace=...)`` (or what ``scorch.einsum(schedule=)`` takes) gives a
    parameter's products, or those with a sparse operand in a module's forward (``s["block"]``; its output is
    then not sparsified unless asked), einsum's directives, in the letters of the op's product (``F.linear`` with a
    sparse weight: ``einsum("oi,bi->ob", W, X)``), which then runs the general lowering, not ``engine.weights``.
    Checked at ``apply`` for an ``nn.Linear``'s weight (einsum's ``ValueError``, nothing replaced), else at the
    first call; shown by ``summary()``/``repr``, removed by ``undo()``, not in the state dict (``nn.directives``).

Convolution weights
    The weight of a ``Conv1d``/``Conv2d``/``Conv3d`` is sparsified and formatted as its matrix view ``(out,
    prod(kernel) * in / groups)``, columns in the order ``(*kernel, in)`` (torch's channels_last weight order:
    ``NM(2, 4)`` groups run along input channels) (``"csr"``, ``.block(bh, bw)``, ``NM(2, 4)``): the
    Parameter keeps the conv's shape (canonical COO of the kept entries, ``to_dense()`` the N-d weight) and
    records the view's format, which ``F.conv*d`` computes in (``scorch.ops.conv``).

Dynamic patterns
    ``s.step(optimizer=None)`` (after ``opt.step()``), or ``s.attach(opt)`` (a step post hook doing it),
    recomputes each dynamic parameter's mask from its current values and stores the new pattern in the same
    Parameter object (``copy_``), so the optimizer keeps referring to it. The optimizer's per-parameter state
    (Adam's ``exp_avg``, SGD's ``momentum_buffer``...) is re-projected onto the new pattern: an entry kept from
    the old pattern keeps its state, a new entry starts at 0. Only the optimizers passed to ``step`` or
    attached are re-projected.

Activations
    A selected module output gets a forward hook that returns, in place of the output, a SparseTensor storing
    the entries the sparsifier keeps, with the mask computed from the activation on every forward (``dynamic``
    does not apply). The values are gathered from the dense output, so gradients flow back through it. The
    output keeps its rank when the format can store it (``coo``, ``csf``, ``dense``, a Format of that rank);
    otherwise (``csr``, ``ell``, ``.block``...) an N-d output (N > 2) is stored flattened to 2-d,
    ``(prod(leading dims), last dim)``, and the module returns that 2-d SparseTensor.
"""
from __future__ import annotations

import difflib
import fnmatch
import numbers
import re

import torch
import torch.nn as _nn

from ..formats import Format, named, storage
from ..formats.expr import Div, Mod, Var, dim_name
from ..formats.levels import Dense
from ..formats.named import short_name
from ..ops.pattern import same_pattern
from ..sparse_tensor import SparseTensor, padding_of
from . import directives as _directives
from .owners import as_stored, conv_weight, sparse_conv_weight, unsupported
from .report import Summary, storage_bytes
from .sparsified import GradSelection, install_grad_spec
from .sparsify import NM, ScalarThreshold, Sparsifier, masked, packed_weight

__all__ = ["schedule", "Schedule", "ParameterSelection", "OutputSelection", "Layout", "Summary"]


def schedule(model: _nn.Module) -> "Schedule":
    """A ``Schedule`` for ``model``: select parameters and module outputs, say how to sparsify and store them,
    then ``apply()``. See ``scorch.nn.schedule``'s module docstring."""
    return Schedule(model)


# --- formats: a block view and format groups composed into one Format ----------------------------------------

def _plain(fmt: Format) -> bool:
    """Whether every level of ``fmt`` stores a plain dimension (so it can be applied to any axes)."""
    return all(isinstance(e, Var) for e in fmt.exprs)


def _check_spec(spec):
    if not isinstance(spec, (str, Format)):
        raise TypeError(f"a format is a name, format text or a scorch.Format, got {type(spec).__name__}")
    named.resolve(spec)  # unknown names and bad text fail here, at the call


class Layout:
    """How one tensor is stored: an optional block view ``(bh, bw)`` and the formats given to ``set_format``
    (see the module docstring); ``compose(ndim)`` builds the ``scorch.Format``."""

    def __init__(self):
        self.block = None
        self.groups = []  # [(spec, axes tuple or None)]

    def copy(self) -> "Layout":
        new = Layout()
        new.block, new.groups = self.block, list(self.groups)
        return new

    def set_block(self, bh, bw):
        for b in (bh, bw):
            if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0:
                raise ValueError(f"block sizes must be positive integers, got ({bh!r}, {bw!r})")
        self.block = (int(bh), int(bw))

    def set_format(self, spec, axes=None):
        _check_spec(spec)
        if axes is None:
            self.groups = [(spec, None)]
            return
        if isinstance(axes, (str, bytes)) or not hasattr(axes, "__iter__"):
            raise TypeError(f"axes must be a list of axis numbers, got {axes!r}")
        axes = tuple(axes)
        if not axes or any(isinstance(a, bool) or not isinstance(a, numbers.Integral) or a < 0 for a in axes):
            raise ValueError(f"axes must be a non-empty list of non-negative integers, got {list(axes)}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"axes {list(axes)} repeat an axis")
        axes = tuple(int(a) for a in axes)
        self.groups = [g for g in self.groups if g[1] is not None and not set(g[1]) & set(axes)] + [(spec, axes)]

    def axis_exprs(self, ndim):
        if self.block is None:
            return [Var(d) for d in range(ndim)]
        if ndim != 2:
            raise ValueError(f".block() views a 2-d tensor as 4 axes, but the tensor is {ndim}-d")
        bh, bw = self.block
        return [Div(0, bh), Div(1, bw), Mod(0, bh), Mod(1, bw)]

    def describe(self) -> str:
        parts = [f"block{self.block}"] if self.block else []
        parts += [str(s) if a is None else f"{s} on axes {list(a)}" for s, a in self.groups]
        return ", ".join(parts) or "default"

    def compose(self, ndim: int) -> Format:
        exprs = self.axis_exprs(ndim)
        groups = list(self.groups)
        if groups and groups[0][1] is None:
            fmt = named.resolve(groups[0][0], ndim if self.block is None else None)
            if self.block is None or not _plain(fmt):
                return named.resolve(fmt, ndim)
            groups = [(fmt, (0, 1))]
        elif not groups:
            if self.block is None:
                return named.resolve("csr" if ndim == 2 else "coo", ndim)
            groups = [("csr", (0, 1))]
        levels, covered = [], set()
        for spec, axes in groups:
            bad = [a for a in axes if a >= len(exprs)]
            if bad:
                raise ValueError(f"axes {list(axes)}: the tensor is viewed as {len(exprs)} axes (0..{len(exprs) - 1})"
                                 + ("" if self.block else "; call .block(bh, bw) first to split it into blocks"))
            fmt = named.resolve(spec, len(axes))
            if not _plain(fmt):
                raise ValueError(f"format {spec!r} stores {', '.join(str(e) for e in fmt.exprs)}: only formats whose"
                                 " levels store plain dimensions (csr, coo, ell, dense...) can be applied to axes")
            levels.append((min(axes), [(axes[e.dim], lvl) for e, lvl in fmt.levels]))
            covered |= set(axes)
        levels += [(a, [(a, Dense())]) for a in range(len(exprs)) if a not in covered]
        levels.sort(key=lambda g: g[0])
        names = [dim_name(d) for d in range(ndim)]
        text = (f"({', '.join(names)}) -> ("
                + ", ".join(f"{exprs[a].render(names)} : {lvl}" for _, group in levels for a, lvl in group) + ")")
        try:
            return Format(text)
        except ValueError as e:
            raise ValueError(f"the format composed from {self.describe()} is not valid: {e}") from e


# --- plans and selections ------------------------------------------------------------------------------------

class _Plan:
    """What the schedule does to one parameter or module output."""

    def __init__(self):
        self.sparsifier: Sparsifier | None = None
        self.dynamic = False
        self.layout = Layout()
        self.directives = None  # the kernels' schedule (``.schedule``), None: the compiler's

    @property
    def rule(self) -> Sparsifier:
        return self.sparsifier if self.sparsifier is not None else ScalarThreshold(0.0)


class _ParamPlan(_Plan):
    def __init__(self):
        super().__init__()
        self.param = None  # the Parameter ``apply`` installed, None until then


class _OutputPlan(_Plan):
    def __init__(self):
        super().__init__()
        self.handle = None
        self._formats = {}  # output rank -> (Format, flattened to 2-d)
        self.sparsified = False  # sparsify/block/set_format called: else only directives (if any) are installed
        self.hooks = ()  # the directives' forward hooks

    @property
    def sparsifies(self) -> bool:
        return self.sparsified or self.directives is None

    def format_for(self, ndim):
        hit = self._formats.get(ndim)
        if hit is None:
            try:
                hit = (self.layout.compose(ndim), False)
            except ValueError:
                if ndim <= 2:
                    raise
                hit = (self.layout.compose(2), True)
            self._formats[ndim] = hit
        return hit


def _check_sparsifier(sparsifier):
    if not isinstance(sparsifier, Sparsifier):
        raise TypeError(f"sparsify takes a scorch.nn.Sparsifier (ScalarFraction(0.9), NM(2, 4)...), got"
                        f" {type(sparsifier).__name__}")


class _Selection:
    _kind = ""

    def __init__(self, sched: "Schedule", names):
        self._schedule, self.names = sched, tuple(names)

    def _plans(self):
        return [self._schedule._plan(self._kind, n) for n in self.names]

    def schedule(self, spec=None, **fields):
        """The loop order, parallel loop and workspace of the kernels this selection's products compile to
        (``order=``, ``parallel=``, ``workspace=``, ``transpose=``, ``temporary=``; or a ``scorch.Directives``, a
        dict of its fields or a loop order, as ``scorch.einsum(..., schedule=)`` takes): a parameter's products
        (``F.linear`` is ``einsum("oi,bi->ob", W, X)``), or those with a sparse operand in a module's forward.
        Checked as ``einsum(schedule=)`` checks them: at ``apply`` for an ``nn.Linear``'s weight, else at the
        first call. ``.schedule()`` takes them away. See ``scorch.nn.directives``."""
        d = _directives.directives_of(spec, fields)
        for name in self.names:
            why = _directives.refused(self._schedule.model, name) if self._kind == "param" else None
            if why and d is not None:
                raise NotImplementedError(f"scorch.schedule: parameter {name!r} cannot take directives: {why}")
        for plan in self._plans():
            plan.directives = d
        return self

    def __repr__(self):
        shown = ", ".join(self.names[:4]) + (f", ... ({len(self.names)} in all)" if len(self.names) > 4 else "")
        return f"{type(self).__name__}([{shown}])"


class ParameterSelection(_Selection):
    """Parameters selected in a ``Schedule``; every method applies to all of them and returns the selection."""

    _kind = "param"

    def sparsify(self, sparsifier: Sparsifier, dynamic: bool = False) -> "ParameterSelection":
        """Keep the entries ``sparsifier`` chooses: once at ``apply`` (``dynamic=False``) or also after every
        optimizer step (``dynamic=True``; see ``Schedule.step``)."""
        _check_sparsifier(sparsifier)
        if not isinstance(dynamic, bool):
            raise TypeError(f"dynamic must be True or False, got {dynamic!r}")
        for plan in self._plans():
            plan.sparsifier, plan.dynamic = sparsifier, dynamic
        return self

    def block(self, bh: int, bw: int) -> "ParameterSelection":
        """View each (2-d) parameter as 4 axes ``(i / bh, j / bw, i % bh, j % bw)`` for ``set_format``."""
        return self._edit(lambda layout: layout.set_block(bh, bw))

    def set_format(self, format, axes=None) -> "ParameterSelection":
        """Store in ``format`` (a name, text or ``scorch.Format``), or apply it to ``axes`` of the (blocked) view."""
        return self._edit(lambda layout: layout.set_format(format, axes))

    @property
    def formats(self) -> dict:
        """``{name: scorch.Format}``: the format each selected parameter will be stored in (a conv weight's: that
        of its matrix view)."""
        params, model = self._schedule._parameters(), self._schedule.model
        return {n: _stored_format(self._schedule._params.get(n) or _ParamPlan(), as_stored(model, n, params[n]))
                for n in self.names}

    def _edit(self, change):
        params = self._schedule._parameters()
        plans = self._plans()
        layouts = [p.layout.copy() for p in plans]
        for name, layout in zip(self.names, layouts):  # all checked before any is changed
            change(layout)
            try:
                layout.compose(2 if conv_weight(self._schedule.model, name) else params[name].dim())
            except ValueError as e:
                raise ValueError(f"parameter {name!r} {tuple(params[name].shape)}: {e}") from e
        for plan, layout in zip(plans, layouts):
            plan.layout = layout
        return self


class OutputSelection(_Selection):
    """Module outputs (activations) selected in a ``Schedule``; the mask is computed on every forward."""

    _kind = "output"

    def sparsify(self, sparsifier: Sparsifier) -> "OutputSelection":
        """Keep the entries of each output that ``sparsifier`` chooses (computed per forward)."""
        _check_sparsifier(sparsifier)
        for plan in self._plans():
            plan.sparsifier, plan.sparsified = sparsifier, True
        return self

    def block(self, bh: int, bw: int) -> "OutputSelection":
        """View the (2-d, or flattened to 2-d) output as 4 axes ``(i / bh, j / bw, i % bh, j % bw)``."""
        for plan in self._plans():
            plan.layout.set_block(bh, bw)
            plan._formats.clear()
            plan.sparsified = True
        return self

    def set_format(self, format, axes=None) -> "OutputSelection":
        """Store each output in ``format``, or apply it to ``axes`` of the (blocked) view."""
        for plan in self._plans():
            plan.layout.set_format(format, axes)
            plan._formats.clear()
            plan.sparsified = True
        return self


# --- the schedule --------------------------------------------------------------------------------------------

def _stored_format(plan, w) -> Format:
    """The format ``apply`` stores ``w`` in: the layout's, or ``nm(n, m)`` for a 2-d weight an ``NM(n, m)`` along its
    last dimension sparsifies where no format was set (docs/training.md's "stored as nm(n, m)"; it was CSR)."""
    rule, layout = plan.sparsifier, plan.layout
    if isinstance(rule, NM) and w.dim() == 2 and rule.dim % 2 == 1 and not layout.groups and layout.block is None \
            and 0 < rule.n and w.shape[1] % rule.m == 0:
        return named.nm(rule.n, rule.m)
    return layout.compose(w.dim())


def _replace(model, old, new):
    """Install ``new`` wherever ``model`` (or a submodule) holds the Parameter ``old``."""
    for _, module in model.named_modules(remove_duplicate=False):
        for attr, p in list(module._parameters.items()):
            if p is old:
                setattr(module, attr, new)


class Schedule:
    """How to sparsify an existing model: selections (``s[name]``, ``s.regex``, ``s.glob``, ``s.output``) with
    chained ``sparsify``/``block``/``set_format`` calls, then ``apply()``. See the module docstring."""

    def __init__(self, model: _nn.Module):
        if not isinstance(model, _nn.Module):
            raise TypeError(f"scorch.schedule takes a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self._params: dict[str, _ParamPlan] = {}
        self._outputs: dict[str, _OutputPlan] = {}
        self._grads, self._grad_hooks = {}, []  # parameter name -> Spec of its gradient; the installed hooks
        self._optimizers = []

    # --- selection ---------------------------------------------------------------------------------------
    def _parameters(self):
        return dict(self.model.named_parameters())

    def _modules(self):
        return {n: m for n, m in self.model.named_modules() if n}

    def _plan(self, kind, name):
        table, cls = (self._params, _ParamPlan) if kind == "param" else (self._outputs, _OutputPlan)
        if name not in table:
            table[name] = cls()
        return table[name]

    @staticmethod
    def _missing(what, key, names):
        names = list(names)
        close = difflib.get_close_matches(str(key), names, n=3)
        shown = close or names[:5]
        label = "close matches" if close else "available"
        more = f", {len(names)} in all" if len(names) > len(shown) else ""
        raise KeyError(f"no {what} matches {key!r} ({label}: {', '.join(shown)}{more})")

    def __getitem__(self, key):
        """A parameter (exact name), a module's output (exact submodule name), or the parameters whose name
        matches a compiled regex."""
        if isinstance(key, re.Pattern):
            return self.regex(key)
        if not isinstance(key, str):
            raise TypeError(f"select with a name (str) or a compiled regex, got {type(key).__name__}")
        if key in self._parameters():
            return ParameterSelection(self, [key])
        if key in self._modules():
            return OutputSelection(self, [key])
        self._missing("parameter or module", key, list(self._parameters()) + list(self._modules()))

    def regex(self, pattern) -> ParameterSelection:
        """The parameters whose whole name matches ``pattern`` (``re.fullmatch``)."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        if not isinstance(rx, re.Pattern):
            raise TypeError(f"regex takes a str or a compiled pattern, got {type(pattern).__name__}")
        params = self._parameters()
        names = [n for n in params if rx.fullmatch(n)]
        if not names:
            self._missing("parameter", rx.pattern, params)
        return ParameterSelection(self, names)

    def glob(self, pattern: str) -> ParameterSelection:
        """The parameters whose name matches the shell pattern (``fnmatch.fnmatchcase``; ``*`` matches dots too)."""
        if not isinstance(pattern, str):
            raise TypeError(f"glob takes a str, got {type(pattern).__name__}")
        params = self._parameters()
        names = [n for n in params if fnmatch.fnmatchcase(n, pattern)]
        if not names:
            self._missing("parameter", pattern, params)
        return ParameterSelection(self, names)

    def output(self, name) -> OutputSelection:
        """The output of the submodule ``name`` (exact), or of those whose name matches a compiled regex."""
        modules = self._modules()
        if isinstance(name, re.Pattern):
            names = [n for n in modules if name.fullmatch(n)]
        elif isinstance(name, str):
            names = [name] if name in modules else []
        else:
            raise TypeError(f"output takes a module name or a compiled regex, got {type(name).__name__}")
        if not names:
            self._missing("module", getattr(name, "pattern", name), modules)
        return OutputSelection(self, names)

    def grad(self, key) -> GradSelection:
        """The gradients of the (dense) parameters ``s[key]`` selects, sparsified into their ``.grad``."""
        sel = self[key]
        if not isinstance(sel, ParameterSelection):
            self._missing("parameter", key, self._parameters())
        return GradSelection(self._grads, {n: self._parameters()[n] for n in sel.names})

    # --- applying ----------------------------------------------------------------------------------------
    def apply(self) -> _nn.Module:
        """Rewrite the model in place (see the module docstring); returns the model. Applying again rebuilds
        every selected parameter from its current values and re-installs the output hooks."""
        params = self._parameters()
        missing = [n for n in list(self._params) + list(self._grads) if n not in params]
        if missing:
            raise KeyError(f"the model no longer has the parameter(s) {', '.join(missing)}")
        modules = self._modules()
        missing = [n for n in self._outputs if n not in modules]
        if missing:
            raise KeyError(f"the model no longer has the module(s) {', '.join(missing)}")
        both = [n for n in self._grads if n in self._params]
        if both:
            raise ValueError(f"scorch.schedule: {both[0]!r} is made sparse, so its gradient is sparse on its pattern;"
                             " s.grad(...) is for dense parameters")
        for name in self._params:
            why = unsupported(self.model, name)
            if why:
                raise NotImplementedError(f"scorch.schedule: parameter {name!r} cannot be sparse: {why}")
        built = {}
        for name, plan in self._params.items():  # build everything first: an error leaves the model untouched
            p = params[name]
            w = p.detach()
            try:
                if conv_weight(self.model, name):
                    fmt = _stored_format(plan, as_stored(self.model, name, w))
                    sparse = sparse_conv_weight(plan.rule, w, fmt)
                    built[name] = _nn.Parameter(sparse, requires_grad=p.requires_grad)
                    built[name].__dict__["_view_format"] = fmt
                else:
                    fmt = _stored_format(plan, w)
                    built[name] = _nn.Parameter(plan.rule.sparsify(w, fmt), requires_grad=p.requires_grad)
            except (ValueError, TypeError) as e:
                raise type(e)(f"parameter {name!r} {tuple(w.shape)}: {e}") from e
            if plan.directives is not None:
                if _directives.linear_owner(self.model, name):
                    _directives.check_linear(f"parameter {name!r}", built[name], plan.directives)
                _directives.attach(built[name], plan.directives)
        for name, plan in self._outputs.items():  # a Linear module's weight, sparse after this apply
            w = built.get(f"{name}.weight", getattr(modules[name], "weight", None))
            if plan.directives is not None and _directives.linear_owner(self.model, f"{name}.weight"):
                _directives.check_linear(f"module {name!r}", w, plan.directives)
        for name, new in built.items():
            _replace(self.model, params[name], new)
            self._params[name].param = new
        for name, plan in self._outputs.items():
            self._remove_hooks(plan)
            if plan.sparsifies:
                plan.handle = modules[name].register_forward_hook(self._output_hook(name, plan))
            if plan.directives is not None:
                plan.hooks = _directives.install(modules[name], plan.directives)
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = [h for n, spec in self._grads.items() for h in install_grad_spec(self.model, params[n],
                                                                                            spec, n)]
        return self.model

    @staticmethod
    def _remove_hooks(plan):
        for h in (plan.handle, *plan.hooks):
            if h is not None:
                h.remove()
        plan.handle, plan.hooks = None, ()

    @staticmethod
    def _output_hook(name, plan):
        def hook(module, args, output):
            if not isinstance(output, torch.Tensor) or isinstance(output, SparseTensor) \
                    or output.layout != torch.strided:
                raise TypeError(f"scorch.schedule: the output of {name!r} is a {type(output).__name__}"
                                f"{'' if not isinstance(output, torch.Tensor) else f' ({output.layout})'}; only a dense"
                                " tensor output can be sparsified")
            if output.dim() == 0:
                raise ValueError(f"scorch.schedule: the output of {name!r} is a scalar; nothing to sparsify")
            fmt, flat = plan.format_for(output.dim())
            x = output.reshape(-1, output.shape[-1]) if flat else output
            with torch.no_grad():
                mask = plan.rule.checked_mask(x.detach())
            return masked(x, mask, fmt)
        return hook

    def undo(self) -> _nn.Module:
        """Back to dense: every installed sparse parameter becomes a dense ``nn.Parameter`` holding its current
        values, and the output hooks are removed. The plans stay, so ``apply()`` can run again."""
        for plan in self._params.values():
            p = plan.param
            if p is not None:
                _directives.detach(p)
                _replace(self.model, p, _nn.Parameter(p.detach().to_dense().clone(), requires_grad=p.requires_grad))
                plan.param = None
        for plan in self._outputs.values():
            self._remove_hooks(plan)
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        return self.model

    # --- dynamic patterns --------------------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer):
        """Run ``step(optimizer)`` after every ``optimizer.step()`` (a step post hook); returns the hook's handle."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"attach takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)
        return optimizer.register_step_post_hook(lambda opt, args, kwargs: self.step(opt))

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Recompute the pattern of every dynamic parameter (only those ``optimizer`` holds, when given) from its
        current values, in the same Parameter object, and re-project the state of ``optimizer`` and of the
        attached optimizers onto the new patterns."""
        owned = None
        if optimizer is not None:
            owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        optimizers = self._optimizers + ([optimizer] if optimizer is not None and optimizer not in self._optimizers
                                         else [])
        for name, plan in self._params.items():
            p = plan.param
            if not plan.dynamic or p is None or (owned is not None and id(p) not in owned):
                continue
            with torch.no_grad():
                dense = p.detach().to_dense()
                view = p.__dict__.get("_view_format")
                new = packed_weight(masked(dense, plan.rule.checked_mask(dense), p.format)) if view is None else \
                    sparse_conv_weight(plan.rule, dense, view)
                p.copy_(new)  # same pattern: values copied; another pattern: p's pattern replaced
                for opt in optimizers:
                    state = opt.state.get(p)
                    for key, v in list((state or {}).items()):
                        if isinstance(v, SparseTensor) and v.shape == p.shape and not same_pattern(v, p):
                            state[key] = _on_pattern(p, v)

    # --- inspection ----------------------------------------------------------------------------------------
    def summary(self, print_it: bool = True) -> Summary:
        """A table of the scheduled parameters (name, shape, format, density = stored / numel, bytes dense and
        as stored: values plus index arrays) and sparsified outputs; printed, and returned as a ``Summary``."""
        params = self._parameters()
        rows = Summary()
        for name in self._params:
            p = params.get(name)
            if p is None:
                continue
            sparse = isinstance(p, SparseTensor)
            rows.append(dict(kind="param", name=name, shape=tuple(p.shape),
                             format=(short_name(p.format) if "_view_format" not in p.__dict__ else
                                     f"{short_name(p.__dict__['_view_format'])} (matrix view)")
                             if sparse else "dense (not applied)",
                             density=p.density if sparse else 1.0, dense_bytes=p.numel() * p.element_size(),
                             bytes=storage_bytes(p), schedule=_shown(self._params[name])))
        for name, plan in self._outputs.items():
            rows.append(dict(kind="output", name=name, format=plan.layout.describe() if plan.sparsifies else None,
                             sparsifier=repr(plan.rule) if plan.sparsifies else None, schedule=_shown(plan)))
        if print_it:
            print(rows)
        return rows

    def __repr__(self):
        lines = [f"Schedule({type(self.model).__name__})"]
        for name, plan in self._params.items():
            lines.append(f"  {name}: {plan.rule!r}{' dynamic' if plan.dynamic else ''}, {plan.layout.describe()}"
                         f"{_shown(plan, ', schedule ')}{'' if plan.param is None else ' (applied)'}")
        for name, plan in self._outputs.items():
            lines.append(f"  output of {name}: {plan.rule!r}, {plan.layout.describe()}" if plan.sparsifies else
                         f"  module {name}: dense output")
            lines[-1] += _shown(plan, ", schedule ")
        lines += [f"  gradient of {name}: {spec!r}" for name, spec in self._grads.items()]
        return "\n".join(lines)


def _shown(plan, prefix=""):
    """A plan's directives as text (``order oib, parallel o``), after ``prefix``; "" without directives."""
    return "" if plan.directives is None else prefix + _directives.describe(plan.directives)


def _on_pattern(p: SparseTensor, v: SparseTensor) -> SparseTensor:
    """``v``'s entries at ``p``'s stored positions, on ``p``'s index arrays (0 where ``v`` stores nothing)."""
    dense = v.detach().to_dense()
    leaf, dims, inside = storage.coordinates(p.format, p.shape, p.levels)
    if p.format.padded:  # padding: its state stays 0
        inside &= ~padding_of(p)[leaf]
    values = torch.zeros(p.nnz, dtype=v.dtype, device=v.device)
    values[leaf[inside]] = dense[tuple(dims[:, inside])]
    return p.detach().with_values(values)
