"""bfloat16 and float16 values: every op family against dense torch in float32.

The kernels keep 16-bit values in memory and compute in float32, rounding once when they store a result. Values
here are multiples of 1/4 small enough that every product and sum is exact in float32, so the result must equal
the float32 reference rounded to the 16-bit type: a kernel that accumulated in 16 bits (rounding at every step)
or computed through another type would differ.
"""
from __future__ import annotations

import pytest
import torch

import scorch
from scorch import SparseTensor

from conftest import quarters

DTYPES = [torch.bfloat16, torch.float16]
FORMATS = ["csr", "csc", "coo", "dcsr", "ell", "dia", "bsr(2, 2)"]
SHAPES = [(6, 8), (0, 8), (1, 1), (37, 29)]


def _dense(r):
    return r.to_dense() if isinstance(r, SparseTensor) else r


def _check(result, ref32, dtype):
    got = _dense(result)
    assert got.dtype == dtype, (got.dtype, dtype)
    assert tuple(got.shape) == tuple(ref32.shape)
    assert torch.equal(got, ref32.to(dtype)), (got, ref32)


def _pair(shape, fmt, dtype, seed=0, density=0.4):
    a = quarters(shape, seed, density, torch.float32).to(dtype)
    return scorch.asformat(a, fmt), a.float()


OPS = {
    "spmm": (lambda s, x: s @ x, lambda a, x: a @ x, lambda m, n, g: torch.randint(-4, 5, (n, 5), generator=g) / 4),
    "spmv": (lambda s, x: s @ x, lambda a, x: a @ x, lambda m, n, g: torch.randint(-4, 5, (n,), generator=g) / 4),
    "t-spmm": (lambda s, x: s.t() @ x, lambda a, x: a.t() @ x,
               lambda m, n, g: torch.randint(-4, 5, (m, 3), generator=g) / 4),
    "mul-dense": (lambda s, x: s * x, lambda a, x: a * x, lambda m, n, g: torch.randint(-4, 5, (m, n), generator=g) / 4),
    "sum": (lambda s, x: s.sum(), lambda a, x: a.sum(), None),
    "sum-rows": (lambda s, x: s.sum(1), lambda a, x: a.sum(1), None),
    "sum-cols": (lambda s, x: s.sum(0), lambda a, x: a.sum(0), None),
    "relu": (lambda s, x: torch.relu(s), lambda a, x: torch.relu(a), None),
    "scale": (lambda s, x: s * 0.5, lambda a, x: a * 0.5, None),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_op_matches_float32_rounded_once(op, shape, fmt, dtype):
    s, a = _pair(shape, fmt, dtype)
    fn, ref, make = OPS[op]
    g = torch.Generator().manual_seed(1)
    x = make(*shape, g) if make else None
    got = fn(s, None if x is None else x.to(dtype))
    _check(got, ref(a, x), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["csr", "coo", "csc"])
@pytest.mark.parametrize("shape", [(6, 8), (37, 29), (0, 4)], ids=str)
def test_sparse_by_sparse(fmt, shape, dtype):
    """Co-iteration: the sum and the elementwise product of two patterns, and the product (SpGEMM)."""
    s, a = _pair(shape, fmt, dtype, seed=2)
    t, b = _pair(shape, fmt, dtype, seed=3)
    u, c = _pair(shape[::-1], fmt, dtype, seed=4)
    _check(s + t, a + b, dtype)
    _check(s * t, a * b, dtype)
    _check(s @ u, a @ c, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_sddmm(fmt, dtype):
    s, a = _pair((23, 19), fmt, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randint(-4, 5, (23, 8), generator=g) / 4, torch.randint(-4, 5, (19, 8), generator=g) / 4
    got = scorch.einsum("ij,ik,jk->ij", s, x.to(dtype), y.to(dtype))
    _check(got, a * (x @ y.t()), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("src,dst", [("csr", "csc"), ("coo", "csr"), ("csr", "coo"), ("csr", "ell"), ("csr", "dcsr"),
                                     ("csc", "bsr(2, 2)"), ("dia", "csr")])
def test_conversions_keep_the_values(src, dst, dtype):
    s, a = _pair((17, 13), src, dtype, seed=7)
    r = scorch.asformat(s, dst)
    assert isinstance(r, SparseTensor) and r.dtype == dtype
    _check(r, a, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients(dtype):
    """Backward of S @ X: the values' and the dense operand's gradients, in the 16-bit type."""
    a = quarters((9, 7), 8, 0.5, torch.float32)
    g = torch.Generator().manual_seed(9)
    x = torch.randint(-4, 5, (7, 4), generator=g) / 4
    s = scorch.asformat(a.to(dtype), "csr").requires_grad_()
    xs = x.to(dtype).requires_grad_()
    (s @ xs).float().sum().backward()
    ad, xd = a.clone().requires_grad_(), x.clone().requires_grad_()
    (ad @ xd).sum().backward()
    assert s.grad.dtype == dtype and xs.grad.dtype == dtype
    _check(s.grad.to_dense(), ad.grad * (a != 0), dtype)
    _check(xs.grad, xd.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_dense_step_inside_a_contraction_is_not_rounded(dtype):
    """``S * (A @ B)`` planned as a dense torch step then a sparse kernel: the dense step on 16-bit operands runs
    in float32 and the result is rounded once. With integer A and B the product is exact in float32 and beyond
    the 16-bit types' integers, so a 16-bit intermediate rounded first shows."""
    g = torch.Generator().manual_seed(7)
    # (a long inner dimension and a dense pattern: the planner's dense step, see contract.DENSE_DISCOUNT)
    a = torch.randint(-64, 65, (24, 256), generator=g).to(dtype)
    b = torch.randint(-64, 65, (256, 20), generator=g).to(dtype)
    keep = torch.rand(24, 20, generator=g) < 0.9
    s = scorch.asformat(keep.to(dtype) * 0.375, "csr")
    assert "dense step" in scorch.explain("ij,ik,kj->ij", s, a, b, file=open("/dev/null", "w"))
    got = scorch.einsum("ij,ik,kj->ij", s, a, b)
    assert got.dtype == dtype
    assert torch.equal(got.to_dense(), (0.375 * (a.float() @ b.float())).to(dtype) * keep)
    a.requires_grad_(True)
    scorch.einsum("ij,ik,kj->ij", s, a, b).values().float().sum().backward()
    torch.testing.assert_close(a.grad.float(), (0.375 * keep.float()) @ b.float().T, rtol=1e-2, atol=0)


def test_bf16_sparse_linear_trains_with_adamw():
    torch.manual_seed(0)
    m = scorch.nn.SparseLinear(32, 16, density=0.3, format="csr").to(torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x, target = torch.randn(64, 32).bfloat16(), torch.randn(64, 16).bfloat16()
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = ((m(x) - target).float() ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert m.weight.dtype == torch.bfloat16 and isinstance(m.weight, SparseTensor)
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_sums_accumulate_in_float32(fmt, dtype):
    """1024 followed by 32 quarters sums to 1032, which both 16-bit types hold; added one step at a time in 16
    bits it stays 1024 (1024 + 0.25 rounds back to 1024). So each sum below must be 1032, whichever way the kernel
    walks the entries."""
    a = torch.full((5, 33), 0.25)
    a[:, 0] = 1024
    for m in (a, a.flip(1)):
        s = scorch.asformat(m.to(dtype), fmt)
        ones = torch.ones(33, dtype=dtype)
        _check(s @ ones, m @ torch.ones(33), dtype)
        _check(s @ ones.unsqueeze(1).repeat(1, 4), m @ torch.ones(33, 4), dtype)
        _check(s.sum(1), m.sum(1), dtype)
        _check(s.t().sum(0), m.sum(1), dtype)
        st = scorch.asformat(m.t().contiguous().to(dtype), fmt)
        _check(st.t() @ ones, m @ torch.ones(33), dtype)
        _check(st.sum(0), m.sum(1), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["csr", "bsr(2, 2)", "coo", "csc"])
@pytest.mark.parametrize("cols", [16, 32, 64, 48])
def test_spmm_in_vector_tiles(fmt, cols, dtype):
    """Dense operands whose row length is a multiple of a vector's lanes: the kernel reads them and writes the
    output as float vectors (widened and rounded 16 lanes at a time). The sums are exact in float32 but need more
    bits than the 16-bit types hold, so they check that the vector rounding is the scalar one (to nearest, ties to
    even)."""
    s, a = _pair((26, 18), fmt, dtype, seed=10)
    g = torch.Generator().manual_seed(11)
    x = torch.randint(-64, 65, (18, cols), generator=g) / 8
    _check(s @ x.to(dtype), a @ x, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["csr", "coo"])
@pytest.mark.parametrize("k", [16, 32, 48])
def test_sddmm_in_vector_tiles(fmt, k, dtype):
    """SDDMM (``sampled_addmm``, one kernel) with a row length of whole vectors: dot products over widened
    vectors, sums exact in float32, rounded once. (A three-operand einsum may instead take a dense step first,
    whose 16-bit result torch rounds as its own; then the result is rounded twice, as in torch.)"""
    s, a = _pair((200, 150), fmt, dtype, seed=12, density=0.03)  # (sparse enough for the SDDMM kernel)
    g = torch.Generator().manual_seed(13)
    x, y = torch.randint(-64, 65, (200, k), generator=g) / 8, torch.randint(-64, 65, (150, k), generator=g) / 8
    got = torch.sparse.sampled_addmm(s, x.to(dtype), y.t().to(dtype), beta=0)
    _check(got, (a != 0) * (x @ y.t()), dtype)


@pytest.mark.parametrize("dtype, vectors, paired", [(torch.bfloat16, 4, True), (torch.float16, 4, False),
                                                    (torch.bfloat16, 3, False)])
def test_bfloat16_tiles_in_lane_pairs(dtype, vectors, paired):
    """A bfloat16 register tile reads two vectors' values as one vector of 32-bit words (even elements in the
    low halves, odd ones in the high) when every vector loop runs whole pairs and touches only bfloat16 memory;
    float16 (converted by the CPU) and rows of an odd number of vectors keep the lanes in order. Either way the
    result is the float32 one rounded once. (Rows are counted in this machine's vectors: the rule is the same
    whatever their width, ``SCORCH_VECTOR_BYTES``.)"""
    from scorch.compiler.target import CPU
    cols = vectors * CPU.lanes("f32")
    s, a = _pair((40, 30), "csr", dtype, seed=14)
    g = torch.Generator().manual_seed(15)
    x = torch.randint(-64, 65, (30, cols), generator=g) / 8
    src = scorch.explain("ij,jk->ik", s, x.to(dtype), source=True)
    assert ("scorch_widen_pair(&" in src) == paired, src
    _check(s @ x.to(dtype), a @ x, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mean_sums_in_float32(fmt, dtype):
    """A 16-bit mean is summed and divided in float32, then rounded once, as torch's: the float16 sum of 256
    entries of 300 overflows where their mean does not (it gave inf)."""
    a = torch.full((16, 16), 300.0, dtype=dtype)
    a[3, :5] = 0  # implicit zeros in the count
    s = scorch.asformat(a, fmt)
    for dims in (None, 0, 1, (0, 1)):
        got = s.mean() if dims is None else s.mean(dims)
        got = got.to_dense() if isinstance(got, SparseTensor) else got
        want = a.mean() if dims is None else a.mean(dims)
        assert got.dtype == dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(s.mean(dtype=torch.float32), a.mean(dtype=torch.float32))


def test_torch_sparse_sum_takes_dtype_by_keyword():
    """``torch.sparse.sum(S, dtype=...)`` passes ``dtype`` to ``torch._sparse_sum`` by keyword (it raised TypeError)."""
    a = torch.eye(3, dtype=torch.bfloat16)
    s = scorch.asformat(a, "csr")
    got = torch.sparse.sum(s, dtype=torch.float32)
    assert got.dtype == torch.float32 and got.item() == 3.0
    per_row = torch.sparse.sum(s, 0, dtype=torch.float32)
    assert per_row.dtype == torch.float32
    torch.testing.assert_close(per_row.to_dense(), a.float().sum(0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sampled_addmm_of_mixed_dtypes_promotes(dtype):
    """16-bit S with float32 A and B: the float32 result scorch's products give for mixed dtypes (it was rounded to
    S's dtype, silently); float32 S with 16-bit A and B was float32 already."""
    s = scorch.asformat(torch.eye(3, dtype=dtype), "csr")
    a, b = torch.full((3, 2), 1.001), torch.ones(2, 3)
    got = torch.sparse.sampled_addmm(s, a, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.to_dense(), torch.eye(3) * (1 + 2.002))
    assert torch.sparse.sampled_addmm(s, a.to(dtype), b.to(dtype)).dtype == dtype
    assert torch.sparse.sampled_addmm(scorch.asformat(torch.eye(3), "csr"), a.to(dtype), b.to(dtype)).dtype == torch.float32
