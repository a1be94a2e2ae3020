"""Grouped products (``scorch/compiler/grouped.py``, run by ``scorch/engine/grouped.py``): a sparse operand's entries grouped by the index it shares with
a sliced dense operand, one dense product per group. Against ``torch.einsum`` on the dense tensors, across
formats, shapes (empty, one entry, all-zero, fully dense), dtypes and index widths; gradients against torch's;
which splits qualify; and that the planner picks it for the mixture-of-experts product."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scorch
from scorch import engine
from scorch.compiler import contract
from scorch.compiler import grouped as grouping
from scorch.engine import grouped

from conftest import assert_matches_dense

# (equation, which operand is sparse): the MoE forward and its gradients, and variants of the split
CASES = [
    ("bd,ndh,bn->bh", 2),     # y = sum_n G[b, n] x[b] @ E[n]
    ("bn,bd,ndh->bh", 0),     # the same, the gate first
    ("bh,bd,bn->ndh", 2),     # dE: rows contracted, one result per group
    ("bh,bd,bn->nhd", 2),     # the same, transposed
    ("bh,ndh,bn->bd", 2),     # dx
    ("bd,ndh,bn->hb", 2),     # output transposed
    ("bd,nde,bn,e->bn", 2),   # the group index kept in the output... (not grouped: output holds both)
    ("bd,dh,nh,bn->b", 3),    # an operand with neither kind, two sliced operands
]
FORMATS = ["coo", "csr", "csc", "dcsr", "ell", "bsr(2, 2)"]


def _sparse(draw, shape, dtype, fmt, index_dtype):
    density = draw(st.sampled_from([0.0, 0.2, 0.6, 1.0]))
    mask = torch.rand(shape) < density
    dense = (torch.randint(-3, 4, shape) * mask).to(dtype)
    return dense, scorch.asformat(dense, fmt, index_dtype=index_dtype)


def _dense(shape, dtype):
    return (torch.randint(-4, 5, shape) / (4 if dtype.is_floating_point else 1)).to(dtype)


@settings(max_examples=25)
@given(data=st.data(), case=st.sampled_from(CASES), fmt=st.sampled_from(FORMATS),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]),
       index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_grouped_matches_dense(data, case, fmt, dtype, index_dtype):
    eq, k = case
    inputs, out = eq.split("->")[0].split(","), eq.split("->")[1]
    sizes = {v: data.draw(st.integers(0 if v in inputs[k] else 1, 5), label=v) for v in set(eq) - set(",->")}
    if fmt.startswith("bsr"):
        sizes.update({v: 2 * max(1, sizes[v] // 2) for v in inputs[k]})
    ops, dense_ops = [], []
    for j, idx in enumerate(inputs):
        shape = [sizes[v] for v in idx]
        if j == k:
            d, s = _sparse(data.draw, shape, dtype, fmt, index_dtype)
            ops.append(s)
            dense_ops.append(d)
        else:
            t = _dense(shape, dtype)
            ops.append(t)
            dense_ops.append(t)
    g = grouping.match([tuple(i) for i in inputs], tuple(out), [j == k for j in range(len(inputs))], sizes)
    expected = torch.einsum(eq, *dense_ops)
    if g is not None:  # the grouped evaluation itself, whatever the planner would choose
        got = grouped.evaluate(g, [tuple(i) for i in inputs], tuple(out), ops, sizes)
        assert_matches_dense(got, expected)
    assert_matches_dense(scorch.einsum(eq, *ops), expected)


def test_which_splits_qualify():
    m = lambda eq, k, sizes=None: grouping.match(  # noqa: E731
        [tuple(i) for i in eq.split("->")[0].split(",")], tuple(eq.split("->")[1]),
        [j == k for j in range(eq.count(",") + 1)], sizes or {v: 4 for v in eq if v.isalpha()})
    assert m("bd,ndh,bn->bh", 2) == grouping.Grouping(2, ("n",), ("b",))
    assert m("bh,bd,bn->ndh", 2) == grouping.Grouping(2, ("n",), ("b",))
    assert m("bd,nde,bn,e->bn", 2) is None           # the output holds both kinds
    assert m("bnd,ndh,bn->bh", 2) is None            # a dense operand holds both kinds
    assert m("bd,dh->bh", 0).group == ("b",)          # SpMM: one group per row (the cost model declines it)
    assert m("bd,bd->b", 0) is None                  # nothing is sliced and the output holds rows only
    # of the two splits, the one gathering less: E (n x d x h) is sliced, not gathered
    assert m("bd,ndh,bn->bh", 2, {"b": 4096, "d": 512, "h": 512, "n": 16}).group == ("n",)


def test_planner_groups_the_moe_product():
    sizes = {"b": 4096, "d": 512, "h": 512, "n": 16}
    ops = [contract.Operand(("b", "d"), False, 4096 * 512, frozenset()),
           contract.Operand(("n", "d", "h"), False, 16 * 512 * 512, frozenset()),
           contract.Operand(("b", "n"), True, 4096, frozenset("bn"))]
    node = contract.best_path(ops, ("b", "h"), sizes)
    assert node.grouped is not None and node.grouped.group == ("n",)
    # experts small enough for a kernel to read from the cache for every token: no reuse to gain, the kernel
    narrow = {"b": 2048, "d": 128, "h": 128, "n": 16}
    assert contract.best_path(ops, ("b", "h"), narrow).grouped is None
    # ... unless the compiled grouped kernels run it (float32 on the CPU: no torch call per group), down to
    # experts of 8K elements
    assert contract.best_path(ops, ("b", "h"), narrow, compiled=True).grouped is not None
    assert contract.best_path(ops, ("b", "h"), {**narrow, "d": 64, "h": 64}, compiled=True).grouped is None
    # few entries per group and little work per entry: the kernel
    small = {"b": 4096, "d": 4, "h": 4, "n": 4096}
    ops[2] = contract.Operand(("b", "n"), True, 4096, frozenset("bn"))
    assert contract.best_path(ops, ("b", "h"), small).grouped is None


def test_explain_names_the_grouping(capsys):
    x, E = torch.randn(512, 512), torch.randn(4, 512, 512)
    g = torch.nn.functional.one_hot(torch.arange(512) % 4, 4).float().to_sparse()
    engine.einsum("bd,ndh,bn->bh", x, E, g, explain=True)
    assert "grouped by n" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["coo", "csr"])
def test_grouped_gradients(fmt):
    torch.manual_seed(0)
    B, D, H, N = 40, 6, 5, 4
    x = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
    E = torch.randn(N, D, H, dtype=torch.float64, requires_grad=True)
    gd = torch.nn.functional.one_hot(torch.randint(0, N, (B,)), N).double() * torch.rand(B, 1, dtype=torch.float64)
    g = scorch.asformat(gd, fmt)
    g.requires_grad_(True)
    sizes = {"b": B, "d": D, "h": H, "n": N}
    gr = grouping.Grouping(2, ("n",), ("b",))
    y = grouped.evaluate(gr, [tuple("bd"), tuple("ndh"), tuple("bn")], tuple("bh"), [x, E, g], sizes)
    w = torch.randn(B, H, dtype=torch.float64)
    (y * w).sum().backward()
    xr, Er, gr_ = x.detach().requires_grad_(), E.detach().requires_grad_(), gd.clone().requires_grad_()
    (torch.einsum("bd,ndh,bn->bh", xr, Er, gr_) * w).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(E.grad, Er.grad)
    torch.testing.assert_close(g.grad.to_dense(), gr_.grad * (gd != 0))


@pytest.mark.parametrize("idx, res, want", [
    ([("p", "a"), ("a", "b")], ("p", "b"), lambda x, y: x @ y),      # the MoE forward per group
    ([("p", "a"), ("p", "b")], ("a", "b"), lambda x, y: x.T @ y),    # the experts' gradient per group
    ([("p", "a"), ("p", "b")], ("b", "a"), lambda x, y: y.T @ x),
])
def test_group_products_run_as_matrix_products(idx, res, want):
    x = torch.randn(5, 3)
    y = torch.randn(*(3 if v == "a" else 5 if v == "p" else 4 for v in idx[1]))
    product = grouped.matrix_product(idx, res, "p")
    assert product is not None
    torch.testing.assert_close(product([x, y]), want(x, y))
    torch.testing.assert_close(product([x, y]), torch.einsum(f"{''.join(idx[0])},{''.join(idx[1])}->{''.join(res)}",
                                                             x, y))


def test_other_group_products_are_einsums():
    assert grouped.matrix_product([("p", "a"), ("p", "a")], ("a", "a"), "p") is None
    assert grouped.matrix_product([("p", "a"), ("a", "b")], ("b", "p"), "p") is None
    assert grouped.matrix_product([("p", "a", "c"), ("a", "b")], ("p", "b"), "p") is None


@pytest.mark.parametrize("at, n", [([0, 1, 2, 3], 4), ([2, 0, 3, 1], 4), ([1, 1, 3, 0], 4), ([0, 2], 4), ([], 3)],
                         ids=["identity", "permutation", "repeated", "missing", "empty"])
def test_placed_rows(at, n):
    """Group results placed at their rows: the identity order is the part itself, a permutation a gather, and
    repeated or missing rows added into zeros; gradients reach the part."""
    part = torch.randn(len(at), 3, dtype=torch.float64, requires_grad=True)
    at = torch.tensor(at, dtype=torch.long)
    got = grouped.placed(part, at, (n, 3))
    want = torch.zeros(n, 3, dtype=torch.float64).index_add(0, at, part)
    torch.testing.assert_close(got, want)
    if at.numel() == n and torch.equal(at, torch.arange(n)):
        assert got is part
    g = torch.randn(n, 3, dtype=torch.float64)
    assert torch.autograd.grad(got, part, g)[0].equal(g[at])


# sizes at which the planner groups the mixture-of-experts product (its kernel is estimated cheaper below them)
MOE = dict(B=512, D=64, H=48, N=8)


def _moe(top_k, fmt, missing_row, seed=0):
    """``(x, E, gate dense, gate sparse)``: float64, expert N-1 given no token, token 3 none when ``missing_row``."""
    g = torch.Generator().manual_seed(seed)
    B, D, H, N = MOE["B"], MOE["D"], MOE["H"], MOE["N"]
    x, E = torch.randn(B, D, generator=g, dtype=torch.float64), torch.randn(N, D, H, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(N - 1, generator=g)[:top_k] for _ in range(B)])
    gd = torch.zeros(B, N, dtype=torch.float64).scatter(1, idx, torch.rand(B, top_k, generator=g, dtype=torch.float64)
                                                         + 0.5)
    if missing_row:
        gd[3] = 0
    return x, E, gd, scorch.asformat(gd, fmt)


@pytest.mark.parametrize("missing_row", [False, True], ids=["every-row", "a-row-without-entry"])
@pytest.mark.parametrize("needs", ["x,E,gate", "x", "E", "gate"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_moe_product_gradients(fmt, top_k, needs, missing_row):
    """``scorch.einsum``'s mixture-of-experts product with gradients runs as the grouped product's own Function
    (entries sorted once, the backward on the same order); its value and the gradients of x, E and the gate's
    values are torch's on the dense gate, for top-1 (each row once: results gathered in row order) and top-2 or a
    row without an entry (added into zeros), with an expert that gets no token (its gradient zero)."""
    x, E, gd, g = _moe(top_k, fmt, missing_row)
    want = needs.split(",")
    x.requires_grad_("x" in want)
    E.requires_grad_("E" in want)
    g.requires_grad_("gate" in want)
    y = scorch.einsum("bn,bd,ndh->bh", g, x, E)
    assert type(y.grad_fn).__name__ == "_GroupedProductBackward"
    xr, Er, gr = x.detach().requires_grad_(), E.detach().requires_grad_(), gd.clone().requires_grad_()
    yr = torch.einsum("bn,bd,ndh->bh", gr, xr, Er)
    torch.testing.assert_close(y, yr)
    w = torch.randn_like(yr)
    (y * w).sum().backward()
    (yr * w).sum().backward()
    if "x" in want:
        torch.testing.assert_close(x.grad, xr.grad)
    if "E" in want:
        torch.testing.assert_close(E.grad, Er.grad)
        assert E.grad[-1].abs().sum() == 0  # the expert without tokens
    if "gate" in want:
        torch.testing.assert_close(g.grad.to_dense(), gr.grad * (gd != 0))


def test_moe_product_double_backward():
    """Gradients of gradients (``create_graph=True``) through the grouped product: the backward's products are
    then differentiable ops."""
    x, E, gd, g = _moe(2, "csr", True)
    for t in (x, E, g):
        t.requires_grad_(True)
    gx, gE, gg = torch.autograd.grad(scorch.einsum("bn,bd,ndh->bh", g, x, E).pow(2).sum(), [x, E, g.values()],
                                     create_graph=True)
    xr, Er, gr = x.detach().requires_grad_(), E.detach().requires_grad_(), gd.clone().requires_grad_()
    rx, rE, rg = torch.autograd.grad(torch.einsum("bn,bd,ndh->bh", gr, xr, Er).pow(2).sum(), [xr, Er, gr],
                                     create_graph=True)
    mask = gd != 0
    torch.testing.assert_close(gg, rg[mask])
    second = torch.autograd.grad(gx.pow(2).sum() + gE.pow(2).sum() + gg.pow(2).sum(), [x, E, g.values()])
    want = torch.autograd.grad(rx.pow(2).sum() + rE.pow(2).sum() + rg[mask].pow(2).sum(), [xr, Er, gr])
    torch.testing.assert_close(second[0], want[0])
    torch.testing.assert_close(second[1], want[1])
    torch.testing.assert_close(second[2], want[2][mask])


def test_moe_product_integer_gates_train_the_experts():
    """The mixture-of-experts program with an integer one-hot gate (``F.one_hot(...).to_sparse()``) and experts
    that need gradients: the values cast to the experts' type, the experts' gradient torch's, with and without
    gradients the same result."""
    x, E, gd, _ = _moe(1, "csr", False)
    onehot = (gd != 0).long()
    E.requires_grad_(True)
    y = scorch.einsum("bd,ndh,bn->bh", x, E, onehot.to_sparse())
    assert type(y.grad_fn).__name__ == "_GroupedProductBackward"
    Er = E.detach().requires_grad_()
    yr = torch.einsum("bd,ndh,bn->bh", x, Er, onehot.double())
    torch.testing.assert_close(y, yr)
    y.sum().backward()
    yr.sum().backward()
    torch.testing.assert_close(E.grad, Er.grad)
    with torch.no_grad():
        torch.testing.assert_close(scorch.einsum("bd,ndh,bn->bh", x, E, onehot.to_sparse()), yr)


@pytest.mark.parametrize("in_cache", [False, True], ids=["whole-arrays", "group-by-group"])
@pytest.mark.parametrize("top_k, missing_row", [(1, False), (1, True), (2, False)])
@pytest.mark.parametrize("ones", [False, True])
def test_moe_product_without_gradients(monkeypatch, in_cache, top_k, missing_row, ones):
    """The forward without gradients, both ways (whole-array ops for small products, group by group in the cache
    above ``IN_CACHE_BYTES``), with weights and with a gate of ones: torch's result."""
    monkeypatch.setattr(grouped, "IN_CACHE_BYTES", 0 if in_cache else 1 << 40)
    x, E, gd, _ = _moe(top_k, "csr", missing_row)
    if ones:
        gd = (gd != 0).double()
    idx, sizes = [tuple("bn"), tuple("bd"), tuple("ndh")], {"b": MOE["B"], "d": MOE["D"], "h": MOE["H"], "n": MOE["N"]}
    g = grouping.match(idx, tuple("bh"), [True, False, False], sizes)
    with torch.no_grad():  # (the grouped evaluation itself: at these sizes the planner picks the kernel)
        torch.testing.assert_close(grouped.evaluate(g, idx, tuple("bh"), [scorch.asformat(gd, "csr"), x, E], sizes),
                                   torch.einsum("bn,bd,ndh->bh", gd, x, E))
