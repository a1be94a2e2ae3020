"""Counters of what scorch did behind an op's back, and the warning for the one thing users must know about:
a sparse operand turned into a dense result.

An op on a SparseTensor whose result is dense because the op does not map 0 to 0 (``torch.sigmoid(S)``,
``S > -1``...) calls ``record_densify(op_name)``. That counts every call under the op's name and warns
(``DensifyWarning``) the first time each op name densifies, so a model that densifies on every step warns once
per op, not once per step. ``stats()`` returns a copy of the counters; ``reset_stats()`` clears them and
re-arms the warnings.

An op with no sparse rule at all (``torch.cumprod(S, 0)``, ``F.mse_loss(S, y)``...) runs on the dense form of its
sparse operands (``SparseTensor.__torch_function__``): ``record_fallback(op_name)`` counts it under
``stats()["fallback"]`` and warns once per op name, as above. ``strict()`` (or ``SCORCH_STRICT=1`` in the
environment) makes both kinds raise ``DensifyError`` instead; ``check_fallback_size`` refuses (``MemoryError``)
a fallback whose dense operands would exceed ``fallback_limit()`` bytes (a quarter of physical memory unless
``set_fallback_limit`` or ``SCORCH_FALLBACK_LIMIT`` says otherwise).
"""
from __future__ import annotations

import os
import sys
import threading
import warnings

import torch

__all__ = ["DensifyError", "DensifyWarning", "check_fallback_size", "fallback_limit", "record_densify",
           "record_fallback", "reset_stats", "set_fallback_limit", "stats", "strict"]


class DensifyWarning(UserWarning):
    """A sparse operand gave a dense result (the op does not map zero to zero, or it has no sparse rule and ran on
    the dense form). Shown once per op name."""


class DensifyError(NotImplementedError):
    """Strict mode (``scorch.strict()``, ``SCORCH_STRICT=1``): an op would have densified a sparse operand."""


_lock = threading.Lock()
_densified: dict[str, int] = {}
_fallback: dict[str, int] = {}
_warned: set[tuple[str, str]] = set()  # (kind, op name)

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
    the last ``reset_stats()``. ``detail`` (e.g. the operand's format and shape) goes into the message. In strict
    mode: ``DensifyError`` instead."""
    what = f" ({detail})" if detail else ""
    if strict.on:
        raise DensifyError(f"scorch: {op_name} maps 0 to a nonzero value here, so its result on a sparse"
                           f" operand{what} would be dense, and strict mode (scorch.strict()) forbids densifying")
    if _count(_densified, "densified", op_name):
        warnings.warn(f"scorch: {op_name} maps 0 to a nonzero value here, so its result on a sparse operand{what}"
                      " is dense: scorch computed it on the densified operand (warned once per op; scorch.stats()"
                      " counts every densification)", DensifyWarning, stacklevel=_stacklevel())


def record_fallback(op_name: str, detail: str = "", nbytes: int = 0) -> None:
    """Count one dense fallback of ``op_name`` (an op with no sparse rule for these operands, computed by torch on
    their dense form, ``nbytes`` in all); warn once per op name since the last ``reset_stats()``. In strict mode:
    ``DensifyError``; over ``fallback_limit()`` bytes: ``MemoryError``."""
    what = f" ({detail})" if detail else ""
    if strict.on:
        raise DensifyError(f"scorch: {op_name} has no sparse rule for these operands{what}, and strict mode"
                           " (scorch.strict()) forbids computing it on their dense form")
    check_fallback_size(op_name, nbytes, detail)
    if _count(_fallback, "fallback", op_name):
        copy = ("; torch's op gives a view, this is a dense copy: an in-place change to it does not reach the"
                " sparse tensor") if op_name.split(".")[-1] in VIEW_FALLBACKS else ""
        warnings.warn(f"scorch: {op_name} has no sparse rule for these operands{what}: computed by torch on their"
                      f" dense form{copy} (warned once per op; scorch.stats() counts every fallback; scorch.strict()"
                      " makes this an error)", DensifyWarning, stacklevel=_stacklevel())


#: torch's view ops (by name) that have no sparse rule: their fallback result is a copy (``record_fallback`` says so)
VIEW_FALLBACKS = frozenset(("diagonal", "unfold", "as_strided", "view_as_real", "view_as_complex", "hsplit", "vsplit",
                            "dsplit", "adjoint", "mH", "imag"))


def _count(counter: dict, kind: str, op_name: str) -> bool:
    """Count one call of ``op_name`` in ``counter``; whether it is the first of its kind since the last reset."""
    with _lock:
        counter[op_name] = counter.get(op_name, 0) + 1
        first = (kind, op_name) not in _warned
        _warned.add((kind, op_name))
    return first


class strict:
    """Strict mode: every densification of a sparse operand (a dense fallback, or a map with f(0) != 0) raises
    ``DensifyError`` instead of warning. ``scorch.strict()`` switches it on, ``scorch.strict(False)`` off;
    ``with scorch.strict(): ...`` switches it on for the block (and restores the previous state after). The
    environment variable ``SCORCH_STRICT=1`` switches it on at import."""

    on: bool = os.environ.get("SCORCH_STRICT", "").strip().lower() not in ("", "0", "false", "no", "off")

    def __init__(self, on: bool = True):
        self._before = strict.on
        strict.on = bool(on)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        strict.on = self._before
        return False

    def __bool__(self):
        return strict.on


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): 16 GiB
        return 16 << 30


def _parse_bytes(text: str) -> int:
    """``"4G"``, ``"512M"``, ``"1000000"`` -> bytes (K, M, G, T are powers of 1024)."""
    t = text.strip().upper().rstrip("B").rstrip("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise ValueError(f"SCORCH_FALLBACK_LIMIT={text!r}: expected a number of bytes, e.g. 4G or 500000000") from None


_limit = [_parse_bytes(os.environ["SCORCH_FALLBACK_LIMIT"]) if os.environ.get("SCORCH_FALLBACK_LIMIT")
          else _physical_memory() // 4]


def fallback_limit() -> int:
    """The most bytes a dense fallback may densify (its sparse operands' dense forms together)."""
    return _limit[0]


def set_fallback_limit(nbytes: int) -> int:
    """Set the dense fallback's limit in bytes; returns the previous one. The default is a quarter of physical
    memory, or ``SCORCH_FALLBACK_LIMIT`` (bytes, or with a K/M/G/T suffix) where set."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"set_fallback_limit: expected a non-negative number of bytes, got {nbytes!r}")
    before, _limit[0] = _limit[0], nbytes
    return before


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def check_fallback_size(op_name: str, nbytes: int, detail: str = "") -> None:
    """``MemoryError`` naming the op and the size when a fallback would densify more than ``fallback_limit()``."""
    if nbytes > _limit[0]:
        what = f" ({detail})" if detail else ""
        raise MemoryError(f"scorch: {op_name} has no sparse rule for these operands{what}, and their dense form would"
                          f" take {_size(nbytes)}, over the dense fallback's limit of {_size(_limit[0])}"
                          " (scorch.set_fallback_limit(), SCORCH_FALLBACK_LIMIT)")


def stats() -> dict:
    """A copy of the counters: ``{"densified": {op_name: calls}, "fallback": {op_name: calls}}`` (maps with
    f(0) != 0, ops with no sparse rule run on the dense form)."""
    with _lock:
        return {"densified": dict(_densified), "fallback": dict(_fallback)}


def reset_stats() -> None:
    """Clear the counters; each op warns again on its next densification."""
    with _lock:
        _densified.clear()
        _fallback.clear()
        _warned.clear()
