"""Targets: what the passes before rendering know about the machine a kernel is generated for.

The lowering (``lower``) takes a ``Target`` and reads its facts from it, never from a renderer: whether it may
tile into explicit vectors (register and dot tiles) and how wide they are. ``name`` picks the renderer in the
pipeline: ``codegen.cpp`` for ``cpu``; for ``cuda``, the GPU mapping pass (``mapping``), then ``codegen.cuda``.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """``name``: ``"cpu"`` or ``"cuda"``. ``vector_bytes``: bytes of an explicit vector (``For.vector`` loops,
    the lowering's register and dot tiles); 0 where the target has none (CUDA maps the same plain inner loops
    to warp lanes instead: ``mapping``)."""
    name: str
    vector_bytes: int = 0
    #: whether a row sum's lead vectors (``For.lead``) may gather (``vectors.vector_sum``): see
    #: ``native_lead_gathers``
    lead_gathers: bool = True
    #: whether an n:4 weight's rows go in a vector's lanes (``compiler.weights_picks``): see ``native_lane_picks``
    lane_picks: bool = False
    #: matrix tiles for bfloat16 block products (``loopir.TileConfig``'s mode): "" none, "tiles" the CPU's (AMX,
    #: allowed and checked: ``engine.amx``), "model" the scalar model of them (tests)
    amx: str = ""

    @property
    def key(self) -> str:
        """What of the machine the generated code depends on, for the keys of plans kept on disk."""
        return f"v{self.vector_bytes}g{int(self.lead_gathers)}p{int(self.lane_picks)}" + \
            (f"x{self.amx}" if self.amx else "")

    @property
    def vectors(self) -> bool:
        """Whether the lowering may tile into explicit vectors."""
        return self.vector_bytes > 0

    def lanes(self, compute_type: str) -> int:
        """Elements of ``compute_type`` (``f32`` or ``f64``) in one explicit vector."""
        return self.vector_bytes // (4 if compute_type == "f32" else 8)

    def sum_lanes(self, compute_type: str) -> int:
        """Lanes of a row sum's vector (``vectors.vector_sum``): at most 32 bytes. On a 64-byte machine a row of
        ~20 entries in 16 lanes wastes most of its last gather, and 8-lane gathers are no slower per lane (SpMV,
        Intel Xeon with AVX-512: 8 lanes 4-8% faster, measured by hand)."""
        return min(self.vector_bytes, 32) // (4 if compute_type == "f32" else 8)


def native_vector_bytes() -> int:
    """The width of this machine's vector registers in bytes: 64 with AVX-512, 32 with AVX/AVX2, 16 otherwise
    (SSE, NEON); ``$SCORCH_VECTOR_BYTES`` (16, 32 or 64) overrides it. The register tiles are sized in these
    vectors: a tile of AVX-512-wide vectors on an AVX2 machine is split by GCC into twice as many registers as
    it has, and spills (SpMM 9x slower, measured on an AMD EPYC)."""
    forced = _forced("SCORCH_VECTOR_BYTES", ("16", "32", "64"))
    if forced:
        return int(forced)
    flags = cpu_flags()
    if flags is None:
        return 32
    return 64 if "avx512f" in flags else 32 if flags & {"avx2", "avx"} else 16


@functools.lru_cache(maxsize=None)
def cpu_flags():
    """This machine's CPU feature flags (``/proc/cpuinfo``'s ``flags``, ARM's ``Features``), a frozenset, or None
    where it lists none; read once (kernel choices ask per call)."""
    info = _cpuinfo()
    listed = info.get("flags", info.get("Features"))  # (x86; ARM)
    return None if listed is None else frozenset(listed.split())


def native_lead_gathers() -> bool:
    """Whether this machine's row sums gain from lead vectors that gather (SpMV's ``x[crd[p]]``): False on AMD
    CPUs, True elsewhere; ``$SCORCH_LEAD_GATHERS`` (0 or 1) overrides it. A lead vector runs whatever a row's
    length, its lanes past the row's end masked off, so that the row's branches are the same in every row. On an
    Intel Xeon (AVX-512) that saved the mispredicted loop exits (SpMV 10-12% faster); on an AMD EPYC (Zen 4,
    AVX-512) a masked gather costs about as much with its lanes off as on, and the same generated SpMV without
    them was faster: uniform 20k (rows of ~20) 155 -> 141 us and 151 -> 128, power-law 100k 1087 -> 1000 and
    1150 -> 1055, Cora 12.0 -> 11.6 (ctypes, interleaved medians, 2 threads; measured by hand). Lead vectors
    without gathers (contiguous row sums) stay on: there the power-law rows gained (518 -> 288 us, by hand)."""
    forced = _forced("SCORCH_LEAD_GATHERS", ("0", "1"))
    if forced:
        return forced == "1"
    return _cpuinfo().get("vendor_id") != "AuthenticAMD"


def native_lane_picks(vector_bytes: int) -> bool:
    """Whether this machine runs n:4 float32 weights with their rows in a vector's lanes, a token's group of 4
    features permuted into them (``compiler.weights_picks``): on AMD CPUs with 8-lane vectors (AVX2), where the
    permutes run beside the multiply-adds; ``$SCORCH_LANE_PICKS`` (0 or 1) overrides it. The other n:4 kernel
    (tokens in the lanes, a broadcast per stored value and a panel load per vector of tokens) is bound by its
    loads with 8 lanes: on an AMD EPYC Zen 3, 2:4 at BERT-base shapes ran level with dense. Off elsewhere: Intel
    cores run every permute on one port that a multiply-add also takes, and on AVX-512 the other kernel meets its
    goals (AMD Zen 4: 2:4 1.36-1.49x dense); neither measured with this kernel."""
    forced = _forced("SCORCH_LANE_PICKS", ("0", "1"))
    if forced:
        return forced == "1"
    return vector_bytes == 32 and _cpuinfo().get("vendor_id") == "AuthenticAMD"


def _forced(variable: str, allowed: tuple) -> str:
    """``$variable`` (stripped; "" where unset), refused by name unless one of ``allowed``."""
    forced = os.environ.get(variable, "").strip()
    if forced and forced not in allowed:
        raise ValueError(f"scorch: {variable} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {forced!r}")
    return forced


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> dict:
    """The fields of the first processor in ``/proc/cpuinfo`` (its lines up to the first blank one; {} where
    there is no such file), read once for every fact taken from it (``flags``, ``vendor_id``...)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, sep, value = line.partition(":")
                if sep:
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


#: the CPU: one machine vector register per explicit vector
CPU = Target("cpu", vector_bytes=native_vector_bytes(), lead_gathers=native_lead_gathers(),
             lane_picks=native_lane_picks(native_vector_bytes()))
#: a CUDA GPU (or its CPU emulation): no explicit vectors
CUDA = Target("cuda")
