"""``F.linear`` with a sparse weight: the weight's arrays bound to the kernel family of ``compiler.weights``.

``applies(weight, x)`` says whether the family serves a product (a CSR, BSR or n:m weight on the CPU, values of
the activation's float type); ``linear(weight, x, bias)`` runs it, ``x`` (tokens x in) row-major in, the result
(tokens x out) row-major out. Kernels are generated per plan (``compiler.weights.Tiles``: the format, types, the
tile shape the target's vectors and the token count pick, the epilogue) and kept.
"""
from __future__ import annotations

import functools

import torch

from .. import loopir as L
from ..compiler import weights as family
from ..compiler.caches import cache
from ..compiler.codegen import cpp
from ..compiler.target import CPU
from ..formats import named
from ..formats.format import nm_size
from ..sparse_tensor import SparseTensor

_KERNELS = cache("weights", "kernels of the dense-activation x sparse-weight family per plan")
#: the float types the family computes in (16-bit values widened in the panel and at each weight)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: work items per thread at least, where the token tiles are fewer: the rows are split into chunks
ITEMS_PER_THREAD = 4


def kind_of(weight: SparseTensor):
    """``(kind, block, group)`` of a weight the family reads, else None."""
    return _kind(weight._format)


@functools.lru_cache(maxsize=256)
def _kind(fmt):
    """(``kind_of``, once per format: naming a format builds the named ones to compare with)"""
    name = named.name_of(fmt)
    if name == "csr":
        return "csr", (1, 1), (1, 1)
    if name and name.startswith("bsr"):
        return "bsr", named.block_size(fmt), (1, 1)
    nm = nm_size(fmt)
    if nm is not None:
        return "nm", (1, 1), nm
    return None


def applies(weight, x) -> bool:
    """Whether ``linear(weight, x)`` runs here: a 2-d sparse weight the family reads, whose values are a plain
    tensor of ``x``'s float dtype, both on the CPU (BSR: its blocks tiling the shape)."""
    if type(weight) is not SparseTensor or type(x) is not torch.Tensor or x.dim() != 2:
        return False
    vals = weight.__dict__.get("_vals")
    if type(vals) is not torch.Tensor or vals.dtype != x.dtype or x.dtype not in DTYPES or \
            vals.device.type != "cpu" or x.device.type != "cpu" or len(weight._shape) != 2:
        return False
    kind = kind_of(weight)
    if kind is None or not family.serves(CPU, kind[0], x.shape[0]):
        return False
    if kind[0] == "bsr":
        (bh, bw), (o, i) = kind[1], weight._shape
        return o % bh == 0 and i % bw == 0
    return True


def plan_for(weight: SparseTensor, tokens: int, bias: bool, activation=None, transposed=False) -> family.Tiles:
    kind, block, group = kind_of(weight)
    levels = [lv for lv in weight._levels if lv.arrays()]
    arrays = levels[-1].arrays()
    ptype = L.type_of(arrays["pos"].dtype) if "pos" in arrays else "i64"
    vtype = L.type_of(weight._vals.dtype)
    return family.tiles(CPU, kind, tokens, vtype, vtype, ptype, L.type_of(arrays["crd"].dtype), block, group,
                        bias, activation, transposed)


def _kernel(plan: family.Tiles):
    entry = _KERNELS.get(plan)
    if entry is None:
        kernel = family.backward_input(plan) if plan.transposed else family.forward(plan)
        entry = _KERNELS[plan] = (kernel, cpp.load(kernel))
    return entry


def _split(plan: family.Tiles, n: int, rows: int, threads: int) -> tuple:
    """``(chunks, row_chunk)``: the output rows in chunks of whole store blocks, enough of them that the work items
    (token tiles x chunks) keep every thread busy."""
    tiles = -(-n // plan.T)
    if plan.transposed or tiles >= ITEMS_PER_THREAD * threads or threads == 1:
        return 1, max(rows, 1)
    chunks = -(-ITEMS_PER_THREAD * threads // tiles)
    row_chunk = -(-rows // chunks)
    row_chunk = -(-row_chunk // plan.rows) * plan.rows
    return -(-rows // row_chunk) if rows else 1, max(row_chunk, plan.rows)


def linear(weight: SparseTensor, x: torch.Tensor, bias=None, activation=None) -> torch.Tensor:
    """``act(x @ weight.T + bias)``, ``x`` 2-d (tokens x in): a new row-major tensor (tokens x out)."""
    x = x.contiguous()
    n, n_in = x.shape
    n_out = weight._shape[0]
    plan = plan_for(weight, n, bias is not None, activation)
    kernel, loaded = _kernel(plan)
    y = torch.empty(n, n_out, dtype=x.dtype)
    if n == 0 or n_out == 0:
        return y
    threads = torch.get_num_threads()
    chunks, row_chunk = _split(plan, n, n_out, threads)
    arrays = [lv for lv in weight._levels if lv.arrays()][-1].arrays()
    args = {"crd": arrays["crd"], "vals": weight._vals, "x": x, "y": y, "n": n, "n_in": n_in, "n_out": n_out,
            "groups": n_in // plan.group[1], "chunks": chunks, "row_chunk": row_chunk, "nthreads": threads}
    if "pos" in arrays:
        args["pos"] = arrays["pos"]
    if bias is not None:
        args["bias"] = bias.to(x.dtype).contiguous()
    cpp.call(kernel, loaded, args)
    return y
