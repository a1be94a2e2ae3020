"""Counters of what scorch did behind an op's back, and the warning for the one thing users must know about:
a sparse operand turned into a dense result.

An op on a SparseTensor whose result is dense because the op does not map 0 to 0 (``torch.sigmoid(S)``,
``S > -1``...) calls ``record_densify(op_name)``. That counts every call under the op's name and warns
(``DensifyWarning``) the first time each op name densifies, so a model that densifies on every step warns once
per op, not once per step. ``stats()`` returns a copy of the counters; ``reset_stats()`` clears them and
re-arms the warnings.
"""
from __future__ import annotations

import os
import sys
import threading
import warnings

import torch

__all__ = ["DensifyWarning", "record_densify", "reset_stats", "stats"]


class DensifyWarning(UserWarning):
    """A sparse operand gave a dense result (the op does not map zero to zero). Shown once per op name."""


_lock = threading.Lock()
_densified: dict[str, int] = {}
_warned: set[str] = set()

# frames in these packages are skipped, so that a warning points at the user's line
_SKIP = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))


def _stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside scorch and torch, counted from ``record_densify``."""
    frame, level = sys._getframe(2), 2  # 1 is record_densify itself, 2 its caller
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def record_densify(op_name: str, detail: str = "") -> None:
    """Count one densification by ``op_name``; warn (``DensifyWarning``) on the first one for this name since
    the last ``reset_stats()``. ``detail`` (e.g. the operand's format and shape) goes into the message."""
    with _lock:
        _densified[op_name] = _densified.get(op_name, 0) + 1
        first = op_name not in _warned
        _warned.add(op_name)
    if first:
        what = f" ({detail})" if detail else ""
        warnings.warn(f"scorch: {op_name} maps 0 to a nonzero value here, so its result on a sparse operand{what}"
                      " is dense: scorch computed it on the densified operand (warned once per op; scorch.stats()"
                      " counts every densification)", DensifyWarning, stacklevel=_stacklevel())


def stats() -> dict:
    """A copy of the counters: ``{"densified": {op_name: calls}}``."""
    with _lock:
        return {"densified": dict(_densified)}


def reset_stats() -> None:
    """Clear the counters; each op warns again on its next densification."""
    with _lock:
        _densified.clear()
        _warned.clear()
