"""A user's schedule (``scorch.einsum(..., schedule=...)``, ``scorch.Directives``): legal ones run and match dense
torch whatever the order; illegal ones raise a ``ValueError`` naming the conflict; ``scorch.explain`` returns the
plan (``Explanation``: the text, the plans, the schedule and the directives that give it again)."""
import io
import itertools

import pytest
import torch

import scorch

torch.manual_seed(0)
D = torch.randn(30, 20) * (torch.rand(30, 20) < 0.3)
X = torch.randn(20, 8)


def _spmm(fmt, schedule):
    return scorch.einsum("ij,jk->ik", scorch.asformat(D, fmt), X, schedule=schedule)


LEGAL = ["ijk", "kij", "jik", "kji"]  # (j inside i or i inside j, k outside or inside both)


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "dcsr"])
@pytest.mark.parametrize("order", LEGAL)
def test_every_legal_order_matches_torch(fmt, order):
    torch.testing.assert_close(_spmm(fmt, order), D @ X, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("order,parallel", [("kij", "k"), ("kji", "k"), ("ijk", "i"), ("ijk", "none"),
                                            ("jik", "none")])
def test_parallel_loops_match_torch(order, parallel):
    torch.testing.assert_close(_spmm("csr", {"order": order, "parallel": parallel}), D @ X, rtol=1e-5, atol=1e-5)


def test_a_user_schedule_that_differs_from_the_automatic_one_runs_and_is_kept():
    s = scorch.asformat(D, "csr")
    auto = scorch.explain("ij,jk->ik", s, X, file=io.StringIO())
    assert auto.directives.order == tuple("ijk") and auto.directives.parallel == "i"
    mine = scorch.explain("ij,jk->ik", s, X, file=io.StringIO(), schedule={"order": "kij", "parallel": "k"})
    assert mine.schedule != auto.schedule
    assert mine.schedule.outer == ("k",) and mine.schedule.parallel == "outer"
    assert "the user's schedule" in mine
    again = scorch.explain("ij,jk->ik", s, X, file=io.StringIO(), schedule=mine.directives)
    assert again.schedule == mine.schedule


def test_a_discordant_order_converts_the_operand_unless_forbidden():
    s = scorch.asformat(D, "csr")
    out = scorch.explain("ij,jk->ik", s, X, file=io.StringIO(), schedule="jik")
    assert "converted from csr" in out
    with pytest.raises(ValueError, match=r"against its storage order ij, and transpose=False"):
        scorch.einsum("ij,jk->ik", s, X, schedule={"order": "jik", "transpose": False})


@pytest.mark.parametrize("schedule,message", [
    ("ikj", r"puts k between the levels of the sparse operand T0 \(csr: ij\)"),
    ("ij", r"must name each index .* once"),
    ("ijkk", r"must name each index"),
    ({"order": "ijk", "parallel": "j"}, r"only the outermost loop \('i'\) runs in parallel"),
    ({"order": "jik", "parallel": "j"}, r"would race: the first level"),
    ({"order": "ijk", "workspace": "hash"}, r"hash workspace assembles the sparse output of several sparse operands"),
    ({"workspace": "tree"}, r"schedule workspace 'tree': one of 'dense', 'hash'"),
    ({"order": "ijk", "tile": 4}, r"unknown schedule fields \['tile'\]"),
])
def test_illegal_schedules_name_the_conflict(schedule, message):
    with pytest.raises(ValueError, match=message):
        _spmm("csr", schedule)


def test_a_parallel_loop_over_a_summed_index_races():
    s = scorch.asformat(D, "csr")
    a, b = torch.randn(30, 6), torch.randn(20, 6)
    with pytest.raises(ValueError, match=r"would race: k is summed over"):
        scorch.einsum("ij,ik,jk->i", s, a, b, schedule={"order": "kij", "parallel": "k"})
    torch.testing.assert_close(scorch.einsum("ij,ik,jk->i", s, a, b, schedule={"order": "kij", "parallel": "none"}),
                               (D * (a @ b.T)).sum(1), rtol=1e-4, atol=1e-4)


def test_a_schedule_with_gradients_directs_the_forward_kernel():
    x = X.clone().requires_grad_()
    y = scorch.einsum("ij,jk->ik", scorch.asformat(D, "csr"), x, schedule={"order": "kij", "parallel": "k"})
    y.square().sum().backward()
    x_ref = X.clone().requires_grad_()
    (D @ x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temporary", ["dense", "csr", "coo"])
def test_the_format_of_temporaries(temporary):
    a, b = scorch.asformat(D, "csr"), scorch.asformat(D.T.contiguous(), "csr")
    want = D @ D.T @ D
    got = scorch.einsum("ij,jk,kl->il", a, b, D, schedule={"temporary": temporary})
    torch.testing.assert_close(got.to_dense() if isinstance(got, scorch.SparseTensor) else got, want,
                               rtol=1e-4, atol=1e-4)


def test_a_loop_order_schedules_the_whole_expression_as_one_loop_nest():
    a, y = scorch.asformat(D, "csr"), torch.randn(8, 5)
    one = scorch.explain("ij,jk,kl->il", a, X, y, file=io.StringIO(), schedule="ijkl")
    assert len(one.plans) == 1 and "contraction:" not in one
    torch.testing.assert_close(scorch.einsum("ij,jk,kl->il", a, X, y, schedule="ijkl"), D @ X @ y,
                               rtol=1e-4, atol=1e-4)


def test_several_sparse_operands_refuse_a_loop_order_clearly():
    s = scorch.asformat(D, "csr")
    with pytest.raises(NotImplementedError, match="several sparse operands"):
        scorch.einsum("ij,ij->ij", s, s, schedule="ij")


def test_orders_over_all_letters_of_an_sddmm():
    """SDDMM ``ij,ik,jk->ij``: every order with i and j adjacent (in storage order or converted) is right."""
    a, b = torch.randn(30, 6), torch.randn(20, 6)
    want = D * (a @ b.T)
    s = scorch.asformat(D, "csr")
    for order in itertools.permutations("ijk"):
        order = "".join(order)
        if abs(order.index("i") - order.index("j")) != 1:
            continue
        got = scorch.einsum("ij,ik,jk->ij", s, a, b, schedule=order)
        torch.testing.assert_close(got.to_dense(), want, rtol=1e-4, atol=1e-4)


EXPRESSIONS = [("ij,jk->ik", [(12, 10), (10, 4)]), ("ij,j->i", [(12, 10), (10,)]), ("ij,ik,jk->ij", [(12, 10), (12, 3), (10, 3)]),
               ("ij,ik->jk", [(12, 10), (12, 3)]), ("ij->j", [(12, 10)]), ("ij,ij->ij", [(12, 10), (12, 10)]),
               ("ij,jk->ki", [(12, 10), (10, 4)]), ("ijk,kl->ijl", [(4, 6, 5), (5, 3)])]
FORMATS = {2: ["csr", "csc", "coo", "dcsr", "bsr(2, 2)", "ell", "dia"], 3: ["coo", "csf"]}


@pytest.mark.parametrize("eq,shapes", EXPRESSIONS, ids=[e for e, _ in EXPRESSIONS])
def test_every_order_is_right_or_refused(eq, shapes):
    """Every permutation of the letters, every parallel choice, each format of the sparse (first) operand: the
    result matches dense torch, or the schedule is refused with a ValueError (never a wrong value)."""
    g = torch.Generator().manual_seed(len(eq))
    dense = [torch.randn(*s, generator=g) for s in shapes]
    dense[0] = dense[0] * (torch.rand(*shapes[0], generator=g) < 0.4)
    want = torch.einsum(eq, *dense)
    letters = sorted(set(eq) - set(",->"))
    ran = 0
    for fmt in FORMATS[dense[0].dim()]:
        s = scorch.asformat(dense[0], fmt)
        for order in itertools.permutations(letters):
            for parallel in (None, "none", order[0]):
                try:
                    got = scorch.einsum(eq, s, *dense[1:], schedule={"order": "".join(order), "parallel": parallel})
                except ValueError:
                    continue
                got = got.to_dense() if isinstance(got, scorch.SparseTensor) else got
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                           msg=lambda m: f"{eq} {fmt} order={''.join(order)} parallel={parallel}: {m}")
                ran += 1
    assert ran > 0


@pytest.mark.parametrize("eq,shape", [("ij,j->i", [(5,)]), ("ij,jk->ik", [(5, 16)]), ("ij,ik,jk->i", [(6, 16), (5, 16)]),
                                      ("ij,ik,jk->k", [(6, 7), (5, 7)]), ("ij,ik,jk->ik", [(6, 16), (5, 16)])])
@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_every_legal_order_with_a_summed_loop_outside_matches_dense(eq, shape, fmt):
    """Orders that put a summed index's loop outside the output's write: each output location is written once
    per iteration of it, so the writes must add up (a kernel that stored instead kept the last one)."""
    import itertools
    g = torch.Generator().manual_seed(4)
    dense = torch.randn(6, 5, generator=g) * (torch.rand(6, 5, generator=g) < 0.5)
    others = [torch.randn(*sh, generator=g) for sh in shape]
    expected = torch.einsum(eq, dense, *others)
    s = scorch.asformat(dense, fmt)
    letters = sorted(set(eq.replace(",", "").replace("->", "")))
    ran = 0
    for order in itertools.permutations(letters):
        try:
            got = scorch.einsum(eq, s, *others, schedule={"order": "".join(order), "parallel": "none"})
        except ValueError:
            continue  # (an order against the storage or between a sparse operand's levels: refused)
        ran += 1
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"order {''.join(order)}")
    assert ran >= 2
