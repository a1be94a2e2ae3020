"""The whole torch surface on sparse operands: the dense fallback (torch's result and gradients, warned, counted,
strict mode, memory limit, in-place refusal), the sparse rules that replace it for the common ops (pow, unbind,
indexing, any/all, broadcasting add/sub/mul, comparisons of two sparse tensors), deepcopy, torch's accessors and
the version seen under the alias."""
from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import scorch
from scorch import SparseTensor, _stats

from conftest import assert_matches_dense, quarters

FORMATS = ["coo", "csr", "csc", "dcsr", "bsr(2, 2)", "ell"]


@pytest.fixture(autouse=True)
def _fresh_stats():
    _stats.reset_stats()
    yield
    _stats.reset_stats()


def _pair(shape, fmt, seed, density=0.5, dtype=torch.float32):
    """``(S, A)``: a SparseTensor in ``fmt`` and its dense twin (both leaves requiring grad where floating)."""
    a = quarters(shape, seed, density, dtype)
    s = scorch.asformat(a, fmt)
    if dtype.is_floating_point:
        s.requires_grad_()
        a = a.clone().requires_grad_()
    return s, a


def _grad_on_pattern(s: SparseTensor, a: torch.Tensor):
    """The sparse gradient as a dense tensor, and the dense gradient kept where ``s`` stores an entry (the
    gradient of the stored values is the dense gradient read at their positions)."""
    stored = scorch.asformat(s.detach(), s.format).with_values(torch.ones_like(s.values().detach())).to_dense() != 0
    return s.grad.to_dense(), torch.where(stored, a.grad, 0)


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        yield


# --- the dense fallback -------------------------------------------------------------------------------------------

FALLBACKS = {
    "mse_loss": lambda x: F.mse_loss(x, torch.linspace(-1, 1, 20).reshape(4, 5)),
    "cumsum": lambda x: torch.cumsum(x, 0),
    "logcumsumexp": lambda x: torch.logcumsumexp(x, 1),
    "prod": lambda x: (x + 0.0).prod(1) if not isinstance(x, SparseTensor) else x.prod(1),
    "std": lambda x: x.std(),
    "var": lambda x: torch.var(x, 0),
    "pad": lambda x: F.pad(x, (1, 2)),
    "hstack": lambda x: torch.hstack([x, torch.ones(4, 1)]),  # a sparse operand inside a list
    "kwargs": lambda x: torch.cumprod(input=x, dim=1),  # a sparse operand passed by keyword
}


@pytest.mark.parametrize("fmt", ["coo", "csr", "bsr(2, 2)"])
@pytest.mark.parametrize("op", sorted(FALLBACKS))
def test_fallback_gives_torchs_values_and_gradients(op, fmt):
    fn = FALLBACKS[op]
    s, a = _pair((4, 5) if fmt != "bsr(2, 2)" else (4, 6), fmt, seed=3)
    if fmt == "bsr(2, 2)":
        fn = {"mse_loss": lambda x: F.mse_loss(x, torch.linspace(-1, 1, 24).reshape(4, 6))}.get(op, fn)
    with pytest.warns(scorch.DensifyWarning, match="no sparse rule"):
        r = fn(s)
    expected = fn(a)
    assert type(r) is torch.Tensor
    assert_matches_dense(r, expected)
    r.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(*_grad_on_pattern(s, a))


def test_fallback_warns_once_per_op_and_counts_every_call():
    s, a = _pair((4, 5), "csr", seed=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.cumsum(s, 0)
            s.cumsum(1)
        s.std()
    found = [w for w in caught if issubclass(w.category, scorch.DensifyWarning)]
    assert [str(w.message).split(" has")[0] for w in found] == ["scorch: torch.cumsum", "scorch: Tensor.cumsum",
                                                                 "scorch: Tensor.std"]
    assert "csr (4, 5)" in str(found[0].message) and found[0].filename == __file__  # points at the caller
    assert scorch.stats() == {"densified": {}, "fallback": {"torch.cumsum": 3, "Tensor.cumsum": 3, "Tensor.std": 1}}
    scorch.reset_stats()
    with pytest.warns(scorch.DensifyWarning, match="torch.cumsum"):
        torch.cumsum(s, 0)  # re-armed by the reset


def test_strict_mode_raises_naming_the_op_and_formats():
    s, a = _pair((4, 5), "coo", seed=5)
    assert not scorch.strict.on
    with scorch.strict():
        assert scorch.strict.on
        with pytest.raises(scorch.DensifyError, match=r"torch\.cumsum has no sparse rule .*coo \(4, 5\).*strict"):
            torch.cumsum(s, 0)
        with pytest.raises(scorch.DensifyError, match="torch.exp maps 0 to a nonzero"):
            torch.exp(s)  # a densifying map is refused too
        assert_matches_dense(torch.relu(s), torch.relu(a))  # sparse rules still run
    assert not scorch.strict.on  # the context restored it
    scorch.strict()
    try:
        with pytest.raises(scorch.DensifyError):
            s.std()
    finally:
        scorch.strict(False)
    with pytest.warns(scorch.DensifyWarning):
        s.std()
    assert scorch.stats()["fallback"] == {"Tensor.std": 1}  # refused calls are not counted


def test_strict_mode_from_the_environment():
    code = ("import torch, scorch\nS = scorch.asformat(torch.eye(3), 'csr')\nassert scorch.strict.on\n"
            "try:\n    torch.cumsum(S, 0)\nexcept scorch.DensifyError as e:\n    print('refused', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SCORCH_STRICT": "1"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused scorch: torch.cumsum has no sparse rule")


def test_fallback_over_the_memory_limit_raises_memory_error():
    big = scorch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (2**40,))
    assert scorch.fallback_limit() < 2**42  # 4 TiB of float32: over the default limit
    with pytest.raises(MemoryError, match=r"torch\.cumsum .*coo.*\(1099511627776,\).*4\.0 TiB.*limit"):
        torch.cumsum(big, 0)
    s, a = _pair((4, 5), "csr", seed=6)
    before = scorch.set_fallback_limit(79)
    try:
        with pytest.raises(MemoryError, match="80 bytes, over the dense fallback's limit of 79 bytes"):
            s.std()
        scorch.set_fallback_limit(80)
        with pytest.warns(scorch.DensifyWarning):
            assert_matches_dense(s.std(), a.std())
    finally:
        scorch.set_fallback_limit(before)
    with pytest.raises(ValueError, match="non-negative"):
        scorch.set_fallback_limit(-1)


def test_in_place_op_needing_a_dense_result_raises_and_leaves_the_tensor():
    s, a = _pair((4, 5), "csr", seed=7)
    before = s.values().detach().clone()
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match="Tensor.cumsum_ would write its result into a sparse tensor"):
            s.cumsum_(0)
        with pytest.raises(NotImplementedError, match="in place"):
            torch.cumsum(torch.ones(4, 5), 0, out=s)
        with pytest.raises(NotImplementedError, match="__setitem__ would write"):
            s[0, 0] = 5.0
    assert torch.equal(s.values().detach(), before)
    d = torch.zeros(4, 5)  # a dense tensor updated in place by a sparse operand: fine
    with pytest.warns(scorch.DensifyWarning):
        d.index_add_(0, torch.tensor([1, 0, 3, 2]), s.detach(), alpha=2)
    assert torch.equal(d, 2 * a.detach()[[1, 0, 3, 2]])


def test_fallback_answers_attributes_computed_by_ops():
    s, a = _pair((4, 5), "csr", seed=8)
    with _quiet():
        assert_matches_dense(s.mT, a.mT)
        assert len(s) == 4 and s.detach().tolist() == a.detach().tolist()
    with pytest.raises(NotImplementedError, match="data_ptr of a sparse tensor"):
        s.data_ptr()


# --- deepcopy, accessors, version ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_deepcopy_copies_arrays_and_keeps_grad_flags(fmt):
    s, a = _pair((4, 6), fmt, seed=9)
    c = copy.deepcopy(s)
    assert type(c) is SparseTensor and c.format == s.format and c.requires_grad and c.is_leaf
    assert_matches_dense(c.detach(), a.detach())
    assert c.values().data_ptr() != s.values().data_ptr()
    assert all(x.data_ptr() != y.data_ptr() for ls, lc in zip(s.levels, c.levels)
               for x, y in zip(ls.arrays().values(), lc.arrays().values()))
    with torch.no_grad():
        c.values().mul_(2)
    assert_matches_dense(s.detach(), a.detach())  # the original is untouched
    pair = copy.deepcopy([s, s])
    assert pair[0] is pair[1]  # the memo keeps shared tensors shared


def test_deepcopy_of_models_with_sparse_parameters():
    torch.manual_seed(0)
    layer = scorch.nn.SparseLinear(6, 3, density=0.5, format="coo")
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    s = scorch.schedule(model)
    s["2.weight"].sparsify(scorch.nn.ScalarFraction(0.5))
    scheduled = s.apply()
    assert isinstance(scheduled[2].weight, SparseTensor) and isinstance(layer.weight, SparseTensor)
    x = torch.randn(2, 5)
    for m in (layer, scheduled):
        c = copy.deepcopy(m)
        inp = x if m is scheduled else torch.randn(2, 6)
        torch.testing.assert_close(c(inp), m(inp))
        for (n, p), (_, q) in zip(m.named_parameters(), c.named_parameters()):
            assert isinstance(q, torch.nn.Parameter) and type(q) is type(p) and q.requires_grad == p.requires_grad, n
            if isinstance(p, SparseTensor):
                assert q.values().data_ptr() != p.values().data_ptr()
        c(inp).sum().backward()
        assert all(p.grad is None for p in m.parameters())  # the copy's gradients are its own


def test_torch_accessors_have_torchs_semantics():
    a = torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 4.0]])
    t = a.to_sparse()
    s = scorch.asformat(a, "coo")
    assert torch.equal(s._values(), t._values()) and torch.equal(s._indices(), t._indices())
    assert torch.equal(s.values(), t.values()) and torch.equal(s.indices(), t.indices())
    assert s._nnz() == t._nnz() == 3 and s.sparse_dim() == t.sparse_dim() == 2 and s.dense_dim() == t.dense_dim() == 0
    assert s.is_coalesced() and torch.Tensor.sparse_dim(s) == 2
    c = scorch.asformat(a, "csr")
    assert c.sparse_dim() == a.to_sparse_csr().sparse_dim() and c.dense_dim() == 0 and c._nnz() == 3
    assert torch.equal(c._values(), a.to_sparse_csr().values())


def test_version_under_the_alias_is_torchs():
    import importlib.metadata
    assert scorch.__version__ == torch.__version__ and scorch.__version__ >= "2.0"
    assert scorch.__scorch_version__ == importlib.metadata.version("scorch")
    assert scorch.version.__version__ == torch.version.__version__ and scorch.backends is torch.backends
