"""``SparseTensor`` as a traceable wrapper subclass for ``torch.compile`` (issue 20; see ``scorch/dynamo.py``).

Dynamo and AOTAutograd take a tensor subclass apart with ``__tensor_flatten__`` (the names of its inner tensors and
static metadata) and build it again with ``__tensor_unflatten__`` from fake or functional inner tensors. A
SparseTensor's inner tensors are its values and each level's ``pos``/``crd`` (named ``_pos<k>``/``_crd<k>``); its
metadata is the format text, which Dynamo guards on.

Gradients: scorch's autograd graph lives on the values; the wrapper takes its own place in torch's graph as a
node over them (see the end of this module), so AOTAutograd, which unwraps a subclass input inside its own
autograd Function and hands back the wrapper's gradient, reaches the values through that node: the same for a
parameter and for a SparseTensor computed before the compiled function (across a graph break).
"""
from __future__ import annotations

import sys
import weakref

import torch

from .formats import LevelStorage
from .formats.format import from_text
from .rules import RULES


def _refuse_export() -> None:
    """``torch.export`` of SparseTensors: refused, naming what is missing. Export traces below torch functions,
    where scorch's sparse ops are not seen: the program it made held each SparseTensor as an opaque input of
    ``aten`` ops, which then ran densely (a fallback), or it failed inside torch with "Expected meta != nullptr".
    Export sets no flag while it fakifies parameters, so its frame on the stack tells (``torch.export._trace``)."""
    if "torch.export._trace" not in sys.modules:  # (no export has run: no stack walk on every flatten)
        return
    f, depth = sys._getframe(2), 0
    while f is not None and depth < 40:  # (export's frame is ~15 above; a compiled call's flatten walks no further)
        depth += 1
        if f.f_code.co_name in ("_export", "_export_for_training") and \
                f.f_code.co_filename.endswith(("export/_trace.py", "export\\_trace.py")):
            raise NotImplementedError(
                "scorch: torch.export of a SparseTensor (a sparse parameter, buffer or input) is not supported: "
                "export traces below torch functions, where scorch's sparse ops are not seen, so the exported "
                "program would run them densely. Use torch.compile (supported), eager, or export a dense copy "
                "(scorch.schedule(model).undo(), or to_dense() the weights)")
        f = f.f_back


#: the SparseTensors a compiled call has flattened (its inputs: parameters, an adjacency), by weak reference, under
#: their arrays' identities (``flat_key``): the graph's ops get those arrays back and find the tensor they came from
#: (``dynamo._rebuild``) instead of wrapping them again on every call, with the tensor's own memos (its kept
#: conversions and products, as in eager calls)
FLATTENED = weakref.WeakValueDictionary()


def flat_key(vals, levels) -> tuple:
    """``FLATTENED``'s key: the ids of the values and of each level's arrays (0 for an absent one)."""
    return (id(vals),) + tuple(id(a) if a is not None else 0 for st in levels for a in (st.pos, st.crd))


def _is_fake(t) -> bool:
    """Whether ``t`` is a tracer's tensor (fake or functional: no memory of its own to run on)."""
    return not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)


class Traceable:
    """The mixin of ``SparseTensor`` (``_format``, ``_levels``, ``_vals``, ``_shape``) for torch's subclass tracing."""

    def __tensor_flatten__(self):
        """The inner tensors' attribute names (the values, then each level's ``pos``/``crd`` present, as
        ``_pos<k>``/``_crd<k>``) and the static metadata: the format text and the number of levels."""
        _refuse_export()
        d = self.__dict__
        vals, levels = d["_vals"], d["_levels"]
        kept = d.get("_flattened")
        # a compiled call flattens each SparseTensor input several times (Dynamo's guards on its metadata and
        # inner names, AOTAutograd's unwrapping): the names and metadata are kept for the arrays they were made
        # of (by identity: the arrays a view was replaced by are the ones kept)
        if kept is None or kept[0] is not vals or kept[1] is not levels or kept[2] is not d["_format"]:
            if _sparse_base(vals) or any(_sparse_base(a) for st in levels for a in (st.pos, st.crd)):
                self._vals, self._levels = vals, levels = _unviewed(vals), tuple(st.map(_unviewed) for st in levels)
            names = ["_vals"]
            _level_properties(len(levels))
            for k, st in enumerate(levels):
                if st.pos is not None:
                    names.append(f"_pos{k}")
                if st.crd is not None:
                    names.append(f"_crd{k}")
            kept = d["_flattened"] = (vals, levels, d["_format"], names, (str(d["_format"]), len(levels)))
            if not _is_fake(vals):
                FLATTENED[flat_key(vals, levels)] = self
        if vals.requires_grad and not torch_requires_grad(self) and attachable(vals, True):
            attach(self)  # (made while grad mode was off: in the graph from here)
        return list(kept[3]), kept[4]

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        fmt, n = ctx
        levels = [LevelStorage(pos=inner.get(f"_pos{k}"), crd=inner.get(f"_crd{k}")) for k in range(n)]
        return cls(from_text(fmt), outer_size, levels, inner["_vals"], check=False)

    # --- autograd: the graph lives on the values; the wrapper is in torch's graph too (the end of the module) -----
    # (``is_leaf`` and ``grad_fn`` are torch's own, the wrapper's: a sparse parameter is a leaf, a computed SparseTensor
    # hangs from a node over its values; ``values().grad_fn`` is the op's)
    @property
    def requires_grad(self) -> bool:
        # (or the wrapper's own flag: a tracer's copy of a computed SparseTensor has its history, not its values')
        return self._vals.requires_grad or torch_requires_grad(self)

    @requires_grad.setter
    def requires_grad(self, flag: bool):
        self.requires_grad_(flag)

    def requires_grad_(self, requires_grad: bool = True) -> "Traceable":
        if requires_grad and self._format.keeps_duplicates and RULES.coalesce_leaf:  # (one gradient an entry, as
            RULES.coalesce_leaf(self)  # torch's: an uncoalesced COO leaf's duplicates summed first, ops.pattern)
        self._vals.requires_grad_(requires_grad)
        if not requires_grad:
            detach_wrapper(self)
        elif not torch_requires_grad(self):  # the wrapper in torch's graph: see _traceable
            if attachable(self._vals, True):
                attach(self)
            else:  # (a tracer's copy over fake values: the flag alone, as torch's tracers read it)
                with torch._C.DisableTorchFunctionSubclass():
                    torch._C.TensorBase.requires_grad_(self)
        return self

    @property
    def grad(self):
        """The gradient on this tensor's pattern (a SparseTensor sharing its index arrays), or None."""
        g = self._vals.grad
        if g is None:
            return None
        out = type(self)(self._format, self._shape, self._levels, g, check=False)
        out._pattern_grad = True
        return out

    @grad.setter
    def grad(self, g):
        if g is None:
            self._vals.grad = None
            return
        if type(g) is not type(self) or g._shape != self._shape or g._vals.shape != self._vals.shape:
            raise ValueError("the grad of a SparseTensor must be a SparseTensor with the same shape and pattern")
        self._vals.grad = g._vals

    def retain_grad(self):
        self._vals.retain_grad()

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """As ``torch.autograd.backward(self, ...)`` (``ops.autograd_api``: the graph lives on the values)."""
        torch.autograd.backward(self, gradient, retain_graph, create_graph, inputs=inputs)

    def _adopt(self):
        """``adopt`` of this tensor alone (its direct methods that read the values), the cheap tests first."""
        if not self._vals.requires_grad and torch._C._any_requires_grad(self) and torch.is_grad_enabled():
            adopt((self,))

    def _stable_hash_for_caching(self) -> str:
        """The key of AOTAutograd's cache for this input: format text, shape and the inner arrays' types."""
        names, _ = self.__tensor_flatten__()
        arrays = [(n, tuple(getattr(self, n).shape), str(getattr(self, n).dtype)) for n in names]
        return repr((str(self._format), tuple(self._shape), self.requires_grad, arrays))

    @property
    def _dynamo_static_indices(self):
        """Every dimension of the wrapper static to Dynamo (the stored arrays' sizes, nnz, may still be dynamic): a
        dynamic outer size makes AOTAutograd read the wrapper's ``stride()`` at run time, which a SparseTensor
        refuses (it has no dense storage). A new sparse shape compiles a new graph."""
        return set(range(len(self._shape)))



def _level_array(k: int, which: str) -> property:
    """The property ``_pos<k>`` or ``_crd<k>``: level ``k``'s array, as ``__tensor_flatten__`` names it. Dynamo's
    guards and AOTAutograd read the inner arrays by these names on every compiled call. (A ``__getattr__`` answered
    them before: each read first failed torch's attribute lookup, and every other failed lookup, such as Dynamo's
    ``hasattr`` guards on each input, ran it in Python.)"""
    return property(lambda self: getattr(self._levels[k], which))


_LEVEL_PROPERTIES = [0]


def _level_properties(n: int) -> None:
    """The properties of levels up to ``n`` on the class (made once; formats have a few levels)."""
    for k in range(_LEVEL_PROPERTIES[0], n):
        setattr(Traceable, f"_pos{k}", _level_array(k, "pos"))
        setattr(Traceable, f"_crd{k}", _level_array(k, "crd"))
    _LEVEL_PROPERTIES[0] = max(_LEVEL_PROPERTIES[0], n)


_level_properties(8)


def _sparse_base(a) -> bool:
    """Whether ``a`` is a view of a torch sparse tensor (``crow_indices()``, ``values()`` of one: a SparseTensor
    viewing a torch CSR tensor holds such arrays), which Dynamo would fakeify with its base and refuse."""
    return a is not None and a._base is not None and a._base.layout != torch.strided


def _unviewed(a):
    """``a``'s memory as a tensor of its own (no ``_base``: Dynamo fakeifies it as a plain input); ``a`` itself
    where it is no view of a torch sparse tensor, or where autograd tracks it (a parameter's values stay the same
    object)."""
    if not _sparse_base(a) or a.requires_grad:
        return a
    return torch.empty(0, dtype=a.dtype, device=a.device).set_(a.untyped_storage(), a.storage_offset(), a.shape,
                                                               a.stride())


# --- the wrapper in torch's autograd graph ------------------------------------------------------------------------
# A SparseTensor's graph lives on its values: scorch's ops read ``_vals`` and record their own nodes. But torch reads
# the wrapper itself where a tensor enters its autograd machinery without passing ``__torch_function__``: a user's
# ``autograd.Function.apply`` (``ctx.needs_input_grad``, the gradient it returns), ``torch.utils.checkpoint``,
# AOTAutograd's subclass inputs. There a wrapper torch sees as not requiring grad would drop its gradient silently.
# So a wrapper whose values require grad is made a node of torch's graph over its values (``SparseTensor._attach``,
# the rule ``attach_wrapper``, ``_autograd._Attach``): its gradient, dense, torch-sparse or a SparseTensor of any
# pattern, is read at its stored positions and handed to the values, where hooks, ``retain_grad`` and accumulation
# are torch's own.

def torch_requires_grad(x) -> bool:
    """The wrapper's own ``requires_grad``, as torch's autograd reads it (the property answers for the values too)."""
    return torch._C._any_requires_grad(x)  # (no __torch_function__ on the way: the cheap read)


def attachable(values, grad_mode: bool) -> bool:
    """Whether a wrapper of ``values`` is put in torch's graph: they require grad, ``grad_mode`` (a graph is being
    recorded, or the caller asks for the leaf's node), and they are a user's tensors: not a tracer's fake or
    functional ones, nor a torch.func transform's wrapped ones (their own graph is the transform's)."""
    return values.requires_grad and grad_mode and type(values) in (torch.Tensor, torch.nn.Parameter) and \
        not torch._is_functional_tensor(values) and not torch._C._functorch.is_functorch_wrapped_tensor(values)


def attach(x):
    """Put ``x`` (its values require grad) in torch's graph (the rule ``attach_wrapper``, ``_autograd``)."""
    if RULES.attach_wrapper is not None:  # (registered by ``_autograd``, which ``import scorch`` loads)
        RULES.attach_wrapper(x)


def detach_wrapper(x):
    """Take ``x``'s wrapper out of torch's graph (``requires_grad_(False)``, ``detach_()``)."""
    if torch_requires_grad(x):
        with torch._C.DisableTorchFunctionSubclass():
            torch._C.TensorBase.detach_(x)


def adopt(tensors, kwargs=None):
    """The other way round: a SparseTensor among ``tensors`` whose wrapper torch gave a history its values lack (the
    output of a user's autograd.Function, of a reentrant checkpoint) gets values under that history (the rule
    ``adopt_wrapper``), so that scorch's ops, which read the values, pass its gradient on. Called as an op starts, with
    grad mode on; ``kwargs``' values too, and the tensors of a list or tuple among them."""
    if not torch.is_grad_enabled() or not torch._C._any_requires_grad(*tensors, *(kwargs.values() if kwargs else ())):
        return  # (one C call: no tensor among them, in lists either, requires grad, the wrapper's flag included)
    for x in (tensors if not kwargs else (*tensors, *kwargs.values())):
        if type(x) in (list, tuple):
            adopt(x)
        elif isinstance(x, Traceable) and not x._vals.requires_grad and torch_requires_grad(x) and \
                type(x._vals) in (torch.Tensor, torch.nn.Parameter) and RULES.adopt_wrapper is not None:
            RULES.adopt_wrapper(x)
