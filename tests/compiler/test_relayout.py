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
