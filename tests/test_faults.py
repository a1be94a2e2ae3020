"""Faults found by trying bad inputs (issue 17, section 2): none may crash, hang or give a wrong value.

Each test here failed on the code before its fix: a segfault (run in a subprocess where one is possible), a wrong
value, or a late ``OverflowError``/``TypeError`` where a clear ``ValueError`` is due.
"""
import ast
import io
import subprocess
import sys
import textwrap

import pytest
import torch

import scorch
from scorch import SparseTensor
from scorch.formats import LevelStorage, named, storage
from conftest import assert_matches_dense

I32, I64 = torch.int32, torch.int64


def run_isolated(code: str, timeout=240):
    """Run ``code`` in a fresh interpreter (a crash there fails the test instead of killing pytest)."""
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run.stdout


# --- mixed index widths -----------------------------------------------------------------------------------------

CSR = (torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2]), torch.tensor([1., 2., 3.], dtype=torch.float64))
DENSE = torch.tensor([[1., 0, 0, 0], [0, 2, 0, 0], [0, 0, 3, 0]], dtype=torch.float64)
WIDTHS = [(I64, I32), (I32, I64), (I32, I32), (I64, I64)]


def test_mixed_index_widths_in_csr_constructor_isolated():
    """int64 pos with int32 crd read past crd's end (ASan: heap overflow, a segfault without ASan); int32 pos with
    int64 crd gave wrong values. Run in a subprocess first, where a regression crashes only the subprocess."""
    out = run_isolated("""
        import torch, scorch
        results = []
        for pos_dtype, crd_dtype in [(torch.int64, torch.int32), (torch.int32, torch.int64)]:
            S = scorch.sparse_csr_tensor(torch.tensor([0, 1, 2, 3], dtype=pos_dtype),
                                         torch.tensor([0, 1, 2], dtype=crd_dtype),
                                         torch.tensor([1., 2., 3.], dtype=torch.float64), (3, 4))
            results.append((S @ torch.ones(4, 2, dtype=torch.float64)).tolist())
        print(results)
    """)
    expected = (DENSE @ torch.ones(4, 2, dtype=torch.float64)).tolist()
    assert ast.literal_eval(out.strip()) == [expected, expected]


@pytest.mark.parametrize("pos_dtype,crd_dtype", WIDTHS)
def test_mixed_index_widths_in_csr_constructor(pos_dtype, crd_dtype):
    """The constructor widens to one dtype (int64 when any array is int64)."""
    pos, crd, vals = CSR
    for check in (None, False, True):
        S = scorch.sparse_csr_tensor(pos.to(pos_dtype), crd.to(crd_dtype), vals, (3, 4), check_invariants=check)
        assert S.index_dtype == (I32 if pos_dtype == crd_dtype == I32 else I64)
        assert {a.dtype for st in S.levels for a in st.arrays().values()} == {S.index_dtype}
        assert_matches_dense(S @ torch.ones(4, 2, dtype=torch.float64), DENSE @ torch.ones(4, 2, dtype=torch.float64))
        assert_matches_dense(S, DENSE)


def test_mixed_index_widths_from_torch():
    t = torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 3], dtype=I32), torch.tensor([0, 1, 2]), CSR[2], (3, 4),
                                check_invariants=False)
    S = scorch.from_torch(t)
    assert {a.dtype for st in S.levels for a in st.arrays().values()} == {I64}
    assert_matches_dense(S.t() @ torch.ones(3, dtype=torch.float64), DENSE.t() @ torch.ones(3, dtype=torch.float64))


def test_mixed_index_widths_widened_by_the_wrapper_and_rejected_by_validation():
    """``SparseTensor(...)`` (checked or not, and so ``torch.load``) widens a mix to int64; the storage's own
    validation, which assumes one width, names the mix."""
    pos, crd, vals = CSR
    levels = [LevelStorage(), LevelStorage(pos=pos, crd=crd.to(I32))]
    with pytest.raises(ValueError, match="mix integer widths"):
        storage.validate(named.resolve("csr", 2), (3, 4), levels, vals)
    for check in (False, True):
        S = SparseTensor("csr", (3, 4), levels, vals, check=check)
        assert {a.dtype for st in S.levels for a in st.arrays().values()} == {I64} and S.index_dtype == I64
        assert_matches_dense(S @ torch.ones(4, 2, dtype=torch.float64), DENSE @ torch.ones(4, 2, dtype=torch.float64))
    # asformat widens a tensor built unchecked (the conversion kernels read every array with one width)
    for fmt in ("coo", "csc", "csr", "ell"):
        for check in (False, True):
            converted = scorch.asformat(SparseTensor("csr", (3, 4), levels, vals, check=False), fmt, check=check)
            assert len({a.dtype for st in converted.levels for a in st.arrays().values()}) == 1
            assert_matches_dense(converted, DENSE)


@pytest.mark.parametrize("retype", ["mixed", "float", "bool", "negative_pos", "unsorted", "out_of_range"])
def test_torch_load_of_a_retyped_file_is_rejected(retype):
    """A checkpoint is input: a file whose arrays were changed (corrupted, retyped) loads with a clear error;
    a mix of int32 and int64 index arrays is widened to int64 as it loads."""
    pos, crd, vals = CSR
    pos, crd = pos.clone(), crd.clone()
    if retype == "mixed":
        crd = crd.to(I32)
    elif retype == "float":
        crd = crd.double()
    elif retype == "bool":
        pos = pos.bool()
    elif retype == "negative_pos":
        pos[1] = -1
    elif retype == "unsorted":
        crd = torch.tensor([0, 2, 1])
        pos = torch.tensor([0, 3, 3, 3])
    else:
        crd[2] = 4
    S = SparseTensor("csr", (3, 4), [LevelStorage(), LevelStorage(pos=pos, crd=crd)], vals, check=False)
    buf = io.BytesIO()
    torch.save({"w": S}, buf)
    buf.seek(0)
    if retype == "mixed":  # widened to one width as it loads
        assert_matches_dense(torch.load(buf)["w"], DENSE)
        return
    with pytest.raises(ValueError, match="level 1"):
        torch.load(buf)


@pytest.mark.parametrize("ctor,pos_name", [("sparse_csc_tensor", "ccol"), ("sparse_bsr_tensor", "crow"),
                                           ("sparse_bsc_tensor", "ccol")])
def test_mixed_index_widths_in_other_compressed_constructors(ctor, pos_name):
    blocked = "b" in ctor[7]
    vals = torch.arange(1., 4.).reshape(3, 1, 1) if blocked else torch.arange(1., 4.)
    S = getattr(scorch, ctor)(torch.tensor([0, 1, 2, 3], dtype=I32), torch.tensor([2, 0, 1]), vals, (3, 3))
    assert S.index_dtype == I64 and {a.dtype for st in S.levels for a in st.arrays().values()} == {I64}
    t = getattr(torch, ctor)(torch.tensor([0, 1, 2, 3]), torch.tensor([2, 0, 1]), vals, (3, 3), check_invariants=True)
    assert_matches_dense(S @ torch.eye(3), t.to_dense() @ torch.eye(3))


# --- absurd sizes in a format ------------------------------------------------------------------------------------

HUGE = "99999999999999999999"


@pytest.mark.parametrize("make", [
    lambda: scorch.Format(f"(i, j) -> (i : dense, j : fixed({HUGE}))"),
    lambda: scorch.Format("(i, j) -> (i / 4611686018427387904 : dense, j : compressed, i % 4611686018427387904 : dense)"),
    lambda: scorch.Format("(i, j) -> (i / 2147483648 : dense, j : compressed, i % 2147483648 : dense)"),
    lambda: scorch.Format(f"bsr({HUGE}, 2)"),
    lambda: scorch.Format(f"nm(2, {HUGE})"),
    lambda: named.bsr(10**20, 2),
    lambda: named.bsc(2, 10**20),
    lambda: named.nm(1, 2**31),
    lambda: scorch.asformat(torch.eye(4), f"bsr({HUGE}, 2)"),
    lambda: scorch.asformat(torch.eye(4), f"fixed({HUGE})"),
    lambda: scorch.asformat(torch.eye(4), f"(i, j) -> (i : dense, j : fixed({HUGE}))"),
    lambda: scorch.asformat(torch.eye(4), f"(i, j) -> (i / {HUGE} : dense, j : compressed, i % {HUGE} : dense)"),
])
def test_absurd_format_sizes_are_rejected_by_the_parser(make):
    """They raised OverflowError/TypeError late (allocating the storage) or were accepted."""
    with pytest.raises(ValueError, match=r"format|2\*\*31"):
        make()


def test_format_limits_and_names():
    from scorch.formats import Div, Fixed, Mod
    for bad in (lambda: Div(0, 2**31), lambda: Mod(0, 0), lambda: Fixed(slots=2**31)):
        with pytest.raises(ValueError, match="2\\*\\*31"):
            bad()
    # the largest allowed sizes parse; Format takes a name as resolve does
    assert scorch.Format("(i, j) -> (i / 2147483647 : dense, j : compressed, i % 2147483647 : dense)").ndim == 2
    assert scorch.Format("bsr(2, 3)") == named.bsr(2, 3) and scorch.Format("csr") == named.csr
    assert scorch.Format("nm(2, 4)") == named.nm(2, 4)


# --- NaN in max/min reductions ------------------------------------------------------------------------------------

NAN = float("nan")


def _same(got, expected):
    got = got.to_dense() if isinstance(got, SparseTensor) else got
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got, expected)
    assert torch.equal(torch.isnan(got), torch.isnan(expected)), (got, expected)
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(expected)), (got, expected)


@pytest.mark.parametrize("fmt", ["coo", "csr", "csc", "ell", "nm(2, 4)", "bsr(1, 2)", "dia"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_min_propagate_nan(fmt, dtype):
    """amax/amin dropped a stored NaN (``[[0, nan, 0]]`` gave 0); torch gives nan. max/min/argmax/argmin too."""
    d = torch.tensor([[0, NAN, 0, 0], [1., 2, 0, -3 if fmt != "nm(2, 4)" else 0], [0, 0, 0, 0]], dtype=dtype)
    S = scorch.asformat(d, fmt)
    for f in ("amax", "amin"):
        for kw in ({}, {"dim": 1}, {"dim": 0}, {"dim": (0, 1)}, {"dim": 1, "keepdim": True}):
            _same(getattr(torch, f)(S, **kw), getattr(torch, f)(d, **kw))
            _same(getattr(S, f)(**kw), getattr(d, f)(**kw))
    for f in ("max", "min"):
        _same(getattr(torch, f)(S), getattr(torch, f)(d))
        for dim in (0, 1):
            for got, expected in zip(getattr(torch, f)(S, dim), getattr(torch, f)(d, dim)):
                _same(got, expected)
    for f in ("argmax", "argmin"):
        _same(getattr(torch, f)(S), getattr(torch, f)(d))
        _same(getattr(torch, f)(S, 1), getattr(torch, f)(d, 1))
    _same(torch.amax(scorch.asformat(torch.tensor([[0, NAN, 0]], dtype=dtype), fmt if fmt not in (
        "nm(2, 4)",) else "csr")), torch.tensor(NAN, dtype=dtype))


def test_amax_with_nan_keeps_gradients_elsewhere():
    d = torch.tensor([[0, NAN, 0], [1., 5, 0]], dtype=torch.float64)
    S = scorch.asformat(d, "csr").requires_grad_()
    out = torch.amax(S, dim=1)
    _same(out.detach(), torch.tensor([NAN, 5.], dtype=torch.float64))
    out[1].backward()
    D = d.clone().requires_grad_()
    torch.amax(D, dim=1)[1].backward()
    assert torch.equal(S.grad.to_dense()[1], D.grad[1])  # (torch's row 0 is 0/0: no entry equals its nan)


# --- optimizers on padded formats (nm, ell) -------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
}


@pytest.mark.parametrize("fmt", ["nm(2, 4)", "ell"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_optimizers_on_padded_weights(fmt, opt):
    """``opt.step()`` raised at lerp_/add_/mul_ on nm and ell parameters. Now a few steps match the same optimizer
    on the dense weight masked to the pattern, and the padding stays zero."""
    from scorch.nn.sparsify import NM
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 8, generator=g, dtype=torch.float64)
    w = NM(2, 4)(w)  # 2:4 pruned, so that it fits nm(2, 4)
    w[1] = 0  # an empty row: padding only
    w[2, :4] = torch.tensor([0., 0, 0, 1.5])  # a group with one entry (ambiguous padding at offset 0)
    mask = w != 0
    S = scorch.asformat(w, fmt).requires_grad_()
    padding = S.values().detach() == 0
    assert padding.any()
    D = w.clone().requires_grad_()
    opt_s, opt_d = OPTIMIZERS[opt]([S]), OPTIMIZERS[opt]([D])
    x = torch.randn(5, 8, generator=g, dtype=torch.float64)
    target = torch.randn(5, 6, generator=g, dtype=torch.float64)
    for _ in range(4):
        for o, weight in ((opt_s, S), (opt_d, D)):
            o.zero_grad()
            y = torch.nn.functional.linear(x, weight if weight is S else weight * mask)
            ((y - target) ** 2).mean().backward()
            o.step()
    assert torch.equal(S.values().detach()[padding], torch.zeros(int(padding.sum()), dtype=torch.float64))
    torch.testing.assert_close(S.detach().to_dense(), D.detach() * mask)
    assert not torch.equal(S.detach().to_dense(), w)  # it trained


@pytest.mark.parametrize("fmt", ["nm(2, 4)", "ell"])
def test_inplace_ops_keep_padding_zero(fmt):
    d = torch.tensor([[1., 0, 0, 0, 0, 0, 0, -2], [0, 0, 3, 0, 0, 5, 6, 0], [0, 0, 0, 0, 0, 0, 0, 0]])
    S = scorch.asformat(d, fmt)
    padding = S.values() == 0
    with pytest.raises(NotImplementedError, match="implicit zero"):
        S.add_(1.0)  # (the dense tensor's result is dense)
    with scorch.stored_only():  # (the stored entries only, as in an optimizer step)
        S.mul_(2).add_(1.0).sub_(0.5).clamp_(min=-10)
    S.addcmul_(S, S, value=0.5).lerp_(torch.zeros_like(S), 0.25)
    expected = 2 * d + 0.5
    expected = torch.where(d != 0, expected + 0.5 * expected * expected, 0) * 0.75
    assert not S.values()[padding].any()
    assert_matches_dense(S, expected)
    S.zero_()
    assert not S.values().any()


# --- in-place ops with another pattern -----------------------------------------------------------------------------

PATTERN_A = torch.tensor([[1., 0, 2, 0], [0, 0, 3, 0], [0, 0, 0, 0]])
PATTERN_B = torch.tensor([[0., 4, 2, 0], [5, 0, 0, 0], [0, 0, 0, 7]])


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc", "dcsr", "ell"])
@pytest.mark.parametrize("other_fmt", ["csr", "coo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inplace_ops_with_another_pattern(fmt, other_fmt, dtype):
    """``S.add_(S2)`` with S2's pattern different raised ValueError; torch allows it for sparse tensors. The result
    takes the union pattern (as torch) and stays in S's format."""
    a, b = PATTERN_A.to(dtype), PATTERN_B.to(dtype)
    cases = [
        (lambda s, o: s.add_(o), a + b), (lambda s, o: s.add_(o, alpha=2), a + 2 * b),
        (lambda s, o: s.sub_(o), a - b), (lambda s, o: s.mul_(o), a * b),
        (lambda s, o: s.lerp_(o, 0.25), a + 0.25 * (b - a)), (lambda s, o: s.addcmul_(o, o, value=2), a + 2 * b * b),
    ]
    for apply, expected in cases:
        S, O = scorch.asformat(a, fmt), scorch.asformat(b, other_fmt)
        out = apply(S, O)
        assert out is S and S.format == scorch.asformat(a, fmt).format
        assert_matches_dense(S, expected)
        assert_matches_dense(O, b)  # the operand is unchanged
    S = scorch.asformat(a, fmt)
    S += scorch.asformat(b, other_fmt)
    assert_matches_dense(S, a + b)


def test_inplace_ops_with_another_pattern_errors():
    S, O = scorch.asformat(PATTERN_A, "csr"), scorch.asformat(PATTERN_B, "csr")
    with pytest.raises(ValueError, match="div_ of SparseTensors with different patterns"):
        S.div_(O)
    with pytest.raises(ValueError, match="shapes"):
        S.add_(scorch.asformat(torch.ones(2, 2), "csr"))
    N = scorch.asformat(torch.tensor([[1., 0, 0, 2]]), "nm(2, 4)")
    with pytest.raises(ValueError, match="nm"):  # the union does not fit the format
        N.add_(scorch.asformat(torch.tensor([[0., 3, 0, 0]]), "csr"))
    assert_matches_dense(S, PATTERN_A)


def test_inplace_op_with_another_pattern_on_a_parameter_trains():
    """A sparse parameter whose gradient is added in place by a hand-written update, pattern-changing included."""
    W = scorch.asformat(PATTERN_A.double(), "csr").requires_grad_()
    with torch.no_grad():
        W.add_(scorch.asformat(PATTERN_B.double(), "coo"), alpha=0.5)
    assert W.requires_grad and W.is_leaf
    (W @ torch.ones(4, dtype=torch.float64)).sum().backward()
    assert_matches_dense(W.grad, torch.where((PATTERN_A + PATTERN_B) != 0, 1., 0.).double())


# --- transpose and permute are views ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "dcsr", "ell", "dia", "bsr(1, 2)", "nm(2, 4)"])
def test_transpose_is_a_view_sharing_values(fmt):
    """``T = S.t(); T.mul_(2)`` left S unchanged: t() copied. Now t/T/transpose/permute share the index arrays and
    values, both ways, as torch's views do."""
    d = torch.tensor([[1., 0, 0, -2], [0, 0, 3, 0], [0, 4, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    S = scorch.asformat(d, fmt)
    for view in (lambda s: s.t(), lambda s: s.T, lambda s: torch.transpose(s, 0, 1), lambda s: s.permute(1, 0),
                 lambda s: torch.t(s), lambda s: s.transpose(-1, -2)):
        T = view(S)
        assert T.values() is S.values()
        assert all(a is b for x, y in zip(T.levels, S.levels) for a, b in zip(x.arrays().values(),
                                                                            y.arrays().values()))
        assert_matches_dense(T, S.to_dense().t())
        T.mul_(2)
        assert_matches_dense(S, 2 * d)
        S.mul_(0.5)
        assert_matches_dense(T, d.t())
        assert_matches_dense(T @ torch.arange(3., 7., dtype=torch.float64), d.t() @ torch.arange(3., 7., dtype=torch.float64))
    assert_matches_dense(S.t().t(), d)


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell"])
def test_ops_between_a_tensor_and_its_transposed_view(fmt):
    """The view shares the arrays but not the pattern: S + S.t() and S.add_(S.t()) are sums of transposes."""
    d = torch.tensor([[1., 0, 2], [0, 3, 0], [4, 0, 0]], dtype=torch.float64)
    S = scorch.asformat(d, fmt)
    assert_matches_dense(S + S.t(), d + d.t())
    assert_matches_dense(S * S.t(), d * d.t())
    S.add_(S.t())
    assert_matches_dense(S, d + d.t())


def test_permute_is_a_view_in_3d():
    x = torch.tensor([[[1., 0], [0, 2]], [[0, 0], [3, 0]], [[0, 4], [0, 0]]])
    for fmt in ("csf", "coo"):
        S = scorch.asformat(x, fmt)
        for dims in ((2, 0, 1), (1, 2, 0), (0, 2, 1), (-1, 0, 1)):
            P = S.permute(*dims)
            assert P.values() is S.values()
            assert_matches_dense(P, x.permute(*dims))
            assert_matches_dense(torch.einsum("abc->b", P), x.permute(*dims).sum((0, 2)))
        with scorch.stored_only():
            S.permute(2, 1, 0).add_(1.0)
        assert_matches_dense(S, torch.where(x != 0, x + 1, 0))
    assert S.permute(0, 1, 2) is S
    with pytest.raises(ValueError, match="permutation"):
        S.permute(0, 0, 1)


def test_transposed_view_gradients():
    d = torch.tensor([[1., 0, 2], [0, 3, 0]], dtype=torch.float64)
    S = scorch.asformat(d, "csr").requires_grad_()
    D = d.clone().requires_grad_()
    x = torch.randn(2, 4, dtype=torch.float64)
    (S.t() @ x).pow(2).sum().backward()
    (D.t() @ x).pow(2).sum().backward()
    assert not S.t().is_leaf
    assert_matches_dense(S.grad, D.grad * (d != 0))
    with pytest.raises(RuntimeError):  # as torch: in place on a view of a leaf that requires grad
        S.t().mul_(2)
    with torch.no_grad():
        S.t().mul_(2)  # (an optimizer's update through a view)
    assert_matches_dense(S.detach(), 2 * d)
