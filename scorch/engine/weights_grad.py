"""The backward of ``F.linear`` with a sparse weight (``engine.weights``): the input gradient ``dX = dY @ W`` as the
forward kernel on the weight's transpose (CSR and n:m: the transposed pattern, BSR: the blocks transposed, each
made once per pattern, the values gathered into its order per call), and the gradient of the stored values
(``compiler.weights_grad``), both read and written row-major."""
from __future__ import annotations

import torch

from .. import loopir as L
from ..compiler import weights as family
from ..compiler import weights_grad as grads
from ..compiler import weights_picks as picks
from ..compiler.relayout import gather
from ..compiler.caches import register
from ..compiler.target import CPU
from ..formats.storage import PatternMemo, coordinates, padding
from ..sparse_tensor import SparseTensor
from . import weights as kernels
from .weights import NARROW_EXTENT, _arrays, _split, kind_of, plan_for

#: the transposed patterns of CSR and n:m weights (``_transposed``), by the weight's index arrays
_TRANSPOSED = PatternMemo(1024)
register("weight transposes", "CSR patterns of weights' transposes, with their values' permutation, by the"
         " weight's index arrays (the input gradient of a sparse-weight linear)", _TRANSPOSED.__len__,
         _TRANSPOSED.clear)


def _transposed(weight: SparseTensor) -> tuple:
    """``(pos, crd, perm)``: the CSR pattern of ``weight``'s transpose (in x out) and the permutation taking the
    weight's values to its order (without an n:m format's padding). Made once per pattern: a weight trained in
    place keeps its index arrays, so each backward pays one gather of the values."""
    def make():
        leaf, dims, inside = coordinates(weight._format, weight._shape, weight._levels)
        if weight._format.padded:
            inside &= ~padding(weight._format, weight._shape, weight._levels, weight._vals)
        leaf, rows, cols = leaf[inside], dims[0][inside], dims[1][inside]
        n_out, n_in = weight._shape
        order = torch.argsort(cols * max(n_out, 1) + rows, stable=True)
        itype = torch.int32 if max(leaf.numel(), n_out) < 2 ** 31 else torch.int64
        pos = torch.zeros(n_in + 1, dtype=torch.int64)
        pos[1:] = torch.bincount(cols, minlength=n_in).cumsum(0)
        crd = rows[order].to(torch.int16 if n_out <= NARROW_EXTENT else itype)
        return pos.to(itype), crd, leaf[order].to(itype)
    return _TRANSPOSED.lookup((weight._format, tuple(weight._shape)), weight._levels, make)


def _block_transposed(weight: SparseTensor) -> tuple:
    """``(pos, crd, perm)``: the BSR pattern of a BSR weight's transpose (in x out, blocks ``bw x bh``) and the
    permutation taking the weight's blocks to its order (each block then transposed: ``input_grad``), made once per
    pattern. The input gradient runs the forward kernel on it, as CSR's does (``_transposed``): 3072 x 768 and
    768 x 3072 BSR 16 x 16 at 90%, 1024 tokens, AVX2, 2 threads: 10-12 -> 6-7 ms, where scattering each block's
    columns into a panel of ``dx`` took the longer."""
    def make():
        arrays = _arrays(weight)
        pos, crd = arrays["pos"].long(), arrays["crd"].long()
        (bh, bw), (n_out, n_in) = kind_of(weight)[1], weight._shape
        rows = torch.repeat_interleave(torch.arange(pos.numel() - 1), pos.diff())
        order = torch.argsort(crd * max(n_out // bh, 1) + rows, stable=True)
        tpos = torch.zeros(n_in // bw + 1, dtype=torch.int64)
        tpos[1:] = torch.bincount(crd, minlength=n_in // bw).cumsum(0)
        return tpos.to(arrays["pos"].dtype), rows[order].to(arrays["crd"].dtype), order
    return _TRANSPOSED.lookup(("blocks", weight._format, tuple(weight._shape)), weight._levels, make)


def input_grad(weight: SparseTensor, dy: torch.Tensor) -> torch.Tensor:
    """``dy @ weight`` (tokens x out -> tokens x in), row-major: the input gradient of ``linear``, as the forward
    kernel on the weight's transpose: a CSR or n:m weight's transposed pattern (``_transposed``: each input feature's
    entries gathered, no read-modify-write of a panel per entry), a BSR weight's transposed blocks
    (``_block_transposed``); the values gathered into its order per call. A BSR weight below half a vector of tokens
    (where the forward kernel does not serve it) scatters whole blocks instead (``backward_input``)."""
    dy = dy.contiguous()
    n, (n_out, n_in) = dy.shape[0], weight._shape
    dx = torch.empty(n, n_in, dtype=dy.dtype)
    if n == 0 or n_in == 0:
        return dx
    kind, block, _ = kind_of(weight)
    if kind == "bsr" and not family.serves(CPU, kind, n):
        arrays = _arrays(weight)
        kernels._run("input_grad", plan_for(weight, n, False, transposed=True, arrays=arrays), weight._shape,
                     {**arrays, "vals": weight._vals}, n, 1, n_out, dy=dy, dx=dx)
        return dx
    if kind == "bsr":
        (bh, bw), (pos, crd, perm) = block, _block_transposed(weight)
        vals = weight._vals.view(-1, bh, bw).index_select(0, perm).transpose(1, 2).reshape(-1)
        block = (bw, bh)
    else:
        (pos, crd, perm), kind, block = _transposed(weight), "csr", (1, 1)
        vals = gather(weight._vals, perm)  # (a parallel loop: index_select's one thread was 12% of BERT's backward)
    plan = family.tiles(CPU, kind, n, L.type_of(weight._vals.dtype), L.type_of(dy.dtype), L.type_of(pos.dtype),
                        L.type_of(crd.dtype), block)
    kernels._run("forward", plan, (n_in, n_out), {"pos": pos, "crd": crd, "vals": vals}, n,
                 *_split(plan, n, n_in, torch.get_num_threads()), x=dy, y=dx)
    return dx


def block_columns(a: torch.Tensor, width: int) -> torch.Tensor:
    """``a`` (tokens x features, row-major) as strips of ``width`` features, each strip's tokens contiguous
    (strips x tokens x width): the layout ``block_weight_grad`` reads a block's columns of ``x`` and rows of ``dy``
    in, a token's slice after the last one's, where reading them in place strides a row's length from token to token
    (a page a token: 3072 x 768 BSR 16 x 16 at 90%, 1024 tokens, AVX2, 2 threads: 25 -> 10.9 ms)."""
    n, f = a.shape
    return a.view(n, f // width, width).transpose(0, 1).contiguous()


def weight_grad(weight: SparseTensor, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The gradient of ``linear``'s weight values: ``(dy^T @ x)`` at the stored positions (``weight``'s values'
    layout and dtype), summed in float32."""
    x, dy = x.contiguous(), dy.contiguous()
    n, n_out = x.shape[0], weight._shape[0]
    arrays = _arrays(weight)
    plan = plan_for(weight, n, False, arrays=arrays)
    if picks.grad_serves(CPU, plan.kind, plan.group, plan.vtype, plan.xtype) and n and n_out:
        return _picks_grad(weight, picks.planned(plan), arrays["crd"], x, dy)
    plan = grads.grad_tiles(plan, n)
    dw = torch.zeros(weight._vals.shape[0], dtype=torch.float32)
    if n and n_out:
        threads = torch.get_num_threads()
        rows = -(-n_out // threads) if threads > 1 else n_out
        rows = -(-rows // plan.rows) * plan.rows
        if grads.blocks_by_columns(plan):
            x, dy = block_columns(x, plan.block[1]), block_columns(dy, plan.block[0])
        kernels._run("weight_grad", plan, weight._shape, arrays, n, -(-n_out // rows), rows, x=x, dy=dy, dw=dw)
    return dw.to(weight._vals.dtype)


def _picks_grad(weight: SparseTensor, plan, crd: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """An n:4 weight's value gradient with its rows in a vector's lanes (``compiler.weights_picks.weight_grad``):
    ``dy``'s rows padded to whole blocks where they are not, the sums made in the blocks' layout (``lane_fields``)
    and put back in the values' order."""
    (n_out, n_in), lanes, k = weight._shape, plan.lanes, plan.group[0]
    groups, blocks = n_in // 4, -(-n_out // lanes)
    if blocks * lanes != n_out:
        dy = torch.nn.functional.pad(dy, (0, blocks * lanes - n_out))
    dw = torch.zeros(blocks * groups * k * lanes, dtype=torch.float32)
    threads = torch.get_num_threads()
    row_chunk = -(-blocks // threads) * lanes
    kernels._run("picks_dw", plan, (blocks * lanes, n_in), {"sel": kernels.lane_fields(weight, crd, lanes)}, x.shape[0],
                 -(-blocks * lanes // row_chunk), row_chunk, x=x, dy=dy, dw=dw)
    return kernels.lane_values(dw, n_out, lanes, groups * k).to(weight._vals.dtype)
