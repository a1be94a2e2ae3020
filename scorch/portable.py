"""Checkpoints that plain torch loads (issue 44): ``scorch.save_portable`` / ``scorch.load_portable``.

``torch.save`` of a SparseTensor pickles ``scorch.sparse_tensor._rebuild``: ``torch.load`` in a process without
scorch refuses it (``Unsupported global: GLOBAL scorch.sparse_tensor._rebuild``). A portable checkpoint holds each
SparseTensor as a torch tensor instead: the torch sparse layout of its format where torch has one (CSR, CSC, COO,
BSR, BSC: its arrays, shared, no conversion), a strided tensor for a dense format, and a COO tensor for the others
(DCSR, ELL, DIA, CSF, n:m...: no entry is densified). Each such tensor carries one attribute, ``_scorch_portable``
(a dict of plain values: the format text, the index dtype, ``requires_grad``, whether it was a parameter), which
torch's ``weights_only`` loader restores and ignores; ``from_portable`` reads it back and stores the tensor in its
format again, with its index dtype. A torch sparse tensor cannot hold explicit padding, so a format that stores
some (ELL, DIA, blocks with zeros) comes back with the same values, its padding as the conversion makes it.
"""
from __future__ import annotations

import torch

from .engine.convert import asformat, from_torch, to_torch
from .sparse_tensor import SparseTensor

ATTRIBUTE = "_scorch_portable"


def _portable_tensor(s: SparseTensor) -> torch.Tensor:
    info = {"format": str(s.format), "index_dtype": str(s._index_dtype).removeprefix("torch."),
            "requires_grad": bool(s.requires_grad), "param": bool(getattr(s, "_is_param", False))}
    s = s.detach()
    try:
        t = to_torch(s)
    except ValueError:  # a format with no torch layout (or blocks the shape does not divide): its entries as COO
        t = to_torch(asformat(s, "coo"))
    t = t.detach()  # a tensor object of its own for the attribute (a dense format's may be the values themselves)
    setattr(t, ATTRIBUTE, info)
    return t


def _restored(t: torch.Tensor) -> SparseTensor:
    info = getattr(t, ATTRIBUTE)
    if not isinstance(info, dict) or not isinstance(info.get("format"), str):
        raise ValueError(f"scorch.from_portable: a tensor's {ATTRIBUTE} is not what save_portable writes: {info!r}")
    index_dtype = getattr(torch, str(info.get("index_dtype", "int64")), None)
    if not isinstance(index_dtype, torch.dtype):
        raise ValueError(f"scorch.from_portable: unknown index dtype {info.get('index_dtype')!r}")
    source = from_torch(t, check=True) if t.layout != torch.strided else t
    s = asformat(source, info["format"], index_dtype=index_dtype)
    if info.get("requires_grad"):
        s.requires_grad_(True)
    if info.get("param"):
        s._is_param = True
    return s


def _walk(obj, leaf):
    """``obj`` with ``leaf(x)`` for each tensor in it (in dicts, lists and tuples, their types and a state dict's
    ``_metadata`` kept); ``leaf`` returns the tensor or its replacement."""
    if isinstance(obj, torch.Tensor):
        return leaf(obj)
    if isinstance(obj, dict):
        out = type(obj)((k, _walk(v, leaf)) for k, v in obj.items()) if type(obj) is not dict else \
            {k: _walk(v, leaf) for k, v in obj.items()}
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_walk(v, leaf) for v in obj)
    if isinstance(obj, tuple):  # a named tuple
        return type(obj)(*(_walk(v, leaf) for v in obj))
    return obj


def to_portable(obj):
    """``obj`` (a tensor, or dicts / lists / tuples of them: a state dict) with every SparseTensor replaced by a
    torch tensor plain torch loads (``weights_only=True``), marked so that ``from_portable`` restores it."""
    return _walk(obj, lambda x: _portable_tensor(x) if isinstance(x, SparseTensor) else x)


def from_portable(obj):
    """``obj`` as ``to_portable`` made it (after ``torch.load``) with each marked tensor a SparseTensor again,
    in its format and index dtype; everything else as it is."""
    return _walk(obj, lambda x: _restored(x) if not isinstance(x, SparseTensor) and hasattr(x, ATTRIBUTE) else x)


def save_portable(obj, f, **kwargs):
    """``torch.save(obj, f)`` loadable without scorch: SparseTensors are saved as torch's sparse tensors (CSR,
    CSC, COO, BSR, BSC, or COO for a format torch lacks; a dense format as a dense tensor), each with its scorch
    format beside it. ``scorch.load_portable(f)`` gives them back in their formats; plain ``torch.load(f)``
    gives the torch tensors. ``kwargs`` go to ``torch.save``."""
    torch.save(to_portable(obj), f, **kwargs)


def load_portable(f, **kwargs):
    """``torch.load(f, **kwargs)`` (``weights_only=True`` by default, as torch's) of a checkpoint written by
    ``save_portable``, its SparseTensors restored in their formats."""
    return from_portable(torch.load(f, **kwargs))
