"""Sparse tensors under ``torch.inference_mode``: tensors made there have no version counter, which scorch's
caches key and check on (kept conversions, relaid copies, prepared SDDMMs, deferred results). Whether the weight
was made inside or outside inference mode, and whichever mode the calls alternate through (a model validated
under ``no_grad`` and served under ``inference_mode``), every result matches the dense one."""
import pytest
import torch

import scorch
from scorch import deferred
from scorch.sparse_tensor import pattern_ones

MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}


@pytest.mark.parametrize("defer", ["auto", "all"])
@pytest.mark.parametrize("made_in", ["grad", "inference"])
@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "ell", "bsr(2, 2)", "dcsr", "dcsc"])
def test_calls_alternating_through_inference_mode(fmt, made_in, defer):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 16, generator=g) * (torch.rand(32, 16, generator=g) < 0.3)
    x = torch.randn(5, 16, generator=g)
    with MODES[made_in]():
        b = scorch.asformat(w.clone(), fmt)
    stored = b.detach().with_values(pattern_ones(b, torch.float32)).to_dense() != 0 if made_in == "grad" else None
    with deferred.deferral(defer):
        for mode in ("grad", "no_grad", "inference", "inference", "no_grad", "grad"):
            with MODES[mode]():
                got = [torch.nn.functional.linear(x, b), b @ x.T, x @ b.T, b.t() @ torch.ones(32, 2), b.sum(0),
                       (b * 2).to_dense()]
                want = [x @ w.T, w @ x.T, x @ w.T, w.t() @ torch.ones(32, 2), w.sum(0), w * 2]
                if stored is not None:
                    got.append(torch.sparse.sampled_addmm(b, torch.ones(32, 1), torch.ones(1, 16)).to_dense())
                    want.append(torch.where(stored, w + 1, 0.))
                for r, e in zip(got, want):
                    r = r.compute() if isinstance(r, deferred.Deferred) else r
                    r = r.to_dense() if isinstance(r, scorch.SparseTensor) else r
                    torch.testing.assert_close(r, e)
