"""scorch's ``torch.compile`` support, loaded when ``torch._dynamo`` is (issue 44).

``scorch/dynamo.py`` and ``scorch/dynamo_sparse.py`` register scorch's custom ops (``torch.ops.scorch.*``), the
traced rules and ``allow_in_graph`` calls; importing them imports ``torch._dynamo`` (with sympy, Inductor's config and
``torch.distributed``), which took more than half of ``import scorch``'s time, for programs that never compile.
Nothing of them is needed before Dynamo or ``torch.export`` runs, and both import ``torch._dynamo`` first (an
``is_compiling()`` that is true implies it), so they are imported right after ``torch._dynamo`` is: a finder at the
front of ``sys.meta_path`` wraps that module's loader (``install()``), as ``wrapt``'s post-import hooks do. Where
``torch._dynamo`` was imported before scorch, ``install()`` loads them at once. Importing ``torch._dynamo``
replaces ``torch.manual_seed``; the forwarded names scorch kept are refreshed then (``_forward.refresh``).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

from . import _compile_ready

_TARGET = "torch._dynamo"
_loaded = False


def load():
    """Import scorch's ``torch.compile`` modules (once; the registrations are theirs). One of them may be the
    module whose import brought ``torch._dynamo`` in (``import scorch.dynamo_fuse`` first): it is then still running
    its body, its ops not defined yet, so its kernels are registered as it ends (``_compile_ready``)."""
    global _loaded
    if not _loaded:
        _loaded = True
        from . import _forward, dynamo, dynamo_fuse, dynamo_sparse, dynamo_train  # noqa: F401
        _forward.refresh()
        _compile_ready.listener = lambda name: _direct_cpu_kernels(sys.modules[name])
        for module in (dynamo, dynamo_fuse, dynamo_sparse, dynamo_train):
            if module.__name__ in _compile_ready.done:
                _direct_cpu_kernels(module)


#: the modules whose ops have their direct CPU kernels
_registered: set = set()
_library = None


def _direct_cpu_kernels(module):
    """Each scorch custom op's function registered as its CPU kernel itself. ``torch.library.custom_op`` registers a
    wrapper for every device (a dynamo-disabling frame, an output aliasing check, a kernel-enabled test) that cost
    about 17 us a call, as much as the call of a small product itself (a Cora GCN's compiled training step calls 8
    scorch ops); its fake kernel stays as registered. scorch's ops return fresh tensors (``dynamo._fresh``), which
    that aliasing check verified; the tests' ``opcheck`` of them still does. The autograd kernel is ``_autograd_cpu``'s
    (custom_op's own where a graph is to be recorded)."""
    global _library
    import torch
    from torch._library.custom_ops import CustomOpDef
    if module.__name__ in _registered:
        return
    _registered.add(module.__name__)
    if _library is None:
        _library = torch.library.Library("scorch", "IMPL")
    for op in vars(module).values():
        fn = getattr(op, "_init_fn", None)
        if isinstance(op, CustomOpDef) and callable(fn):
            _library.impl(op._name, fn, "CPU")
            _library.impl(op._name, _autograd_cpu(op, fn), "AutogradCPU", with_keyset=True)


def _autograd_cpu(op, fn):
    """The CPU autograd kernel of the custom op ``op`` whose function is ``fn``: ``fn`` called at once where no
    graph is recorded (grad mode off or no input requiring a gradient, as inside a compiled graph, whose autograd is
    AOTAutograd's) and the call reaches the CPU kernel next (no fake tensor, mode or functionalization between);
    custom_op's own autograd kernel otherwise. Custom_op's checks its schema, builds a record and redispatches below
    autograd through Python on every call: about 10 us of each of the 8 scorch ops of a Cora GCN's compiled
    training step."""
    import torch
    from torch._library.autograd import make_autograd_impl
    general = make_autograd_impl(op._opoverload, op)
    below, cpu = torch._C._after_autograd_keyset, torch._C.DispatchKey.CPU
    grad_enabled, any_requires_grad = torch._C.is_grad_enabled, torch._C._any_requires_grad

    def kernel(keyset, *args, **kwargs):
        if (keyset & below).highestPriorityTypeId() == cpu and not (grad_enabled() and any_requires_grad(*args)):
            return fn(*args, **kwargs)
        return general(keyset, *args, **kwargs)
    return kernel


class _ThenLoad(importlib.abc.Loader):
    """``torch._dynamo``'s own loader, then ``load()``."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader  # (its own again: get_source, resources)
        _uninstall()
        load()

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _DynamoFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenLoad(spec.loader)
        return spec


_FINDER = _DynamoFinder()


def _uninstall():
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def install():
    """Load scorch's compile support now if ``torch._dynamo`` is imported already, else right after it is."""
    if _TARGET in sys.modules:
        load()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
