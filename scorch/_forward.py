"""Forwarding of torch's namespace: every name and submodule scorch does not define is torch's own object.

``forward(namespace, target)`` gives a module ``__getattr__`` / ``__dir__`` pair that answers with
``target``'s attribute (cached in the module's dict after the first look-up, so dense code pays a plain
dict hit). ``TorchAliasFinder`` makes ``import scorch.X.Y`` return the module ``torch.X.Y`` itself
wherever scorch has no ``X/Y`` of its own, so ``from scorch.utils.data import DataLoader`` is torch's class.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

_PLAIN_DATA = (bool, int, float, complex, str, bytes, list, dict, set, tuple, type(None))


def forward(namespace: dict, target):
    def __getattr__(name):
        try:
            value = getattr(target, name)
        except AttributeError:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}"
                                 f" (nor has {target.__name__!r})") from None
        if not isinstance(value, _PLAIN_DATA):  # plain data may be reassigned in torch: always read it there
            namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(dir(target)))

    return __getattr__, __dir__


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, module):
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec  # the import system stamped scorch's spec on torch's module: undo it


class TorchAliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``scorch.a.b`` to ``torch.a.b`` when scorch has no such module of its own."""

    def find_spec(self, fullname, path=None, target=None):
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


def install():
    if not any(isinstance(f, TorchAliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchAliasFinder())
