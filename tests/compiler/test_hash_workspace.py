"""Hash workspaces: a sparse output of several sparse operands assembled row by row in an open-addressing table
instead of a dense array over the row's width (``compiler/coiterate.py``, "the hash workspace";
``compiler.schedule.row_workspace`` chooses). Chosen by ``schedule={"workspace": "hash"}`` or, where a dense one
would not fit, by the compiler; every result against dense torch."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch import SparseTensor

HASH = {"workspace": "hash"}


def _rand(shape, density, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    vals = torch.randint(-8, 9, shape, generator=g).to(torch.float64) / 4
    return (vals * (torch.rand(shape, generator=g) < density)).to(dtype)


def _check(result, expected):
    assert isinstance(result, SparseTensor)
    got = result.to_dense()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 9), k=st.integers(0, 9), n=st.integers(0, 9), density=st.sampled_from([0.0, 0.3, 1.0]),
       fmt=st.sampled_from(["csr", "coo", "csc", "dcsr"]), seed=st.integers(0, 2**16))
def test_products_sums_and_elementwise_products_match_dense(m, k, n, density, fmt, seed):
    a, b, c = _rand((m, k), density, seed), _rand((k, n), density, seed + 1), _rand((m, k), density, seed + 2)
    sa, sb, sc = (scorch.asformat(x, fmt) for x in (a, b, c))
    _check(scorch.einsum("ij,jk->ik", sa, sb, schedule=HASH), a @ b)
    _check(scorch.einsum("ij,ij->ij", sa, sc, schedule=HASH), a * c)
    _check(scorch.einsum("ij,jk->ik", sa, sb, format="coo", schedule=HASH), a @ b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16])
def test_value_types(dtype):
    a, b = _rand((17, 23), 0.3, 1, dtype), _rand((23, 11), 0.3, 2, dtype)
    got = scorch.einsum("ij,jk->ik", scorch.asformat(a, "csr"), scorch.asformat(b, "csr"), schedule=HASH)
    _check(got, (a.double() @ b.double()).to(dtype))


def test_a_row_full_of_colliding_keys():
    """One row with hundreds of keys spread over 2**40 coordinates (the product of [1, 1] and two such rows): many
    share a first slot, so the probing and the clean-up through the slots list both run; and repeated keys (the
    same coordinate in both rows) are summed once each. The sum of the two rows as vectors (a merge, written
    directly: no workspace) gives the same entries."""
    n = 2**40
    g = torch.Generator().manual_seed(3)
    ka = torch.randint(0, n, (300,), generator=g).unique()
    kb = torch.cat([ka[::3], torch.randint(0, n, (200,), generator=g)]).unique()
    va, vb = torch.randint(1, 9, (ka.numel(),), generator=g) / 4, torch.randint(1, 9, (kb.numel(),), generator=g) / 4
    a = scorch.sparse_coo_tensor(ka.unsqueeze(0), va, (n,))
    b = scorch.sparse_coo_tensor(kb.unsqueeze(0), vb, (n,))
    rows = torch.stack([torch.cat([torch.zeros_like(ka), torch.ones_like(kb)]), torch.cat([ka, kb])])
    both = scorch.asformat(scorch.sparse_coo_tensor(rows, torch.cat([va, vb]), (2, n)), "csr")
    ones = scorch.asformat(torch.ones(1, 2), "csr")
    keys = torch.cat([ka, kb])
    uniq, inv = keys.unique(return_inverse=True)
    expected = torch.zeros(uniq.numel()).index_add_(0, inv, torch.cat([va, vb]))
    r = a + b
    assert isinstance(r, SparseTensor)
    assert torch.equal(r.indices()[0], uniq) and torch.equal(r.values(), expected)
    p = scorch.einsum("ij,jk->ik", ones, both)  # the dense workspace would take 2**40 entries: a hash one
    assert isinstance(p, SparseTensor)
    pos, crd = p._levels[1].pos.long(), p._levels[1].crd.long()
    assert pos.tolist() == [0, uniq.numel()] and torch.equal(crd, uniq) and torch.equal(p.values(), expected)


def test_wide_products_choose_the_hash_workspace():
    """A product whose rows are 2**40 wide: a dense workspace would not fit, the hash one holds a row's terms."""
    n = 2**40
    a = scorch.sparse_coo_tensor(torch.tensor([[0, 0, 1], [3, 7, 3]]), torch.tensor([1.0, 2.0, 3.0]), (2, 8))
    b = scorch.sparse_coo_tensor(torch.tensor([[3, 7, 3], [n - 2, 5, 5]]), torch.tensor([4.0, 5.0, 6.0]), (8, n))
    r = scorch.einsum("ij,jk->ik", scorch.asformat(a, "csr"), scorch.asformat(b, "csr"))
    d = r.to_sparse_coo() if hasattr(r, "to_sparse_coo") else r
    got = dict(zip(map(tuple, d.indices().t().tolist()), d.values().tolist()))
    # row 0: 1*B[3] + 2*B[7] = 4 @ (n-2) + 6 @ 5 + 10 @ 5; row 1: 3*B[3] = 12 @ (n-2) + 18 @ 5
    assert got == {(0, n - 2): 4.0, (0, 5): 16.0, (1, n - 2): 12.0, (1, 5): 18.0}


def _assembly(*args, **kw):
    return [line for line in scorch.explain(*args, **kw).splitlines() if line.startswith("assembly:")]


@pytest.mark.parametrize("width, m, per, hashed", [(20_000, 400, 5, False), (100_000, 400, 5, True),
                                                  (100_000, 4000, 20, False), (4_000_000, 400, 5, True)])
def test_the_cost_model_takes_a_hash_for_wide_thinly_filled_rows(width, m, per, hashed):
    """Without a directive, ``row_workspace`` weighs a thread's dense workspace (bytes zeroed and faulted in per
    call) against the terms the call adds (``bind._terms``: nnz(A) * nnz(B) / J for a product): 2,000 terms
    into rows 100k or 4M wide take the hash table; 20k-wide rows (a workspace that stays in cache) and 1.6M
    terms into 100k-wide rows a dense array; each result against torch."""
    g = torch.Generator().manual_seed(width + m)
    rows = torch.arange(m).repeat_interleave(per)
    a = torch.sparse_coo_tensor(torch.stack([rows, torch.randint(0, m, (m * per,), generator=g)]),
                                torch.ones(m * per), (m, m)).coalesce()
    b = torch.sparse_coo_tensor(torch.stack([rows, torch.randint(0, width, (m * per,), generator=g)]),
                                torch.rand(m * per, generator=g), (m, width)).coalesce()
    sa, sb = scorch.asformat(a, "csr"), scorch.asformat(b, "csr")
    text = scorch.explain("ij,jk->ik", sa, sb).splitlines()
    line = [x for x in text if x.startswith("assembly:")]
    assert len(line) == 1 and ("hash" in line[0]) == hashed and ("dense workspace" in line[0]) != hashed
    # the cost model's reason: the dense workspace's size against the terms, and which bound decided
    why = [x for x in text if x.startswith("workspace:")]
    assert len(why) == 1 and why[0].split()[1] == ("hash:" if hashed else "dense:") and "terms" in why[0]
    assert ("zeroing it costs more than hashing" in why[0]) == hashed
    expected = (a @ b).coalesce()
    got = scorch.asformat(sa @ sb, "coo")
    torch.testing.assert_close(torch.sparse_coo_tensor(torch.stack([got.levels[0].crd, got.levels[1].crd]).long(),
                                                       got.values(), got.shape).coalesce(), expected)


def test_explain_shows_the_workspace():
    s = scorch.asformat(torch.eye(6), "csr")
    hashed = [line for line in scorch.explain("ij,jk->ik", s, s, schedule=HASH).splitlines()
              if line.startswith("assembly:")]
    dense = [line for line in scorch.explain("ij,jk->ik", s, s).splitlines() if line.startswith("assembly:")]
    assert len(hashed) == 1 and "hash" in hashed[0] and "slots" in hashed[0]
    assert len(dense) == 1 and "dense workspace" in dense[0]
    asked = [line for line in scorch.explain("ij,jk->ik", s, s, schedule=HASH).splitlines()
             if line.startswith("workspace:")]
    assert asked == ["workspace:    hash: asked for (schedule={'workspace': ...})"]
    merged = [line for line in scorch.explain("ij,ij->ij", s, s + s).splitlines() if line.startswith("workspace:")]
    assert merged == ["workspace:    direct: each entry of a row is met once, in order"]


def test_the_loop_ir_interpreter_agrees():
    a, b = _rand((9, 12), 0.4, 5), _rand((12, 7), 0.4, 6)
    with scorch.engine.cpu_backend("interp"):
        got = scorch.einsum("ij,jk->ik", scorch.asformat(a, "csr"), scorch.asformat(b, "csr"), schedule=HASH)
    _check(got, a @ b)


def test_bad_workspace_names_are_refused():
    s = scorch.asformat(torch.eye(3), "csr")
    with pytest.raises(ValueError, match="workspace"):
        scorch.einsum("ij,jk->ik", s, s, schedule={"workspace": "tree"})


def test_a_dense_workspace_asked_for_where_it_cannot_fit_is_refused_clearly():
    n = 2**40
    a = scorch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (n,))
    with pytest.raises(ValueError, match="hash"):
        scorch.einsum("i,i->i", a, a, schedule={"workspace": "dense"})
