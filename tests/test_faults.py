"""Faults found by trying bad inputs (issue 17, section 2): none may crash, hang or give a wrong value.

Each test here failed on the code before its fix: a segfault (run in a subprocess where one is possible), a wrong
value, or a late ``OverflowError``/``TypeError`` where a clear ``ValueError`` is due.
"""
import io
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import scorch
from scorch import SparseTensor
from scorch.formats import LevelStorage, named
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


@pytest.mark.parametrize("pos_dtype,crd_dtype", [(I64, I32), (I32, I64), (I32, I32), (I64, I64)])
def test_mixed_index_widths_in_csr_constructor(pos_dtype, crd_dtype):
    """int64 pos with int32 crd read past crd's end (ASan: heap overflow, a segfault without ASan); int32 pos with
    int64 crd gave wrong values. The constructor widens to one dtype (int64 when any array is int64)."""
    pos, crd, vals = CSR
    out = run_isolated(f"""
        import torch, scorch
        S = scorch.sparse_csr_tensor(torch.tensor([0, 1, 2, 3], dtype={pos_dtype}),
                                     torch.tensor([0, 1, 2], dtype={crd_dtype}),
                                     torch.tensor([1., 2., 3.], dtype=torch.float64), (3, 4))
        dtypes = {{a.dtype for st in S.levels for a in st.arrays().values()}}
        assert dtypes == {{S.index_dtype}}, dtypes
        print((S @ torch.ones(4, 2, dtype=torch.float64)).tolist())
    """)
    assert eval(out) == (DENSE @ torch.ones(4, 2, dtype=torch.float64)).tolist()
    S = scorch.sparse_csr_tensor(pos.to(pos_dtype), crd.to(crd_dtype), vals, (3, 4), check_invariants=False)
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


def test_mixed_index_widths_rejected_by_validation():
    pos, crd, vals = CSR
    levels = [LevelStorage(), LevelStorage(pos=pos, crd=crd.to(I32))]
    with pytest.raises(ValueError, match="mix int32 and int64"):
        SparseTensor("csr", (3, 4), levels, vals)
    with pytest.raises(ValueError, match="mix int32 and int64"):
        SparseTensor("csr", (3, 4), levels, vals, check=False).check_invariants()
    with pytest.raises(ValueError, match="mix int32 and int64"):
        scorch.asformat(SparseTensor("csr", (3, 4), levels, vals, check=False), "coo", check=True)


@pytest.mark.parametrize("retype", ["mixed", "float", "bool", "negative_pos", "unsorted", "out_of_range"])
def test_torch_load_of_a_retyped_file_is_rejected(retype):
    """A checkpoint is input: a file whose arrays were changed (retyped, corrupted) loads with a clear error."""
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
