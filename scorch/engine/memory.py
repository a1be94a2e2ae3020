"""Dense buffers for kernel outputs, backed by huge pages where the OS offers them.

A fresh CPU buffer of many MiB comes from ``mmap``, and the first write to each 4 KiB page faults into the
kernel, which zeroes it: on the machines measured that cost 60 ms for a 51 MB SpMM output, more than the product
itself. ``madvise(MADV_HUGEPAGE)`` on the buffer before it is written lets the kernel fault 2 MiB at a time (the
same as torch's ``THP_MEM_ALLOC_ENABLE=1``, which it reads once, before scorch can set it). The advice is only
advice: where transparent huge pages are off, or on another OS, nothing changes.
"""
from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
#: buffers from this size on get the advice: glibc maps arrays this large afresh (or trims them from the heap
#: after), so each call faults them in again (SpGEMM's 31.6 MB arrays: 15.4k faults a call); smaller ones are
#: reused from the heap without faults (the power-law add's 16.8 MB: none), where the advice only split the
#: heap's mapping (about 1k extra faults a call)
THRESHOLD_BYTES = 24 << 20

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


#: copies kept across calls (a relaid operand) get the advice from this size on: their rows are read in random
#: order, and on 4 KiB pages nearly every row read missed the TLB (SDDMM's kept copy of B)
KEPT_THRESHOLD_BYTES = 4 << 20


def advise_huge(t: torch.Tensor, threshold: int = None) -> torch.Tensor:
    """Advise huge pages for the whole 2 MiB pages inside ``t``'s memory (a CPU tensor not yet written), if it
    holds at least ``threshold`` bytes (default ``THRESHOLD_BYTES``)."""
    nbytes = t.numel() * t.element_size()
    threshold = THRESHOLD_BYTES if threshold is None else threshold
    if _madvise is not None and nbytes >= threshold and t.device.type == "cpu":
        p = t.data_ptr()
        lo, hi = (p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), (p + nbytes) & ~(HUGE_PAGE - 1)
        if hi > lo:
            _madvise(lo, hi - lo, MADV_HUGEPAGE)
    return t


def empty(shape, dtype, device=None) -> torch.Tensor:
    """``torch.empty`` with the huge-page advice."""
    return advise_huge(torch.empty(shape, dtype=dtype, device=device))


def zeros(shape, dtype, device=None) -> torch.Tensor:
    """``torch.zeros`` with the huge-page advice (given before the zeros are written)."""
    return advise_huge(torch.empty(shape, dtype=dtype, device=device)).zero_()


def kept_empty(shape, dtype, device=None) -> torch.Tensor:
    """``torch.empty`` for a copy kept across calls: the huge-page advice from ``KEPT_THRESHOLD_BYTES``."""
    return advise_huge(torch.empty(shape, dtype=dtype, device=device), KEPT_THRESHOLD_BYTES)
