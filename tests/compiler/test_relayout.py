"""Dense operands read along a dimension other than their last get a copy with that dimension last."""
import io

import pytest
import torch

import scorch
from scorch.compiler import relayout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int16, torch.bool])
@pytest.mark.parametrize("shape", [(5, 7), (1, 1), (0, 3), (3, 4, 5), (2, 33, 65), (40, 70)])
def test_dim_last_matches_torch(shape, dtype):
    x = (torch.randn(shape) * 10).to(dtype)
    for d in range(len(shape)):
        torch.testing.assert_close(relayout.dim_last(x, d), x.movedim(d, -1).contiguous())


def test_dim_last_of_a_non_contiguous_view():
    x = torch.randn(6, 8)[:, ::2]
    torch.testing.assert_close(relayout.dim_last(x, 0), x.t().contiguous())


def test_sddmm_reads_mat2_through_a_copy():
    g = torch.Generator().manual_seed(0)
    dense = (torch.rand(400, 500, generator=g) < 0.01) * torch.randn(400, 500, generator=g)
    s = scorch.asformat(dense, "csr")  # sparse enough that the contraction stays one SDDMM kernel
    a, b = torch.randn(400, 16, generator=g), torch.randn(16, 500, generator=g)
    buf = io.StringIO()
    scorch.explain("ij,ik,kj->ij", s, a, b, file=buf)
    assert "relayout:     T2" in buf.getvalue()
    r = scorch.einsum("ij,ik,kj->ij", s, a, b)
    torch.testing.assert_close(r.to_dense(), dense * (a @ b))


def test_a_transposed_view_is_read_in_its_memory_order():
    """``k.T`` (a view of a contiguous k) as the SDDMM's mat2: read as k itself, neither copied nor relaid out;
    3-d permuted views give torch's values too."""
    g = torch.Generator().manual_seed(1)
    dense = (torch.rand(400, 500, generator=g) < 0.01) * torch.randn(400, 500, generator=g)
    s = scorch.asformat(dense, "csr")
    a, k = torch.randn(400, 16, generator=g), torch.randn(500, 16, generator=g)
    buf = io.StringIO()
    scorch.explain("ij,ik,kj->ij", s, a, k.T, file=buf)
    assert "relayout" not in buf.getvalue()
    torch.testing.assert_close(scorch.einsum("ij,ik,kj->ij", s, a, k.T).to_dense(), dense * (a @ k.T))
    x = torch.randn(3, 500, 4, generator=g).permute(2, 0, 1)  # (4, 3, 500), strides (1, 2000, 4)
    torch.testing.assert_close(scorch.einsum("ij,abj->abi", s, x), torch.einsum("ij,abj->abi", dense, x))


def test_no_copy_when_the_operand_is_large_next_to_the_reads():
    s = scorch.asformat(torch.eye(200)[:, :1] * 0 + torch.eye(200)[:, :1], "csr")  # one stored entry
    b = torch.randn(4, 1)
    assert relayout.moves((("i", "j"), ("k", "j")), [s, torch.randn(4, 1)], _sched(s, b), {"i": 200, "j": 1, "k": 4},
                         frozenset()) == ()


def _sched(s, b):
    from scorch.engine import tensor_type as _type
    from scorch.compiler.einsum import to_index_notation
    from scorch.compiler.infer import infer
    from scorch.compiler.ir import Assignment
    from scorch.compiler.schedule import schedule
    asg = Assignment(("i", "k"), to_index_notation((("i", "j"), ("k", "j"))), (_type(s), _type(b)), "sum", None)
    return schedule(asg, infer(asg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [0, 5, 40000])
def test_gather_matches_index_select(dtype, index_dtype, n):
    g = torch.Generator().manual_seed(n)
    src = (torch.randn(n + 3, generator=g) * 100).to(dtype)
    index = torch.randint(0, n + 3, (n,), generator=g).to(index_dtype)
    assert torch.equal(relayout.gather(src, index), torch.index_select(src, 0, index))


def _sddmm_operands(seed=2):
    g = torch.Generator().manual_seed(seed)
    dense = (torch.rand(300, 400, generator=g) < 0.02) * torch.randn(300, 400, generator=g)
    return dense, scorch.asformat(dense, "csr"), torch.randn(300, 16, generator=g), torch.randn(16, 400, generator=g)


def test_the_copy_is_kept_for_the_same_unchanged_operand(monkeypatch):
    """A second call with the same ``B`` reuses the copy made at the first; an in-place change of ``B`` (its version
    counter), another tensor with the same values, or ``B`` reshaped in place make a new one; the copy dies with
    ``B``."""
    dense, s, a, b = _sddmm_operands()
    copies = []
    real = relayout.dim_last
    monkeypatch.setattr(relayout, "dim_last", lambda x, d, *alloc: copies.append(d) or real(x, d, *alloc))
    for _ in range(3):
        torch.testing.assert_close(scorch.einsum("ij,ik,kj->ij", s, a, b).to_dense(), dense * (a @ b))
    torch.testing.assert_close(torch.sparse.sampled_addmm(s, a, b).to_dense(), dense + (a @ b) * (dense != 0))
    assert len(copies) == 1
    b.mul_(-2)  # in place: the kept copy is stale
    torch.testing.assert_close(scorch.einsum("ij,ik,kj->ij", s, a, b).to_dense(), dense * (a @ b))
    assert len(copies) == 2
    with torch.no_grad():
        b[3, 7] = 100.0  # (an indexed write, under no_grad, counts too)
    torch.testing.assert_close(scorch.einsum("ij,ik,kj->ij", s, a, b).to_dense(), dense * (a @ b))
    assert len(copies) == 3
    b2 = b.clone()
    torch.testing.assert_close(scorch.einsum("ij,ik,kj->ij", s, a, b2).to_dense(), dense * (a @ b2))
    assert len(copies) == 4
    kept = scorch.cache_info()["relaid"][0]
    assert kept >= 2
    del b, b2
    assert scorch.cache_info()["relaid"][0] == kept - 2
    scorch.clear_caches()
    assert scorch.cache_info()["relaid"][0] == 0


def test_a_kept_copy_follows_writes_that_bypass_the_version_counter(monkeypatch):
    """Writes through ``.data`` (a hand-written optimizer step), a NumPy view, or one element through ``.data``
    (gradcheck's perturbations) leave ``B``'s version counter as it was: the copy is checked against ``B``'s bytes
    (``relayout.fingerprint``) and made again, and every result is the dense product's."""
    dense, s, a, b = _sddmm_operands()
    copies = []
    real = relayout.dim_last
    monkeypatch.setattr(relayout, "dim_last", lambda x, d, *alloc: copies.append(d) or real(x, d, *alloc))

    def check():
        torch.testing.assert_close(torch.sparse.sampled_addmm(s, a, b).to_dense(), dense + (a @ b) * (dense != 0))
        torch.testing.assert_close(scorch.einsum("ij,ik,kj->ij", s, a, b).to_dense(), dense * (a @ b))

    check()
    check()
    assert len(copies) == 1
    version = b._version
    b.data.sub_(0.5 * torch.ones_like(b))       # p.data -= lr * p.grad
    b.numpy()[2, 5] += 3.0                      # a NumPy view
    assert b._version == version
    check()
    assert len(copies) == 2
    b.data[0, 0] += 1e-6                        # one element, as gradcheck perturbs
    check()
    assert len(copies) == 3
    check()
    assert len(copies) == 3


@pytest.mark.parametrize("n", [0, 1, 7, 8, 63, 64, 65, 1000, (1 << 16) + 9, 3 << 17])
def test_the_fingerprint_sees_every_changed_word(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    f = relayout.fingerprint(x)
    assert relayout.fingerprint(x.clone()) == f
    for at in sorted({0, n // 2, n - 1}) if n else ():
        y = x.clone()
        y[at] ^= 1 << (at % 8)
        assert relayout.fingerprint(y) != f, at
    if n >= 16:                                 # two words swapped
        y = x.clone()
        y[:8], y[8:16] = x[8:16].clone(), x[:8].clone()
        assert torch.equal(y, x) or relayout.fingerprint(y) != f
    assert relayout.fingerprint(x[: max(n - 1, 0)].clone()) != f or n == 0


def test_kept_copies_stay_under_their_budget(monkeypatch):
    monkeypatch.setattr(relayout, "KEEP_BYTES", 3 * 16 * 400 * 4)  # room for three copies of B
    dense, s, a, _ = _sddmm_operands()
    bs = [torch.randn(16, 400) for _ in range(5)]
    for b in bs:
        torch.testing.assert_close(scorch.einsum("ij,ik,kj->ij", s, a, b).to_dense(), dense * (a @ b))
    assert sum(e[2].numel() * 4 for e in relayout._KEPT.values()) <= relayout.KEEP_BYTES
    assert [e[0]() for e in relayout._KEPT.values()][-3:] == bs[-3:]  # the most recent kept


def test_a_copy_is_not_kept_for_a_view():
    _, s, a, b = _sddmm_operands()
    k = b.t().contiguous()
    before = scorch.cache_info()["relaid"][0]
    scorch.einsum("ij,ik,kj->ij", s, a, k.T)
    assert scorch.cache_info()["relaid"][0] == before


def test_a_kept_copy_of_a_parameter_follows_its_updates():
    """An optimizer's step changes a parameter in place (under no_grad): the next call sees the new values, and the
    gradients are those of the dense product."""
    dense, s, a, b0 = _sddmm_operands(3)
    b = torch.nn.Parameter(b0.clone())
    opt = torch.optim.SGD([b], lr=0.01)
    for _ in range(3):
        ref_b = b.detach().clone().requires_grad_()
        want = dense * (a @ ref_b)
        got = scorch.einsum("ij,ik,kj->ij", s, a, b)
        torch.testing.assert_close(got.to_dense(), want.detach(), rtol=1e-4, atol=1e-4)
        opt.zero_grad()
        (got.values() ** 2).sum().backward()
        (want ** 2).sum().backward()
        torch.testing.assert_close(b.grad, ref_b.grad, rtol=1e-4, atol=1e-4)
        opt.step()


def test_a_source_written_between_calls_is_copied_without_fingerprints(monkeypatch):
    """A dense operand changed in place (its version bumped) before every call, as a parameter an optimizer steps,
    is relaid each call without a fingerprint and without a kept copy; once it stops changing, its copy is kept and
    reused again. Values stay the dense product's throughout."""
    prints, copies = [], []
    real_print, real_copy = relayout.fingerprint, relayout.dim_last
    monkeypatch.setattr(relayout, "fingerprint", lambda x: prints.append(1) or real_print(x))
    monkeypatch.setattr(relayout, "dim_last", lambda x, d, *alloc: copies.append(d) or real_copy(x, d, *alloc))
    dense, s, a, b = _sddmm_operands()

    def check():
        torch.testing.assert_close(scorch.einsum("ij,ik,kj->ij", s, a, b).to_dense(), dense * (a @ b))

    check()
    for step in range(4):
        with torch.no_grad():
            b.mul_(0.9).add_(0.01)
        prints.clear()
        check()
        if step:
            assert prints == [] and relayout._KEPT[id(b)][2] is None
    check()                                     # unchanged since: kept again
    copies.clear()
    check()
    assert copies == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_explicit_product_is_relaid_too(dtype):
    """``sampled_addmm(alpha=...)`` runs a kernel with an explicit product (alpha inside it): its k-major mat2 is
    relaid as the plain SDDMM's, twice (a repeated call replays the relayout), with torch's values."""
    from scorch import engine
    from scorch.compiler.ir import Access, Mul, Scalar
    g = torch.Generator().manual_seed(2)
    dense = (torch.rand(400, 500, generator=g) < 0.02) * torch.randn(400, 500, generator=g)
    s = scorch.asformat(dense, "csr").to(dtype)
    a, b = torch.randn(400, 16, generator=g).to(dtype), torch.randn(16, 500, generator=g).to(dtype)
    rhs = Mul((Scalar("alpha"), Access(0, ("i", "j")), Access(1, ("i", "k")), Access(2, ("k", "j"))))
    buf = io.StringIO()
    import contextlib
    with contextlib.redirect_stdout(buf):
        engine.run((("i", "j"), ("i", "k"), ("k", "j")), ("i", "j"), [s, a, b], rhs=rhs, scalars={"alpha": 0.5},
                   explain=True)
    assert "relayout:     T2" in buf.getvalue()
    want = (0.5 * (dense != 0) * (a.float() @ b.float())).to(dtype)  # (the product sampled at the pattern)
    for _ in range(2):
        r = scorch.sparse.sampled_addmm(s, a, b, beta=0.0, alpha=0.5)
        torch.testing.assert_close(r.to_dense().float(), want.float(), rtol=1e-2, atol=1e-2)


def test_reindexed_rewrites_one_operands_accesses():
    from scorch.compiler.ir import Access, Add, Map, Mul, Scalar, reindexed
    e = Add((Mul((Scalar("a"), Access(0, ("i", "j")), Access(1, ("k", "j")))), Map("neg", Access(1, ("k", "j")))))
    r = reindexed(e, 1, ("k", "j"), ("j", "k"))
    assert [a.indices for a in r.accesses()] == [("i", "j"), ("j", "k"), ("j", "k")]
    with pytest.raises(ValueError, match="accessed as"):
        reindexed(e, 1, ("j", "k"), ("k", "j"))
