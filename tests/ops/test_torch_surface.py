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
from hypothesis import example, given, settings, strategies as st

import scorch
from scorch import SparseTensor
from scorch.sparse_tensor import padding_of

from conftest import assert_matches_dense, quarters
from fallback_check import falls_back

FORMATS = ["coo", "csr", "csc", "dcsr", "bsr(2, 2)", "ell"]


@pytest.fixture(autouse=True)
def _fresh_stats():
    scorch.reset_stats()
    yield
    scorch.reset_stats()


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
    return s.grad.to_dense(), torch.where(_stored(s), a.grad, 0)


def _same_sparse_result_and_gradients(fn, operands, dense, seed=1):
    """``fn(*operands)`` is a SparseTensor (computed by a sparse rule: no fallback warning) equal to
    ``fn(*dense)``, and a random weighting of both sends the same gradients to the stored values."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)
        r = fn(*operands)
    expected = fn(*dense)
    assert isinstance(r, SparseTensor)
    assert_matches_dense(r, expected)
    w = torch.rand(expected.shape, generator=torch.Generator().manual_seed(seed), dtype=expected.dtype)
    (r.to_dense() * w).sum().backward()
    (expected * w).sum().backward()
    for x, a in zip(operands, dense):
        if isinstance(x, SparseTensor):
            torch.testing.assert_close(*_grad_on_pattern(x, a))


def _stored(s: SparseTensor) -> torch.Tensor:
    """Where ``s`` stores an entry (explicit zeros included), as a dense bool tensor."""
    return s.detach().with_values(torch.ones_like(s.values().detach())).to_dense() != 0


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
    "pad": lambda x: F.pad(x, (1, 2), value=1.0),  # (a nonzero pad makes it dense; zeros keep it sparse)
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


def test_in_place_foreach_on_sparse_tensors_raises():
    s, _ = _pair((4, 5), "csr", seed=11)
    d = s.detach()
    before = d.values().clone()
    with pytest.raises(NotImplementedError, match="torch._foreach_maximum_ would write its result into a sparse"):
        torch._foreach_maximum_([d], [torch.ones(4, 5)])  # the list's tensors are written: not a silent no-op
    with pytest.raises(NotImplementedError, match="dense tensor"):
        torch._foreach_add_([d], [torch.ones(4, 5)])  # element by element: Tensor.add_'s own refusal
    assert torch.equal(d.values(), before)


@pytest.mark.parametrize("opt, kwargs", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                         (torch.optim.Adam, {"lr": 0.01}), (torch.optim.AdamW, {"lr": 0.01})])
def test_foreach_optimizers_and_clipping_match_the_loop(opt, kwargs):
    weights = []
    for foreach in (False, True):
        torch.manual_seed(3)
        m = scorch.nn.SparseLinear(6, 3, density=0.5)
        o = opt(m.parameters(), foreach=foreach, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error", scorch.DensifyWarning)  # element by element: no fallback
            for _ in range(3):
                loss = m(torch.randn(4, 6)).pow(2).sum()
                o.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, foreach=foreach)
                o.step()
        weights.append(m.weight.detach())
    assert weights[1].levels[1].crd is not None and weights[0].nnz == weights[1].nnz
    torch.testing.assert_close(weights[1].to_dense(), weights[0].to_dense())
    d = [scorch.asformat(quarters((3, 4), 7, 0.5), "csr"), torch.ones(2)]
    r = torch._foreach_mul(d, 2.0)  # out of place, mixed sparse and dense
    assert isinstance(r[0], SparseTensor) and torch.equal(r[0].to_dense(), 2 * d[0].to_dense())
    assert torch.equal(r[1], torch.full((2,), 2.0))


@pytest.mark.parametrize("fmt", ["coo", "csr", "ell"])
def test_dtype_conversions_keep_the_pattern_and_print_without_densifying(fmt):
    s, a = _pair((4, 5), fmt, seed=12)
    d = s.detach()
    for name, other in (("long", None), ("int", None), ("bool", None), ("half", None), ("byte", None),
                        ("type_as", torch.zeros(1, dtype=torch.float64))):
        r = getattr(d, name)(*([] if other is None else [other]))
        assert isinstance(r, SparseTensor) and r.levels is d.levels, name
        assert_matches_dense(r, getattr(a.detach(), name)(*([] if other is None else [other])))
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)
        assert f"{d}" == repr(d) and f"{d:>5}".endswith(repr(d)[-5:])


def test_fallback_answers_attributes_computed_by_ops():
    s, a = _pair((4, 5), "csr", seed=8)
    r = falls_back(lambda: s.H, lambda: a.H, "Tensor.H")  # under the attribute's name, differentiable
    (r * torch.arange(20.0).reshape(5, 4)).sum().backward()
    (a.H * torch.arange(20.0).reshape(5, 4)).sum().backward()
    torch.testing.assert_close(*_grad_on_pattern(s, a))
    falls_back(lambda: s.detach().H, lambda: a.detach().H, "Tensor.H")
    assert s.shape == (4, 5) and s.dtype == torch.float32 and scorch.stats()["fallback"] == {"Tensor.H": 1}
    with _quiet():
        assert len(s) == 4 and s.detach().tolist() == a.detach().tolist()
    with pytest.raises(NotImplementedError, match="data_ptr of a sparse tensor"):
        s.data_ptr()


def test_ops_reaching_the_dispatcher_fall_back_without_gradients():
    s, a = _pair((4, 5), "coo", seed=10)
    d = s.detach()
    with torch._C.DisableTorchFunctionSubclass():  # as torch internals call ops: straight to the dispatcher
        with pytest.warns(scorch.DensifyWarning, match=r"torch\.ops\.aten\.cumsum\.default has no sparse rule"):
            r = torch.cumsum(d, 0)
        with pytest.raises(NotImplementedError, match="requires grad"):
            torch.cumsum(s, 0)  # a dense result here would not reach the stored values
        with pytest.raises(NotImplementedError, match="write into a sparse tensor"):
            d.cumsum_(0)
    assert type(r) is torch.Tensor and torch.equal(r, torch.cumsum(a.detach(), 0))
    assert scorch.stats()["fallback"] == {"torch.ops.aten.cumsum.default": 1}


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


@pytest.mark.parametrize("convert, dtype", [(lambda m: m.double(), torch.float64), (lambda m: m.half(), torch.float16),
                                            (lambda m: m.to(torch.float64), torch.float64)])
def test_module_dtype_conversion_converts_sparse_parameters(convert, dtype):
    torch.manual_seed(1)
    m = scorch.nn.SparseLinear(6, 3, density=0.5, format="csr")
    dense = m.weight.detach().to_dense()
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)
        convert(m)
    w = m.weight
    assert isinstance(w, SparseTensor) and isinstance(w, torch.nn.Parameter) and w.requires_grad and w.is_leaf
    assert w.dtype == w.values().dtype == dtype  # the stored values converted, not only the wrapper's dtype
    assert_matches_dense(w.detach(), dense.to(dtype))


def test_data_reads_and_writes_the_sparse_tensor():
    s, a = _pair((4, 5), "csr", seed=13)
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)
        d = s.data
        assert isinstance(d, SparseTensor) and not d.requires_grad
        d.mul_(2)  # as optimizers and initializers write: through .data into the parameter
        assert_matches_dense(s.detach(), 2 * a.detach())
        t = scorch.asformat(torch.ones(4, 5), "coo")
        s.data = t
    assert s.requires_grad and s.is_leaf and s.format == t.format
    assert_matches_dense(s.detach(), torch.ones(4, 5))
    s.data = torch.full((4, 5), 2.0)  # a dense y inside s's pattern (now every element): the stored values
    assert s.format == t.format
    assert_matches_dense(s.detach(), torch.full((4, 5), 2.0))
    partial = scorch.asformat(torch.eye(4, 5), "csr")
    with pytest.raises(ValueError, match="same shape, dtype and device, got a dense tensor"):
        partial.data = torch.ones(4, 5)  # (nonzeros off the pattern)
    with pytest.raises(ValueError, match="same shape"):
        s.data = scorch.asformat(torch.ones(5, 4), "coo")


@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr(2, 2)", "ell", "dia"])
def test_vector_to_parameters_writes_a_sparse_parameter_back(fmt):
    """``nn.utils.vector_to_parameters`` sets ``p.data`` to a dense piece of the flat vector: for a sparse ``p`` its
    values at ``p``'s entries become the stored values (format, pattern and padding kept); it raised on any
    model with sparse and dense parameters. A piece that is nonzero off the pattern still raises."""
    g = torch.Generator().manual_seed(4)
    d = torch.randn(4, 6, generator=g) * (torch.rand(4, 6, generator=g) < 0.5)
    d[:2, :2], d[3, 0] = 0, 0  # a block and a diagonal off every format's pattern
    w, b = torch.nn.Parameter(scorch.asformat(d, fmt)), torch.nn.Parameter(torch.randn(4, generator=g))
    b0 = b.detach().clone()
    vec = torch.nn.utils.parameters_to_vector([w, b])
    torch.nn.utils.vector_to_parameters(vec * 3, [w, b])
    assert isinstance(w, SparseTensor) and w.format == scorch.asformat(d, fmt).format and w.requires_grad
    assert_matches_dense(w.detach(), 3 * d)
    torch.testing.assert_close(b.detach(), 3 * b0)
    if w.format.padded:
        assert not w.values()[padding_of(w)].any()  # padding stays 0
    (w @ torch.ones(6)).sum().backward()
    torch.optim.SGD([w], lr=0.1).step()  # still a sparse parameter an optimizer steps
    with pytest.raises(ValueError, match="nonzeros off x's pattern"):
        torch.nn.utils.vector_to_parameters(torch.ones_like(vec), [w, b])


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


# --- sparse rules: pow -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pow_with_a_positive_exponent_keeps_the_pattern(fmt, dtype):
    for e, call in ((2, lambda x: x ** 2), (3.0, lambda x: torch.pow(x, 3.0)), (0.5, lambda x: x.abs().pow(0.5)),
                    (1, lambda x: torch.pow(x, torch.tensor(1.0, dtype=dtype)))):
        s, a = _pair((4, 6), fmt, seed=20, dtype=dtype)
        r = call(s)
        assert isinstance(r, SparseTensor) and r.format == s.format, e
        expected = call(a)
        assert_matches_dense(r, expected)
        if e < 1:
            continue  # the gradient of |x| ** 0.5 at a stored zero is not defined
        (r.to_dense() * torch.arange(24, dtype=dtype).reshape(4, 6)).sum().backward()
        (expected * torch.arange(24, dtype=dtype).reshape(4, 6)).sum().backward()
        torch.testing.assert_close(*_grad_on_pattern(s, a))


def test_pow_that_moves_zero_is_dense_and_in_place_pow_updates_the_values():
    s, a = _pair((4, 6), "csr", seed=21)
    with pytest.warns(scorch.DensifyWarning, match="torch.pow maps 0 to a nonzero"):
        r = s ** 0
    assert type(r) is torch.Tensor and torch.equal(r, a ** 0)
    assert_matches_dense(s.detach() ** -1.0, a.detach() ** -1.0)  # inf at the implicit zeros, as torch
    assert scorch.stats()["densified"] == {"torch.pow": 2}
    falls_back(lambda: 2 ** s.detach(), lambda: 2 ** a.detach(), "Tensor.__rpow__")
    d = s.detach().clone()
    levels = d.levels
    d.pow_(3)
    assert d.levels is levels
    assert_matches_dense(d, a.detach() ** 3)
    d **= 2
    assert_matches_dense(d, a.detach() ** 6)
    with pytest.raises(NotImplementedError, match="in-place torch.pow .*result is dense"):
        d.pow_(0)


# --- sparse rules: indexing ---------------------------------------------------------------------------------------------

def _key_item(draw, size):
    kind = draw(st.sampled_from(["int", "slice", "list", "mask", "tensor", "full"]))
    if kind == "int":
        return draw(st.integers(-size, size - 1))
    if kind == "slice":
        return slice(draw(st.none() | st.integers(-size - 1, size + 1)), draw(st.none() | st.integers(-size - 1, size + 1)),
                     draw(st.none() | st.integers(1, 3)))
    if kind == "list":
        return draw(st.lists(st.integers(-size, size - 1), max_size=4))
    if kind == "mask":
        return torch.tensor(draw(st.lists(st.booleans(), min_size=size, max_size=size)), dtype=torch.bool)
    if kind == "tensor":
        dtype = draw(st.sampled_from([torch.int32, torch.int64]))
        return torch.tensor(draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=4)), dtype=dtype)
    return slice(None)


@st.composite
def index_cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    fmt = draw(st.sampled_from(["coo", "csr", "dcsr"] if ndim == 2 else ["coo"]))
    n_items = draw(st.integers(1, ndim))
    key, advanced = [], False
    for d in range(n_items):
        item = _key_item(draw, shape[d])
        if isinstance(item, (list, torch.Tensor)):
            if advanced:
                item = slice(None)  # one index tensor: the sparse rule's case
            advanced = True
        key.append(item)
    if draw(st.booleans()):
        key.insert(draw(st.integers(0, len(key))), None)
    if draw(st.booleans()) and n_items < ndim:
        key.insert(draw(st.integers(0, len(key))), Ellipsis)
    density = draw(st.sampled_from([0.0, 0.5, 1.0]))
    return shape, fmt, tuple(key) if len(key) != 1 or draw(st.booleans()) else key[0], density, draw(st.integers(0, 99))


@settings(max_examples=60)
@given(index_cases())
@example(((1, 2, 1), "coo", (Ellipsis, slice(None, 0, None), [1]), 0.0, 0))  # empty: torch checks no bound
@example(((0, 3), "csr", (slice(None), [5]), 0.5, 1))
def test_indexing_matches_torch_with_gradients(case):
    shape, fmt, key, density, seed = case
    s, a = _pair(shape, fmt, seed, density, torch.float64)
    try:
        expected = a[key]
    except IndexError:  # an index out of range (an ellipsis moved the key along): torch's error
        with pytest.raises(IndexError):
            s[key]
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)  # a sparse rule: no fallback
        r = s[key]
    if expected.dim():
        assert isinstance(r, SparseTensor), key
    assert_matches_dense(r, expected)
    weight = torch.arange(expected.numel(), dtype=torch.float64).reshape(expected.shape) + 1
    got = ((r.to_dense() if isinstance(r, SparseTensor) else r) * weight).sum()
    (expected * weight).sum().backward()
    if not got.requires_grad:  # nothing stored was selected: the gradient of the stored values is 0
        assert not torch.where(_stored(s), a.grad, 0).any()
        return
    got.backward()
    torch.testing.assert_close(*_grad_on_pattern(s, a))


def test_indexing_edge_cases_and_errors():
    s, a = _pair((4, 5), "csr", seed=22)
    s, a = s.detach(), a.detach()
    assert_matches_dense(s[1], a[1])
    assert_matches_dense(s[:, torch.tensor([0, 2])], a[:, torch.tensor([0, 2])])
    assert_matches_dense(s[..., 0], a[..., 0])
    assert_matches_dense(s[torch.tensor(2)], a[torch.tensor(2)])
    assert_matches_dense(s[1, 2], a[1, 2])  # 0-d: dense
    assert_matches_dense(s[2:2], a[2:2])  # empty
    assert_matches_dense(s[:, [-1, 0, 0]], a[:, [-1, 0, 0]])  # negative and repeated indices
    u = scorch.sparse_coo_tensor(torch.tensor([[0, 1, 0], [2, 0, 2]]), torch.tensor([1.0, 2.0, 3.0]), (2, 3))
    assert_matches_dense(u[0], u.to_dense()[0])  # duplicates summed
    with pytest.raises(IndexError, match="out of bounds"):
        s[4]
    with pytest.raises(IndexError, match="too many indices"):
        s[0, 0, 0]
    with pytest.raises(IndexError, match="out of range"):
        s[:, [5]]
    with pytest.raises(ValueError, match="step must be greater than zero"):
        s[::-1]
    falls_back(lambda: s[[0, 1], [1, 2]], lambda: a[[0, 1], [1, 2]], "Tensor.__getitem__")  # two index tensors
    falls_back(lambda: s[a > 0], lambda: a[a > 0], "Tensor.__getitem__")  # a 2-d mask


@pytest.mark.parametrize("fmt", ["coo", "csr", "csc", "bsr(2, 2)", "ell"])
def test_unbind_select_narrow_iterate(fmt):
    s, a = _pair((4, 6), fmt, seed=23, dtype=torch.float64)
    for dim in (0, 1, -1):
        parts = s.unbind(dim)
        assert len(parts) == a.shape[dim] and all(isinstance(p, SparseTensor) for p in parts)
        for p, e in zip(parts, a.unbind(dim)):
            assert_matches_dense(p, e)
        assert_matches_dense(torch.select(s, dim, 1), a.select(dim, 1))
        assert_matches_dense(s.narrow(dim, 1, 2), a.narrow(dim, 1, 2))
    assert len(s) == 4 and [tuple(r.shape) for r in s] == [(6,)] * 4
    sum(p.to_dense().sum() * k for k, p in enumerate(torch.unbind(s, 1))).backward()
    sum(p.sum() * k for k, p in enumerate(a.unbind(1))).backward()
    torch.testing.assert_close(*_grad_on_pattern(s, a))
    v = scorch.asformat(torch.tensor([0.0, 2.0, 0.0]), "coo")
    assert [float(x) for x in v.unbind()] == [0.0, 2.0, 0.0]  # 1-d: 0-d dense parts
    with pytest.raises(IndexError, match="narrow"):
        s.narrow(0, 3, 2)


# --- sparse rules: any, all -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["coo", "csr", "dia", "ell", "bsr(2, 2)"])
@pytest.mark.parametrize("density", [0.0, 0.5, 1.0])
def test_any_all_match_torch(fmt, density):
    a = quarters((4, 6), 24, density)
    a[0, 0] = 0.0  # a stored zero where the format stores the position (dense pattern)
    for x in (a, a != 0, (a * 4).to(torch.uint8), (a * 4).to(torch.int32)):
        s = scorch.asformat(x, fmt)
        for call in (torch.any, torch.all, lambda t: t.any(1), lambda t: t.all(0), lambda t: torch.all(t, -1, True),
                     lambda t: torch.any(t, dim=(0, 1)), lambda t: t.all(dim=0, keepdim=True)):
            assert_matches_dense(call(s), call(x))
    full = scorch.asformat(torch.ones(2, 4), fmt)
    assert bool(full.all()) and bool(full.any()) and bool(full.all(1).all())


# --- sparse rules: broadcasting add / sub / mul, comparisons of two sparse tensors ------------------------------------

SHAPES = [((4, 5), (1, 5)), ((4, 1), (4, 5)), ((5,), (3, 5)), ((2, 1, 5), (3, 1)), ((4, 5), (4, 5))]


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_broadcasting_two_sparse_operands(shapes, op):
    (sa, ta), (sb, tb) = _pair(shapes[0], "coo", 25, dtype=torch.float64), _pair(shapes[1], "coo", 26,
                                                                                      dtype=torch.float64)
    if len(shapes[1]) == 2 and shapes[1][0] > 1 and len(shapes[0]) == 2:
        sb, tb = _pair(shapes[1], "csr", 26, dtype=torch.float64)
    _same_sparse_result_and_gradients(getattr(torch, op), (sa, sb), (ta, tb))


@pytest.mark.parametrize("dense_shape", [(1, 5), (3, 4, 5), (4, 1), (3, 1, 1)])
def test_broadcasting_sparse_with_dense(dense_shape):
    s, a = _pair((4, 5), "csr", 27, dtype=torch.float64)
    d = torch.rand(dense_shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    r = s * d
    assert isinstance(r, SparseTensor)
    assert_matches_dense(r, a * d)
    assert_matches_dense(d * s, d * a)
    assert_matches_dense(s + d, a + d)
    assert_matches_dense(d - s, d - a)
    r.to_dense().sum().backward()
    (a * d).sum().backward()
    torch.testing.assert_close(*_grad_on_pattern(s, a))
    with pytest.raises(ValueError, match="do not broadcast"):
        s + scorch.asformat(torch.ones(3, 5), "coo")
    with pytest.raises(RuntimeError):
        s * torch.ones(3, 5)


@pytest.mark.parametrize("fmts", [("csr", "csr"), ("coo", "csc"), ("dcsr", "coo")])
def test_comparisons_of_two_sparse_tensors(fmts):
    a = quarters((4, 6), 28, 0.5)
    b = torch.where(torch.rand(4, 6, generator=torch.Generator().manual_seed(3)) < 0.5, a, quarters((4, 6), 29, 0.5))
    s, t = scorch.asformat(a, fmts[0]), scorch.asformat(b, fmts[1])
    for op in (torch.gt, torch.lt, torch.ne, lambda x, y: x > y, lambda x, y: x != y):
        r = op(s, t)
        assert isinstance(r, SparseTensor) and r.dtype == torch.bool
        assert_matches_dense(r, op(a, b))
    row = scorch.asformat(a[:1], "coo")
    assert_matches_dense(torch.lt(s, row), torch.lt(a, a[:1]))  # broadcast
    with pytest.warns(scorch.DensifyWarning, match="torch.eq maps 0 to a nonzero"):
        r = s == t  # eq(0, 0) is True: dense
    assert type(r) is torch.Tensor and torch.equal(r, a == b)
    assert_matches_dense(torch.ge(s, t), a >= b)


def test_where_and_invert_fall_back():
    s, a = _pair((4, 5), "csr", 30)
    mask = torch.rand(4, 5, generator=torch.Generator().manual_seed(4)) < 0.5
    other = torch.full((4, 5), -1.0)
    r = falls_back(lambda: torch.where(mask, s, other), lambda: torch.where(mask, a, other), "torch.where")
    r.sum().backward()
    torch.where(mask, a, other).sum().backward()
    torch.testing.assert_close(*_grad_on_pattern(s, a))
    b = s.detach() > 0
    falls_back(lambda: ~b, lambda: ~(a.detach() > 0), "Tensor.__invert__")


# --- the generated table of the torch surface ----------------------------------------------------------------------

def test_catalog_lists_every_overridable_function_with_its_behaviour():
    from scorch import catalog
    rows = {name: kind for name, kind, _ in catalog.surface()}
    assert {"sparse rule", "dense fallback", "error", "metadata"} == set(rows.values())
    names = catalog.public_names()
    for func in torch.overrides.get_testing_overrides():
        name = catalog.public_name(func, names)
        assert name in rows or name.startswith(("torch._", "Tensor._")), name
    s, a = _pair((4, 5), "csr", seed=31)
    s, a = s.detach(), a.detach()
    assert rows["Tensor.__getitem__"] == rows["torch.pow"] == rows["torch.any"] == "sparse rule"
    assert rows["torch.cumsum"] == rows["Tensor.std"] == rows["torch.nn.functional.mse_loss"] == "dense fallback"
    assert rows["Tensor.cumsum_"] == rows["Tensor.data_ptr"] == "error"
    assert rows["Tensor.shape"] == rows["Tensor.dtype"] == "metadata"
    assert rows["Tensor.mT"] == rows["Tensor.T"] == "sparse rule" and rows["Tensor.diagonal"] == "dense fallback"
    falls_back(lambda: torch.cumsum(s, 0), lambda: torch.cumsum(a, 0), "torch.cumsum")  # as the table says


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_new_rules_on_either_index_width_and_empty_tensors(index_dtype):
    a = torch.tensor([[0.0, 2.0, 0.0, -1.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    t = a.to_sparse_csr()
    s = scorch.sparse_csr_tensor(t.crow_indices().to(index_dtype), t.col_indices().to(index_dtype), t.values(),
                                 a.shape)
    assert s.index_dtype == index_dtype
    assert_matches_dense(s[1:, [3, 0]], a[1:, [3, 0]])
    assert_matches_dense(s.unbind(1)[3], a[:, 3])
    assert_matches_dense(s.any(0), a.any(0)) and assert_matches_dense(s.all(1), a.all(1))
    assert_matches_dense(s ** 2, a ** 2)
    assert_matches_dense(s + scorch.asformat(a[:1], "coo"), a + a[:1])
    assert_matches_dense(s > scorch.asformat(a.flip(0), "coo"), a > a.flip(0))
    e = scorch.asformat(torch.zeros(0, 3), "coo")
    for call in (lambda x: x[:, 1], lambda x: x.any(), lambda x: x.all(), lambda x: x.any(1), lambda x: x ** 2,
                 lambda x: x + scorch.asformat(torch.zeros(1, 3), "coo") if isinstance(x, SparseTensor) else x):
        assert_matches_dense(call(e), call(torch.zeros(0, 3)))
    assert e.unbind(0) == () and len(e.unbind(1)) == 3


@st.composite
def broadcast_pairs(draw):
    """Two broadcastable shapes (1 to 3 dims, sizes 1 to 4), each operand sparse (a format) or dense."""
    n = draw(st.integers(1, 3))
    full = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    shapes = []
    for _ in range(2):
        k = draw(st.integers(1, n))
        shapes.append(tuple(1 if draw(st.booleans()) else m for m in full[n - k:]))
    kinds = [draw(st.sampled_from(["coo", "csr", "dense"] if len(sh) == 2 else ["coo", "dense"])) for sh in shapes]
    if kinds == ["dense", "dense"]:
        kinds[0] = "coo"
    op = draw(st.sampled_from(["add", "sub", "mul", "gt", "ne"]))
    return shapes, kinds, op, draw(st.integers(0, 99))


@settings(max_examples=40)
@given(broadcast_pairs())
def test_broadcasting_ops_match_torch(case):
    shapes, kinds, op, seed = case
    operands, dense = [], []
    for k, (shape, kind) in enumerate(zip(shapes, kinds)):
        if kind == "dense":
            d = quarters(shape, seed + k, 1.0, torch.float64).requires_grad_()
            operands.append(d)
            dense.append(d)
        else:
            s, a = _pair(shape, kind, seed + k, 0.5, torch.float64)
            operands.append(s)
            dense.append(a)
    if op in ("gt", "ne"):
        operands = [x.detach() for x in operands]
        dense = [x.detach() for x in dense]
    fn = getattr(torch, op)
    expected = fn(*dense)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)  # a comparison with a dense tensor falls back
        r = fn(*operands)
    assert_matches_dense(r, expected)
    if op in ("gt", "ne"):
        return
    w = torch.rand(expected.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got = ((r.to_dense() if isinstance(r, SparseTensor) else r) * w).sum()
    if not got.requires_grad:  # to_dense() of a result with nothing stored is not on the graph
        assert isinstance(r, SparseTensor) and r.nnz == 0
        return
    got.backward()
    (expected * w).sum().backward()
    for x, a in zip(operands, dense):
        if isinstance(x, SparseTensor):
            torch.testing.assert_close(*_grad_on_pattern(x, a))


# --- nonzero, count_nonzero, predicates, aliases, dimension moves, metadata questions --------------------------------

def _uncoalesced():
    """A COO with duplicates, two of which cancel (the position reads 0), and a stored zero."""
    idx = torch.tensor([[0, 0, 1, 2, 2, 1], [1, 1, 0, 3, 3, 2]])
    s = scorch.sparse_coo_tensor(idx, torch.tensor([1.0, -1.0, 2.0, 3.0, 4.0, 0.0]), (3, 4))
    return s, s.to_dense()


@pytest.mark.parametrize("fmt", ["coo", "csr", "csc", "bsr(2, 2)", "ell", "uncoalesced"])
def test_nonzero_argwhere_count_nonzero(fmt):
    if fmt == "uncoalesced":
        s, a = _uncoalesced()
    else:
        a = quarters((4, 6), 40, 0.5)
        a[0, 0] = 0.0
        s = scorch.asformat(a, fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)
        assert torch.equal(s.nonzero(), a.nonzero()) and torch.equal(torch.argwhere(s), torch.argwhere(a))
        for got, want in zip(torch.nonzero(s, as_tuple=True), a.nonzero(as_tuple=True)):
            assert torch.equal(got, want)
        for dim in (None, 0, 1, (0, 1), -1):
            assert torch.equal(torch.count_nonzero(s, dim), torch.count_nonzero(a, dim)), dim
    e = scorch.asformat(torch.zeros(0, 3), "coo")
    assert torch.equal(e.nonzero(), torch.zeros(0, 3).nonzero()) and int(e.count_nonzero()) == 0


def test_zero_preserving_predicates_keep_the_pattern():
    a = torch.tensor([[0.0, float("nan"), 0.0, -0.5], [float("inf"), 0.0, -float("inf"), 2.0]])
    s = scorch.asformat(a, "csr")
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)
        for name in ("isnan", "isinf", "isposinf", "isneginf", "signbit"):
            r = getattr(torch, name)(s)
            assert isinstance(r, SparseTensor) and r.dtype == torch.bool, name
            assert_matches_dense(r, getattr(torch, name)(a))
    with pytest.warns(scorch.DensifyWarning, match="isfinite maps 0 to a nonzero"):
        assert_matches_dense(torch.isfinite(s), torch.isfinite(a))
    assert_matches_dense(s.logical_not(), a.logical_not())


def test_aliases_dimension_moves_and_metadata_questions_use_sparse_rules():
    a = quarters((2, 3, 4), 41, 0.5)
    s = scorch.asformat(a, "coo")
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)
        for name, args in (("absolute", ()), ("negative", ()), ("multiply", (2.0,)), ("subtract", (s,)),
                           ("divide", (4.0,)), ("true_divide", (2.0,)), ("swapdims", (0, 2)),
                           ("movedim", (0, -1)), ("moveaxis", ((0, 1), (2, 0)))):
            r = getattr(s, name)(*args)
            assert isinstance(r, SparseTensor), name
            assert_matches_dense(r, getattr(a, name)(*[a if x is s else x for x in args]))
        assert +s is s and torch.positive(s) is s
        assert s.is_signed() and s.is_same_size(a) and not s.is_same_size(a[0]) and not s.is_conj()
        assert not s.is_neg() and not s.is_inference()
    with pytest.raises(RuntimeError, match="movedim"):
        s.movedim((0, 1), (0,))


@pytest.mark.parametrize("op", ["maximum", "minimum", "fmax", "fmin"])
@pytest.mark.parametrize("shapes", [((4, 5), (4, 5)), ((4, 5), (1, 5)), ((3, 1), (3, 4))])
def test_binary_maps_of_two_sparse_tensors_take_the_union(op, shapes):
    (s, a), (t, b) = _pair(shapes[0], "csr", 42, dtype=torch.float64), _pair(shapes[1], "coo", 43,
                                                                              dtype=torch.float64)
    fn = getattr(torch, op)
    _same_sparse_result_and_gradients(fn, (s, t), (a, b), seed=5)
    falls_back(lambda: fn(s.detach(), b.detach()), lambda: fn(a.detach(), b.detach()), f"torch.{op}")


def test_logical_and_bitwise_ops_of_sparse_masks():
    a, b = quarters((4, 6), 44, 0.5), quarters((4, 6), 45, 0.5)
    m, n = scorch.asformat(a, "csr") > 0, scorch.asformat(b, "coo") != 0
    md, nd = a > 0, b != 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)
        for fn in (lambda x, y: x & y, lambda x, y: x | y, lambda x, y: x ^ y, torch.logical_and, torch.logical_or,
                   torch.logical_xor, torch.bitwise_and):
            r = fn(m, n)
            assert isinstance(r, SparseTensor)
            assert_matches_dense(r, fn(md, nd))
        ints = scorch.asformat((a * 4).to(torch.int32), "coo"), scorch.asformat((b * 4).to(torch.int32), "csr")
        assert_matches_dense(ints[0] | ints[1], (a * 4).to(torch.int32) | (b * 4).to(torch.int32))
    falls_back(lambda: m & nd, lambda: md & nd, "Tensor.__and__")


@pytest.mark.parametrize("fmt", ["coo", "csr", "csc", "bsr(2, 2)", "ell", "uncoalesced"])
def test_setting_zero_through_an_index_keeps_the_pattern(fmt):
    if fmt == "uncoalesced":
        s0, a = _uncoalesced()
        a = a.clone()
    else:
        a = quarters((4, 6), 46, 0.6)
        s0 = scorch.asformat(a, fmt)
    keys = [1, (slice(None), 2), (slice(1, 3), [0, 2]), (..., -1), torch.tensor([True, False, True] + [False] *
                                                                                  (a.shape[0] - 3)),
            "mask", "sparse mask"]
    for key in keys:
        s = s0.clone()
        levels = [st.arrays() for st in s.levels]
        if isinstance(key, str):
            key = a > 0.5 if key == "mask" else s > 0.5
        expected = a.clone()
        expected[key.to_dense() if isinstance(key, SparseTensor) else key] = 0
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", scorch.DensifyWarning)
            s[key] = 0
        assert_matches_dense(s, expected)
        assert all(torch.equal(x, y) for st, lv in zip(s.levels, levels) for x, y in zip(st.arrays().values(),
                                                                                           lv.values()))
    s = s0.clone()
    with pytest.raises(NotImplementedError, match="__setitem__ would write"):
        s[0, 0] = 1.0  # would fill an implicit zero
    d = torch.zeros(a.shape)
    with pytest.warns(scorch.DensifyWarning):
        d[1:3] = s0[1:3]  # a dense tensor takes a sparse value: on the dense form
    assert torch.equal(d[1:3], a[1:3])


@pytest.mark.parametrize("op,call", [
    ("Tensor.add_", lambda d, s: d.add_(s)),
    ("Tensor.mul_", lambda d, s: d.mul_(s)),
])  # (``d.copy_(S)`` takes S's dense form without a fallback: tests/ops/test_edge_semantics.py)
def test_in_place_into_a_dense_tensor_from_a_sparse_one(op, call):
    """A dense ``self`` updated in place from a sparse operand runs on the dense form and updates ``self``
    (``dense *= S`` raised NotImplementedError)."""
    x = torch.tensor([[1., 0, 2], [0, 0, 3]])
    d, want = torch.full((2, 3), 2.), torch.full((2, 3), 2.)
    got = falls_back(lambda: call(d, scorch.asformat(x, "csr")), lambda: call(want, x), op)
    assert got is d


def test_sparse_and_dense_dims_of_a_hybrid_coo():
    x = torch.randn(4, 3, 2)
    x[1] = 0
    for k in (0, 1, 2):
        t = x.to_sparse(x.dim() - k)
        s = scorch.from_torch(t)
        assert (s.sparse_dim(), s.dense_dim()) == (t.sparse_dim(), t.dense_dim())
    s = scorch.asformat(x[0], "csr")
    assert (s.sparse_dim(), s.dense_dim()) == (2, 0)


@pytest.mark.parametrize("shape,fmt", [((3, 4, 5), "coo"), ((2, 2, 3, 5), "coo"), ((5,), "coo"), ((4, 5), "csr")])
def test_linear_with_a_sparse_input_of_any_rank(shape, fmt):
    """``F.linear(S, W, b)`` with a sparse input of 1, 2 or more dimensions (more than 2 raised): values and
    the gradients of the input's stored values, the weight and the bias."""
    torch.manual_seed(0)
    x = torch.randn(shape) * (torch.rand(shape) < 0.4)
    w, b = torch.randn(6, 5, requires_grad=True), torch.randn(6, requires_grad=True)
    s = scorch.asformat(x, fmt).requires_grad_()
    got = F.linear(s, w, b)
    assert_matches_dense(got, F.linear(x, w, b))
    got.square().sum().backward()
    gw, gb = w.grad.clone(), b.grad.clone()
    w.grad = b.grad = None
    xd = x.clone().requires_grad_()
    F.linear(xd, w, b).square().sum().backward()
    torch.testing.assert_close(gw, w.grad)
    torch.testing.assert_close(gb, b.grad)
    torch.testing.assert_close(s.grad.to_dense(), xd.grad * (x != 0))  # on the stored entries
