"""Packed levels (``formats.levels.PackedLevel``): a compressed level whose coordinates are held narrower than its
positions (a pruned weight's int16 columns under int32 row pointers). Every kernel reads one index width, the
positions' (``crd``: the wide view, made once per pattern); only the weight kernels, the storage's size, saving and
copying see the narrow array. Checked against dense torch through general ops (also deferred), the weight family's
forward and backward, autograd, conversions, pickling, deepcopy, scheduled training and torch.compile."""
from __future__ import annotations

import copy
import io
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch import SparseTensor
from scorch import loopir as L
from scorch.engine import args as engine_args, bind, prepared, weights as kernels
from scorch.formats import LevelStorage, PackedLevel, packed_level, storage
from scorch.nn.sparsify import packed_weight

from conftest import assert_matches_dense

F = torch.nn.functional
I16, I32, I64 = torch.int16, torch.int32, torch.int64


def _packed(dense: torch.Tensor, fmt: str = "csr") -> SparseTensor:
    s = scorch.asformat(dense, fmt)
    levels = storage.packed_coordinates(s.format, s.shape, s.levels)
    return SparseTensor(s.format, s.shape, levels, s.values(), check=True)


def _sparse(rows, cols, density, seed, dtype=torch.float32, exact=False):
    """A random ``rows x cols`` matrix of about ``density``; ``exact``: nonzero multiples of 1/8 in [-1, 1], whose
    sums and products here are exact in float32, so that no order of summation can fail a comparison (a sum of 60
    normal values with cancellation differed from torch's by 1.4e-5 against a 1e-5 tolerance)."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        mag = torch.randint(1, 9, (rows, cols), generator=g) / 8
        w = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -mag, mag)
    else:
        w = torch.randn(rows, cols, generator=g)
    w = w * (torch.rand(rows, cols, generator=g) < density)
    return w.to(dtype)


def _check_widths(mp) -> list:
    """Make every index array a general kernel is given be checked against the width the kernel was generated for:
    those ``args.argument`` binds (``call_plan``, co-iterations) and those a prepared call reads (its first call:
    the C form reads the same attributes); returns the list of the parameter types seen."""
    seen = []
    real, real_prepared = engine_args.argument, prepared.prepared_call

    def check(a, v):
        seen.append(a.param.type)
        assert a.param.type == L.type_of(v.dtype), (a, v.dtype)

    def argument(a, ops, *rest, **kw):
        v = real(a, ops, *rest, **kw)
        if a.kind in ("pos", "crd"):
            check(a, v)
        return v

    def prepared_call(plan, *args, **kw):
        record = real_prepared(plan, *args, **kw)
        inner = record.python

        def checked(ops, scalars):
            for a in plan.lowered.args:
                if a.kind in ("pos", "crd"):
                    check(a, getattr(ops[a.operand]._levels[a.level], a.kind))
            return inner(ops, scalars)
        record.run = record.python = checked
        return record
    scorch.clear_caches()  # (no prepared call made before the check)
    mp.setattr(engine_args, "argument", argument)
    mp.setattr(bind, "argument", argument)
    mp.setattr(sys.modules["scorch.engine.run"], "prepared_call", prepared_call)  # (the package's ``run`` is a function)
    mp.setattr(prepared, "prepared_call", prepared_call)  # (a call kept on disk is prepared there)
    return seen


def test_packed_level_construction():
    pos, crd = torch.tensor([0, 1, 3], dtype=I32), torch.tensor([2, 0, 1], dtype=I16)
    st_ = packed_level(pos, crd)
    assert type(st_) is PackedLevel and st_.arrays()["crd"] is crd and st_.stored_crd is crd
    assert st_.dtypes() == {I32} and not st_.widened
    assert st_.crd.dtype == I32 and st_.widened and st_.crd is st_.crd  # (made once)
    assert torch.equal(st_.crd, crd.to(I32))
    assert type(packed_level(pos, crd.to(I32))) is LevelStorage  # (not narrower: plain)
    assert type(st_.map(lambda a: a.to(I64))) is LevelStorage  # (widened to the positions' width: plain)
    assert type(st_.map(torch.clone)) is PackedLevel
    with pytest.raises(ValueError, match="int8 or int16 coordinates under wider positions"):
        PackedLevel(pos.to(I16), crd)
    with pytest.raises(ValueError, match="int8 or int16"):
        PackedLevel(pos, crd.to(I32))
    with pytest.raises(TypeError):
        PackedLevel(None, crd)


def test_wide_view_follows_in_place_changes_of_the_stored_array():
    st_ = packed_level(torch.tensor([0, 2], dtype=I32), torch.tensor([0, 1], dtype=I16))
    first = st_.crd
    st_.stored_crd[1] = 3
    assert st_.crd.tolist() == [0, 3] and st_.crd is not first


def test_packed_tensor_reads_one_index_dtype():
    w = _sparse(9, 13, 0.4, 0)
    s = _packed(w)
    lv = s.levels[1]
    assert type(lv) is PackedLevel and lv.arrays()["crd"].dtype == I16
    assert s.index_dtype == I32 and lv.pos.dtype == I32 and lv.crd.dtype == I32
    plain = scorch.asformat(w, "csr")
    assert scorch.nn.storage_bytes(s) == scorch.nn.storage_bytes(plain) - 2 * plain.nnz
    assert s.col_indices().dtype == I64 and torch.equal(s.col_indices(), plain.col_indices())
    assert torch.equal(s.crow_indices(), plain.crow_indices())
    t = s.to_torch()
    assert t.col_indices().dtype == t.crow_indices().dtype and torch.equal(t.to_dense(), w)
    assert_matches_dense(s, w)


def test_packing_only_where_the_coordinates_fit():
    s = scorch.asformat(torch.eye(3, 40000), "csr")
    assert storage.packed_coordinates(s.format, s.shape, s.levels)[1] is s.levels[1]
    t = scorch.asformat(torch.eye(40000, 3), "csr")
    assert type(storage.packed_coordinates(t.format, t.shape, t.levels)[1]) is PackedLevel


OPS = {
    "matmul": lambda s, d, x: (s @ x, d @ x),
    "rmatmul": lambda s, d, x: (torch.ones(3, s.shape[0]) @ s, torch.ones(3, s.shape[0]) @ d),
    "matvec": lambda s, d, x: (s @ x[:, 0].contiguous(), d @ x[:, 0].contiguous()),
    "add_plain": lambda s, d, x: (s + scorch.asformat(d * 2, "csr"), d + d * 2),
    "add_self": lambda s, d, x: (s + s, d + d),
    "mul_dense": lambda s, d, x: (s * (d + 1), d * (d + 1)),
    "mul_scalar": lambda s, d, x: (s * 3.0, d * 3.0),
    "sum0": lambda s, d, x: (s.sum(0), d.sum(0)),
    "sum1": lambda s, d, x: (s.sum(1), d.sum(1)),
    "sum": lambda s, d, x: (s.sum(), d.sum()),
    "transpose": lambda s, d, x: (s.t(), d.t()),
    "transpose_matmul": lambda s, d, x: (s.t() @ torch.ones(s.shape[0], 2), d.t() @ torch.ones(s.shape[0], 2)),
    "row": lambda s, d, x: (s[1], d[1]),
    "relu": lambda s, d, x: (torch.relu(s), torch.relu(d)),
    "to_coo": lambda s, d, x: (scorch.asformat(s, "coo"), d),
    "to_csc": lambda s, d, x: (scorch.asformat(s, "csc"), d),
    "to_ell": lambda s, d, x: (scorch.asformat(s, "ell"), d),
    "spgemm": lambda s, d, x: (s @ s.t(), d @ d.t()),
    "einsum": lambda s, d, x: (torch.einsum("ij,jk->ik", s, x), d @ x),
}


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 12), cols=st.integers(1, 12), density=st.sampled_from([0.0, 0.2, 0.6, 1.0]),
       seed=st.integers(0, 2 ** 16), op=st.sampled_from(sorted(OPS)), mode=st.sampled_from(["auto", "all"]),
       fmt=st.sampled_from(["csr", "csc", "dcsr", "coo", "bsr(2, 2)"]))
def test_general_ops_on_packed_tensors_match_dense(rows, cols, density, seed, op, mode, fmt):
    """Every compressed level packed (CSR's columns, CSC's rows, DCSR's rows and columns, COO's rows, BSR's block
    columns), through a spread of general ops, eager and deferred, each kernel given the width it was made for."""
    rows, cols = 2 * rows, 2 * cols
    d = _sparse(rows, cols, density, seed, exact=True)
    x = torch.randint(-8, 9, (cols, 5), generator=torch.Generator().manual_seed(seed)) / 8
    s = _packed(d, fmt)
    assert any(type(lv) is PackedLevel for lv in s.levels)
    with pytest.MonkeyPatch.context() as mp:
        seen = _check_widths(mp)
        with scorch.deferral(mode):
            got, want = OPS[op](s, d, x)
            got = got.to_dense() if isinstance(got, SparseTensor) else got
            assert_matches_dense(got, want)
    assert all(t == "i32" for t in seen)


def test_general_kernels_get_the_width_they_were_made_for(monkeypatch):
    seen = _check_widths(monkeypatch)
    d = _sparse(20, 30, 0.3, 1)
    s = _packed(d)
    x = torch.randn(30, 4)
    for mode in ("auto", "all"):
        with scorch.deferral(mode):
            assert_matches_dense(s @ x, d @ x)
            assert_matches_dense(s + s, d + d)
            assert_matches_dense((s @ s.t()).to_dense(), d @ d.t())
            assert_matches_dense(s.sum(1), d.sum(1))
    assert seen and all(t == "i32" for t in seen)


@pytest.mark.parametrize("fmt", ["csr", "bsr(2, 2)"])
def test_autograd_through_the_values(fmt):
    d = _sparse(12, 10, 0.5, 3)
    s = _packed(d, fmt).requires_grad_()
    assert type(s.levels[1]) is PackedLevel
    x = torch.randn(10, 3)
    (s @ x).pow(2).sum().backward()
    dd = s.detach().to_dense().requires_grad_()
    (dd @ x).pow(2).sum().backward()
    mask = s.detach().to_dense() != 0
    assert_matches_dense(s.grad.to_dense() * mask, dd.grad * mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("fmt", ["csr", "bsr(4, 4)"])
def test_weight_family_reads_the_packed_columns(dtype, tokens, fmt):
    d = _sparse(24, 36, 0.4, tokens)
    s = packed_weight(scorch.asformat(d.to(dtype), fmt)).requires_grad_()
    lv = s.levels[1]
    assert type(lv) is PackedLevel
    arrays = kernels._arrays(s)
    assert arrays["crd"] is lv.stored_crd and arrays["crd"].dtype == I16 and arrays["pos"].dtype == I32
    before = len(kernels._NARROW)
    x = torch.randn(tokens, 36).to(dtype).requires_grad_()
    y = F.linear(x, s)
    ref_w = d.to(dtype).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    ref = F.linear(xr, ref_w)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(y, ref, **tol)
    g = torch.randn_like(ref)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    mask = d != 0
    torch.testing.assert_close(s.grad.to_dense().float() * mask, ref_w.grad.float() * mask, **tol)
    assert len(kernels._NARROW) == before
    served = kernels.applies(s, x.detach())  # (bsr at one token: the general kernel, which reads the wide view)
    assert served or fmt != "csr"
    assert lv.widened != served  # (the family made no 16-bit copy and no wide view)


def test_pickle_deepcopy_and_clone_keep_the_packing():
    d = _sparse(7, 11, 0.5, 4)
    s = _packed(d)
    buf = io.BytesIO()
    torch.save({"w": s, "p": torch.nn.Parameter(s)}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    for t in (loaded["w"], loaded["p"], copy.deepcopy(s), s.clone(), s.detach(), s.to(torch.float64)):
        assert type(t.levels[1]) is PackedLevel and t.levels[1].arrays()["crd"].dtype == I16
        assert_matches_dense(t.to_dense().float(), d)
    assert isinstance(loaded["p"], torch.nn.Parameter)


def test_a_retyped_packed_checkpoint_is_widened_or_rejected():
    d = _sparse(5, 6, 0.5, 5)
    s = _packed(d)
    fn, (fmt, shape, levels, vals, grad, param, packed) = s.__reduce_ex__(2)
    wide = tuple((p, c.to(I32) if c is not None else c) for p, c in levels)
    t = fn(fmt, shape, wide, vals, grad, param, packed)
    assert type(t.levels[1]) is LevelStorage and t.index_dtype == I32
    assert_matches_dense(t, d)
    bad = tuple((p, c + 100 if c is not None else c) for p, c in levels)
    if s.nnz:
        with pytest.raises(ValueError, match="out of range"):
            fn(fmt, shape, bad, vals, grad, param, packed)


def test_a_mixed_plain_level_is_still_widened():
    """Packing is explicit (a ``PackedLevel``): a plain level whose arrays mix widths is widened, as before."""
    pos, crd = torch.tensor([0, 1, 2], dtype=I32), torch.tensor([0, 1], dtype=I16)
    s = SparseTensor("csr", (2, 2), [LevelStorage(), LevelStorage(pos=pos, crd=crd)], torch.ones(2))
    assert type(s.levels[1]) is LevelStorage and s.levels[1].arrays()["crd"].dtype == I32


def test_to_dense_reads_the_narrow_array():
    """to_dense lists a packed weight's entries from its narrow columns: no wide view kept beside it."""
    d = _sparse(300, 200, 0.9, 6)
    s = _packed(d)
    assert_matches_dense(s.to_dense(), d)
    assert not s.levels[1].widened


class _Block(torch.nn.Module):
    def __init__(self, width=24, hidden=40):
        super().__init__()
        self.q = torch.nn.Linear(width, width)
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        h = self.norm(x + self.q(x))
        return self.norm(h + self.down(F.gelu(self.up(h))))


@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw"])
def test_scheduled_training_equals_masked_dense(opt):
    torch.manual_seed(0)
    model = _Block()
    dense = copy.deepcopy(model)
    s = scorch.schedule(model)
    sel = s.regex(r"(q|up|down)\.weight").sparsify(scorch.nn.ScalarFraction(0.9)).set_format("csr").names
    s.apply()
    params = dict(model.named_parameters())
    masks = {}
    with torch.no_grad():
        for n, p in dense.named_parameters():
            if n in sel:
                assert type(params[n].levels[1]) is PackedLevel and params[n].levels[1].arrays()["crd"].dtype == I16
                p.copy_(params[n].to_dense())
                masks[n] = params[n].to_dense() != 0
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}[opt]
    o1, o2 = make(model.parameters()), make(dense.parameters())
    for step in range(3):
        x = torch.randn(6, 24, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, o1), (dense, o2)):
            o.zero_grad()
            (m(x) - torch.linspace(-1, 1, 24)).pow(2).mean().backward()  # (a LayerNorm output's mean square is
            # constant: a loss on it alone gives gradients of rounding noise, which Adam scales up to whole steps)
        with torch.no_grad():
            for n, p in dense.named_parameters():
                if n in masks:
                    p.grad *= masks[n]
        o1.step()
        o2.step()
        with torch.no_grad():
            for n, p in dense.named_parameters():
                if n in masks:
                    p *= masks[n]  # (the masked dense model's weights stay on the pattern, as the sparse ones do)
    for n, p in dense.named_parameters():
        got = params[n].to_dense() if n in masks else params[n]
        torch.testing.assert_close(got, p.detach(), rtol=1e-4, atol=1e-5)
        if n in masks:
            assert type(params[n].levels[1]) is PackedLevel
    # the state dict round trip keeps the packing and the values
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = _Block()
    s2 = scorch.schedule(fresh)
    s2.regex(r"(q|up|down)\.weight").sparsify(scorch.nn.ScalarFraction(0.9)).set_format("csr")
    s2.apply()
    fresh.load_state_dict(torch.load(buf))
    for n, p in fresh.named_parameters():
        q = params[n]
        if n in masks:
            assert type(p.levels[1]) is PackedLevel
            torch.testing.assert_close(p.to_dense(), q.to_dense())
        else:
            torch.testing.assert_close(p, q)


def test_dynamic_schedule_keeps_the_packing():
    torch.manual_seed(1)
    model = _Block()
    s = scorch.schedule(model)
    s.regex(r"up\.weight").sparsify(scorch.nn.ScalarFraction(0.8), dynamic=True).set_format("csr")
    s.apply()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    s.attach(opt)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 24)).sum().backward()
        opt.step()
    w = model.up.weight
    assert type(w.levels[1]) is PackedLevel and not w.levels[1].widened
    assert int((w.to_dense() != 0).sum()) <= w.nnz


def test_torch_compile_of_a_packed_weight():
    d = _sparse(16, 20, 0.3, 7)
    s = packed_weight(scorch.asformat(d, "csr"))
    assert type(s.levels[1]) is PackedLevel
    fn = torch.compile(lambda x: F.linear(x, s) + 1, backend="eager")
    x = torch.randn(3, 20)
    torch.testing.assert_close(fn(x), F.linear(x, d) + 1)


def test_a_sparse_parameter_is_packed_on_first_use():
    d = _sparse(10, 14, 0.5, 8)
    p = torch.nn.Parameter(scorch.asformat(d, "csr"))
    assert type(p.levels[1]) is LevelStorage
    opt = torch.optim.SGD([p], lr=0.1)
    x = torch.randn(4, 14)
    y = F.linear(x, p)
    assert type(p.levels[1]) is PackedLevel and p.index_dtype == I32
    torch.testing.assert_close(y, F.linear(x, d))
    y.sum().backward()
    mask = d != 0
    torch.testing.assert_close(p.grad.to_dense() * mask, torch.ones(4, 10).T @ x * mask)
    opt.step()
    torch.testing.assert_close(p.to_dense(), d - 0.1 * (torch.ones(4, 10).T @ x) * mask)
    plain = torch.nn.Parameter(scorch.asformat(torch.eye(3, 40000), "csr"))
    F.linear(torch.randn(2, 40000), plain)
    assert type(plain.levels[1]) is LevelStorage  # (columns past 16 bits)


def test_wide_view_made_under_inference_mode_serves_outside_it():
    """The wide view is a normal array even when first made under ``torch.inference_mode`` (an inference array
    saved for a backward later would raise)."""
    d = _sparse(40, 30, 0.3, 9)
    s = _packed(d)
    x = torch.randn(30, 3)
    with torch.inference_mode():
        assert_matches_dense(s @ x, d @ x)
    assert s.levels[1].widened and not s.levels[1].crd.is_inference()
    w = s.detach().requires_grad_()
    (w @ x).sum().backward()
    assert_matches_dense(w.grad.to_dense() * (d != 0), torch.ones(40, 3) @ x.T * (d != 0))


def test_torch_compile_of_a_scheduled_training_step():
    """A compiled module over packed weights (AOTAutograd traces the wrapper through its flattened arrays: the wide
    view) computes the eager module's output and gradients."""
    torch.manual_seed(2)
    model = _Block()
    s = scorch.schedule(model)
    s.regex(r"(q|up|down)\.weight").sparsify(scorch.nn.ScalarFraction(0.9)).set_format("csr")
    s.apply()
    ref = copy.deepcopy(model)
    assert type(model.up.weight.levels[1]) is PackedLevel and type(ref.up.weight.levels[1]) is PackedLevel
    x = torch.randn(6, 24)
    y, yr = torch.compile(model, backend="aot_eager")(x), ref(x)
    torch.testing.assert_close(y, yr)
    y.pow(2).sum().backward()
    yr.pow(2).sum().backward()
    for name in ("q", "up", "down"):
        got, want = getattr(model, name).weight.grad, getattr(ref, name).weight.grad
        torch.testing.assert_close(got.to_dense(), want.to_dense())
    torch.testing.assert_close(model.q.bias.grad, ref.q.bias.grad)
