"""On a GPU: ops on CUDA tensors run generated CUDA kernels (or a measured library call) and equal dense torch
on the same device; gradients flow; ``.to("cuda")`` moves every level. Skipped without a GPU: the same kernels
are run by the CPU emulation and compiled to PTX in ``tests/compiler/test_cuda.py``.
"""
from __future__ import annotations

import pytest
import torch

import scorch
from scorch.compiler import pipeline

from conftest import assert_matches_dense, quarters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA GPU here (torch.cuda.is_available() is False); the CUDA kernels are"
                                       " checked without one by tests/compiler/test_cuda.py")

FORMATS = ["csr", "csc", "coo", "dcsr", "ell", "bsr(2, 2)", "dia"]


def sparse(shape, density, fmt, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(-4, 5, shape, generator=g) * (torch.rand(shape, generator=g) < density)).to(dtype) / 4
    return x.cuda(), scorch.asformat(x, fmt).cuda()


def test_to_cuda_moves_every_level():
    x, s = sparse((6, 8), 0.4, "csr")
    assert s.device.type == "cuda" and s.values().device.type == "cuda"
    for lvl in s.levels:
        for a in (lvl.pos, lvl.crd):
            assert a is None or a.device.type == "cuda"
    back = s.cpu()
    assert back.device.type == "cpu" and torch.equal(back.to_dense(), x.cpu())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eq", ["ij,jk->ik", "ij,j->i", "ij,ik,jk->ij", "ij->i", "ij->j", "ij->", "ij,ij->ij",
                                "ij->ji", "ki,ij->kj"])
def test_einsum_on_gpu_matches_dense(fmt, dtype, eq):
    for shape, density in [((0, 5), 0.5), ((33, 17), 0.3), ((64, 200), 0.05), ((16, 16), 1.0)]:
        x, s = sparse(shape, density, fmt, dtype)
        m, n = shape
        dense = {"ij,jk->ik": [torch.randn(n, 40, dtype=dtype, device="cuda")],
                 "ij,j->i": [torch.randn(n, dtype=dtype, device="cuda")],
                 "ij,ik,jk->ij": [torch.randn(m, 24, dtype=dtype, device="cuda"),
                                  torch.randn(n, 24, dtype=dtype, device="cuda")],
                 "ij,ij->ij": [torch.randn(m, n, dtype=dtype, device="cuda")],
                 "ki,ij->kj": [torch.randn(7, m, dtype=dtype, device="cuda")]}.get(eq, [])
        ops = [s] + dense if eq != "ki,ij->kj" else dense + [s]
        dense_ops = [x] + dense if eq != "ki,ij->kj" else dense + [x]
        r = scorch.einsum(eq, *ops)
        got = r.to_dense() if isinstance(r, scorch.SparseTensor) else r
        assert got.device.type == "cuda"
        assert_matches_dense(got, torch.einsum(eq, *dense_ops))


def _quarters(shape, fmt, dtype, seed, density=0.4):
    """(float32 values on the GPU, the sparse tensor of them in ``dtype``): quarters in [-2, 2], whose products and
    sums are exact in float32 but not in 16 bits (``tests/ops/test_half.py``)."""
    a = quarters(shape, seed, density)
    return a.cuda(), scorch.asformat(a.to(dtype), fmt).cuda()


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc", "dcsr"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("eq", ["ij,jk->ik", "ij,j->i", "ij,ik,jk->ij", "ij->i", "ij->j", "ij->", "ij,ij->ij",
                                "ij,i->j"])
def test_16_bit_einsum_on_gpu_is_float32_rounded_once(fmt, dtype, eq):
    """bf16 and f16 operands: the CUDA kernels compute in float32 and round each result once (to nearest even),
    whether they store it directly or add into a float32 buffer rounded after the kernel (COO, x^T A). (SDDMM only
    where it is sparse enough for its kernel: a denser one takes a dense 16-bit product first, rounded twice.)"""
    for shape, density, seed in [((33, 17), 0.3, 0), ((200, 150), 0.03, 1), ((0, 5), 0.5, 2)]:
        if eq == "ij,ik,jk->ij" and density > 0.05:
            continue
        a, s = _quarters(shape, fmt, dtype, seed, density)
        m, n = shape
        g = torch.Generator().manual_seed(seed + 10)
        dense = {"ij,jk->ik": [(n, 40)], "ij,j->i": [(n,)], "ij,ik,jk->ij": [(m, 40), (n, 40)], "ij,ij->ij": [(m, n)],
                 "ij,i->j": [(m,)]}.get(eq, [])
        dense = [(torch.randint(-8, 9, d, generator=g) / 4).cuda() for d in dense]
        r = scorch.einsum(eq, s, *[x.to(dtype) for x in dense])
        got = r.to_dense() if isinstance(r, scorch.SparseTensor) else r
        assert got.device.type == "cuda" and got.dtype == dtype
        assert torch.equal(got, torch.einsum(eq, a, *dense).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_sums_accumulate_in_float32_on_gpu(dtype):
    """1024 and 32 quarters: 1032 in float32 and in both 16-bit types, 1024 if summed in 16 bits."""
    a = torch.full((5, 33), 0.25, device="cuda")
    a[:, 0] = 1024
    for m in (a, a.flip(1)):
        for fmt in ("csr", "coo"):
            s = scorch.asformat(m.to(dtype), fmt)
            ones = torch.ones(33, 40, dtype=dtype, device="cuda")
            assert torch.equal(scorch.einsum("ij,jk->ik", s, ones), (m @ ones.float()).to(dtype))
            assert torch.equal(scorch.einsum("ij->i", s), m.sum(1).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_spgemm_and_add_on_gpu(dtype):
    a, s = _quarters((50, 40), "csr", dtype, 1, 0.1)
    b, t = _quarters((40, 30), "csr", dtype, 2, 0.1)
    c, u = _quarters((50, 40), "csr", dtype, 3, 0.1)
    assert torch.equal((s @ t).to_dense(), (a @ b).to(dtype))
    assert torch.equal((s + u).to_dense(), (a + c).to(dtype))


@pytest.mark.parametrize("fa,fb", [("csr", "csr"), ("csr", "csc"), ("coo", "csr")])
def test_spgemm_and_add_on_gpu(fa, fb):
    x, a = sparse((50, 40), 0.1, fa, seed=1)
    y, b = sparse((40, 30), 0.1, fb, seed=2)
    assert_matches_dense(scorch.einsum("ij,jk->ik", a, b), x @ y)
    z, c = sparse((50, 40), 0.1, fb, seed=3)
    assert_matches_dense(a + c, x + z)


def test_gpu_path_is_explained():
    x, s = sparse((64, 64), 0.1, "csr")
    text = scorch.explain("ij,jk->ik", s, torch.randn(64, 32, device="cuda"))
    assert "target:       CUDA;" in text and "path:" in text


def test_training_on_gpu():
    """A sparse weight on the GPU: forward, backward, SGD; the gradient on the pattern equals the dense one."""
    x, w = sparse((32, 16), 0.3, "csr")
    w = torch.nn.Parameter(w)
    inp = torch.randn(16, 8, device="cuda")
    loss = (w @ inp).pow(2).sum()
    loss.backward()
    xd = x.clone().requires_grad_()
    (xd @ inp).pow(2).sum().backward()
    mask = x != 0
    assert isinstance(w.grad, scorch.SparseTensor) and w.grad.device.type == "cuda"
    torch.testing.assert_close(w.grad.to_dense(), xd.grad * mask)
    torch.optim.SGD([w], lr=0.1).step()


def test_mixed_devices_are_refused():
    _, s = sparse((4, 4), 0.5, "csr")
    with pytest.raises(ValueError, match="same device"):
        scorch.einsum("ij,jk->ik", s, torch.ones(4, 2))


def test_kernels_are_cached_per_device_arch():
    _, s = sparse((20, 20), 0.2, "csr")
    scorch.einsum("ij,j->i", s, torch.ones(20, device="cuda"))
    keys = [k for k, _ in pipeline.compiled_plans() if k[-1] == "cuda"]
    assert keys
