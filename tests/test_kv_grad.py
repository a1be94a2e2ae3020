"""The attention backward's ``dv = P^T g`` and ``dk = dS^T q`` in one pass over the transposed pattern
(``scorch/compiler/kv_grad.py``), against dense torch; and the compiled attention backward running it."""
import pytest
import torch

from scorch import dynamo_sparse
from scorch.compiler import kv_grad

import test_compile_sparse as cs
from test_compile import fresh_dynamo  # noqa: F401  (every test compiles anew)


def _pattern(rows, cols, density, index_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(rows, cols, generator=g) < density
    keep[:, 0] = True  # a full first column, many of the entries: columns of uneven length, split by entries
    keep[:, cols // 2] = False  # an empty column: its output rows are zeros
    keep[rows // 3] = False  # an empty row
    csr = keep.float().to_sparse_csr()
    return csr.crow_indices().to(index_dtype), csr.col_indices().to(index_dtype), keep


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype,index_dtype", [(torch.float32, torch.int32), (torch.float64, torch.int64),
                                               (torch.float32, torch.int64)])
@pytest.mark.parametrize("wv,wk", [(5, 7), (16, 16)])  # (runtime widths; widths the kernel is specialized to)
def test_kv_grad_is_the_transposed_products(threads, dtype, index_dtype, wv, wk):
    rows, cols = 37, 29
    pos, crd, keep = _pattern(rows, cols, 0.05, index_dtype)
    g = torch.Generator().manual_seed(1)
    p, ds = (torch.randn(int(keep.sum()), generator=g, dtype=dtype) for _ in range(2))
    go, q = torch.randn(rows, wv, generator=g, dtype=dtype), torch.randn(rows, wk, generator=g, dtype=dtype)
    dense_p, dense_ds = (torch.zeros(rows, cols, dtype=dtype).masked_scatter(keep, x) for x in (p, ds))
    assert kv_grad.applies(pos, crd, p, go, q)
    # (int32 transposed arrays for every pattern that fits; int64 ones for a larger one, taken here too)
    transposed = tuple(x.to(index_dtype) for x in kv_grad.transpose(pos, crd, cols))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dv, dk = kv_grad.kv_grad(transposed, p, ds, go, q)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(dv, dense_p.T @ go)
    torch.testing.assert_close(dk, dense_ds.T @ q)


def test_kv_grad_declines():
    pos, crd, keep = _pattern(6, 6, 0.5, torch.int32)
    p = torch.randn(int(keep.sum()))
    assert not kv_grad.applies(pos, crd, p.half(), torch.randn(6, 2).half(), torch.randn(6, 2).half())
    assert not kv_grad.applies(pos, crd.long(), p, torch.randn(6, 2), torch.randn(6, 2))
    assert not kv_grad.applies(pos, crd, p, torch.randn(6, 2, dtype=torch.float64), torch.randn(6, 2))


def test_compiled_attention_backward_runs_it(monkeypatch):
    """The compiled attention's backward takes ``dv`` and ``dk`` from ``kv_grad``: gradients equal to eager's."""
    calls = []
    real = kv_grad.kv_grad
    monkeypatch.setattr(kv_grad, "kv_grad", lambda *a: calls.append(1) or real(*a))
    cs._check_attention("aot_eager", n=30, d=6)
    assert calls


def test_transpose_is_kept_per_pattern(monkeypatch):
    """The transposed pattern is made once for a mask used step after step."""
    made = []
    real = kv_grad.transpose
    monkeypatch.setattr(kv_grad, "transpose", lambda *a: made.append(1) or real(*a))
    mask, _ = cs._mask(20, 0.3, seed=5)
    q, k, v = cs._qkv(20, 4)
    f = torch.compile(cs.attention_loss, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        torch.autograd.grad(f(mask, q, k, v), (q, k, v))
    assert len(made) == 1


def test_compiled_attention_backward_where_it_declines(monkeypatch):
    """Where ``kv_grad`` declines, the general products give the same gradients."""
    monkeypatch.setattr(dynamo_sparse, "_kv_grad", lambda *a: None)
    cs._check_attention("aot_eager", n=30, d=6)
