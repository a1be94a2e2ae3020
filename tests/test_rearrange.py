"""``rearrange``: einops patterns on dense tensors and SparseTensors, checked against hand-written torch code."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scorch
from scorch.formats import named
from scorch.rearrange import rearrange


def _rand(*shape, density=0.5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=dtype)
    return x * (torch.rand(*shape, generator=g) < density)


# (pattern, sizes, input shape, the same rearrangement in plain torch)
CASES = [
    ("bd->bnd", dict(n=3), (4, 6), lambda x: x[:, None, :].expand(4, 3, 6)),
    ("b d -> b n d", dict(n=3), (4, 6), lambda x: x.unsqueeze(1).expand(-1, 3, -1)),
    ("bnd->nbd", {}, (2, 3, 4), lambda x: x.permute(1, 0, 2)),
    ("b n d -> n b d", {}, (2, 3, 4), lambda x: x.transpose(0, 1)),
    ("b(hd)->bhd", dict(h=2), (3, 8), lambda x: x.reshape(3, 2, 4)),
    ("b (h d) -> b h d", dict(h=2), (3, 8), lambda x: x.reshape(3, 2, 4)),
    ("b (h d) -> b h d", dict(d=2), (3, 8), lambda x: x.reshape(3, 4, 2)),
    ("b (h d) -> b h d", dict(h=4, d=2), (3, 8), lambda x: x.reshape(3, 4, 2)),
    ("bhd->b(hd)", {}, (2, 3, 4), lambda x: x.reshape(2, 12)),
    ("b h d -> b (d h)", {}, (2, 3, 4), lambda x: x.transpose(1, 2).reshape(2, 12)),
    ("ij->ji", {}, (3, 5), lambda x: x.T),
    ("ij->(ij)", {}, (3, 5), lambda x: x.reshape(15)),
    ("ij->(ji)", {}, (3, 5), lambda x: x.T.reshape(15)),
    ("i j -> (i 2) j", {}, (3, 4), lambda x: x.repeat_interleave(2, 0)),
    ("i j -> (r i) j", dict(r=2), (3, 4), lambda x: x.repeat(2, 1)),
    ("h w -> h w c", dict(c=3), (2, 5), lambda x: x[..., None].expand(2, 5, 3)),
    ("ij->1ij", {}, (3, 4), lambda x: x[None]),
    ("i j -> i () j 1", {}, (3, 4), lambda x: x[:, None, :, None]),
    ("(i 1) j -> j i", {}, (3, 4), lambda x: x.T),
    ("ij->ji", {}, (1, 1), lambda x: x.T),
    ("1 j -> j", {}, (1, 5), lambda x: x[0]),
    ("ij->ji", {}, (0, 3), lambda x: x.T),
    ("ij->jni", dict(n=2), (0, 3), lambda x: x.T[:, None, :].expand(3, 2, 0)),
    ("ij->jni", dict(n=0), (2, 3), lambda x: x.T[:, None, :].expand(3, 0, 2)),
    ("(ab)j->jab", dict(a=2), (0, 3), lambda x: x.reshape(2, 0, 3).permute(2, 0, 1)),
    ("abc->cab", {}, (2, 3, 4), lambda x: x.permute(2, 0, 1)),
    ("a b c -> c (a b)", {}, (2, 3, 4), lambda x: x.permute(2, 0, 1).reshape(4, 6)),
    ("a(bc)d->dcba", dict(b=3), (2, 6, 2), lambda x: x.reshape(2, 3, 2, 2).permute(3, 2, 1, 0)),
    ("b (h w) c -> (b h) (c w)", dict(h=2), (2, 6, 3),
     lambda x: x.reshape(2, 2, 3, 3).permute(0, 1, 3, 2).reshape(4, 9)),
    ("b ... -> ... b", {}, (2, 3, 4), lambda x: x.movedim(0, -1)),
    ("b ... d -> d (...) b", {}, (2, 3, 4, 5), lambda x: x.permute(3, 1, 2, 0).reshape(5, 12, 2)),
    ("b ... d -> d ... b", {}, (2, 5), lambda x: x.T),
    ("... -> ...", {}, (2, 3), lambda x: x),
    ("x -> x", {}, (4,), lambda x: x),
    ("x->xn", dict(n=2), (4,), lambda x: x[:, None].expand(4, 2)),
]
CASE_IDS = [f"{p}|{','.join(f'{k}={v}' for k, v in kw.items())}|{s}" for p, kw, s, _ in CASES]


# --- dense -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern,sizes,shape,ref", CASES, ids=CASE_IDS)
def test_dense_matches_torch(pattern, sizes, shape, ref):
    x = _rand(*shape, density=1.0)
    got = rearrange(x, pattern, **sizes)
    want = ref(x)
    assert got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("pattern,sizes,shape,ref", [c for c in CASES if 0 not in c[2]],
                         ids=[i for i, c in zip(CASE_IDS, CASES) if 0 not in c[2]])
def test_dense_gradcheck(pattern, sizes, shape, ref):
    x = _rand(*shape, density=1.0).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: rearrange(t, pattern, **sizes), (x,))


def test_dense_results_are_views():
    x = torch.randn(4, 6)
    r = rearrange(x, "bd->bnd", n=3)  # a repeat is a broadcast view (stride 0), not a copy
    assert r.data_ptr() == x.data_ptr() and r.stride() == (6, 0, 1)
    assert rearrange(x, "b (h d) -> h b d", h=2).data_ptr() == x.data_ptr()
    assert rearrange(x, "ij->ji")._base is x


def test_dense_list_input_is_stacked():
    xs = [torch.randn(3, 4) for _ in range(2)]
    assert torch.equal(rearrange(xs, "b h w -> h (b w)"), torch.stack(xs).permute(1, 0, 2).reshape(3, 8))


@settings(max_examples=40)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_dense_permutation_and_merge_property(shape, rnd):
    names = "abcd"[:len(shape)]
    perm = list(range(len(shape)))
    rnd.shuffle(perm)
    x = torch.randn(*shape)
    out = "".join(names[p] for p in perm)
    assert torch.equal(rearrange(x, f"{names}->{out}"), x.permute(perm))
    # merging everything in a permuted order, then splitting back, is the identity
    flat = rearrange(x, f"{names}->({out})")
    assert torch.equal(flat, x.permute(perm).reshape(-1))
    back = rearrange(flat, f"({out})->{names}", **{names[p]: shape[p] for p in perm[1:]})
    assert torch.equal(back, x)


# --- sparse ------------------------------------------------------------------------------------------------

FORMATS = ["csr", "coo", "csc", "bsr(2, 2)"]
SPARSE_PATTERNS = [
    ("ij->jni", dict(n=2)),
    ("ij->ji", {}),
    ("i(jk)->kij", dict(k=2)),
    ("i (j k) -> (k i) j", dict(k=3)),
    ("ij->(ij)", {}),
    ("ij->(ji)", {}),
    ("i j -> (i 2) j", {}),
    ("i j -> 1 i j", {}),
    ("(a i) j -> j a i r", dict(a=2, r=2)),
]


def _expected(S, pattern, sizes):
    return rearrange(S.to_dense(), pattern, **sizes)


def _check(R, want):
    assert type(R) is scorch.SparseTensor
    assert R.format == named.coo_nd(R.dim())  # canonical (coalesced) COO
    R.check_invariants()
    assert R.shape == want.shape
    assert torch.equal(R.to_dense(), want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pattern,sizes", SPARSE_PATTERNS, ids=[p for p, _ in SPARSE_PATTERNS])
def test_sparse_matches_dense(fmt, pattern, sizes):
    S = scorch.asformat(_rand(4, 6), fmt)
    _check(rearrange(S, pattern, **sizes), _expected(S, pattern, sizes))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pattern,sizes", SPARSE_PATTERNS[:4], ids=[p for p, _ in SPARSE_PATTERNS[:4]])
def test_sparse_gradcheck(fmt, pattern, sizes):
    S = scorch.asformat(_rand(4, 6, seed=1), fmt)
    v = S.values().detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda v: rearrange(S.with_values(v), pattern, **sizes).to_dense(), (v,))


def test_sparse_backward_through_values():
    S = scorch.asformat(_rand(4, 6, dtype=torch.float32), "csr").requires_grad_()
    R = rearrange(S, "ij->jni", n=3)
    assert R.requires_grad
    (R.values() * 2).sum().backward()
    assert torch.equal(S.grad.values(), torch.full_like(S.values(), 6.0))  # each entry repeated 3 times


def test_sparse_layout_matches_asformat():
    S = scorch.asformat(_rand(4, 6), "csr")
    R = rearrange(S, "ij->jni", n=2)
    ref = scorch.asformat(R.to_dense(), "coo")
    # the same entries (explicit zeros aside) with the index arrays asformat makes
    assert R.index_dtype == ref.index_dtype == torch.int32
    assert all(torch.equal(a.crd, b.crd) for a, b in zip(R.levels, ref.levels))
    assert torch.equal(R.levels[0].pos, ref.levels[0].pos)
    assert torch.equal(R.values(), ref.values())


@pytest.mark.parametrize("fmt", ["ell", "dia", "dcsr", "bsc(2, 2)", "bsr(2, 3)", "dense"])
def test_sparse_other_formats(fmt):
    S = scorch.asformat(_rand(4, 6, seed=2), fmt)
    for pattern, sizes in SPARSE_PATTERNS:
        _check(rearrange(S, pattern, **sizes), _expected(S, pattern, sizes))


def test_sparse_padding_is_not_carried():
    # bsr(2, 2) of a 3 x 5 matrix stores blocks reaching past the shape; ELL pads rows with zeros
    d = _rand(3, 5, seed=3)
    for fmt in ("bsr(2, 2)", "ell", "dia"):
        R = rearrange(scorch.asformat(d, fmt), "ij->ji")
        _check(R, d.T)
        assert R.nnz <= d.numel()


def test_sparse_ell_gradient_on_stored_entries():
    S = scorch.asformat(_rand(4, 6, seed=4), "ell").requires_grad_()
    rearrange(S, "ij->jin", n=2).values().sum().backward()
    # every nonzero slot gets 2 (two copies); padding (value 0) gets none
    assert torch.equal(S.grad.values(), (S.values() != 0).to(S.dtype) * 2)


def test_sparse_3d_and_1d():
    d = _rand(2, 3, 4, seed=5)
    for fmt in ("coo", "csf"):
        S = scorch.asformat(d, fmt)
        for pattern, sizes in [("abc->cab", {}), ("a b c -> c (a b)", {}), ("a b (c e) -> (e b) a c", dict(e=2)),
                               ("abc->(abc)", {}), ("a ... -> ... a n", dict(n=2))]:
            _check(rearrange(S, pattern, **sizes), _expected(S, pattern, sizes))
    v = scorch.asformat(_rand(6, seed=6), "coo")
    _check(rearrange(v, "(ab)->ba", a=2), _rand(6, seed=6).reshape(2, 3).T)
    _check(rearrange(v, "i->ni", n=3), _rand(6, seed=6).expand(3, 6))


def test_sparse_empty():
    e = scorch.asformat(torch.zeros(0, 4), "csr")
    _check(rearrange(e, "ij->jin", n=3), torch.zeros(4, 0, 3))
    z = scorch.asformat(torch.zeros(3, 4), "csr")  # no stored entries
    _check(rearrange(z, "ij->(ji)"), torch.zeros(12))
    S = scorch.asformat(torch.ones(3, 4), "csr").requires_grad_()
    R = rearrange(S, "ij->jin", n=0)
    _check(R, torch.zeros(4, 3, 0))
    R.values().sum().backward()
    assert torch.equal(S.grad.values(), torch.zeros(12))


def test_sparse_one_element():
    S = scorch.asformat(torch.tensor([[2.5]]), "csr")
    _check(rearrange(S, "ij->ji"), torch.tensor([[2.5]]))
    _check(rearrange(S, "1 j -> j n", n=2), torch.tensor([[2.5, 2.5]]))


@pytest.mark.filterwarnings("ignore:.*support is in beta state")
def test_torch_sparse_inputs():
    d = _rand(4, 6, seed=7)
    for t in (d.to_sparse(), d.to_sparse_csr(), d.to_sparse_csc(), d.to_sparse_bsr((2, 2))):
        _check(rearrange(t, "ij->jni", n=2), rearrange(d, "ij->jni", n=2))


def test_uncoalesced_duplicates_are_summed():
    idx = torch.tensor([[1, 0, 1], [2, 3, 2]])
    vals = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    t = torch.sparse_coo_tensor(idx, vals, (3, 4), check_invariants=True)
    R = rearrange(t, "ij->ji")
    _check(R, t.to_dense().T)
    assert R.nnz == 2
    S = scorch.from_torch(t)
    assert torch.autograd.gradcheck(lambda v: rearrange(S.with_values(v), "ij->jni", n=2).to_dense(),
                                    (vals.clone().requires_grad_(),))


def test_sparse_explicit_zeros_are_kept():
    S = scorch.sparse_csr_tensor(torch.tensor([0, 2, 2]), torch.tensor([0, 1]), torch.tensor([0.0, 3.0]), (2, 2))
    R = rearrange(S, "ij->ji")
    assert R.nnz == 2 and torch.equal(R.values(), torch.tensor([0.0, 3.0]))


@settings(max_examples=25)
@given(st.sampled_from(FORMATS), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3),
       st.randoms(use_true_random=False))
def test_sparse_split_permute_repeat_property(fmt, rows, a, n, rnd):
    # a (2 rows) x (2 a) matrix split into (r, s) x (a, c), permuted, with a new axis n
    d = _rand(2 * rows, 2 * a, seed=rnd.randint(0, 1000))
    S = scorch.asformat(d, fmt)
    out = list("rsacn")
    rnd.shuffle(out)
    pattern = f"(r s) (a c) -> {' '.join(out)}"
    want = d.reshape(rows, 2, a, 2)[..., None].expand(rows, 2, a, 2, n).permute(["rsacn".index(v) for v in out])
    _check(rearrange(S, pattern, s=2, c=2, n=n), want)


# --- errors ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern,sizes,match", [
    ("bd->bn", {}, "axis 'd' of the left is dropped"),
    ("bnd->bd", {}, "axis 'n' of the left is dropped"),
    ("bd->bnd", {}, "missing size for the new axis 'n'"),
    ("bd->bd", dict(q=2), "size given for axis 'q', which is not in the pattern"),
    ("bd->bdd", {}, "axis 'd' appears twice on the right"),
    ("b (d d) -> b d", {}, "axis 'd' appears twice on the left"),
    ("bd->bd", dict(d=5), "size mismatch: dimension 1 has size 6"),
    ("b(hd)->bhd", dict(h=4), r"size mismatch: dimension 1 of size 6 cannot be split into \(h d\) with h=4"),
    ("b (h d) -> b h d", dict(h=2, d=2), r"size mismatch: dimension 1 has size 6, but the pattern gives \(h d\)"),
    ("b(hd)->bhd", {}, "cannot infer the sizes of axes 'h', 'd'"),
    ("bnd->bnd", {}, "has 3 dimension.* but the input has 2"),
    ("batch dim -> dim batch extra", {}, "missing size for the new axis 'extra'"),
    ("1 d -> d", {}, "size mismatch: dimension 0 has size 4"),
    ("() d -> d", {}, r"size mismatch: dimension 0 has size 4, but the pattern gives \(\) \(size 1\)"),
    ("b d", {}, "must have the form 'lhs -> rhs'"),
    ("b d -> b d -> b", {}, "must have the form"),
    ("b (d -> b d", {}, r"unbalanced '\('"),
    ("b d) -> b d", {}, r"unbalanced '\)'"),
    ("b d -> ((b d))", {}, "nested parentheses"),
    ("b d -> b d ...", {}, r"'\.\.\.' must appear on both sides"),
    ("b (... d) -> b d ...", {}, r"'\.\.\.' cannot be inside parentheses on the left"),
    ("b 6 -> b", {}, "anonymous axis 6 on the left"),
    ("b, d -> b d", {}, "invalid axis name 'b,'"),
    ("b-d->bd", {}, "invalid character '-' on the left"),
    ("b d -> b d", dict(b=-1), "must be >= 0"),
    ("b d -> b n d", dict(n=1.5), "must be an int"),
])
def test_errors(pattern, sizes, match):
    x = torch.zeros(4, 6)
    with pytest.raises(ValueError, match=match):
        rearrange(x, pattern, **sizes)
    # the same errors for sparse inputs
    with pytest.raises(ValueError, match=match):
        rearrange(scorch.asformat(x + torch.eye(4, 6), "csr"), pattern, **sizes)


def test_error_hints_one_letter_per_axis():
    with pytest.raises(ValueError, match="read one letter per axis"):
        rearrange(torch.zeros(3), "batch->batch")


def test_a_sparse_result_without_dimensions_is_a_dense_scalar():
    r = rearrange(scorch.asformat(torch.full((1, 1), 2.5), "csr"), "1 1 ->")
    assert type(r) is torch.Tensor and r.shape == () and float(r) == 2.5
    assert rearrange(torch.ones(1, 1), "1 1 ->").shape == ()  # dense: a 0-d view


def test_type_errors():
    with pytest.raises(TypeError):
        rearrange([[1.0]], "i j -> j i")  # a list of lists is not a list of tensors...
    with pytest.raises(TypeError):
        rearrange(torch.zeros(2), 3)


def test_sparse_huge_shape():
    # coordinates past int32 (int64 index arrays), a merged dimension of 2**62 and a result too large to shape
    idx = torch.tensor([[5, 2**30, 7], [3, 1, 2**30 + 5]])
    S = scorch.sparse_coo_tensor(idx, torch.tensor([1.0, 2.0, 3.0]), (2**31, 2**31)).asformat("coo")
    R = rearrange(S, "(a b) j -> j b a", a=2)
    R.check_invariants()
    assert R.shape == (2**31, 2**30, 2) and R.index_dtype == torch.int64
    assert [lv.crd.tolist() for lv in R.levels] == [[1, 3, 2**30 + 5], [0, 5, 7], [1, 0, 0]]
    assert R.values().tolist() == [2.0, 1.0, 3.0]
    assert rearrange(S, "ij->(ji)").levels[0].crd.tolist() == [2**31 + 2**30, 3 * 2**31 + 5, (2**30 + 5) * 2**31 + 7]
    with pytest.raises(ValueError, match="2\\*\\*63 elements or more"):
        rearrange(S, "ij->inj", n=2)
