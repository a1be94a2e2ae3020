"""``SparseTensor`` as a traceable wrapper subclass for ``torch.compile`` (issue 20; see ``scorch/dynamo.py``).

Dynamo and AOTAutograd take a tensor subclass apart with ``__tensor_flatten__`` (the names of its inner tensors and
static metadata) and build it again with ``__tensor_unflatten__`` from fake or functional inner tensors. A
SparseTensor's inner tensors are its values and each level's ``pos``/``crd`` (named ``_pos<k>``/``_crd<k>``); its
metadata is the format text, which Dynamo guards on.

Gradients: scorch's autograd graph lives on the values, the wrapper is no autograd leaf. AOTAutograd unwraps a
subclass input inside its own autograd Function, so the gradient it computes for the values is handed to the
wrapper. A SparseTensor with leaf values that require grad is therefore made an autograd leaf itself (torch's own
flag; the ``requires_grad`` property stays the values') when Dynamo first flattens it, and a hook moves each
gradient the wrapper accumulates into the values' ``.grad``.
"""
from __future__ import annotations

import torch

from .formats import LevelStorage
from .formats.format import from_text


class Traceable:
    """The mixin of ``SparseTensor`` (``_format``, ``_levels``, ``_vals``, ``_shape``) for torch's subclass tracing."""

    def __tensor_flatten__(self):
        """The inner tensors' attribute names (the values, then each level's ``pos``/``crd`` present, as
        ``_pos<k>``/``_crd<k>``) and the static metadata: the format text and the number of levels."""
        if _sparse_base(self._vals) or any(_sparse_base(a) for st in self._levels for a in (st.pos, st.crd)):
            self._vals, self._levels = _unviewed(self._vals), tuple(st.map(_unviewed) for st in self._levels)
        names = ["_vals"]
        for k, st in enumerate(self._levels):
            if st.pos is not None:
                names.append(f"_pos{k}")
            if st.crd is not None:
                names.append(f"_crd{k}")
        v = self._vals
        if v.requires_grad and not getattr(self, "_bridged", False) and type(v) in (torch.Tensor, torch.nn.Parameter) \
                and not torch._is_functional_tensor(v):  # (a user's tensor: not a tracer's fake or functional one)
            self._bridge_grad()
        return names, (str(self._format), len(self._levels))

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        fmt, n = ctx
        levels = [LevelStorage(pos=inner.get(f"_pos{k}"), crd=inner.get(f"_crd{k}")) for k in range(n)]
        return cls(from_text(fmt), outer_size, levels, inner["_vals"], check=False)

    def _bridge_grad(self):
        """Let a compiled graph's gradient of this input reach its values (the module's docstring). Only for leaf
        values (a parameter): the gradient of values computed by an earlier op would have to flow on through
        their graph."""
        if not self._vals.is_leaf:
            raise RuntimeError("scorch: under torch.compile a SparseTensor input whose values require grad must"
                               " be a leaf (a parameter): compute it inside the compiled function, or detach it")
        with torch._C.DisableTorchFunctionSubclass():
            torch._C.TensorBase.requires_grad_(self)
            torch.Tensor.register_post_accumulate_grad_hook(self, _move_grad_to_values)
        self._bridged = True

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

    def __getattr__(self, name):
        # (only names not found otherwise: a level's arrays by the names __tensor_flatten__ gives them)
        if name[:4] in ("_pos", "_crd") and name[4:].isdigit():
            st = self._levels[int(name[4:])]
            return st.pos if name[1:4] == "pos" else st.crd
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")


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


def _move_grad_to_values(x):
    """The post-accumulate hook of a bridged SparseTensor (``_bridge_grad``): the wrapper's gradient (a SparseTensor
    on its pattern) is added to the values' ``.grad``, and the wrapper's cleared."""
    with torch._C.DisableTorchFunctionSubclass():
        g = torch._C.TensorBase.grad.__get__(x)
        torch._C.TensorBase.grad.__set__(x, None)
    if g is None:
        return
    g = getattr(g, "_vals", g)
    v = x._vals
    v.grad = g.detach() if v.grad is None else v.grad + g
