"""Work that scorch does once per pattern and reuses: validation of index arrays passed again, conversions of
an unchanged tensor, the requested format of a gradient on its operand's pattern. Each must notice in-place
changes and never serve stale results."""
import pytest
import torch

import scorch
from scorch.formats import storage
from scorch.ops import segment

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")


def _csr_arrays():
    crow = torch.tensor([0, 2, 3, 5])
    col = torch.tensor([0, 2, 1, 0, 2])
    return crow, col


def test_same_arrays_are_validated_once_but_changes_are_caught():
    crow, col = _csr_arrays()
    calls = []
    original = storage.validate_uncached

    def counting(*a):
        calls.append(1)
        return original(*a)

    storage.validate_uncached = counting
    try:
        for _ in range(3):
            scorch.sparse_csr_tensor(crow, col, torch.randn(5), (3, 3))
        assert len(calls) == 1, "the same unchanged arrays are checked once"
        col[1] = 7                       # in place: out of range now
        with pytest.raises(ValueError, match="out of range"):
            scorch.sparse_csr_tensor(crow, col, torch.randn(5), (3, 3))
        col[1] = 2
        scorch.sparse_csr_tensor(crow, col.clone(), torch.randn(5), (3, 3))
        assert len(calls) == 3, "a new array object is checked again"
        with pytest.raises(ValueError, match="values"):
            scorch.sparse_csr_tensor(crow, col, torch.randn(4), (3, 3))
    finally:
        storage.validate_uncached = original


def test_conversion_is_reused_until_either_side_changes():
    x = torch.randn(30, 20) * (torch.rand(30, 20) < 0.3)
    s = scorch.asformat(x, "csr")
    c1 = scorch.asformat(s, "csc")
    assert scorch.asformat(s, "csc") is c1
    s.values().mul_(2)                   # the source changed: converted again
    c2 = scorch.asformat(s, "csc")
    assert c2 is not c1 and torch.equal(c2.to_dense(), 2 * x)
    c2.values().zero_()                  # the converted tensor changed: not served again
    c3 = scorch.asformat(s, "csc")
    assert c3 is not c2 and torch.equal(c3.to_dense(), 2 * x)


@pytest.mark.parametrize("fmt", ["csr", "csc", "dcsr", "coo"])
@pytest.mark.parametrize("log", [False, True])
def test_segment_softmax_matches_torch(fmt, log):
    x = torch.randn(9, 7, dtype=torch.float64) * (torch.rand(9, 7) < 0.5)
    x[3] = 0                              # an empty row
    f = torch.sparse.log_softmax if log else torch.sparse.softmax
    for dim in (0, 1):
        s = scorch.asformat(x, fmt)
        vals = s.values().detach().clone().requires_grad_()
        got = f(s.with_values(vals), dim)
        torch.testing.assert_close(got.to_dense(), f(x.to_sparse(), dim).to_dense())
        torch.autograd.gradcheck(lambda v: f(s.with_values(v), dim).values(), (vals,))
        torch.autograd.gradgradcheck(lambda v: f(s.with_values(v), dim).values(), (vals,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("log", [False, True])
def test_segment_softmax_short_and_long_rows(dtype, log):
    """Rows shorter than ``fuse.SHORT_ROW`` run plain loops, longer ones simd loops: both give torch's softmax and
    its gradient (row lengths 0 to 40, one row of -inf, large values that would overflow unshifted)."""
    from scorch.compiler import fuse
    lengths = list(range(0, 41)) + [fuse.SHORT_ROW - 1, fuse.SHORT_ROW, fuse.SHORT_ROW + 1, 3, 200]
    n = max(lengths)
    x = torch.randn(len(lengths), n, dtype=dtype) * 30
    keep = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    keep = keep[:, torch.randperm(n)]
    s = scorch.asformat(x * keep, "csr")
    vals = x[keep].clone()
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    vals[rows == 5] = float("-inf")  # (row 5 all -inf: NaN, as torch gives)
    vals = vals.requires_grad_()
    f = torch.sparse.log_softmax if log else torch.sparse.softmax
    got = f(s.with_values(vals), 1).values()
    ref_in = vals.detach().clone().requires_grad_()
    dense = torch.full((len(lengths), n), float("-inf"), dtype=dtype)
    dense = dense.masked_scatter(keep, ref_in)
    want = (torch.log_softmax if log else torch.softmax)(dense, 1)[keep]
    torch.testing.assert_close(got, want, equal_nan=True)
    g = torch.randn_like(got)
    g[rows == 5] = 0
    (dv,), (dref,) = torch.autograd.grad(got, vals, g), torch.autograd.grad(want, ref_in, g)
    ok = rows != 5
    torch.testing.assert_close(dv[ok], dref[ok])


def test_csr_softmax_runs_the_segment_kernel():
    s = scorch.asformat(torch.randn(6, 6) * (torch.rand(6, 6) < 0.5), "csr")
    assert segment.SegmentSoftmax is not None
    out = torch.sparse.softmax(s.requires_grad_(), 1)
    assert type(out.values().grad_fn).__name__ == "SegmentSoftmaxBackward"


def test_gradient_in_requested_format_shares_the_pattern():
    s = scorch.asformat(torch.randn(40, 40) * (torch.rand(40, 40) < 0.1), "csr")
    a, b = torch.randn(40, 8), torch.randn(40, 8)
    text = scorch.explain("ij,ik,jk->ij", s, a, b, format=s.format, file=open("/dev/null", "w"))
    assert "requested, which is the driver's pattern" in text and "dense workspace" not in text


def test_conversion_by_known_permutation_follows_the_values():
    crow, col = _csr_arrays()
    first = scorch.sparse_csr_tensor(crow, col, torch.arange(5.0), (3, 3))
    scorch.asformat(first, "csc")
    before = scorch.cache_info()["permutations"][0]
    for k in range(3):                    # other values on the same arrays: one gather each, right values
        vals = torch.randn(5)
        s = scorch.sparse_csr_tensor(crow, col, vals, (3, 3))
        c = scorch.asformat(s, "csc")
        torch.testing.assert_close(c.to_dense(), s.to_dense())
        c.check_invariants()
    assert scorch.cache_info()["permutations"][0] == before
    col[0], col[1] = 1, 2                 # the pattern changed in place: the permutation is recomputed
    s = scorch.sparse_csr_tensor(crow, col, torch.randn(5), (3, 3))
    torch.testing.assert_close(scorch.asformat(s, "csc").to_dense(), s.to_dense())


def test_transposed_product_of_fresh_values_on_one_pattern():
    x = torch.randn(30, 20) * (torch.rand(30, 20) < 0.3)
    s = scorch.asformat(x, "csr")
    u = torch.randn(30, 5)
    for k in range(3):
        v = torch.randn(s.nnz)
        t = s.with_values(v)
        torch.testing.assert_close(t.t() @ u, t.to_dense().t() @ u)


@pytest.mark.parametrize("write", ["numpy", ".data", "one value"])
def test_kept_conversions_follow_values_written_around_the_version_counter(write):
    """Values written through a NumPy view or ``.data`` leave their version counter as it was: the conversions
    kept on the tensor (and the last values moved by a kept permutation) are checked against the values' bytes,
    so a transposed product after such a write is dense torch's, on the source and on a kept conversion."""
    g = torch.Generator().manual_seed(5)
    s = scorch.asformat(torch.randn(40, 30, generator=g) * (torch.rand(40, 30, generator=g) < 0.2), "csr")
    x = torch.randn(40, 6, generator=g)
    c = scorch.asformat(s, "csc")
    for _ in range(2):
        torch.testing.assert_close(s.t() @ x, s.to_dense().t() @ x)
    version = s.values()._version
    if write == "numpy":
        s.values().numpy()[:] *= 2
    elif write == ".data":
        s.values().data.sub_(1.0)
    else:
        s.values().data[3] += 0.25
    assert s.values()._version == version
    torch.testing.assert_close(s.t() @ x, s.to_dense().t() @ x)
    torch.testing.assert_close(scorch.asformat(s, "csc").to_dense(), s.to_dense())
    c2 = scorch.asformat(s, "csc")
    c2.values().numpy()[:] = 0.0            # the kept conversion itself written: made again from the source
    torch.testing.assert_close(scorch.asformat(s, "csc").to_dense(), s.to_dense())
    assert c.values().numel() == s.nnz


def test_copy_of_another_pattern_drops_kept_conversions():
    a = torch.tensor([[1., 0, 2], [0, 3, 0]])
    b = torch.tensor([[0., 5, 0], [6, 0, 7]])
    S = scorch.asformat(a, "csr")
    scorch.asformat(S, "csc")  # kept on S
    S.copy_(scorch.asformat(b, "csr"))
    assert torch.equal(scorch.asformat(S, "csc").to_dense(), b)


def test_a_recurring_pattern_is_transposed_for_a_product_that_reads_it_transposed():
    """``A^T G`` on a pattern that comes back with new values every step (GAT's attention gradient): the first call
    weighs the pattern and runs the loop nest over the rows (its kernel kept under no signature, so the choice is
    not fixed); from the second on, a transposition by the pattern's kept permutation (one gather) and a product
    parallel over the output's rows. The values equal dense torch's at every step, and an in-place change of the
    pattern is followed."""
    scorch.clear_caches()
    n, k = 300, 8
    mask = (torch.rand(n, n) < 0.02) | torch.eye(n, dtype=torch.bool)
    x = mask.float().to_sparse_csr()
    crow, col = x.crow_indices().clone(), x.col_indices().clone()
    reformats = []
    for step in range(4):
        a = scorch.sparse_csr_tensor(crow, col, torch.randn(col.numel()), (n, n))
        g = torch.randn(n, k)
        torch.testing.assert_close(scorch.einsum("ij,ik->jk", a, g), a.to_dense().T @ g)
        text = scorch.explain("ij,ik->jk", a, g, file=open("/dev/null", "w"))
        reformats.append("reformat:" in text)
    assert reformats == [True] * 4, reformats  # (the first call weighed it; explain's calls see it again)
    other = scorch.sparse_csr_tensor(crow.clone(), col.clone(), torch.randn(col.numel()), (n, n))
    text = scorch.explain("ij,ik->jk", other, torch.randn(n, k), file=open("/dev/null", "w"))
    assert "reformat:" not in text, "a pattern never seen before is not transposed for one product"
    col[0], col[1] = col[1].item(), col[0].item()  # (row 0's first two entries swapped: unordered now)
    col[0], col[1] = col[1].item(), col[0].item()  # and back: the same pattern, new versions
    a = scorch.sparse_csr_tensor(crow, col, torch.randn(col.numel()), (n, n))
    g = torch.randn(n, k)
    torch.testing.assert_close(scorch.einsum("ij,ik->jk", a, g), a.to_dense().T @ g)


def test_steps_before_a_kernel_are_replayed_without_planning(monkeypatch):
    """A call whose operands take steps before the kernel (a dense operand relaid; a recurring pattern transposed)
    replays them from the second call on without planning (``run.STEPS``); another pattern of the same signature,
    or one changed in place, is weighed again. Values equal dense torch's throughout."""
    import importlib
    run = importlib.import_module("scorch.engine.run")
    scorch.clear_caches()
    planned = []
    real = run.planned
    monkeypatch.setattr(run, "planned", lambda *a: planned.append(1) or real(*a))
    x = scorch.asformat(torch.randn(50, 70) * (torch.rand(50, 70) < 0.1), "csr")
    w = torch.randn(24, 70)                   # read along its first dimension: relaid before the kernel
    for step in range(3):
        planned.clear()
        torch.testing.assert_close(scorch.einsum("ij,oj->io", x, w), x.to_dense() @ w.T)
        if step:
            assert not planned, "replayed: no planning"
    n, k = 300, 8
    mask = ((torch.rand(n, n) < 0.02) | torch.eye(n, dtype=torch.bool)).float().to_sparse_csr()
    crow, col = mask.crow_indices().clone(), mask.col_indices().clone()
    for step in range(4):
        planned.clear()
        a = scorch.sparse_csr_tensor(crow, col, torch.randn(col.numel()), (n, n))
        g = torch.randn(n, k)
        torch.testing.assert_close(scorch.einsum("ij,ik->jk", a, g), a.to_dense().T @ g)
        if step >= 2:
            assert not planned, "replayed: the pattern's transposition and the kept call"
    other = scorch.sparse_csr_tensor(crow.clone(), col.clone(), torch.randn(col.numel()), (n, n))
    planned.clear()
    torch.testing.assert_close(scorch.einsum("ij,ik->jk", other, g), other.to_dense().T @ g)
    assert planned, "another pattern of the same signature is weighed again"
    col[0], col[1] = col[1].item(), col[0].item()
    col[0], col[1] = col[1].item(), col[0].item()   # the same pattern, changed in place (new versions)
    a = scorch.sparse_csr_tensor(crow, col, torch.randn(col.numel()), (n, n))
    torch.testing.assert_close(scorch.einsum("ij,ik->jk", a, g), a.to_dense().T @ g)


def test_patterns_that_do_not_recur_are_kept_as_before(monkeypatch):
    """A transposed product on a new pattern every call (same signature): after a few, the call is kept under its
    signature (no planning each call), and the values stay right."""
    import importlib
    run = importlib.import_module("scorch.engine.run")
    scorch.clear_caches()
    planned = []
    real = run.planned
    monkeypatch.setattr(run, "planned", lambda *a: planned.append(1) or real(*a))
    n, k = 310, 8
    for step in range(8):
        mask = ((torch.rand(n, n) < 0.02) | torch.eye(n, dtype=torch.bool)).float().to_sparse_csr()
        a = scorch.sparse_csr_tensor(mask.crow_indices(), mask.col_indices(), torch.randn(mask.values().numel()),
                                     (n, n))
        g = torch.randn(n, k)
        planned.clear()
        torch.testing.assert_close(scorch.einsum("ij,ik->jk", a, g), a.to_dense().T @ g)
        if step >= 5:
            assert not planned, step


def _kept_product_cases():
    g = torch.Generator().manual_seed(7)
    d = torch.randn(9, 7, generator=g) * (torch.rand(9, 7, generator=g) < 0.4)
    return d, scorch.asformat(d, "csr"), torch.randn(7, 5, generator=g), torch.randn(4, 9, generator=g)


def test_a_repeated_operator_product_takes_the_call_kept_on_the_tensor():
    """``S @ X`` and ``X @ S`` keep their prepared call on ``S`` and reuse it (``engine.kept_product``), with the
    same results as the first call; every other operand kind goes the long way and is right. (Under
    ``SCORCH_DEFER=all`` products defer instead: the default mode here.)"""
    from scorch.engine import evaluate
    with scorch.deferred.deferral("auto"):
        _repeated_operator_products(evaluate)


def _repeated_operator_products(evaluate):
    d, s, x, w = _kept_product_cases()
    v, u = x[:, 0].contiguous(), w[0].contiguous()
    for _ in range(3):
        torch.testing.assert_close(s @ x, d @ x)
        torch.testing.assert_close(w @ s, w @ d)
        torch.testing.assert_close(s @ v, d @ v)
        torch.testing.assert_close(u @ s, u @ d)
    assert evaluate.kept_product(s, x, True) and evaluate.kept_product(s, w, False)
    assert evaluate.kept_product(s, v, True) and evaluate.kept_product(s, u, False)
    # other operands of the kept shapes: none of them takes the kept call
    xt = torch.randn(5, 7).t()                         # not contiguous
    assert evaluate.kept_product(s, xt, True) is None
    torch.testing.assert_close(s @ xt, d @ xt)
    xg = x.clone().requires_grad_(True)                # a gradient to record
    assert evaluate.kept_product(s, xg, True) is None
    (s @ xg).sum().backward()
    torch.testing.assert_close(xg.grad, d.t() @ torch.ones(9, 5))
    with torch.no_grad():                              # no gradient recorded: the kept call serves it
        assert evaluate.kept_product(s, xg, True)
        torch.testing.assert_close(s @ xg, d @ x)
    x64 = x.double()                                   # another dtype
    assert evaluate.kept_product(s, x64, True) is None
    torch.testing.assert_close(s.double() @ x64, d.double() @ x64)
    xs = x.to_sparse_csr()                             # a torch sparse operand
    assert evaluate.kept_product(s, xs, True) is None
    torch.testing.assert_close((s @ xs).to_dense(), d @ x)


def test_a_kept_product_follows_the_pattern_and_the_caches():
    """An in-place change of ``S``'s pattern, its values' dtype, the caches emptied, another CPU backend, or
    deferral: the kept call is not used where it would be wrong or would skip what the mode asks for."""
    from scorch.engine import evaluate
    with scorch.deferred.deferral("auto"):
        _kept_product_follows_changes(evaluate)


def _kept_product_follows_changes(evaluate):
    d, s, x, _ = _kept_product_cases()
    torch.testing.assert_close(s @ x, d @ x)
    torch.testing.assert_close(s @ x, d @ x)
    d2 = torch.randn(9, 7) * (torch.rand(9, 7) < 0.6)
    s.copy_(scorch.asformat(d2, "coo"))                # another pattern (and format) in place
    torch.testing.assert_close(s @ x, d2 @ x)
    torch.testing.assert_close(s @ x, d2 @ x)
    s.values().mul_(2)                                 # values changed in place: read at each call
    torch.testing.assert_close(s @ x, 2 * d2 @ x)
    assert evaluate.kept_product(s, x, True)
    scorch.clear_caches()
    assert evaluate.kept_product(s, x, True) is None
    torch.testing.assert_close(s @ x, 2 * d2 @ x)
    with scorch.engine.cpu_backend("interp"):
        assert evaluate.kept_product(s, x, True) is None
        torch.testing.assert_close(s @ x, 2 * d2 @ x)
    with scorch.deferred.deferral("all"):
        r = s @ x
        assert isinstance(r, scorch.deferred.Deferred)
        torch.testing.assert_close(r.compute(), 2 * d2 @ x)


def test_a_repeated_sampled_addmm_takes_the_call_kept_on_the_input():
    """``sampled_addmm`` keeps its prepared call and the pattern of ones on the input (``engine.kept_sddmm``):
    a repeated call with operands of the kept shapes and dtypes takes it, with the same result as the first;
    an in-place change of pattern, of values, of the caches, a gradient to record or another alpha does not
    take it where it would be wrong."""
    from scorch.engine import evaluate
    g = torch.Generator().manual_seed(11)
    # (sparse enough for one kernel, not a dense product masked after; 16 columns: a whole number of vectors,
    # where the kernel reads its operands as given and the call is kept)
    d = torch.randn(64, 48, generator=g) * (torch.rand(64, 48, generator=g) < 0.05)
    s, a, b = scorch.asformat(d, "csr"), torch.randn(64, 16, generator=g), torch.randn(16, 48, generator=g)

    def want(d, a, b, beta=1.0, alpha=1.0):
        return beta * d + alpha * (d != 0) * (a @ b)

    for _ in range(3):
        torch.testing.assert_close(torch.sparse.sampled_addmm(s, a, b).to_dense(), want(d, a, b))
    assert evaluate.kept_sddmm(s, a, b)
    r = torch.sparse.sampled_addmm(s, a, b, beta=0.5)
    torch.testing.assert_close(r.to_dense(), want(d, a, b, beta=0.5))
    assert r.levels[1].crd is s.levels[1].crd                       # the input's pattern, shared
    torch.testing.assert_close(torch.sparse.sampled_addmm(s, a, b, alpha=2.0).to_dense(), want(d, a, b, alpha=2.0))
    torch.testing.assert_close(torch.sparse.sampled_addmm(s, 2 * a, b).to_dense(), want(d, 2 * a, b))
    bt = b.t().contiguous().t()                                       # not contiguous: the long way
    assert evaluate.kept_sddmm(s, a, bt) is None
    torch.testing.assert_close(torch.sparse.sampled_addmm(s, a, bt).to_dense(), want(d, a, b))
    assert evaluate.kept_sddmm(s, a, b)                               # (and the kept call still there)
    a4, b4 = a[:, :4].contiguous(), b[:4].contiguous()                # other shapes: their own call
    for _ in range(3):
        torch.testing.assert_close(torch.sparse.sampled_addmm(s, a4, b4).to_dense(), want(d, a4, b4))
        torch.testing.assert_close(torch.sparse.sampled_addmm(s, a, b).to_dense(), want(d, a, b))
    assert evaluate.kept_sddmm(s, a.double(), b.double()) is None
    ag = a.clone().requires_grad_(True)                               # a gradient to record
    assert evaluate.kept_sddmm(s, ag, b) is None
    torch.sparse.sampled_addmm(s, ag, b).values().sum().backward()
    torch.testing.assert_close(ag.grad, (d != 0).float() @ b.t())
    s.values().mul_(3)                                                # values changed in place: read each call
    torch.testing.assert_close(torch.sparse.sampled_addmm(s, a, b).to_dense(), want(3 * d, a, b))
    d2 = torch.randn(64, 48, generator=g) * (torch.rand(64, 48, generator=g) < 0.08)
    s.copy_(scorch.asformat(d2, "csr"))                               # another pattern in place
    assert evaluate.kept_sddmm(s, a, b) is None
    for _ in range(2):
        torch.testing.assert_close(torch.sparse.sampled_addmm(s, a, b).to_dense(), want(d2, a, b))
    assert evaluate.kept_sddmm(s, a, b)
    scorch.clear_caches()
    assert evaluate.kept_sddmm(s, a, b) is None
    torch.testing.assert_close(torch.sparse.sampled_addmm(s, a, b).to_dense(), want(d2, a, b))
    with scorch.engine.cpu_backend("interp"):
        assert evaluate.kept_sddmm(s, a, b) is None
        torch.testing.assert_close(torch.sparse.sampled_addmm(s, a, b).to_dense(), want(d2, a, b))
