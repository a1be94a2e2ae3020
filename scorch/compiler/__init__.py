"""The tensor-algebra compiler (DESIGN.md section 3): operand types in, a plan with a loaded kernel out
(``pipeline``). It knows formats (``scorch.formats``) and the loop IR (``scorch.loopir``), never tensors: the
execution layer above it (``scorch.engine``) binds tensors to plans. The stages, in the order a call meets them:

1. ``einsum.parse``: the equation, checked against its grammar, as index letters per operand.
2. ``ir``: index notation (``Assignment`` of an ``IndexExpr`` over typed operand placeholders).
3. ``contract``: for three or more operands, the contraction tree (fused kernels vs pairwise steps).
4. ``infer``: the output format, by the rules documented there and in docs/format-inference.md.
5. ``schedule``: loop order, parallel loop, workspaces, specialized extents (``Schedule`` for one sparse
   operand, ``CoSchedule`` for several).
6. ``lower`` (one sparse operand, its levels drive the loops) or ``coiterate`` (several, merged by index
   variable through ``lattice``): a ``loopir.Kernel``, through the level capability interface only.
7. ``interp`` runs a kernel in NumPy (the reference semantics); for a GPU, ``mapping`` decides how the loops map
   to warps, lanes and threads; ``codegen.cpp`` renders a kernel as C++, ``codegen.cuda`` as CUDA (carrying the
   mapping out). ``target`` describes what lowering may assume of the machine (vector width).
8. ``runtime``: compile once (g++, or nvcc for a GPU), cache in memory and on disk, load through ctypes.
9. ``pipeline``: the stages above in one line, with the plan caches (``caches``: every memo table's owner);
   ``library`` names a vendor call computing the same assignment (cuSPARSE, chosen by measurement on a GPU).

``torch.compiler`` shares this package's name, so its names are forwarded here: under
``import scorch as torch``, ``torch.compiler.disable`` stays torch's own.
"""
import torch.compiler as _torch_compiler


def __getattr__(name):  # (the compiler package imports nothing of scorch outside it: no scorch._forward here)
    try:
        return getattr(_torch_compiler, name)
    except AttributeError:
        raise AttributeError(f"module 'scorch.compiler' has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(dir(_torch_compiler)))
