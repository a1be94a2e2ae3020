"""16-bit values summed in 16 bits, narrow index arrays and padded formats (stop 39's probing against dense torch):
norms and the torch-ops softmax of bfloat16 / float16 values, boolean maps of ELL / n:m, the sparse softmax of int8
and int16 indexed tensors, and conversions to n:m from formats that store zeros."""
import pytest
import torch

import scorch
from scorch.ops import segment


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norms_of_16_bit_values_sum_as_torch_does(dtype):
    """4 x 3000 values near 1: the 1-norm summed in bfloat16 stopped at 512 (torch: 12032)."""
    g = torch.Generator().manual_seed(0)
    d = (torch.rand(4, 3000, generator=g) + 0.5).to(dtype)
    s = scorch.asformat(d, "csr")
    for got, ref in ((s.norm(1), d.norm(1)), (s.norm(), d.norm()),
                     (torch.linalg.vector_norm(s, 2, dim=1), torch.linalg.vector_norm(d, 2, dim=1)),
                     (torch.linalg.matrix_norm(s, 1), torch.linalg.matrix_norm(d, 1))):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("log", [False, True])
def test_torch_ops_softmax_of_16_bit_values(dtype, log):
    """``forward_ops`` / ``backward_ops`` (the GPU's softmax, and the CPU's double backward) summed a segment's
    exponentials in 16 bits: a 4000-entry bfloat16 row's softmax summed to 15.6."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=g)
    pos = torch.tensor([0, 4000])
    y = segment.forward_ops(x.to(dtype), pos, log)
    ref = torch.log_softmax(x, 0) if log else torch.softmax(x, 0)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=1e-5)
    dy = torch.randn(4000, generator=g)
    got = segment.backward_ops(ref.to(dtype), dy.to(dtype), pos, log)
    want = segment.backward_ops(ref, dy, pos, log)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize("fmt", ["ell", "nm(2, 4)"])
@pytest.mark.parametrize("name", ["isnan", "isinf", "isposinf", "isneginf", "signbit"])
def test_boolean_maps_of_padded_formats_are_bool(fmt, name):
    d = torch.tensor([[1.0, 0.0, -float("inf"), 0.0], [0.0, float("nan"), 0.0, -2.0]])
    r = getattr(torch, name)(scorch.asformat(d, fmt))
    assert r.dtype == torch.bool
    assert torch.equal(r.to_dense(), getattr(torch, name)(d))


@pytest.mark.parametrize("fmt", ["csr", "dcsr", "csc", "coo"])
@pytest.mark.parametrize("index_dtype", [torch.int8, torch.int16])
@pytest.mark.parametrize("log", [False, True])
def test_sparse_softmax_with_narrow_indices(fmt, index_dtype, log):
    """int8 / int16 index arrays reached the segment kernel, which takes int32 / int64 positions: a TypeError."""
    g = torch.Generator().manual_seed(2)
    d = torch.randn(6, 9, generator=g) * (torch.rand(6, 9, generator=g) < 0.5)
    s = scorch.asformat(d, fmt, index_dtype=index_dtype)
    ref = scorch.asformat(d, fmt)
    fn = torch.sparse.log_softmax if log else torch.sparse.softmax
    w, w_ref = s.detach().requires_grad_(), ref.detach().requires_grad_()
    got, want = fn(w, 1), fn(w_ref, 1)
    torch.testing.assert_close(got.to_dense(), want.to_dense())
    (got.to_dense() * torch.arange(9.0)).sum().backward()
    (want.to_dense() * torch.arange(9.0)).sum().backward()
    torch.testing.assert_close(w.grad.to_dense(), w_ref.grad.to_dense())


@pytest.mark.parametrize("src", ["bsr(2, 2)", "dia"])
def test_formats_storing_zeros_convert_to_n_m(src):
    """A 2:4 tensor in BSR or DIA stores zeros beside its entries; converting it to nm(2, 4) counted them: 'row 0
    has 4 nonzeros'."""
    d = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 3.0, 0.0, 4.0], [5.0, 6.0, 0.0, 0.0], [0.0, 0.0, 7.0, 0.0]])
    s = scorch.asformat(scorch.asformat(d, src), "nm(2, 4)")
    assert torch.equal(s.to_dense(), d)
    with pytest.raises(ValueError, match="nonzeros"):
        scorch.asformat(scorch.asformat(d + 1, src), "nm(2, 4)")
