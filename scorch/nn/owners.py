"""Which parameters ``scorch.schedule`` can make sparse, and how a convolution's weight is stored.

A parameter is refused where its module passes it to a torch function scorch does not implement for sparse
operands (``unsupported``). A ``Conv1d``/``Conv2d``/``Conv3d`` weight is sparsified and formatted on its matrix
view ``(out, prod(kernel) * in / groups)`` (``ops.conv``), and kept in the conv's own shape.
"""
from __future__ import annotations

import torch.nn as _nn
import torch.nn.functional as _F

from ..formats import Format, storage
from ..interop import coo_from_entries
from ..sparse_tensor import IMPLEMENTATIONS, SparseTensor, padding_of


# module types whose forward passes their parameters to a torch function; a sparse parameter works only where
# scorch implements that function for sparse operands
_OWNER_FUNCTIONS = [
    (_nn.MultiheadAttention, (_F.multi_head_attention_forward,), True),  # True: its submodules (out_proj) too
    (_nn.Conv1d, (_F.conv1d,), False), (_nn.Conv2d, (_F.conv2d,), False), (_nn.Conv3d, (_F.conv3d,), False),
    (_nn.ConvTranspose1d, (_F.conv_transpose1d,), False), (_nn.ConvTranspose2d, (_F.conv_transpose2d,), False),
    (_nn.ConvTranspose3d, (_F.conv_transpose3d,), False), (_nn.Embedding, (_F.embedding,), False),
    (_nn.EmbeddingBag, (_F.embedding_bag,), False), (_nn.LayerNorm, (_F.layer_norm,), False),
    (_nn.GroupNorm, (_F.group_norm,), False), (_nn.modules.batchnorm._NormBase, (_F.batch_norm,), False),
    (_nn.Bilinear, (_F.bilinear,), False),
]


def owners(model, name):
    """``(where, module, direct)`` for each module on the path to the parameter ``name``, the model first:
    ``where`` its dotted path (``"the model"`` for the root), ``direct`` whether it holds the parameter itself."""
    path = name.split(".")[:-1]
    for depth in range(len(path) + 1):
        where = ".".join(path[:depth])
        yield where or "the model", model.get_submodule(where), depth == len(path)


def unsupported(model, name) -> str | None:
    """Why the parameter ``name`` cannot be sparse (its owner calls an op scorch lacks), or None."""
    for where, module, direct in owners(model, name):
        for cls, funcs, covers_children in _OWNER_FUNCTIONS:
            if isinstance(module, cls) and (direct or covers_children):
                missing = [f for f in funcs if f not in IMPLEMENTATIONS]
                if missing:
                    fn = ", ".join(f"{f.__module__}.{f.__name__}" for f in missing)
                    return (f"its module {where!r} ({type(module).__name__}) passes it to {fn}, which scorch does not"
                            " implement for sparse operands")
    return None


def conv_weight(model, name) -> bool:
    """Whether the parameter ``name`` is the weight of a ``Conv1d``/``Conv2d``/``Conv3d``: its formats and
    sparsifiers apply to its matrix view ``(out, in / groups * prod(kernel))`` (``ops.conv``)."""
    owner, _, attr = name.rpartition(".")
    return attr == "weight" and isinstance(model.get_submodule(owner), (_nn.Conv1d, _nn.Conv2d, _nn.Conv3d))


def as_stored(model, name, w):
    """``w`` as its format applies to it: a conv weight's matrix view ``(out, *kernel, in / groups)`` flattened to
    ``(out, prod(kernel) * in / groups)`` (``ops.conv``), any other parameter itself."""
    return w.movedim(1, -1).reshape(w.shape[0], -1) if conv_weight(model, name) else w


def sparse_conv_weight(rule, w, fmt: Format) -> SparseTensor:
    """``w`` (``out x in/groups x *kernel``) sparsified by ``rule`` on its matrix view, stored in ``fmt`` there,
    kept as the canonical COO of the conv's shape (the view's entries: block fill stays stored, padding does not)
    with ``fmt`` recorded as the view's format (``_view_format``, read by ``ops.conv``)."""
    view = rule.sparsify(w.movedim(1, -1).reshape(w.shape[0], -1), fmt)
    leaf, dims, inside = storage.coordinates(view.format, view.shape, view.levels)
    if view.format.padded:
        inside &= ~padding_of(view)[leaf]
    leaf, (row, col) = leaf[inside], dims[:, inside]
    kernel, cg = tuple(w.shape[2:]), w.shape[1]
    coords, flat = [], col // cg
    for k in reversed(kernel):
        coords.append(flat % k)
        flat = flat // k
    out = coo_from_entries([row, col % cg, *reversed(coords)], view.values()[leaf], tuple(w.shape), False)
    out.__dict__["_view_format"] = fmt
    return out
