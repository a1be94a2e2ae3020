"""``SparseTensor``: a ``torch.Tensor`` wrapper subclass holding a format's level storage and values.

It owns no dense storage: its arrays are ``levels`` (one ``LevelStorage`` per format level) and ``values``
(1-d). ``__torch_function__`` routes torch functions and methods with a sparse operand to scorch's
implementations (``implements``); anything without one raises ``NotImplementedError`` naming the op and the
format, never a silent densify.
"""
from __future__ import annotations

import functools
import math
import threading

import torch

from .formats import Format, LevelStorage, PackedLevel, packed_level, resolve
from .formats import named
from .formats.named import short_name
from .formats import storage as _storage
from .rules import RULES
from ._traceable import Traceable, adopt, attach, attachable, detach_wrapper

#: torch function or method -> scorch implementation, filled next to each implementation by ``implements``
IMPLEMENTATIONS: dict = {}

# Metadata reads that are answered by the wrapper itself (shape, dtype, device and autograd flags).
_METADATA = {
    torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.ndimension,
    torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device,
    torch.Tensor.__hash__, torch.is_complex, torch.is_floating_point, torch.Tensor.is_contiguous,
}


def implements(*funcs):
    """Register ``fn`` as the implementation of each torch function / ``torch.Tensor`` method in ``funcs``."""
    def register(fn):
        for f in funcs:
            IMPLEMENTATIONS[f] = fn
        return fn
    return register


class _Checking(threading.local):
    depth = 0


_checking = _Checking()
_getting = _Checking()  # depth of attribute reads in progress (SparseTensor.__torch_function__)


def checking_invariants() -> bool:
    """Whether storage is validated on construction (inside ``scorch.sparse.check_invariants()``)."""
    return _checking.depth > 0


def _as_storage(level):
    if isinstance(level, LevelStorage):
        return level
    if isinstance(level, dict):
        return LevelStorage(pos=level.get("pos"), crd=level.get("crd"))
    if level is None:
        return LevelStorage()
    raise TypeError(f"a level's storage is a LevelStorage or a dict with 'pos'/'crd', got {type(level).__name__}")


def refuse_complex(what: str, dtype) -> None:
    """Raise the ``TypeError`` for complex values (``UnsupportedDtype``): scorch's kernels and sparse rules take
    real values only, and a complex SparseTensor accepted here would fail later, in some op, with torch's dtype
    error. Raised inside an op (``S * 1j``, ``S.cfloat()``), it makes that op run on the dense form, as any op
    without a sparse rule: torch's complex result, warned and counted."""
    raise UnsupportedDtype(f"scorch: {what} has complex values ({dtype}); SparseTensors hold real values only (bool,"
                    " integers, float16, bfloat16, float32, float64). Keep a complex tensor dense, or store its"
                    " real and imaginary parts as two SparseTensors (x.real, x.imag)")


class SparseTensor(Traceable, torch.Tensor):
    """A sparse tensor in any scorch format. Build one with ``scorch.asformat`` or the ``sparse_*_tensor``
    constructors; ``SparseTensor(format, shape, levels, values)`` wraps existing arrays without copying
    (and validates them unless ``check=False``)."""

    _format: Format
    _levels: tuple
    _vals: torch.Tensor  # the stored values (``values()`` returns them; torch's ``_values()`` too)
    _shape: torch.Size  # the same as .shape, readable without __torch_function__ (hot paths use it)

    @staticmethod
    def __new__(cls, format, shape, levels, values, *, requires_grad=False, check=True):
        shape = torch.Size(shape)
        fmt = resolve(format, len(shape))
        levels = _storage.uniform_index_dtype(_as_storage(lv) for lv in levels)
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if values.is_complex():
            refuse_complex("a sparse tensor", values.dtype)
        # kernels read arrays as contiguous: a strided view (a column of a matrix) is copied
        if not values.is_contiguous():
            values = values.contiguous()
        if any(not a.is_contiguous() for st in levels for a in st.arrays().values()):
            levels = tuple(st.map(torch.Tensor.contiguous) for st in levels)
        if any(n < 0 for n in shape):
            raise ValueError(f"negative dimension in shape {tuple(shape)}")
        for st in levels:
            for name, a in st.arrays().items():
                if a.device != values.device:
                    raise ValueError(f"{name} is on {a.device} but values are on {values.device}")
        if check or checking_invariants():
            _storage.validate(fmt, shape, levels, values)
        elif len(levels) != len(fmt.levels):
            raise ValueError(f"format {fmt} has {len(fmt.levels)} levels, storage has {len(levels)}")
        # autograd runs on the values (scorch/_autograd.py); the wrapper is a node over them (_traceable.py)
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=values.dtype, device=values.device)
        if requires_grad and not values.requires_grad:
            values = (values if values.is_leaf else values.detach()).requires_grad_()
        r._format, r._levels, r._vals, r._shape = fmt, levels, values, shape
        r._index_dtype = _storage.index_dtype_of(levels)
        if values.requires_grad and attachable(values, requires_grad or torch.is_grad_enabled()):
            attach(r)
        return r

    # --- routing -------------------------------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not args and "input" in kwargs:  # (``torch.sum(input=S, dim=0)``: implementations name it otherwise)
            kwargs = dict(kwargs)
            args = (kwargs.pop("input"),)
        if torch.compiler.is_compiling() and func not in _METADATA:  # Dynamo traces: one custom op in the graph
            r = RULES.traced_op(func, types, args, kwargs)
            if r is not NotImplemented:
                return r
        if func not in _METADATA:
            adopt(args, kwargs)  # (a wrapper with a history its values lack: _traceable)
        impl = IMPLEMENTATIONS.get(func)
        if impl is not None:
            if RULES.lazy_type in types and not getattr(impl, "fuses", False):
                RULES.compute_lazy(args)  # deferred dense operands are computed, except for products that fuse them
                RULES.compute_lazy(kwargs.values())
            try:
                return impl(*args, **kwargs)
            except NoSparseRule as why:  # no sparse rule for these particular arguments
                return dense_fallback(func, args, kwargs, why)
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__"):
            try:
                _getting.depth += 1  # an op reached from here is refused below, and computed here instead
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            except _ReachedDispatch:  # an attribute computed by an op (x.mT, x.H...): on the dense form
                if func.__name__ != "__get__":
                    raise
            finally:
                _getting.depth -= 1
        if RULES.lazy_type in types:
            RULES.compute_lazy(args)
            RULES.compute_lazy(kwargs.values())
        return dense_fallback(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # reached below autograd (torch internals that skip __torch_function__): without a gradient to lose, the
        # op runs on the dense form as a fallback; with one, the dense result would not reach the stored values
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default and type(args[0]) is SparseTensor:  # (AccumulateGrad's, a tracer's)
            x = args[0]  # (a tracer's copy over fake values keeps them: their requires_grad is what AOTAutograd reads)
            return x.detach() if type(x._vals) in (torch.Tensor, torch.nn.Parameter) else x._wrap(x._vals)
        if func is torch.ops.aten.detach_.default and type(args[0]) is SparseTensor:  # (_traceable.detach_wrapper)
            return args[0]
        if _getting.depth:  # an attribute read: __torch_function__ computes it, differentiably, under its name
            raise _ReachedDispatch(f"scorch: {func} reached torch's dispatcher")
        sparse = [x for x in _flat((args, kwargs)) if type(x) is SparseTensor]
        if torch.is_grad_enabled() and any(x._vals.requires_grad for x in sparse):
            raise _ReachedDispatch(f"scorch: {func} reached torch's dispatcher with a sparse operand that requires"
                                   f" grad ({_describe(args, kwargs)}); scorch has no implementation for it")
        if func._schema.is_mutable and any(type(a) is SparseTensor for a, arg in zip(args, func._schema.arguments)
                                           if arg.alias_info is not None and arg.alias_info.is_write):
            raise _ReachedDispatch(f"scorch: {func} would write into a sparse tensor ({_describe(args, kwargs)})"
                                   " in place, and scorch has no implementation for it")
        with torch.no_grad():
            return dense_fallback(func, args, kwargs)

    # --- storage ---------------------------------------------------------------------------------------------
    @property
    def format(self) -> Format:
        return self._format

    @property
    def levels(self) -> tuple:
        """One ``LevelStorage`` (``pos``, ``crd`` torch tensors, ``None`` where absent) per format level."""
        return self._levels

    def values(self) -> torch.Tensor:
        """The 1-d array of stored values, one per stored position (padding included)."""
        self._adopt()  # (a wrapper with a history its values lack: _traceable)
        return self._vals

    @property
    def layout(self) -> torch.layout:
        """torch's layout for this format: ``sparse_coo`` (COO, and formats torch has no layout for),
        ``sparse_csr``, ``sparse_csc``, ``sparse_bsr``, ``sparse_bsc``, or ``strided`` (dense). While
        ``torch.compile`` traces, the wrapper's own ``strided``: Dynamo refuses tensors of torch's sparse layouts,
        and it meets a SparseTensor as a traceable wrapper of dense arrays (``__tensor_flatten__``)."""
        if torch.compiler.is_compiling():
            return torch.strided
        return _layout_of(self._format)

    @property
    def is_sparse(self) -> bool:
        """As torch: True for the ``sparse_coo`` layout (COO and the formats torch has no layout for).
        False for a parameter's ``.grad``: it is the gradient of the parameter's values on its own pattern,
        which optimizers apply like a dense gradient (torch's Adam refuses gradients that are "sparse" in
        torch's sense: index/value pairs to scatter)."""
        return self.layout == torch.sparse_coo and not getattr(self, "_pattern_grad", False)

    @property
    def is_sparse_csr(self) -> bool:
        return self.layout == torch.sparse_csr

    @property
    def nnz(self) -> int:
        """The number of stored values (explicit zeros and padding included)."""
        return self._vals.numel()

    def _nnz(self) -> int:
        """The number of stored values."""
        return self.nnz

    def sparse_dim(self) -> int:
        """As torch: the number of dimensions the index arrays address (all but a hybrid COO's dense trailing
        dimensions)."""
        return len(self._shape) - self.dense_dim()

    def dense_dim(self) -> int:
        """As torch: the number of dense trailing dimensions of each stored entry (a hybrid COO's; 0 otherwise)."""
        from .formats.named import hybrid_coo_dims
        coo = hybrid_coo_dims(self._format)
        return coo[0] if coo is not None else 0

    @property
    def index_dtype(self) -> torch.dtype:
        return self._index_dtype

    @property
    def density(self) -> float:
        n = self.numel()
        return self.nnz / n if n else 0.0

    def with_values(self, values: torch.Tensor, requires_grad: bool = False) -> "SparseTensor":
        """The same pattern (shared index arrays) with other values."""
        if not requires_grad and isinstance(values, torch.Tensor) and values.dim() == 1 and \
                values.device == self._vals.device and values.is_contiguous() and not checking_invariants():
            return self._wrap(values)  # the pattern's checks hold already (a hot path of every op)
        return SparseTensor(self._format, self.shape, self._levels, values, requires_grad=requires_grad,
                            check=False)

    def _wrap(self, values: torch.Tensor, dtype=None) -> "SparseTensor":
        """The same pattern with ``values``, which the caller knows to be 1-d, contiguous and on the pattern's
        device (and of ``dtype``, where given: a deferred value's metadata reads are calls): only the wrapper is
        made."""
        dtype = dtype or values.dtype
        if dtype.is_complex:  # (x * 1j, x.cfloat(): as at construction)
            refuse_complex("the result", dtype)
        r = torch.Tensor._make_wrapper_subclass(SparseTensor, self._shape, dtype=dtype, device=self._vals.device)
        r._format, r._levels, r._vals, r._shape = self._format, self._levels, values, self._shape
        r._index_dtype = self._index_dtype
        if values.requires_grad and attachable(values, torch.is_grad_enabled()):
            attach(r)
        if self.__dict__.get("_pattern_grad"):  # (a parameter's gradient, changed: ``grad.add(p, alpha=wd)``)
            r._pattern_grad = True
        return r

    def _map_arrays(self, fn):
        self._adopt()
        levels = tuple(st.map(fn) for st in self._levels)
        return SparseTensor(self._format, self.shape, levels, fn(self._vals), check=False)

    # --- autograd: the graph lives on the values; the wrapper is in torch's graph too: the mixin ``Traceable`` ---

    # --- conversions -------------------------------------------------------------------------------------------
    def to_dense(self, dtype=None, *, masked_grad=None) -> torch.Tensor:
        """The dense tensor (differentiable: the gradient reaches the stored values). On the CPU a generated
        kernel writes it (``engine.densify``); elsewhere, and for small storage, the entries are listed."""
        self._adopt()
        out = RULES.traced_op(torch.Tensor.to_dense, (), (self,), {}) if torch.compiler.is_compiling() else \
            RULES.to_dense(self._format, self._shape, self._levels, self._vals)  # (compiling: one custom op)
        if out is None:
            out = _storage.to_dense(self._format, self._shape, self._levels, self._vals)
        return out if dtype is None else out.to(dtype)

    def to_torch(self) -> torch.Tensor:
        """The torch layout this format matches (COO, CSR, CSC, BSR, BSC or strided), sharing storage."""
        self._adopt()
        return RULES.to_torch(self)

    def to_scipy(self):
        """The SciPy sparse array (``scipy.sparse``: csr, csc, coo or bsr, the nearest to this format; other
        formats are converted first) sharing this tensor's arrays where the dtypes allow. 2-d, on the CPU."""
        self._adopt()
        return RULES.to_scipy(self)

    def asformat(self, format, **kwargs) -> "SparseTensor":
        self._adopt()
        return RULES.asformat(self, format, **kwargs)

    def to(self, *args, **kwargs) -> "SparseTensor":
        """Another device (every array moved) and/or dtype (values converted); the format is kept."""
        copy = kwargs.pop("copy", False)
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        out = self
        self._adopt()
        if device is not None and torch.device(device) != self.device:
            out = out._map_arrays(lambda a: a.to(device, non_blocking=non_blocking))
        if dtype is not None and dtype != self.dtype:
            if out._format.keeps_duplicates and not dtype.is_floating_point:
                # (an integer or bool of each duplicate is not that of their sum: 0.6 + 0.6 is 1, 1 + -1 False)
                out = out.asformat(named.coo_nd(out.dim()))
            out = out.with_values(out._vals.to(dtype))
        if copy and out is self:
            out = self.clone()
        return out

    def clone(self, *, memory_format=None) -> "SparseTensor":
        """A copy of the index arrays and values, in the same format."""
        return self._map_arrays(torch.clone)

    def __deepcopy__(self, memo) -> "SparseTensor":
        """A copy of the index arrays and values (a leaf, requiring grad as this one does; a parameter stays one,
        without its ``.grad``, as torch's ``Parameter.__deepcopy__`` leaves it)."""
        if id(self) in memo:
            return memo[id(self)]
        out = SparseTensor(self._format, self._shape, tuple(st.map(torch.clone) for st in self._levels),
                           self._vals.detach().clone(), requires_grad=self._vals.requires_grad, check=False)
        for flag in ("_is_param", "_pattern_grad"):
            if getattr(self, flag, False):
                setattr(out, flag, True)
        if self._vals.grad is not None and not getattr(self, "_is_param", False):
            out._vals.grad = self._vals.grad.clone()
        memo[id(self)] = out
        return out

    def detach(self) -> "SparseTensor":
        """The same arrays with detached values."""
        return SparseTensor(self._format, self.shape, self._levels, self._vals.detach(), check=False)

    def detach_(self) -> "SparseTensor":
        """The values detached in place (their graph dropped; they no longer require grad)."""
        self._vals = self._vals.detach()
        detach_wrapper(self)
        return self

    def cpu(self):
        """On the CPU, as ``to('cpu')``."""
        return self.to("cpu")

    def cuda(self, device=None, non_blocking=False):
        """On a CUDA device (every level's arrays and the values), as ``to('cuda')``; ops on it then run
        generated CUDA kernels."""
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device)
                       if isinstance(device, int) else device, non_blocking=non_blocking)

    def double(self):
        """float64 values, same arrays."""
        return self.to(torch.float64)

    def float(self):
        """float32 values, same arrays."""
        return self.to(torch.float32)

    def check_invariants(self) -> "SparseTensor":
        """Validate the storage; raise ``ValueError`` naming the level and position of a violation."""
        _storage.validate(self._format, self.shape, self._levels, self._vals)
        return self

    # --- display -----------------------------------------------------------------------------------------------
    def __matmul__(self, other):
        """``self @ other``: the ops layer's product operator (``RULES.product_operator``: a repeated product goes
        straight to the call kept on ``self``). After the first product kept, its C form takes this slot."""
        return RULES.product_operator(self, other, True)

    def __rmatmul__(self, other):
        """``other @ self``: as ``__matmul__``, the operands the other way round."""
        return RULES.product_operator(self, other, False)

    def __repr__(self, *, tensor_contents=None) -> str:
        """Format, shape, dtype, nnz, density, and a picture of the pattern for small matrices."""
        fmt = short_name(self._format)
        head = (f"SparseTensor(format={fmt}, shape={tuple(self.shape)}, dtype={self.dtype}, nnz={self.nnz},"
                f" density={_g3(self.density)}")
        if self.device.type != "cpu":
            head += f", device={self.device}"
        if self.requires_grad:
            head += ", requires_grad=True"
        pic = "" if torch.compiler.is_compiling() else self._picture()  # (fake arrays while compiling: no data)
        return head + ")" + ("\n" + pic if pic else "")

    __str__ = __repr__

    def _picture(self, max_rows=24, max_cols=64) -> str:
        """A character picture of the pattern: '#' a stored nonzero, '0' a stored zero, '.' nothing stored."""
        if self.dim() not in (1, 2) or self.numel() == 0:
            return ""
        rows, cols = (1, self.shape[0]) if self.dim() == 1 else tuple(self.shape)
        if rows > max_rows or cols > max_cols:
            return ""
        dims, vals = _storage.unpack(self._format, self.shape, self._levels, self._vals)
        grid = [["."] * cols for _ in range(rows)]
        r = [0] * vals.numel() if self.dim() == 1 else dims[0].tolist()
        for i, j, v in zip(r, dims[-1].tolist(), (vals != 0).tolist()):
            grid[i][j] = "#" if v or grid[i][j] == "#" else "0"
        return "\n".join("  " + "".join(row) for row in grid)

    def __reduce_ex__(self, proto):
        """Pickling (``torch.save``): format text, shape, the arrays as held (a packed level's narrow coordinates)
        and values; validated when loaded."""
        return (_rebuild, (str(self._format), tuple(self.shape),
                           tuple((st.pos, st.stored_crd) for st in self._levels), self._vals.detach(),
                           self.requires_grad, bool(getattr(self, "_is_param", False)),
                           tuple(isinstance(st, PackedLevel) for st in self._levels)))


def _g3(x) -> str:
    """``x`` to 3 digits; a symbolic size's expression as it is (a fake tensor's, while torch.compile traces)."""
    return f"{x:.3g}" if isinstance(x, float) else str(x)


@functools.lru_cache(maxsize=256)
def _layout_of(fmt: Format) -> torch.layout:
    from .formats.named import name_of
    name = (name_of(fmt) or "").split("(")[0]
    return {"dense": torch.strided, "csr": torch.sparse_csr, "csc": torch.sparse_csc, "bsr": torch.sparse_bsr,
            "bsc": torch.sparse_bsc}.get(name, torch.sparse_coo)


def shape_of(x) -> torch.Size:
    """``x.shape`` without a trip through ``__torch_function__`` for SparseTensors (hot paths)."""
    return x._shape if type(x) is SparseTensor else x.shape


def dtype_of(x) -> torch.dtype:
    return x._vals.dtype if type(x) is SparseTensor else x.dtype


def device_of(x) -> torch.device:
    return x._vals.device if type(x) is SparseTensor else x.device


def _rebuild(fmt, shape, levels, values, requires_grad, is_param=False, packed=()):
    # validated: a checkpoint is input like any other (``storage.validate_loaded``); a level saved packed is packed
    # again where its arrays still have a packed level's widths, else widened as any mix (``uniform_index_dtype``)
    fmt = Format(fmt)
    levels = [packed_level(*lv) if k < len(packed) and packed[k] and len(lv) == 2 and
              all(isinstance(a, torch.Tensor) for a in lv) else LevelStorage(*lv) for k, lv in enumerate(levels)]
    s = SparseTensor(fmt, shape, levels, values, requires_grad=requires_grad, check=False)
    _storage.validate_loaded(fmt, s._shape, s._levels, s._vals)
    if is_param:
        s._is_param = True
    return s


# ``torch.load`` (weights_only=True by default) may rebuild SparseTensors: ``_rebuild`` parses a format string
# and validates the arrays, it runs no code from the file
torch.serialization.add_safe_globals([_rebuild])


def _op_name(func) -> str:
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"torch.ops.{func}"  # torch.ops.aten.cumsum.default
    if getattr(func, "__name__", "") == "__get__" and hasattr(getattr(func, "__self__", None), "__name__"):
        return f"Tensor.{func.__self__.__name__}"  # an attribute's getter: Tensor.mT
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    mod = getattr(func, "__module__", None) or ""
    if name.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + name.split(".", 1)[1]
    if name.startswith("_VariableFunctionsClass."):
        return "torch." + name.split(".", 1)[1]
    return f"{mod}.{name}" if mod and not mod.startswith("torch._C") else f"torch.{name}"


def _describe(args, kwargs) -> str:
    found = [f"{short_name(x._format)} {tuple(x._shape)}" for x in _flat((args, kwargs)) if type(x) is SparseTensor]
    return "format " + ", ".join(found) if found else "sparse operand"


def _flat(obj):
    """The leaves of ``obj``, nested lists, tuples and dicts opened."""
    if isinstance(obj, (list, tuple)):
        for a in obj:
            yield from _flat(a)
    elif isinstance(obj, dict):
        for a in obj.values():
            yield from _flat(a)
    else:
        yield obj


class _DenseGradient(torch.autograd.Function):
    """The identity, whose backward hands a torch sparse gradient on densified: a fallback's torch op may give
    one (``nn.Embedding(sparse=True)``), which the dense form's own backward cannot index."""
    forward = staticmethod(lambda ctx, x: x.view_as(x))
    backward = staticmethod(lambda ctx, g: g.to_dense() if g.layout != torch.strided else g)


def _densified(obj):
    """``obj`` with every SparseTensor (in nested lists, tuples and dicts too) replaced by its differentiable dense
    form."""
    if type(obj) is SparseTensor:
        d = obj.to_dense()
        return _DenseGradient.apply(d) if d.requires_grad else d
    if isinstance(obj, (list, tuple)) and any(type(x) is SparseTensor for x in _flat(obj)):
        items = [_densified(a) for a in obj]
        return items if type(obj) is list else tuple(items) if type(obj) is tuple else type(obj)(*items)
    if isinstance(obj, dict) and any(type(x) is SparseTensor for x in _flat(obj)):
        return {k: _densified(v) for k, v in obj.items()}
    return obj


class ShapeError(ValueError, RuntimeError):
    """Operands whose shapes do not fit the op: a ``RuntimeError``, as torch raises for them (``except RuntimeError``
    in code written for torch catches it), and a ``ValueError``, as scorch's other bad-input errors are."""


class NoSparseRule(NotImplementedError):
    """Raised by an implementation that has no sparse rule for the arguments it got: the op then runs on the dense
    form (``dense_fallback``)."""


class UnsupportedDtype(TypeError, NoSparseRule):
    """A value type the kernels do not take (bool, int8, uint8, complex...): a ``TypeError`` to a caller of the
    compiler's own API (``scorch.einsum``), and through a torch function the dense form's op, as any op without a
    sparse rule (warned and counted; refused in strict mode)."""


class _ReachedDispatch(NotImplementedError):
    """An op reached torch's dispatcher with a sparse operand, where no dense fallback can run."""


# in-place dunders: they write into their first argument
_INPLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                              "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                              "__imatmul__", "__setitem__"})
# ops whose dense form would answer about a temporary, not about the sparse tensor
_NO_FALLBACK = {torch.Tensor.data_ptr, torch.Tensor.untyped_storage, torch.Tensor.storage,
                torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.storage_offset,
                torch.Tensor.stride, torch.Tensor.share_memory_, torch.Tensor.is_shared, torch.Tensor.is_pinned,
                torch.Tensor.pin_memory}


def _writes_sparse(func, args, kwargs) -> bool:
    """Whether ``func`` writes into a sparse argument: an in-place method on it, ``inplace=True``, ``out=`` it, an
    in-place function given it by keyword (``nn.init.uniform_(tensor=S)``), or a ``torch.distributed`` collective."""
    if any(type(x) is SparseTensor for x in _flat(kwargs.get("out"))):
        return True
    if getattr(func, "__module__", "").startswith("torch.distributed"):
        return True
    name = getattr(func, "__name__", "")
    inplace = (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS or \
        kwargs.get("inplace") is True
    # the written argument is the first one, or the tensors of a list (torch._foreach_add_([S, ...], ...))
    written = args[0] if args else list(kwargs.values())  # (all by keyword: any of them)
    return inplace and any(type(x) is SparseTensor for x in _flat(written))


def dense_fallback(func, args, kwargs, why: Exception | None = None):
    """Run ``func`` on the dense form of every sparse argument (``to_dense()``, differentiable: gradients reach
    the stored values) and return torch's own result; counted and warned about once per op (``scorch.stats()``),
    an error in strict mode (``scorch.strict()``) or over the memory limit (``scorch.set_fallback_limit``).
    An op that would write into a sparse argument raises: a sparse tensor cannot become dense in place."""
    from . import _stats
    name = _op_name(func)
    sparse = [x for x in _flat((args, kwargs)) if type(x) is SparseTensor]
    why = str(why or "").removeprefix("scorch: ")
    detail = _describe(args, kwargs) + (f": {why}" if why else "")
    if _writes_sparse(func, args, kwargs):
        raise NotImplementedError(f"scorch: {name} would write its result into a sparse tensor ({detail}) in place,"
                                  " and scorch has no sparse rule for it here: a sparse tensor cannot become dense in"
                                  " place; use the out-of-place form, or x.to_dense() first (an initializer or a"
                                  " collective: pass x.values(), the stored entries)")
    if func in _NO_FALLBACK:
        raise NotImplementedError(f"scorch: {name} of a sparse tensor ({detail}): it has no dense storage to answer"
                                  " about (its arrays are x.values() and x.levels)")
    nbytes = sum(math.prod(x._shape) * x._vals.element_size() for x in sparse)
    _stats.record_fallback(name, detail, nbytes)
    return func(*_densified(args), **_densified(kwargs))


# torch.* spellings of the methods SparseTensor defines
def _method(name):
    return functools.wraps(getattr(SparseTensor, name))(lambda self, *a, **k: getattr(SparseTensor, name)(self, *a, **k))


for _name in ("to_dense", "values", "clone", "detach", "detach_", "to", "cpu", "double", "float", "_nnz", "sparse_dim",
              "dense_dim", "__deepcopy__"):
    IMPLEMENTATIONS[getattr(torch.Tensor, _name)] = _method(_name)
IMPLEMENTATIONS[torch.Tensor._values] = _method("values")
IMPLEMENTATIONS[torch.Tensor.__format__] = lambda self, spec: format(self.__repr__(), spec)  # f"{S}": its repr


def _converter(dtype):
    def convert(self, memory_format=torch.preserve_format):
        return self.to(dtype)
    convert.__name__ = convert.__qualname__ = f"to_{str(dtype).removeprefix('torch.')}"
    convert.__doc__ = (f"The values converted to {dtype}; the pattern (shared index arrays) and format kept." if not
                       dtype.is_complex else f"{dtype}: SparseTensors hold real values, so the dense fallback (torch's"
                       " dense complex result, warned and counted).")
    return convert


# x.long(), x.bool()...: a dtype conversion keeps the pattern
for _name, _dtype in (("long", torch.int64), ("int", torch.int32), ("short", torch.int16), ("char", torch.int8),
                      ("byte", torch.uint8), ("bool", torch.bool), ("half", torch.float16),
                      ("bfloat16", torch.bfloat16), ("cfloat", torch.complex64), ("cdouble", torch.complex128)):
    IMPLEMENTATIONS[getattr(torch.Tensor, _name)] = _converter(_dtype)


def _type_as(self, other):
    """The values converted to ``other``'s dtype; the pattern and format kept."""
    return self.to(other.dtype)


IMPLEMENTATIONS[torch.Tensor.type_as] = _type_as


def _no_shallow_copy(a, b):
    """False: ``x.data = y`` cannot swap a SparseTensor's arrays (torch would change only the wrapper's dtype), so
    ``nn.Module.double()`` / ``.to()`` install a new Parameter holding the converted tensor."""
    return False


IMPLEMENTATIONS[torch._has_compatible_shallow_copy_type] = _no_shallow_copy
IMPLEMENTATIONS[torch.clone] = _method("clone")
IMPLEMENTATIONS[torch.detach] = _method("detach")
IMPLEMENTATIONS[torch.Tensor.__repr__] = _method("__repr__")
IMPLEMENTATIONS[torch.Tensor.__reduce_ex__] = _method("__reduce_ex__")


# --- helpers the layers above share ------------------------------------------------------------------------

def needs_grad(operands) -> bool:
    """Whether a call on ``operands`` records a graph: grad mode is on and some tensor requires grad."""
    if not torch.is_grad_enabled():
        return False
    for x in operands:
        if type(x) is SparseTensor:
            if x._vals.requires_grad:
                return True
        elif isinstance(x, torch.Tensor) and x.requires_grad:
            return True
    return False


def is_pattern_ones(t) -> bool:
    """Whether ``t`` is (a whole view of) the ones ``pattern_ones`` keeps, unmodified."""
    kept = ONES.get((t.numel(), t.dtype, t.device)) if type(t) is torch.Tensor else None
    return kept is not None and _storage.array_version(kept[0]) == kept[1] and t.data_ptr() == kept[0].data_ptr()


def padding_of(x: SparseTensor, *others) -> torch.Tensor:
    """The padding of ``x``'s padded (fixed) level as a bool mask over its values (``storage.padding``; slots
    it cannot read off the coordinates are padding where ``x`` and every SparseTensor of ``others``, on the same
    index arrays, hold 0). A tensor made by ``zeros_like`` of a padded tensor keeps that tensor's reading while it
    holds the same arrays: its own zeros cannot tell an entry at coordinate 0 from padding (optimizer state)."""
    pad = _storage.padding(x._format, x._shape, x._levels, x._vals.detach(), *(o._vals.detach() for o in others))
    kept = x.__dict__.get("_padding")
    return pad & kept[1] if kept is not None and kept[0] is x._levels else pad


def pattern_ones(x: SparseTensor, dtype):
    """Ones at ``x``'s stored positions (the values of its pattern). In a format with a padded level, 0 at the
    padding (``padding_of``: a gradient there would turn padding into an entry, an SDDMM there would too)."""
    v = x._vals
    if x._format.padded:
        return (~padding_of(x)).to(dtype)
    key = (v.numel(), dtype, v.device)
    kept = ONES.get(key)
    if kept is None or _storage.array_version(kept[0]) != kept[1]:  # (modified in place since: not ones any more)
        if len(ONES) >= 8:
            ONES.clear()
        ones = torch.ones(v.shape, dtype=dtype, device=v.device)
        kept = ONES[key] = (ones, _storage.array_version(ones))
    return kept[0].view(v.shape)


#: ones of a size, kept: a model's patterns (a weight's, a graph's) ask for the same ones every step
ONES: dict = {}
