"""Forwarding of torch's namespace: every name and submodule scorch does not define is torch's own object.

``forward(namespace, target)`` gives a module ``__getattr__`` / ``__dir__`` pair that answers with
``target``'s attribute (cached in the module's dict after the first look-up, so dense code pays a plain
dict hit). ``TorchAliasFinder`` makes ``import scorch.X.Y`` return the module ``torch.X.Y`` itself
wherever scorch has no ``X/Y`` of its own, so ``from scorch.utils.data import DataLoader`` is torch's class.

With ``routed=True`` (``scorch`` and ``scorch.nn.functional``), the functions that take tensors (torch's
overridable functions) are answered by ``on_torch_layouts(fn)``: torch's function, run as it is, and run again
with torch's sparse layouts (``x.to_sparse()``...) viewed as SparseTensors (zero copy) when torch refuses them,
so ``scorch.reshape(x.to_sparse(), ...)`` and ``scorch.nn.functional.pad(x.to_sparse(), ...)`` run in scorch.
Dense calls pay one Python call and a ``try`` (measured in ``docs/design-notes.md``). The wrapper pickles as
``scorch.<name>`` and TorchScript compiles it as torch's function.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import functools
import sys

import torch as _torch

_PLAIN_DATA = (bool, int, float, complex, str, bytes, list, dict, set, tuple, type(None))


_SPARSE_LAYOUTS = (_torch.sparse_coo, _torch.sparse_csr, _torch.sparse_csc, _torch.sparse_bsr, _torch.sparse_bsc)


def view_torch_layout(x):
    """A torch sparse tensor viewed as a SparseTensor (zero copy); anything else, and torch sparse tensors that
    require grad (their gradient belongs to torch) or that scorch cannot view (hybrid, batched), as it is."""
    if type(x) is _torch.Tensor and x.layout in _SPARSE_LAYOUTS and not x.requires_grad:
        from .interop import from_torch
        try:
            return from_torch(x)
        except NotImplementedError:
            return x
    return x


def _viewed(obj):
    """``obj`` with the torch sparse tensors in it (nested in lists, tuples, dicts) viewed; ``obj`` itself (the
    same object) where there are none."""
    if type(obj) is _torch.Tensor:
        return view_torch_layout(obj)
    if isinstance(obj, (list, tuple)):
        items = [_viewed(a) for a in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return items if type(obj) is list else tuple(items) if type(obj) is tuple else type(obj)(*items)
    if isinstance(obj, dict):
        items = {k: _viewed(v) for k, v in obj.items()}
        return obj if all(items[k] is v for k, v in obj.items()) else items
    return obj


def on_torch_layouts(fn, module: str, name: str):
    """``fn`` (a torch function), run again with torch sparse layouts viewed as SparseTensors when torch's own
    call raises; spelled ``module.name`` for pickling, compiled by TorchScript as ``fn`` itself."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:
            viewed_args, viewed_kwargs = _viewed(args), _viewed(kwargs)
            if viewed_args is args and viewed_kwargs is kwargs:
                raise  # no torch sparse operand: torch's own error
        return fn(*viewed_args, **viewed_kwargs)
    call.__module__, call.__qualname__ = module, name
    call.__prepare_scriptable__ = lambda: fn  # TorchScript compiles torch's function
    from torch.jit import _builtins
    op = _builtins._find_builtin(fn)
    if op is not None:  # a builtin op for TorchScript, as torch's function is
        _builtins._register_builtin(call, op)
    return call


@functools.lru_cache(maxsize=None)
def _tensor_functions(target) -> frozenset:
    """The ids of ``target``'s functions that take tensors (torch's overridable functions)."""
    return frozenset(id(f) for f in _torch.overrides.get_overridable_functions().get(target, ()))


#: per forwarding namespace: ``(namespace, target, names)``, the names whose torch object it keeps (``refresh``)
_FORWARDED = []


def forward(namespace: dict, target, routed: bool = False):
    forwarded = set()
    _FORWARDED.append((namespace, target, forwarded))
    if routed:  # now, while torch's modules are torch's: code that aliases torch to scorch later reads them here
        _tensor_functions(target)

    def __getattr__(name):
        try:
            value = getattr(target, name)
        except AttributeError:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}"
                                 f" (nor has {target.__name__!r})") from None
        if routed and id(value) in _tensor_functions(target):
            value = on_torch_layouts(value, namespace["__name__"], name)
        if not isinstance(value, _PLAIN_DATA):  # plain data may be reassigned in torch: always read it there
            namespace[name] = value
            forwarded.add(name)
        return value

    def __dir__():
        return sorted(set(namespace) | set(dir(target)))

    return __getattr__, __dir__


def refresh():
    """Forget the kept torch objects torch has replaced since (importing ``torch._dynamo`` replaces
    ``torch.manual_seed`` by a version Dynamo does not trace): the next read takes torch's object of now."""
    for namespace, target, names in _FORWARDED:
        for name in list(names):
            kept, now = namespace.get(name), getattr(target, name, None)
            if kept is not now and getattr(kept, "__wrapped__", None) is not now:
                namespace.pop(name, None)
                names.discard(name)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, module):
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec  # the import system stamped scorch's spec on torch's module: undo it


def _aliased_torch_modules() -> dict:
    """The ``sys.modules`` entries named ``torch`` / ``torch.*`` that hold scorch's modules (code that replaced
    torch by scorch there, as the drop-in tests of third-party packages do)."""
    return {k: v for k, v in list(sys.modules.items()) if (k == "torch" or k.startswith("torch.")) and
            getattr(v, "__name__", "").startswith("scorch")}


def _real(name: str):
    module = _torch
    for part in name.split(".")[1:]:
        module = getattr(module, part)
    return module


class TorchAliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``scorch.a.b`` to ``torch.a.b`` when scorch has no such module of its own; and, where
    ``sys.modules['torch']`` is scorch, a torch submodule not imported yet (``import torch._dynamo``) to torch's
    own module, imported with torch's modules put back meanwhile (its own ``import torch`` must get torch)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torch.") and sys.modules.get("torch") is not _torch:
            aliased = _aliased_torch_modules()
            if not aliased:
                return None
            try:
                sys.modules.update({k: _real(k) for k in aliased})
                module = importlib.import_module(fullname)
            except (ImportError, AttributeError):
                return None
            finally:
                sys.modules.update(aliased)
            return importlib.util.spec_from_loader(fullname, _AliasLoader(module))
        if not fullname.startswith("scorch."):
            return None
        parent_name, _, child = fullname.rpartition(".")
        parent = sys.modules.get(parent_name)
        if parent is None:
            return None
        if not parent.__name__.startswith("torch"):  # a real scorch package: its own modules come first
            if importlib.machinery.PathFinder.find_spec(fullname, getattr(parent, "__path__", None)):
                return None
        torch_name = "torch" + fullname[len("scorch"):] if parent.__name__.startswith("scorch") \
            else f"{parent.__name__}.{child}"
        try:
            module = importlib.import_module(torch_name)
        except ImportError:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(module))


@contextlib.contextmanager
def no_collection():
    """The block without Python's cyclic garbage collection (as it was after it, also where the block raises)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def install():
    if not any(isinstance(f, TorchAliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchAliasFinder())
