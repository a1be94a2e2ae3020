"""Targets: what the passes before rendering know about the machine a kernel is generated for.

The lowering (``lower``) takes a ``Target`` and reads its facts from it, never from a renderer: whether it may
tile into explicit vectors (register and dot tiles) and how wide they are. ``name`` picks the renderer in the
pipeline: ``codegen.cpp`` for ``cpu``; for ``cuda``, the GPU mapping pass (``mapping``), then ``codegen.cuda``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """``name``: ``"cpu"`` or ``"cuda"``. ``vector_bytes``: bytes of an explicit vector (``For.vector`` loops,
    the lowering's register and dot tiles); 0 where the target has none (CUDA maps the same plain inner loops
    to warp lanes instead: ``mapping``)."""
    name: str
    vector_bytes: int = 0

    @property
    def vectors(self) -> bool:
        """Whether the lowering may tile into explicit vectors."""
        return self.vector_bytes > 0

    def lanes(self, compute_type: str) -> int:
        """Elements of ``compute_type`` (``f32`` or ``f64``) in one explicit vector."""
        return self.vector_bytes // (4 if compute_type == "f32" else 8)


#: the CPU: one AVX-512 register per explicit vector (GCC splits it where the machine's are narrower)
CPU = Target("cpu", vector_bytes=64)
#: a CUDA GPU (or its CPU emulation): no explicit vectors
CUDA = Target("cuda")
