"""Per-layer directives in ``scorch.schedule``: ``s["fc.weight"].schedule(order="oib", parallel="o")`` or
``s["block"].schedule(...)`` (a module), checked and installed by ``Schedule.apply``.

A parameter's directives are attached to the sparse Parameter ``apply`` installs (``ops.directed.attach``), so
every product it is an operand of (``F.linear``, ``torch.einsum``, ``@``, ``mm``...) compiles with them; a
module's are pushed while its forward runs (forward hooks), so the products with a sparse operand in that forward
take them (an operand's own directives win). The letters an order names are those of the product the op computes:
``F.linear`` with a sparse weight is ``einsum("oi,bi->ob", W, X)`` (``o`` output feature, ``i`` input feature,
``b`` token), ``W @ X`` is ``"ij,jk->ik"``, ``torch.einsum`` the call's own equation. With directives, ``F.linear``
runs the general lowering, not the dense-activation x sparse-weight kernels, which have no loop order to direct
(docs/design-notes.md, "Per-layer directives").
"""
from __future__ import annotations

import torch
import torch.nn as _nn

from ..compiler.schedule import Directives
from ..engine.run import check
from ..ops import directed
from ..sparse_tensor import SparseTensor, dtype_of
from .owners import owners

describe, attach, detach = directed.describe, directed.attach, directed.remove

# modules whose forward hands their parameters to an op that takes no directives (True: their submodules' too)
_OTHER_OPS = [(_nn.MultiheadAttention, True), (_nn.Conv1d, False), (_nn.Conv2d, False), (_nn.Conv3d, False),
              (_nn.Embedding, False), (_nn.EmbeddingBag, False), (_nn.Bilinear, False)]

LINEAR = ((("o", "i"), ("b", "i")), ("o", "b"), "einsum('oi,bi->ob')")


def directives_of(spec, fields: dict):
    """The directives of a ``.schedule(spec, **fields)`` call (``scorch.Directives.of``'s checks and messages:
    ``spec`` a ``Directives``, a dict of its fields or a loop order; or the fields as keywords); None (``spec``
    None, no fields) takes them away."""
    if spec is not None and fields:
        raise TypeError(".schedule takes directives (a scorch.Directives, a dict of its fields or a loop order) or"
                        " their fields as keywords, not both")
    return Directives.of(dict(fields) if fields else spec)


def refused(model: _nn.Module, name: str):
    """Why the parameter ``name`` cannot take directives (its module passes it to an op that takes none), or None."""
    for where, module, direct in owners(model, name):
        for cls, children in _OTHER_OPS:
            if isinstance(module, cls) and (direct or children):
                return (f"its module {where!r} ({type(module).__name__}) computes with it in its own kernels, which"
                        " take no directives; F.linear, torch.einsum and matmul/@/mm/bmm products take them")
    return None


def linear_owner(model: _nn.Module, name: str) -> bool:
    """Whether the parameter ``name`` is an ``nn.Linear``'s weight (its product is known before the first call)."""
    owner, _, attr = name.rpartition(".")
    return attr == "weight" and type(model.get_submodule(owner)).forward is _nn.Linear.forward


def check_linear(what: str, weight, d: Directives) -> None:
    """Raise, now, the error ``F.linear`` with the sparse ``weight`` and directives ``d`` would raise at its first
    call (``engine.run.check``: that product's planning, no kernel run), its message prefixed by ``what``."""
    if d is None or not isinstance(weight, SparseTensor):
        return
    x = torch.zeros(1, weight.shape[1], dtype=dtype_of(weight), device=weight.device)
    inputs, out, name = LINEAR
    try:
        check(inputs, out, [weight, x], "dense", d, name)
    except (ValueError, NotImplementedError) as e:
        raise type(e)(f"scorch.schedule: {what} (F.linear computes {name} on W, X): {e}") from e


def install(module: _nn.Module, d: Directives):
    """Forward hooks that let ``module``'s forward run with ``d`` (``ops.directed``); their handles."""
    pre = module.register_forward_pre_hook(lambda m, args: directed.entered(d))
    post = module.register_forward_hook(lambda m, args, out: directed.left(), always_call=True)
    return pre, post
