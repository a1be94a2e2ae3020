"""Convenience on top of ``scorch.schedule``: a sparse ``nn.Linear``, and whole-model patching and reformatting.

- ``SparseLinear``: a drop-in ``nn.Linear`` (a subclass) whose weight is a sparse ``nn.Parameter``.
- ``patch_model(model, {module regex: options})``: prune and store the weights of the matching modules.
- ``reformat_model(model, fn)``: store existing weights in the formats ``fn`` picks, without pruning.

Each is a few selections on a ``Schedule`` followed by ``apply()``; all return the model, changed in place.
"""
from __future__ import annotations

import inspect
import numbers
import re

import torch
import torch.nn as _nn

from ..formats import Format, resolve
from ..formats.named import block_size, short_name
from ..sparse_tensor import SparseTensor
from .schedule import schedule
from .sparsify import BlockFraction, RandomFraction, ScalarFraction, ScalarThreshold, Sparsifier

__all__ = ["SparseLinear", "patch_model", "reformat_model"]


def _check_density(density) -> float:
    if isinstance(density, bool) or not isinstance(density, numbers.Real) or not 0.0 <= float(density) <= 1.0:
        raise ValueError(f"density must be a number in [0, 1] (the fraction of entries kept), got {density!r}")
    return float(density)


class SparseLinear(_nn.Linear):
    """``nn.Linear`` with a sparse weight: ``y = x @ W.T + b`` with ``W`` an ``nn.Parameter(SparseTensor)``.

    The weight is initialized as ``nn.Linear`` does, then sparsified: by default a uniformly random pattern
    keeping the fraction ``density`` of entries (``RandomFraction(1 - density)``, torch's global random state;
    in a blocked format the fraction of blocks with the largest norms, ``BlockFraction``);
    ``sparsifier=`` sets another rule (not both). ``format`` is any scorch format (default ``"csr"``). The bias
    stays dense. Attributes are ``nn.Linear``'s (``weight``, ``bias``, ``in_features``, ``out_features``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, format="csr", density=None,
                 sparsifier: Sparsifier | None = None, device=None, dtype=None):
        if density is not None and sparsifier is not None:
            raise ValueError("SparseLinear takes density or sparsifier, not both")
        if sparsifier is None:
            sparsity = 1.0 - _check_density(0.1 if density is None else density)
            # a blocked format keeps that fraction of blocks (single entries at random kept almost every block)
            block = block_size(resolve(format, 2))
            sparsifier = RandomFraction(sparsity) if block is None else BlockFraction(sparsity, block)
        elif not isinstance(sparsifier, Sparsifier):
            raise TypeError(f"sparsifier must be a scorch.nn.Sparsifier, got {type(sparsifier).__name__}")
        self.sparsifier, self.format = sparsifier, format
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)  # calls reset_parameters

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization, then the sparsifier (a new pattern)."""
        if isinstance(self.weight, SparseTensor):
            self.weight = _nn.Parameter(torch.empty(self.weight.shape, dtype=self.weight.dtype,
                                                    device=self.weight.device))
        super().reset_parameters()
        self._sparsify()

    def _sparsify(self):
        s = schedule(self)
        s["weight"].sparsify(self.sparsifier).set_format(self.format)
        s.apply()

    @classmethod
    def from_dense(cls, linear: _nn.Linear, sparsifier: Sparsifier | None = None, format="csr") -> "SparseLinear":
        """A SparseLinear with ``linear``'s weight (sparsified by ``sparsifier``; default: its nonzeros) and bias
        (copied). ``linear`` itself is not changed."""
        if not isinstance(linear, _nn.Linear):
            raise TypeError(f"from_dense takes an nn.Linear, got {type(linear).__name__}")
        if sparsifier is not None and not isinstance(sparsifier, Sparsifier):
            raise TypeError(f"sparsifier must be a scorch.nn.Sparsifier, got {type(sparsifier).__name__}")
        new = cls.__new__(cls)
        _nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.sparsifier, new.format = sparsifier if sparsifier is not None else ScalarThreshold(0.0), format
        w = linear.weight.detach()
        new.weight = _nn.Parameter(w.to_dense() if isinstance(w, SparseTensor) else w.clone(),
                                   requires_grad=linear.weight.requires_grad)
        new.bias = None if linear.bias is None else _nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=linear.bias.requires_grad)
        new._sparsify()
        return new

    def extra_repr(self) -> str:
        w = self.weight
        fmt = short_name(w.format) if isinstance(w, SparseTensor) else "dense"
        density = f", density={w.density:.3g}" if isinstance(w, SparseTensor) else ""
        return f"{super().extra_repr()}, format={fmt}{density}"


_PATCH_OPTIONS = {"density", "sparsifier", "block", "format", "dynamic"}


def patch_model(model: _nn.Module, spec: dict) -> _nn.Module:
    """Sparsify the weights of ``model``'s modules whose name matches a key of ``spec``; returns ``model``.

    Keys are regular expressions matched against whole module names (``re.fullmatch`` on
    ``model.named_modules()`` names, e.g. ``r"layers\\.\\d+\\.linear1"``); each matching module's ``weight``
    parameter is patched (biases stay dense; a module without a ``weight`` is skipped, and a key matching no
    module with a weight raises ``KeyError``). A module matched by several keys takes the last key's options.
    Options:

    - ``density``: the fraction of entries kept, by magnitude (``ScalarFraction(1 - density)``); with
      ``block``, the fraction of blocks kept (``BlockFraction(1 - density, block)``);
    - ``sparsifier``: any ``scorch.nn.Sparsifier`` instead of ``density`` (not both). Neither: the nonzeros;
    - ``block``: ``(bh, bw)``; the format defaults to ``bsr(bh, bw)`` and a named format such as ``"csr"``
      applies to the blocks (see ``scorch.schedule``);
    - ``format``: a name, format text or ``scorch.Format`` (default ``"csr"``).

    Patterns are static (for dynamic ones, use ``scorch.schedule`` and its ``step``/``attach``).
    """
    if not isinstance(spec, dict):
        raise TypeError(f"patch_model takes a dict {{module regex: options}}, got {type(spec).__name__}")
    modules = {n: m for n, m in model.named_modules() if n}
    params = dict(model.named_parameters())  # a weight shared by several modules is listed once
    chosen = {}  # weight name -> (key, options): the last matching key wins
    for key, options in spec.items():
        if not isinstance(key, (str, re.Pattern)):
            raise TypeError(f"patch_model keys are module-name regexes, got {type(key).__name__}")
        if not isinstance(options, dict):
            raise TypeError(f"patch_model: the options of {key!r} must be a dict, got {type(options).__name__}")
        unknown = set(options) - _PATCH_OPTIONS
        if unknown:
            raise ValueError(f"patch_model: unknown option(s) {', '.join(sorted(unknown))} for {key!r}; expected"
                             f" {', '.join(sorted(_PATCH_OPTIONS - {'dynamic'}))}")
        if options.get("dynamic"):
            raise ValueError("patch_model makes static patterns; for dynamic ones use scorch.schedule(model) with"
                             " .sparsify(..., dynamic=True) and step()/attach(optimizer)")
        rx = re.compile(key) if isinstance(key, str) else key
        names = [f"{n}.weight" for n, m in modules.items()
                 if rx.fullmatch(n) and isinstance(m._parameters.get("weight"), torch.Tensor)]
        names = [n for n in names if n in params]
        if not names:
            raise KeyError(f"patch_model: no module with a weight matches {rx.pattern!r}; modules:"
                           f" {', '.join(list(modules)[:8])}{' ...' if len(modules) > 8 else ''}")
        chosen.update((n, (key, options)) for n in names)
    s = schedule(model)
    for name, (key, options) in chosen.items():
        selection = s[name]
        block = options.get("block")
        sparsifier = _patch_sparsifier(key, options, block)
        if sparsifier is not None:
            selection.sparsify(sparsifier)
        if block is not None:
            selection.block(*block)
        selection.set_format(options.get("format", "csr"))
    s.apply()
    return model


def _patch_sparsifier(key, options, block):
    if block is not None and (isinstance(block, (str, bytes)) or not hasattr(block, "__len__") or len(block) != 2):
        raise ValueError(f"patch_model: block for {key!r} must be a pair (bh, bw), got {block!r}")
    if "density" in options and "sparsifier" in options:
        raise ValueError(f"patch_model: give density or sparsifier for {key!r}, not both")
    if "sparsifier" in options:
        if not isinstance(options["sparsifier"], Sparsifier):
            raise TypeError(f"patch_model: sparsifier for {key!r} must be a scorch.nn.Sparsifier")
        return options["sparsifier"]
    if "density" in options:
        sparsity = 1.0 - _check_density(options["density"])
        return BlockFraction(sparsity, tuple(block)) if block is not None else ScalarFraction(sparsity)
    return None


def reformat_model(model: _nn.Module, fn) -> _nn.Module:
    """Store existing parameters in the formats ``fn`` chooses, keeping their nonzeros (no pruning); returns
    ``model``.

    ``fn(name, weight)`` or ``fn(weight)`` (told apart by how many positional arguments it accepts) is called
    for every parameter (``model.named_parameters()``, biases included) and returns a format (a name, format
    text or ``scorch.Format``) or ``None`` to leave that parameter dense. Stored entries are the nonzeros
    (``ScalarThreshold(0)``), so the model computes exactly what it did."""
    if not callable(fn):
        raise TypeError(f"reformat_model takes a function, got {type(fn).__name__}")
    two = _takes_name(fn)
    s = schedule(model)
    for name, p in list(model.named_parameters()):
        fmt = fn(name, p) if two else fn(p)
        if fmt is None:
            continue
        if not isinstance(fmt, (str, Format)):
            raise TypeError(f"reformat_model: fn returned {type(fmt).__name__} for {name!r}; expected a format"
                            " (str or scorch.Format) or None")
        s[name].sparsify(ScalarThreshold(0.0)).set_format(fmt)
    s.apply()
    return model


def _takes_name(fn) -> bool:
    """Whether ``fn`` is called ``fn(name, weight)`` (True) or ``fn(weight)`` (False)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True  # builtins without a signature: the documented two-argument form
    for args in (("name", None), (None,)):
        try:
            sig.bind(*args)
            return len(args) == 2
        except TypeError:
            pass
    raise TypeError(f"reformat_model: fn must take (name, weight) or (weight), its signature is {sig}")

