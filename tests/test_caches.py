"""One owner for the memo tables (``scorch.cache_info``, ``scorch.clear_caches``) and the CPU backend block
(``scorch.engine.cpu_backend``)."""
import pytest
import torch

import scorch
from scorch import engine


def _spmm():
    d = torch.arange(36.).reshape(6, 6) * (torch.arange(36).reshape(6, 6) % 4 == 0)
    s = scorch.asformat(d, "csr")
    x = torch.arange(12.).reshape(6, 2)
    return s, x, d @ x


def test_cache_info_lists_every_cache_and_clear_empties_them():
    s, x, want = _spmm()
    torch.testing.assert_close(scorch.einsum("ij,jk->ik", s, x), want)
    info = scorch.cache_info()
    for name in ("planned", "compiled", "prepared", "prepared-by-equation", "paths", "converters"):
        assert name in info, name
        entries, what = info[name]
        assert isinstance(entries, int) and what
    assert info["compiled"][0] >= 1 and info["prepared"][0] >= 1
    scorch.clear_caches()
    assert all(entries == 0 for entries, _ in scorch.cache_info().values())
    torch.testing.assert_close(scorch.einsum("ij,jk->ik", s, x), want)  # planned and prepared again
    assert scorch.cache_info()["compiled"][0] >= 1


def test_cpu_backend_runs_every_op_on_the_chosen_backend():
    s, x, want = _spmm()
    scorch.einsum("ij,jk->ik", s, x)  # a prepared C++ call exists now
    with engine.cpu_backend("interp"):
        torch.testing.assert_close(scorch.einsum("ij,jk->ik", s, x), want)
        torch.testing.assert_close((s + s).to_dense(), 2 * s.to_dense())
        assert scorch.cache_info()["prepared"][0] == 0  # (the interpreter is never prepared)
    with pytest.raises(ValueError, match="cpu_backend"):
        with engine.cpu_backend("cuda"):
            pass
