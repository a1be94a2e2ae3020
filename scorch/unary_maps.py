"""The unary maps (``relu``, ``erf``, ``F.gelu``, ``sigmoid``...): one record per map, declared once.

Each layer that treats unary maps reads this table instead of keeping its own list of names: ``ops.elementwise``
and ``ops.activation`` register the eager implementations of each record's spellings, ``dynamo_sparse`` the
``torch.compile`` rule of the traced ones, ``fusion_epilogue`` the epilogue steps of ``scorch.compile``'s products,
``ops.pattern`` the in-place forms of the plain maps. A leaf: it imports torch only, so every layer may read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_T = torch.Tensor


@dataclass(frozen=True)
class UnaryMap:
    """One unary map.

    - ``name``: torch's name (``"relu"``, ``"gelu"``); ``namespace`` the module it comes from (``qualname``).
    - ``funcs``: its out-of-place spellings (``torch.X``, ``Tensor.X``, ``F.X``, ``torch.special.X``, aliases), all
      taking the arguments of ``funcs[0]``; ``inplace``: its in-place ones (``Tensor.X_``, ``torch.X_``...).
    - ``zero``: f(0) = 0 with the default arguments, so the result of a sparse operand keeps its pattern; a map with
      f(0) != 0 gives a dense result (counted by ``scorch.stats()``).
    - ``probe``: each eager call first runs f on a zero of the operand's dtype with the call's arguments, and keeps
      the pattern where that gives 0 (``ops.activation``: arguments such as ``hardtanh``'s bounds decide); without,
      the map takes no arguments, f(0) = 0 always, and f runs on the stored values directly (``ops.elementwise``,
      whose in-place forms are ``ops.pattern``'s).
    - ``linear``: f(a + b) = f(a) + f(b), so an uncoalesced COO's duplicates need not be summed first.
    - ``traced``: under ``torch.compile`` the result is torch's op on the values, kept sparse in the graph
      (``dynamo_sparse``), for number arguments that keep f(0) = 0 (checked while tracing, as ``probe`` does).
    - ``epilogue``: ``scorch.compile`` computes it on each finished row of a product's dense output inside the
      product's kernel (``fusion_epilogue``): the loop IR has it (``loopir.UNARY``), or the epilogue builds it
      (``sigmoid``).
    """
    name: str
    funcs: tuple
    inplace: tuple = ()
    namespace: str = "torch"
    zero: bool = True
    probe: bool = True
    linear: bool = False
    traced: bool = False
    epilogue: bool = False

    @property
    def qualname(self) -> str:
        return f"{self.namespace}.{self.name}"


def _torch_map(name, aliases=(), zero=True, **props) -> UnaryMap:
    """``torch.<name>`` with its ``Tensor`` method, its ``torch.special`` function and ``aliases``; in place,
    ``Tensor.<name>_`` and ``torch.<name>_`` (those that exist). Traced where zero-preserving."""
    funcs = (getattr(torch, name), getattr(_T, name, None), getattr(torch.special, name, None), *aliases)
    inplace = (getattr(_T, name + "_", None), getattr(torch, name + "_", None))
    return UnaryMap(name, tuple(f for f in funcs if f is not None), tuple(f for f in inplace if f is not None),
                    zero=zero, traced=zero, **props)


def _nn_map(name, inplace=None, aliases=(), zero=True) -> UnaryMap:
    """``torch.nn.functional.<name>`` with ``aliases``, and its in-place form ``inplace`` (where torch has one).
    Traced where zero-preserving."""
    return UnaryMap(name, (getattr(F, name), *aliases), (inplace,) if inplace is not None else (),
                    "torch.nn.functional", zero=zero, traced=zero)


def _plain(name, *funcs) -> UnaryMap:
    """A map of the loop IR with no arguments: f on the stored values, traced, fused into an epilogue."""
    return UnaryMap(name, funcs, (getattr(_T, name + "_"),), probe=False, linear=name == "neg", traced=True,
                    epilogue=True)


#: every unary map scorch has a rule for, in registration order (a spelling belongs to one map)
MAPS: tuple[UnaryMap, ...] = (
    _plain("relu", torch.relu, _T.relu, F.relu),
    _plain("neg", torch.neg, _T.neg, _T.__neg__, torch.negative, _T.negative),
    _plain("abs", torch.abs, _T.abs, _T.__abs__, torch.absolute, _T.absolute),
    _plain("sqrt", torch.sqrt, _T.sqrt),
    _plain("square", torch.square, _T.square),
    _plain("sin", torch.sin, _T.sin),
    _plain("tanh", torch.tanh, _T.tanh, F.tanh),
    _plain("sign", torch.sign, _T.sign),
    # f(0) = 0 for every argument, or for the usual ones (each call checks its own)
    *(_torch_map(n) for n in (
        "erf", "erfinv", "expm1", "log1p", "sinh", "asinh", "arcsinh", "atanh", "arctanh", "tan", "asin", "arcsin",
        "atan", "arctan", "trunc", "fix", "floor", "ceil", "round", "frac")),
    *(_torch_map(n, linear=True) for n in ("deg2rad", "rad2deg")),
    *(_torch_map(n) for n in ("nan_to_num", "clamp", "clip", "clamp_min", "clamp_max", "isnan", "isinf", "isposinf",
                              "isneginf", "signbit")),
    # f(0) != 0: a dense result
    _torch_map("sigmoid", (torch.special.expit, F.sigmoid), zero=False, epilogue=True),
    *(_torch_map(n, zero=False) for n in (
        "exp", "exp2", "cos", "cosh", "log", "log2", "log10", "reciprocal", "rsqrt", "acos", "arccos", "erfc",
        "sinc", "logit", "isfinite", "logical_not")),
    # pow(x, e): f(0) = 0 for a scalar e > 0
    UnaryMap("pow", (torch.pow, _T.pow, _T.__pow__), (_T.pow_, _T.__ipow__), traced=True),
    _nn_map("leaky_relu", getattr(F, "leaky_relu_", None)),
    *(_nn_map(n) for n in ("gelu", "silu", "mish", "hardswish")),
    _nn_map("hardtanh", getattr(F, "hardtanh_", None)),
    _nn_map("relu6"),
    _nn_map("elu", getattr(F, "elu_", None)),
    _nn_map("selu", getattr(torch, "selu_", None), (torch.selu,)),
    _nn_map("celu", getattr(torch, "celu_", None), (torch.celu,)),
    _nn_map("rrelu", getattr(F, "rrelu_", None), (torch.rrelu,)),
    _nn_map("softshrink"),
    _nn_map("hardshrink", None, (_T.hardshrink,)),
    *(_nn_map(n) for n in ("tanhshrink", "softsign")),
    _nn_map("threshold", getattr(F, "threshold_", None), (torch.threshold,)),  # (torch.threshold: what F's calls)
    *(_nn_map(n, zero=False) for n in ("softplus", "logsigmoid", "hardsigmoid")),
)
