"""The grouped product's compiled kernels (``scorch/compiler/grouped_gemm.py``, bound in
``scorch/engine/grouped.py``): the mixture-of-experts product ``y[b] = sum_n G[b, n] x[b] E[n]`` with a float32
sparse gate, its gate values' and experts' gradients, against torch in float64 on the dense gate. Shapes that
hit every edge of the tiles: token and width counts that are no multiple of the tile (rows, columns), experts
without tokens, one expert, one token, rows named twice (top-2) or not at all; the tasks' blocks forced small
(several row blocks per expert, the weight gradient reduced over several blocks of entries and split along d);
the AVX2-width source as well as the machine's."""
from __future__ import annotations

import pytest
import torch

import scorch
from scorch.compiler import grouped_gemm
from scorch.engine import grouped


def _case(B, D, H, N, top_k=1, empty=(), missing=(), seed=0):
    """``(x, E, dense gate float64)``: experts in ``empty`` get no token, the tokens in ``missing`` none."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g)
    E = torch.randn(N, D, H, generator=g) / D ** 0.5
    allowed = torch.tensor([n for n in range(N) if n not in empty])
    pick = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(B)])
    gate = torch.zeros(B, N, dtype=torch.float64).scatter(1, pick, torch.rand(B, top_k, generator=g,
                                                                               dtype=torch.float64) + 0.25)
    gate[list(missing)] = 0
    return x, E, gate


def _counted(monkeypatch):
    """The calls of the compiled forward and backward, counted by name."""
    calls = {"compiled_forward": 0, "compiled_backward": 0}
    for name in calls:
        def spy(*args, _f=getattr(grouped, name), _name=name, **kw):
            calls[_name] += 1
            return _f(*args, **kw)
        monkeypatch.setattr(grouped, name, spy)
    return calls


def _check(monkeypatch, x, E, gate, needs=("x", "E", "gate"), fmt="csr"):
    """scorch's product and gradients (float32, through ``scorch.einsum``) against torch's in float64, the
    compiled kernels' forward and backward having run."""
    calls = _counted(monkeypatch)
    g = scorch.asformat(gate.float(), fmt)
    xs, Es = x.clone().requires_grad_("x" in needs), E.clone().requires_grad_("E" in needs)
    g.requires_grad_("gate" in needs)
    y = scorch.einsum("bn,bd,ndh->bh", g, xs, Es)
    xr, Er, gr = x.double().requires_grad_(), E.double().requires_grad_(), gate.clone().requires_grad_()
    yr = torch.einsum("bn,bd,ndh->bh", gr, xr, Er)
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.double(), yr, **tol)
    with torch.no_grad():
        torch.testing.assert_close(scorch.einsum("bn,bd,ndh->bh", g.detach(), x, E).double(), yr, **tol)
    assert type(y.grad_fn).__name__ == "_GroupedProductBackward"
    w = torch.randn(yr.shape, generator=torch.Generator().manual_seed(1))
    (y * w).sum().backward()
    (yr * w.double()).sum().backward()
    if "x" in needs:
        torch.testing.assert_close(xs.grad.double(), xr.grad, **tol)
    if "E" in needs:
        torch.testing.assert_close(Es.grad.double(), Er.grad, **tol)
    if "gate" in needs:
        torch.testing.assert_close(g.grad.to_dense().double(), gr.grad * (gate != 0), **tol)
    assert calls["compiled_forward"] >= 1 and calls["compiled_backward"] == 1


@pytest.mark.parametrize("B, D, H, N, top_k, empty, missing", [
    (4096 // 16, 64, 64, 4, 1, (), ()),            # whole tiles
    (37, 13, 70, 5, 1, (), ()),                    # odd counts: a partial row tile, a partial column tile
    (37, 13, 70, 5, 2, (), ()),                    # rows named twice: the products added into zeros
    (50, 7, 5, 6, 1, (0, 4), (3, 9)),              # experts without tokens, tokens without an expert
    (40, 9, 17, 1, 1, (), ()),                     # one expert
    (1, 5, 3, 3, 1, (), ()),                       # one token
    (9, 130, 33, 40, 1, (), ()),                   # more experts than tokens, a width past two tiles
])
def test_compiled_moe_product(monkeypatch, B, D, H, N, top_k, empty, missing):
    _check(monkeypatch, *_case(B, D, H, N, top_k, empty, missing))


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("needs", [("E",), ("gate",), ("x",), ("E", "gate")])
def test_compiled_moe_product_each_gradient(monkeypatch, needs, top_k):
    """Each gradient alone (the gate values' gradient by the weight gradient's kernel or, without the experts',
    by torch; the input's by the forward's kernel on the transposed experts), from the products kept (top-2) or
    recovered from the result's rows (top-1)."""
    _check(monkeypatch, *_case(61, 24, 40, 3, top_k), needs=needs)


@pytest.mark.parametrize("needs", [("gate",), ("E", "gate")])
def test_compiled_moe_product_tiny_gate_weight(monkeypatch, needs):
    """A top-1 gate weight below ``DIVISIBLE``: the products are kept instead of recovered from the result
    (dividing by 1e-13 would not give them back), the gate values' gradient still torch's."""
    x, E, gate = _case(40, 16, 24, 4, 1)
    keeps, forward = [], grouped.compiled_forward
    monkeypatch.setattr(grouped, "compiled_forward", lambda *a, keep: keeps.append(keep) or forward(*a, keep=keep))
    _check(monkeypatch, x, E, gate, needs=needs)
    assert keeps[0] is False  # (every weight divisible: recovered from the result)
    gate[7] = gate[7] * 1e-13
    assert gate[7].abs().max() < grouped.DIVISIBLE
    keeps.clear()
    _check(monkeypatch, x, E, gate, needs=needs)
    assert keeps[0] is True


def test_compiled_moe_product_small_blocks(monkeypatch):
    """Many tasks per expert: row blocks of the forward of one tile, the weight gradient reduced over blocks of
    five entries (the first stored, the others added) and split along ``d`` in blocks of one tile."""
    monkeypatch.setattr(grouped_gemm, "row_block", lambda entries, width, threads: 1)
    monkeypatch.setattr(grouped_gemm, "grad_blocks", lambda groups, entries, d, h, threads: (5, 1))
    _check(monkeypatch, *_case(83, 20, 70, 3, 1, empty=(1,)))
    _check(monkeypatch, *_case(83, 20, 70, 3, 2))


def test_compiled_moe_product_avx2_width(monkeypatch):
    """The source for 32-byte vectors (8 lanes, two vectors a tile row): the same results (it runs on any x86 CPU
    with AVX2, which the one with AVX-512 that builds the other has)."""
    if grouped_gemm.vectors()[0] < 8:
        pytest.skip("a machine without 32-byte vectors")
    monkeypatch.setattr(grouped_gemm, "vectors", lambda: (8, 2))
    monkeypatch.setattr(grouped_gemm, "_kernels", {})
    _check(monkeypatch, *_case(37, 13, 70, 5, 2, empty=(2,)))


def test_compiled_forward_matches_the_per_expert_loop():
    """The kernel's forward against the per-expert loop it replaces (``index_select``, ``mm``, weighted,
    ``index_add_``) in float32: the same sums up to rounding."""
    x, E, gate = _case(300, 48, 96, 6, 1, empty=(5,))
    nz = gate.nonzero()
    routing, order = grouped.route(nz[:, 1], nz[:, 0], 6, 300)
    vals = gate[nz[order, 0], nz[order, 1]].float()
    y, p = grouped.compiled_forward(routing, vals, x, E, keep=True)
    want = torch.zeros(300, 96)
    for n in range(6):
        at = nz[nz[:, 1] == n, 0]
        want.index_add_(0, at, torch.mm(x.index_select(0, at), E[n]) * gate[at, n].float()[:, None])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p * vals[:, None], want[routing.rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_take_the_torch_path(dtype):
    """float64 and bfloat16 are not the compiled kernels' (``grouped.compiled``): the torch ops serve them, with
    torch's result."""
    x, E, gate = _case(40, 16, 24, 4, 1)
    assert not grouped.compiled(torch.ones(1, dtype=dtype), x.to(dtype), E.to(dtype))
    g = scorch.asformat(gate.to(dtype), "csr")
    with torch.no_grad():
        got = scorch.einsum("bn,bd,ndh->bh", g, x.to(dtype), E.to(dtype))
    want = torch.einsum("bn,bd,ndh->bh", gate, x.double(), E.double())
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_route_sorts_stably_and_says_whether_rows_are_named_once(index_dtype):
    """``route``: the entries sorted by group, stably (torch's stable sort's permutation), each group's first
    entry, and whether every row is named once; a group key out of range raises instead of writing past the
    counts."""
    groups = torch.tensor([2, 0, 2, 1, 0, 2], dtype=index_dtype)
    rows = torch.tensor([0, 1, 2, 3, 4, 5], dtype=index_dtype)
    routing, order = grouped.route(groups, rows, 4, 6)
    assert order.equal(torch.sort(groups.long(), stable=True)[1])
    assert routing.rows.equal(rows.long()[order])
    assert routing.starts.tolist() == [0, 2, 3, 6, 6]
    assert routing.ranges == [(0, 0, 2), (1, 2, 3), (2, 3, 6)] and not routing.covered
    assert routing.once and routing.inverse.equal(torch.argsort(routing.rows))
    assert not grouped.route(groups, torch.tensor([0, 1, 2, 3, 4, 4]), 4, 6)[0].once   # a row twice
    assert not grouped.route(groups, rows, 4, 7)[0].once                                # a row without entry
    assert grouped.route(groups, rows, 4, 7)[0].inverse is None
    with pytest.raises(IndexError, match="group 4"):
        grouped.route(torch.tensor([0, 4]), torch.tensor([0, 1]), 4, 2)


SANITIZED = r'''
import torch, scorch
from scorch.compiler import grouped_gemm
from scorch.engine import grouped

def case(B, D, H, N, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    x, E = torch.randn(B, D, generator=g), torch.randn(N, D, H, generator=g)
    pick = torch.stack([torch.randperm(N, generator=g)[:top_k] for _ in range(B)])
    gate = torch.zeros(B, N, dtype=torch.float64).scatter(1, pick, torch.rand(B, top_k, generator=g,
                                                                               dtype=torch.float64) + 0.25)
    gate[B // 2] = 0
    return x, E, gate

n, bad = 0, []
for small in (False, True):
    if small:  # one tile a task, five entries a block of the weight gradient
        grouped_gemm.row_block = lambda *a: 1
        grouped_gemm.grad_blocks = lambda *a: (5, 1)
    for widths in ([None, (8, 2)] if grouped_gemm.vectors()[0] >= 8 else [None]):
        if widths:
            grouped_gemm.vectors = lambda: widths
            grouped_gemm._kernels.clear()
        for B, D, H, N, top_k in ((37, 13, 70, 5, 1), (37, 13, 70, 5, 2), (9, 7, 5, 12, 1), (64, 20, 64, 3, 1)):
            x, E, gate = case(B, D, H, N, top_k, n)
            xs, Es, g = x.clone().requires_grad_(), E.clone().requires_grad_(), scorch.asformat(gate.float(), "csr")
            g.requires_grad_(True)
            y = scorch.einsum("bn,bd,ndh->bh", g, xs, Es)
            (y * y).sum().backward()
            xr, Er, gr = x.double().requires_grad_(), E.double().requires_grad_(), gate.clone().requires_grad_()
            yr = torch.einsum("bn,bd,ndh->bh", gr, xr, Er)
            (yr * yr).sum().backward()
            for got, want in ((y, yr), (xs.grad, xr.grad), (Es.grad, Er.grad),
                              (g.grad.to_dense(), gr.grad * (gate != 0))):
                n += 1
                if not torch.allclose(got.double(), want, rtol=1e-3, atol=1e-3):
                    bad.append((B, D, H, N, top_k, small, widths))
print("MISMATCH", bad) if bad else print("checked", n)
'''


def test_compiled_kernels_under_sanitizers(tmp_path):
    """The compiled grouped kernels (route, forward, weight gradient; both vector widths; small blocks) built with
    AddressSanitizer and UndefinedBehaviorSanitizer, in a subprocess: no read or write outside torch's buffers
    (partial row and column tiles, the prefetches' pointer rows), the results torch's."""
    import os
    import subprocess
    import sys
    from test_sanitize import _sanitized_env, _sanitizer_available
    if not sys.platform.startswith("linux") or not _sanitizer_available():
        pytest.skip("no ASan/UBSan runtime here")
    env = _sanitized_env(tmp_path)
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    run = subprocess.run([sys.executable, "-c", SANITIZED], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = run.stdout + run.stderr
    assert "AddressSanitizer" not in out and "runtime error" not in out, out[-6000:]
    assert run.returncode == 0 and "checked" in run.stdout and "MISMATCH" not in run.stdout, out[-6000:]
    assert list((tmp_path / "cache").rglob("*.so"))
