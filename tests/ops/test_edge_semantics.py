"""Edges of torch's semantics that a sparse operand must keep: reductions over an empty dim list, adding a zero
scalar (a new tensor of the promoted type), and 0-d tensor operands of ``*`` and ``/`` (their gradient and
their part in type promotion). Each against the dense tensor."""
import warnings

import pytest
import torch

import scorch

from conftest import assert_matches_dense
from fallback_check import falls_back

FORMATS = ["csr", "coo", "csc", "bsr(1, 3)"]
M = torch.tensor([[1., 0., 2.], [0., -3., 0.]])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("empty", [(), []])
@pytest.mark.parametrize("keepdim", [False, True])
def test_reductions_over_an_empty_dim_list(fmt, empty, keepdim):
    s = scorch.asformat(M, fmt)
    for name in ("sum", "mean", "amax", "amin"):
        got, want = getattr(s, name)(empty, keepdim=keepdim), getattr(M, name)(empty, keepdim=keepdim)
        assert_matches_dense(got, want)
        assert_matches_dense(getattr(torch, name)(s, empty, keepdim=keepdim), want)
    for name in ("any", "all"):  # (torch: over no dimension)
        assert_matches_dense(getattr(s, name)(empty, keepdim=keepdim), getattr(M, name)(empty, keepdim=keepdim))
    assert_matches_dense(torch.count_nonzero(s, empty), torch.count_nonzero(M, empty))
    # torch.sparse.sum keeps torch.sparse's own rule: dim=() sums over no dimension
    assert_matches_dense(torch.sparse.sum(s, empty), torch.sparse.sum(M.to_sparse(), empty).to_dense())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float32, torch.float16])
@pytest.mark.parametrize("zero", [0, 0.0, False])
def test_adding_a_zero_scalar_gives_a_new_tensor_of_the_promoted_type(fmt, dtype, zero):
    d = M.to(dtype)
    s = scorch.asformat(d, fmt)
    for fn in (lambda t: t + zero, lambda t: zero + t, lambda t: t - zero, lambda t: torch.add(t, zero, alpha=2),
               lambda t: torch.add(zero, t, alpha=2)):
        try:
            want = fn(d)
        except RuntimeError as e:  # (torch refuses bool subtraction, and a float alpha for integers)
            with pytest.raises(type(e)):
                fn(s)
            continue
        got = fn(s)
        assert_matches_dense(got, want)
        assert got is not s
    if dtype.is_floating_point:
        y = s + zero
        y.mul_(10)  # (the result, not the operand)
        assert_matches_dense(s, d)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_dim_tensor_operands_keep_their_gradient(fmt):
    w = torch.tensor(2.0, requires_grad=True)
    v = torch.tensor(4.0, requires_grad=True)
    s = scorch.asformat(M, fmt).requires_grad_()
    ((s * w).sum() + (w * s).sum() + (s / v).sum()).backward()
    w2, v2, m2 = w.detach().clone().requires_grad_(), v.detach().clone().requires_grad_(), M.clone().requires_grad_()
    ((m2 * w2).sum() + (w2 * m2).sum() + (m2 / v2).sum()).backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(v.grad, v2.grad)
    stored = s.detach().with_values(torch.ones_like(s.values())).to_dense() != 0  # (a block's zeros too)
    torch.testing.assert_close(s.grad.to_dense(), m2.grad * stored)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float16, torch.float32])
@pytest.mark.parametrize("scalar", [torch.tensor(1.5, dtype=torch.float64), torch.tensor(3), torch.tensor(2.5)])
def test_zero_dim_tensor_operands_promote_as_torch(fmt, dtype, scalar):
    d = M.to(dtype)
    s = scorch.asformat(d, fmt)
    assert_matches_dense(s * scalar, d * scalar)
    assert_matches_dense(scalar * s, scalar * d)
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)  # (a scalar divisor keeps the pattern: no fallback)
        assert_matches_dense(s / scalar, d / scalar)


@pytest.mark.parametrize("fmt", ["ell", "nm(2, 4)"])
@pytest.mark.parametrize("op", ["sqrt", "pow", "operator", "rsqrt_free_chain"])
def test_padded_formats_give_their_padding_no_gradient(fmt, op):
    """ELL and n:m pad rows with zeros at a real entry's coordinates; a map whose derivative at 0 is infinite
    (sqrt, pow(0.5)) must not put that on the real entry (nor one optimizer step turn it into nan)."""
    d = torch.tensor([[0., 4., 0., 0.], [1., 0., 9., 0.], [0., 0., 0., 0.]])
    fn = {"sqrt": torch.sqrt, "pow": lambda t: torch.pow(t, 0.5), "operator": lambda t: t ** 0.5,
          "rsqrt_free_chain": lambda t: torch.sqrt(t).abs() * 2}[op]
    w = torch.nn.Parameter(scorch.asformat(d, fmt))
    fn(w).sum().backward()
    dd = d.clone().requires_grad_()
    fn(dd).sum().backward()
    got = w.grad.to_dense()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.where(d != 0, dd.grad, torch.zeros(())))
    torch.optim.SGD([w], lr=0.1).step()
    assert torch.isfinite(w.to_dense()).all()
    torch.testing.assert_close(w.to_dense(), torch.where(d != 0, d - 0.1 * dd.grad, torch.zeros(())))


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell"])
def test_in_place_scalars_that_would_densify_raise_outside_optimizer_steps(fmt):
    d = torch.tensor([[0., 2.], [3., 0.]])
    s = scorch.asformat(d, fmt)
    for name, fn in (("add_", lambda t: t.add_(1)), ("add_", lambda t: t.__iadd__(1.5)),
                     ("sub_", lambda t: t.sub_(torch.tensor(1.))), ("clamp_", lambda t: t.clamp_(min=0.5)),
                     ("clamp_min_", lambda t: t.clamp_min_(0.5)), ("reciprocal_", lambda t: t.reciprocal_())):
        with pytest.raises(NotImplementedError, match=f"in-place {name}.*implicit zero"):
            fn(s)
        assert_matches_dense(s, d)  # (unchanged)
    # scalars that keep zeros zero change the stored values, as the dense tensor changes
    for fn in (lambda t: t.mul_(2), lambda t: t.clamp_(-1, 1), lambda t: t.add_(0), lambda t: t.sub_(0.0)):
        t, dd = s.clone(), d.clone()
        assert_matches_dense(fn(t), fn(dd))
    with scorch.stored_only():  # (the stored entries alone, asked for; padding stays 0)
        s.add_(1).clamp_(min=3.5)
    assert_matches_dense(s, torch.where(d != 0, (d + 1).clamp(min=3.5), 0.))
    s.values().sub_(1)
    assert_matches_dense(s, torch.where(d != 0, (d + 1).clamp(min=3.5) - 1, 0.))


def test_in_place_scalars_inside_an_optimizer_step_update_the_stored_values():
    class Shift(torch.optim.Optimizer):  # (an optimizer defined outside torch.optim)
        def __init__(self, params):
            super().__init__(params, {})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(0.5)
                    p.clamp_(min=1.0)

    d = torch.tensor([[0., 2.], [3., 0.]])
    w = torch.nn.Parameter(scorch.asformat(d, "csr"))
    Shift([w]).step()
    assert_matches_dense(w.detach(), torch.tensor([[0., 2.5], [3.5, 0.]]))
    w2 = torch.nn.Parameter(scorch.asformat(d, "csr"))
    opt = torch.optim.Adam([w2], lr=0.1)
    (w2 * w2).sum().backward()
    opt.step()
    assert_matches_dense(w2.detach(), torch.tensor([[0., 1.9], [2.9, 0.]]))


def test_keyword_and_vararg_forms_torch_takes():
    s = scorch.asformat(M, "csr")
    assert_matches_dense(s.broadcast_to(2, 2, 3), M.broadcast_to(2, 2, 3))
    assert_matches_dense(torch.broadcast_to(s, size=(2, 2, 3)), M.broadcast_to((2, 2, 3)))
    assert_matches_dense(torch.permute(s, dims=(1, 0)), torch.permute(M, dims=(1, 0)))
    assert_matches_dense(torch.sum(input=s, dim=0), torch.sum(input=M, dim=0))
    w = scorch.asformat(torch.zeros(4, 0), "csr")
    x = torch.randn(2, 0)
    assert_matches_dense(torch.nn.functional.linear(x, w), torch.nn.functional.linear(x, torch.zeros(4, 0)))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8])
def test_value_types_the_kernels_do_not_take_run_dense_through_torch_functions(dtype):
    d = (M != 0).to(dtype) if dtype == torch.bool else M.abs().to(dtype)
    s = scorch.asformat(d, "csr")
    falls_back(lambda: s.amax(1), lambda: d.amax(1), "Tensor.amax")
    with pytest.raises(TypeError, match="unsupported dtype"):  # (the compiler's own API says so)
        scorch.einsum("ij->ji", s)
    torch.testing.assert_close(scorch.einsum("ij->i", s), torch.einsum("ij->i", d))  # (a sum: int64, as torch.sum)


@pytest.mark.parametrize("fmt", ["ell", "nm(2, 4)"])
def test_padding_stays_zero_under_non_finite_scalars_and_products(fmt):
    """Padding shares a real entry's coordinates: 0 * inf there would be nan, added onto the real entry."""
    d = torch.tensor([[0., 4., 0., 0.], [1., 0., 9., 0.], [0., 0., 0., 0.]])
    s, ref = scorch.asformat(d, fmt), scorch.asformat(d, "csr")
    inf = float("inf")
    for fn in (lambda t: t / 0, lambda t: t * inf, lambda t: t * torch.tensor(-inf), lambda t: t / torch.tensor(0.),
               lambda t: torch.sparse.sampled_addmm(t, torch.ones(3, 1), torch.tensor([[1., inf, 2., 3.]]), beta=0),
               lambda t: torch.sparse.sampled_addmm(t, torch.ones(3, 1), torch.tensor([[1., inf, 2., 3.]]))):
        torch.testing.assert_close(fn(s).to_dense(), fn(ref).to_dense(), equal_nan=True)
    w = torch.nn.Parameter(scorch.asformat(d, fmt))
    (w @ torch.tensor([[1.], [2.], [3.], [4.]]) * torch.tensor([[inf], [1.], [1.]])).sum().backward()
    g = w.grad.to_dense()
    assert g[1].isfinite().all() and g[2].eq(0).all()  # (rows without inf: exact; the padded row stays 0)


@pytest.mark.parametrize("fmt", ["csr", "coo"])
@pytest.mark.parametrize("sparse_grad", [False, True])
def test_embedding_with_a_sparse_weight_and_torchs_sparse_gradient(fmt, sparse_grad):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 4, generator=g, dtype=torch.float64) * (torch.rand(10, 4, generator=g) < 0.5)
    idx = torch.tensor([[1, 2, 4], [4, 3, 9]])
    param = torch.nn.Parameter(scorch.asformat(w, fmt))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        torch.nn.functional.embedding(idx, param, sparse=sparse_grad).pow(2).sum().backward()
    ref = w.clone().requires_grad_()
    torch.nn.functional.embedding(idx, ref).pow(2).sum().backward()
    torch.testing.assert_close(param.grad.to_dense(), ref.grad * (w != 0))


@pytest.mark.parametrize("shape", [(3, 8), (2, 3, 8), (8,)])
def test_linear_with_only_a_sparse_bias_or_sparse_input_and_weight(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    w = torch.randn(4, 8, generator=g, dtype=torch.float64)
    b = torch.tensor([0., 1.5, 0., -2.], dtype=torch.float64)
    torch.testing.assert_close(torch.nn.functional.linear(x, w, scorch.asformat(b, "coo")), x @ w.T + b)
    xs, ws = scorch.asformat(x.relu(), "coo"), scorch.asformat(w.relu(), "coo")
    y = torch.nn.functional.linear(xs, ws)
    torch.testing.assert_close(y.to_dense() if isinstance(y, scorch.SparseTensor) else y, x.relu() @ w.relu().T)


def test_initializers_and_out_never_write_a_dense_copy_silently():
    """``nn.init.uniform_(S)`` passes the tensor by keyword; ``torch.abs(S, out=o)``: each ran on a dense copy
    and left its target as it was. A constant fill raises (naming ``values()``); random initializers draw the
    stored values (stop 40: the pattern is a sparse weight's structure); a map's dense ``out`` is written."""
    s = scorch.asformat(M, "csr")
    for init in (lambda t: torch.nn.init.constant_(t, 0.5), lambda t: torch.nn.init.constant_(val=0.5, tensor=t)):
        with pytest.raises(NotImplementedError, match="values"):
            init(s)
        assert_matches_dense(s, M)
    for init in (lambda t: torch.nn.init.uniform_(t, 5, 6), lambda t: torch.nn.init.uniform_(tensor=t, a=5, b=6)):
        init(s)
        assert bool(((s.values() >= 5) & (s.values() <= 6)).all())
        assert_matches_dense(s, s.values().new_zeros(M.shape).index_put_(tuple(M.nonzero().t()), s.values()))
    torch.nn.init.uniform_(s.values(), 5, 6)  # (the stored entries)
    assert bool(((s.values() >= 5) & (s.values() <= 6)).all())
    s = scorch.asformat(M, "csr")
    for fn in (torch.abs, torch.neg, torch.tanh, torch.sign, torch.sin, torch.square):
        out = torch.full((2, 3), 99.)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", scorch.DensifyWarning)
            r = fn(s, out=out)
        assert r is out
        torch.testing.assert_close(out, fn(M))
        with pytest.raises(NotImplementedError, match="in place"):
            fn(s, out=scorch.asformat(M, "csr"))


@pytest.mark.parametrize("make", ["transposed", "permuted", "ell", "uncoalesced"])
def test_coalesce_gives_coalesced_coo_for_torchs_coo_layout(make):
    """torch code calls ``coalesce()`` then reads ``indices()``: a transposed COO view (and any tensor of torch's
    COO layout) must come back as coalesced COO."""
    x = torch.tensor([[0., 1, 0], [2, 0, 3]])
    if make == "transposed":
        s, d = scorch.asformat(x, "coo").t(), x.t()
    elif make == "permuted":
        s, d = scorch.asformat(x[None], "coo").permute(2, 0, 1), x[None].permute(2, 0, 1)
    elif make == "ell":
        s, d = scorch.asformat(x, "ell"), x
    else:
        s = scorch.sparse_coo_tensor(torch.tensor([[1, 0, 1], [2, 1, 0]]), torch.tensor([1., 1., 2.]), (2, 3))
        s, d = s + scorch.sparse_coo_tensor(torch.tensor([[1], [2]]), torch.tensor([2.]), (2, 3)), x
    c = s.coalesce()
    assert c.is_coalesced() and c.layout == torch.sparse_coo
    ref = d.to_sparse().coalesce()
    assert torch.equal(c.indices(), ref.indices()) and torch.equal(c.values(), ref.values())
    assert torch.equal(c.to_torch().to_dense(), d)


@pytest.mark.parametrize("fmt", ["coo", "csf"])
def test_products_broadcasting_a_sparse_batch_dimension_run_dense(fmt):
    """torch's matmul broadcasts a size-1 batch dimension; the kernels do not along a sparse operand's: the
    product runs on the dense form (warned, counted) instead of stopping the program."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 4, 5, generator=g) * (torch.rand(1, 4, 5, generator=g) < 0.5)
    s = scorch.asformat(x, fmt)
    d, e = torch.randn(3, 5, 6, generator=g), torch.randn(3, 2, 4, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        torch.testing.assert_close(torch.matmul(s, d), torch.matmul(x, d))
        torch.testing.assert_close(s @ d, x @ d)
        torch.testing.assert_close(e @ s, e @ x)
    with scorch.strict(), pytest.raises(scorch.DensifyError):
        torch.matmul(s, d)


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell"])
def test_torch_functions_take_out_as_torch_does(fmt):
    """``torch.sum(S, 1, out=o)``, ``torch.add`` / ``torch.mul`` / ``torch.bmm`` / ``torch.max(dim)`` with ``out=``
    raised a TypeError (their implementations had no ``out=``): the result is written into the dense ``out``."""
    g = torch.Generator().manual_seed(3)
    M = torch.randn(4, 5, generator=g) * (torch.rand(4, 5, generator=g) < 0.5)
    X = torch.randn(5, 3, generator=g)
    s = scorch.asformat(M, fmt)
    cases = [(lambda o: torch.sum(s, 1, out=o), M.sum(1)), (lambda o: torch.add(s, M, out=o), M + M),
             (lambda o: torch.mul(s, 2.0, out=o), M * 2), (lambda o: torch.sub(s, M, out=o), M - M)]
    if fmt == "coo":
        b = scorch.asformat(M[None], "coo")
        cases.append((lambda o: torch.bmm(b, X[None], out=o), (M @ X)[None]))
    for call, ref in cases:
        out = torch.full(ref.shape, 7.0)
        r = call(out)
        assert r is out and torch.allclose(out, ref, atol=1e-6)
    vals, idx = torch.empty(4), torch.empty(4, dtype=torch.long)
    r = torch.max(s, 1, out=(vals, idx))
    assert r[0] is vals and torch.equal(vals, M.max(1).values) and torch.equal(idx, M.max(1).indices)
    with pytest.raises(NotImplementedError, match="in place"):
        torch.sum(s, 1, out=scorch.asformat(torch.zeros(4), "coo"))


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell", "bsr(2, 2)"])
def test_products_under_autocast_run_in_the_autocast_dtype(fmt):
    """Inside ``torch.autocast("cpu")`` torch's products return bfloat16; the sparse ones returned float32 (a
    model's next op then met mixed dtypes). Repeated: the kept call (and its C operator) stands aside inside
    autocast and is taken again outside it."""
    g = torch.Generator().manual_seed(5)
    M = torch.randn(6, 5, generator=g) * (torch.rand(6, 5, generator=g) < 0.5)
    X, b = torch.randn(5, 3, generator=g), torch.randn(6, 3, generator=g)
    s = scorch.asformat(M, fmt)
    calls = {"@": lambda: s @ X, "mv": lambda: torch.mv(s, X[:, 0]), "rmatmul": lambda: X.t() @ s.t(),
             "linear": lambda: torch.nn.functional.linear(X.t(), s, b[:, 0]), "addmm": lambda: torch.addmm(b, s, X),
             "einsum": lambda: torch.einsum("ij,jk->ik", s, X), "spgemm": lambda: s @ s.t()}
    for _ in range(3):
        for name, call in calls.items():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                r = call()
                with torch.autocast("cpu", enabled=False):
                    dense = {"@": M @ X, "mv": M @ X[:, 0], "rmatmul": X.t() @ M.t(), "spgemm": M @ M.t(),
                             "linear": X.t() @ M.t() + b[:, 0], "addmm": b + M @ X, "einsum": M @ X}[name]
            assert r.dtype == torch.bfloat16, name
            got = r.to_dense() if isinstance(r, scorch.SparseTensor) else r
            torch.testing.assert_close(got.float(), dense, atol=0.1, rtol=0.05)
            outside = call()
            assert outside.dtype == torch.float32, name
            got = outside.to_dense() if isinstance(outside, scorch.SparseTensor) else outside
            torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    w = scorch.asformat(M, fmt).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = w @ X
    y.float().sum().backward()
    ref = scorch.asformat(M, fmt).requires_grad_()
    (ref @ X).sum().backward()
    assert w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad.to_dense(), ref.grad.to_dense(), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("fmt", ["(i, j, k) -> (i : dense, j : dense, k : fixed)",
                                 "(i, j, k) -> (i : dense, j : compressed, k : fixed)"])
@pytest.mark.parametrize("dims", [0, 2, (0, 2), (0, 1, 2)])
def test_extrema_of_padded_formats_with_three_dimensions(fmt, dims):
    """A 3-d padded format was converted to "csr" first: 'format csr is for 2-d tensors'."""
    g = torch.Generator().manual_seed(7)
    d = torch.randn(2, 3, 4, generator=g) * (torch.rand(2, 3, 4, generator=g) < 0.5)
    s = scorch.asformat(d, fmt)
    for name in ("amax", "amin"):
        torch.testing.assert_close(getattr(s, name)(dims), getattr(d, name)(dims))


@pytest.mark.parametrize("dtype", [torch.int32])
def test_one_operand_einsum_sums_integers_to_int64_as_torch(dtype):
    """torch's one-operand einsum sums with ``torch.sum``: int32 values summed over an index give int64 (scorch gave
    int32, values equal); a permutation or a diagonal keeps the dtype."""
    t = torch.randint(-3, 4, (3, 3, 3), dtype=dtype, generator=torch.Generator().manual_seed(4))
    s = scorch.asformat(t, "coo")
    for eq in ("ijk->k", "iij->j", "ijk->", "ijk->kji", "ijj->ij", "ijk", "jik"):
        want = torch.einsum(eq, t)
        got = scorch.einsum(eq, s)
        got = got.to_dense() if isinstance(got, scorch.SparseTensor) else got
        assert got.dtype == want.dtype, eq
        assert torch.equal(got, want), eq


def test_addmm_of_integer_operands_takes_its_scalars_as_integers():
    """torch's ``addmm`` of int64 operands with ``beta=0.5, alpha=2`` is int64 (the scalars as integers: 0 and 2);
    scorch gave float32 ``[[16.5, ...]]``."""
    c = torch.ones(2, 2, dtype=torch.int64)
    a = torch.tensor([[1, 0], [0, 2]])
    b = torch.tensor([[8, 11], [6, 7]])
    for fmt in ("coo", "csr"):
        for fn in (torch.addmm, torch.sparse.addmm):
            got = fn(c, scorch.asformat(a, fmt), b, beta=0.5, alpha=2)
            want = torch.addmm(c, a, b, beta=0.5, alpha=2)
            assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_count_nonzero_any_all_check_their_dims(fmt):
    """``count_nonzero(S, 5)`` read dim 5 as dim 1 (wrapped), ``any(S, (0, 1, 1))`` took the repeat: torch raises."""
    d = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]])
    s = scorch.asformat(d, fmt)
    for fn in (torch.count_nonzero, torch.any, torch.all):
        for dim in (5, -3, 2):
            with pytest.raises(IndexError, match="out of range"):
                fn(s, dim)
    for dims in ((0, 0), (0, 1, 1)):
        with pytest.raises(RuntimeError, match="multiple times"):
            torch.count_nonzero(s, dims)
    torch.testing.assert_close(torch.count_nonzero(s, -1), torch.count_nonzero(d, -1))


@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_embedding_max_norm_renorms_the_sparse_weight_in_place(fmt):
    """``F.embedding(idx, S, max_norm=1)`` renormed a dense copy (the fallback): the lookup was right, ``S`` kept
    its old rows, silently. Its looked-up rows are rescaled in place, as torch does to a dense weight."""
    import torch.nn.functional as F
    w = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 0.0], [0.0, 6.0, 8.0], [0.0, 0.3, 0.4]], dtype=torch.float64)
    idx = torch.tensor([0, 2, 3])
    for fn, kw in ((F.embedding, {}), (F.embedding_bag, {"offsets": torch.tensor([0, 2])})):
        dense, s = w.clone(), scorch.asformat(w, fmt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", scorch.DensifyWarning)
            got = fn(idx, s, max_norm=1.0, **kw)
        want = fn(idx, dense, max_norm=1.0, **kw)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(s.to_dense(), dense)


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc", "bsr(2, 2)", "ell", "dia"])
def test_dense_copy_from_a_sparse_tensor(fmt):
    """``dense.copy_(S)`` (a dense model loading a sparse model's state dict) gives S's dense form, broadcast and cast
    as torch's copy_, differentiable, and without a fallback (it had warned on every ``load_state_dict``)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64) * (torch.rand(4, 6, generator=g) < 0.5)
    s = scorch.asformat(x, fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)
        lin = torch.nn.Linear(6, 4, bias=False)
        lin.load_state_dict({"weight": s})
        batch = torch.full((2, 4, 6), 7.0).copy_(s)
        leaf = s.detach().requires_grad_()
        out = torch.zeros(4, 6, dtype=torch.float64).copy_(leaf)
    torch.testing.assert_close(lin.weight.detach(), x.float())
    torch.testing.assert_close(batch, x.float().expand(2, 4, 6))
    (out * torch.arange(24.0, dtype=torch.float64).reshape(4, 6)).sum().backward()
    ref = x.clone().requires_grad_()
    (torch.zeros(4, 6, dtype=torch.float64).copy_(ref) * torch.arange(24.0, dtype=torch.float64).reshape(4, 6)).sum().backward()
    torch.testing.assert_close(leaf.grad.to_dense() * (x != 0), ref.grad * (x != 0))


def test_shape_errors_are_runtime_errors_as_torchs():
    """Code written for torch catches a shape mismatch as ``RuntimeError``: scorch's are that and a ValueError."""
    s = scorch.asformat(torch.eye(3, 5), "csr")
    for call in (lambda: s @ torch.randn(4, 2), lambda: s + scorch.asformat(torch.eye(4, 5), "csr"),
                 lambda: scorch.einsum("ij,jk->ik", s, torch.randn(4, 2))):
        with pytest.raises(RuntimeError) as caught:
            call()
        assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell", "dia"])
def test_full_like(fmt):
    """``full_like(S, 0)`` is zeros on S's pattern (sparse, as ``zeros_like``); another value is torch's dense result
    (the fallback) outside an optimizer step, and fills the stored entries inside ``stored_only()`` where S has no
    padding."""
    from scorch import SparseTensor
    x = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]])
    s = scorch.asformat(x, fmt)
    z = torch.full_like(s, 0, dtype=torch.float64)
    assert isinstance(z, SparseTensor) and z.dtype == torch.float64 and not z.to_dense().any()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        dense = torch.full_like(s, 2.5)
        with scorch.stored_only():
            filled = torch.full_like(s, 2.5)
    assert type(dense) is torch.Tensor and torch.equal(dense, torch.full_like(x, 2.5))
    if not s.format.padded:
        assert isinstance(filled, SparseTensor)
        stored = s.detach().with_values(torch.ones_like(s.values())).to_dense() != 0
        torch.testing.assert_close(filled.to_dense(), 2.5 * stored.float())
