"""Software prefetches for the register tile (``lower._register_tile``) and for SDDMM's entries taken one at a
time (``lower._dot_tile``, where ``B`` is larger than ``lower.DOT_TILE_BYTES``): SpMM reads a row of the dense
operand at each entry's column, SDDMM a row of ``B``, in an order only the sparse operand knows, so the hardware
prefetcher cannot follow it; the loop asks for the row an entry ``prefetch_distance`` positions later while it
works on this one. Measured on
the power-law 100k graph (AVX2, machine loaded by other jobs, ratios to torch in one process): K=32 2.7x -> 4.1x,
K=128 2.1x -> 2.9x; uniform 20k K=128 2.8x -> 4.0x."""
from __future__ import annotations

from .. import loopir as L

#: how many entries ahead a register tile prefetches the dense row it will read: enough entries for about
#: ``PREFETCH_LINES`` lines in flight, at least ``PREFETCH_ENTRIES`` and at most ``PREFETCH_MAX_ENTRIES``. Measured
#: by hand (AMD EPYC Zen 4, 2 threads, the kernel's loop with distances 8 to 64, interleaved medians, warm and with
#: the L3 flushed before each call): rows of 2 lines (K=32, float32) 16 -> 32 entries: power-law 100k 4.21 ->
#: 3.89 ms warm, 5.16 -> 4.60 cold, uniform 20k cold 0.555 -> 0.521 ms (warm equal; 48 and 64 slower); rows of 4
#: lines (K=64) 16 and 24 equal; rows of 8 lines (K=128) 16 best (8, 12 and 24 slower)
PREFETCH_ENTRIES = 16
PREFETCH_LINES = 64
PREFETCH_MAX_ENTRIES = 32


#: the rows are prefetched into L2 (``prefetcht1``), not L1: 16 rows of 8 lines ahead (SpMM K=128) are 128 lines,
#: a quarter of a 32 KiB L1, evicting the lines the tile is reading. Measured by hand (the register tile's loop,
#: AMD EPYC Zen 4, 2 threads, interleaved medians, the L3 flushed before each call / warm): power-law 100k K=128
#: 36.4 -> 25.0 ms, uniform 20k K=128 3.07 -> 2.74 / 2.64 -> 2.42 ms; K=64 power-law 11.8 -> 10.2 / 11.4 -> 10.4
#: ms, uniform 1.56 -> 1.31 / 0.75 -> 0.75 ms; K=32 power-law 5.39 -> 4.96 / 4.74 -> 4.64 ms, uniform 0.64 -> 0.56
#: / 0.40 -> 0.42 ms (the one case it loses, warm); SDDMM's entries (K=64) uniform 1.53 -> 1.33 / 0.85 -> 0.88
#: ms, power-law 13.9 -> 13.7 / 12.5 -> 12.0 ms. `python -m benchmarks --only spmm,sddmm` (T0 -> T1): SpMM
#: uniform K=128 2.44 -> 2.04 ms, power-law K=128 35.1 -> 29.7, K=32 3.71 -> 3.74, uniform K=32 0.53 -> 0.57;
#: SDDMM uniform 1.84 -> 1.56, power-law 15.6 -> 12.7 ms
PREFETCH_LOCALITY = 2


def prefetch_distance(row_bytes: int) -> int:
    """Entries ahead for dense rows of ``row_bytes`` read at each entry (see ``PREFETCH_LINES``)."""
    lines = max(1, -(-row_bytes // 64))
    return min(max(PREFETCH_ENTRIES, PREFETCH_LINES // lines), PREFETCH_MAX_ENTRIES)


def indirect_names(entry, lets) -> set:
    """The names of the nest items ``lets`` (of one entry, the loop variable ``entry``) whose values are read
    through an array at a position that follows from the entry (a coordinate, and what is computed from it)."""
    found = {entry.name}  # variables that follow from the entry, and those read through an array
    indirect = set()
    for it in lets:
        if it[0] == "let" and L.uses(it[2]) & (found | indirect):
            (indirect if any(L.loads(it[2])) or L.uses(it[2]) & indirect else found).add(it[1].name)
    return indirect


def prefetch_ahead(pre, kept, value, bv, T):
    """Prefetches of the dense rows the register tile will read ``prefetch_distance`` entries later (SpMM: the row
    of X at a later entry's column), one per 64-byte line of the tile's ``T`` columns; the later entry is clamped
    to the last entry of the whole loop nest (the innermost loop's bound with every enclosing loop at its last
    iteration), so its coordinate is read in bounds, and it crosses rows: the next rows' first entries are
    fetched while this row ends. Only where an entry's row is found through a loaded coordinate (a dense row in
    order needs no hint: the hardware prefetcher follows it). None where the tile has no such loop."""
    f = max((i for i, it in enumerate(kept) if it[0] == "for"), default=None)
    if f is None or kept[f][4] is not None or not PREFETCH_ENTRIES:
        return None
    _, pv, _, hi, _ = kept[f]
    per_entry = kept[f + 1:]
    if any(it[0] == "if" for it in per_entry):
        return None
    indirect = indirect_names(pv, per_entry)
    rows = [(ld.array, ld.index, ld.type) for ld in L.loads(value)
            if L.depends(ld.index, bv.name) and L.uses(ld.index) & indirect]
    if not rows:
        return None
    last = {}
    for it in pre + kept[:f]:
        if it[0] == "for":
            last[it[1].name] = L.substitute(L.binary("sub", it[3], L.Const(1)), last)
        elif it[0] == "let":
            last[it[1].name] = L.substitute(it[2], last)
    end = L.substitute(hi, last)
    ahead = prefetch_distance(T * max(L.TO_TORCH[t].itemsize for _, _, t in rows))
    later = {pv.name: L.binary("min", L.binary("add", pv, L.Const(ahead)), L.binary("sub", end, L.Const(1)))}
    for it in per_entry:
        later[it[1].name] = L.substitute(it[2], later)
    later[bv.name] = L.Const(0)
    out = []
    for array, index, t in dict.fromkeys(rows):
        at, line = L.substitute(index, later), 64 // L.TO_TORCH[t].itemsize
        out += [L.Prefetch(array, L.binary("add", at, L.Const(k)), PREFETCH_LOCALITY) for k in range(0, T, line)]
    return out

