"""``scorch.sparsified_op`` (STen's operator model): outputs and gradients sparsified through an inline and an
external stage into formats, checked against dense torch computing ``op(...) * mask`` and masked gradients; STen's
two examples (an ``add`` re-sparsified 2:4; a Linear whose weight gradient is kept top-k in COO, trained by SGD)."""
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import scorch
from scorch.nn import NM, BlockFraction, KeepAll, RandomFraction, ScalarFraction, ScalarThreshold, Sparsifier


def _pair(shape=(4, 8), seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(),
            torch.randn(*shape, generator=g, dtype=dtype).requires_grad_())


def test_exported_names():
    assert scorch.sparsified_op is scorch.nn.sparsified_op and "sparsified_op" in scorch.__all__


# --- STen's example (a): a sparse add whose result is re-sparsified 2:4 --------------------------------------

@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_add_with_an_nm_output_is_the_masked_dense_sum_and_its_gradient(rows, groups, seed):
    x, y = _pair((rows, 4 * groups), seed)
    add = scorch.sparsified_op(torch.add, out_fmt=[(NM(2, 4), "nm(2, 4)")])
    z = add(x, y, alpha=2.0)
    assert isinstance(z, scorch.SparseTensor) and z.format == scorch.formats.named.resolve("nm(2, 4)", 2)
    ref = torch.add(x, y, alpha=2.0)
    mask = NM(2, 4).mask(ref.detach())
    torch.testing.assert_close(z.to_dense(), ref * mask)
    grad = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(seed + 1))
    (z.to_dense() * grad).sum().backward()
    gx, gy = torch.autograd.grad((ref * mask * grad).sum(), (x, y))
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(y.grad, gy)


def test_add_of_sparse_operands_runs_through_scorch_and_keeps_only_stored_entries():
    g = torch.Generator().manual_seed(3)
    a = scorch.asformat(torch.randn(6, 8, generator=g).relu(), "csr")
    b = scorch.asformat(torch.randn(6, 8, generator=g).relu(), "csr")
    dense = a.to_dense() + b.to_dense()
    z = scorch.sparsified_op(torch.add, out_fmt=[(NM(2, 4), "nm(2, 4)")])(a, b)
    torch.testing.assert_close(z.to_dense(), dense * NM(2, 4).mask(dense))
    kept = scorch.sparsified_op(torch.add, out_fmt=[(KeepAll(), "coo")])(a, b)
    assert kept.format == scorch.formats.named.resolve("coo", 2)
    union = (a.to_dense() != 0) | (b.to_dense() != 0)
    assert kept.nnz == int(union.sum())  # KeepAll on a sparse result: its pattern, not every entry
    torch.testing.assert_close(kept.to_dense(), dense)


# --- STen's example (b): a Linear whose weight gradient is kept top-k in COO ---------------------------------

def _linear_pair(seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(12, 6).double()  # (float64: a rounding difference cannot flip a top-k choice)
    ref = torch.nn.Linear(12, 6).double()
    ref.load_state_dict(layer.state_dict())
    return layer, ref


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_linear_with_top_k_coo_weight_gradient_trains_as_dense_with_the_masked_gradient(momentum):
    layer, ref = _linear_pair()
    linear = scorch.sparsified_op(F.linear, grad_inp_fmt=[None, (ScalarFraction(0.8), "coo")])
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=momentum)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, target = (torch.randn(n, k, generator=g, dtype=torch.float64) for n, k in ((5, 12), (5, 6)))
        opt.zero_grad()
        F.mse_loss(linear(x, layer.weight, layer.bias), target).backward()
        grad = layer.weight.grad
        assert grad.layout == torch.sparse_coo and grad.coalesce()._nnz() == round(0.2 * 72)
        assert layer.bias.grad.layout == torch.strided
        opt_ref.zero_grad()
        F.mse_loss(ref(x), target).backward()
        ref.weight.grad *= ScalarFraction(0.8).mask(ref.weight.grad)
        torch.testing.assert_close(grad.to_dense(), ref.weight.grad)
        opt.step()
        opt_ref.step()
    assert layer.weight.layout == torch.strided
    torch.testing.assert_close(layer.weight.detach(), ref.weight.detach())
    torch.testing.assert_close(layer.bias.detach(), ref.bias.detach())


def test_sparse_weight_gradient_with_sparse_adam_and_adams_refusal():
    layer, ref = _linear_pair(2)
    linear = scorch.sparsified_op(F.linear, grad_inp_fmt={1: (ScalarFraction(0.5), "coo")})
    opt = torch.optim.SparseAdam([layer.weight], lr=0.05)
    opt_ref = torch.optim.SparseAdam([ref.weight], lr=0.05)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(3, 12, generator=g, dtype=torch.float64)
        opt.zero_grad()
        linear(x, layer.weight, layer.bias).pow(2).sum().backward()
        opt_ref.zero_grad()
        ref(x).pow(2).sum().backward()
        ref.weight.grad = (ref.weight.grad * ScalarFraction(0.5).mask(ref.weight.grad)).to_sparse()
        opt.step()
        opt_ref.step()
    torch.testing.assert_close(layer.weight.detach(), ref.weight.detach())
    with pytest.raises(RuntimeError, match="SparseAdam"):
        torch.optim.Adam([layer.weight]).step()


def _blocks(mask, bh, bw):
    r, c = mask.shape
    return mask.reshape(r // bh, bh, c // bw, bw).any(3).any(1).repeat_interleave(bh, 0).repeat_interleave(bw, 1)


@pytest.mark.parametrize("case", ["coo", "csr", "dense", "nm", "bsr"])
def test_two_stage_gradient_of_a_leaf_stored_as_coo(case):
    """The COO gradient of a parameter stores the final mask: where the temporary format stores exactly its mask
    (coo, csr) the inline and external masks combine; a dense temporary stores every entry; an nm temporary its
    n:m entries; a bsr temporary whole blocks (zeros included), which an external KeepAll keeps."""
    inline, tmp, external = {
        "coo": (ScalarFraction(0.5), "coo", ScalarThreshold(0.3)),
        "csr": (ScalarThreshold(0.2), "csr", NM(1, 4)),
        "dense": (ScalarFraction(0.5), torch.Tensor, KeepAll()),
        "nm": (NM(2, 4), "nm(2, 4)", ScalarThreshold(0.3)),
        "bsr": (ScalarFraction(0.9), "bsr(2, 4)", KeepAll()),
    }[case]
    w = torch.nn.Parameter(torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5)))
    up = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    op = scorch.sparsified_op(torch.mul, grad_inp_fmt={1: (inline, tmp, external, "coo")})
    (op(up, w)).sum().backward()
    first = inline.mask(up)
    stored = {"dense": torch.ones_like(first), "bsr": _blocks(first, 2, 4)}.get(case, first)
    expected = stored & external.mask(up * first)
    grad = w.grad.coalesce()
    assert grad.layout == torch.sparse_coo and grad._nnz() == int(expected.sum())
    assert torch.equal(grad.indices(), expected.nonzero().t())
    torch.testing.assert_close(grad.to_dense(), up * first * expected)


def test_sparse_leaf_gradients_accumulate_over_backward_calls():
    layer, ref = _linear_pair(5)
    linear = scorch.sparsified_op(F.linear, grad_inp_fmt={"weight": (ScalarFraction(0.9), "coo")})
    expected = torch.zeros_like(ref.weight)
    for seed in (0, 1):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        linear(x, weight=layer.weight, bias=layer.bias).sum().backward()
        ref.weight.grad = None
        ref(x).sum().backward()
        expected += ref.weight.grad * ScalarFraction(0.9).mask(ref.weight.grad)
    torch.testing.assert_close(layer.weight.grad.to_dense(), expected)


# --- every built-in sparsifier and a custom one, in output and gradient specs ------------------------------

class Positive(Sparsifier):
    def mask(self, w):
        return w > 0


SPARSIFIERS = {
    "keep-all": lambda: KeepAll(),
    "threshold": lambda: ScalarThreshold(0.5),
    "magnitude": lambda: ScalarFraction(0.7),
    "random": lambda: RandomFraction(0.5, seed=3),
    "block": lambda: BlockFraction(0.5, (2, 4)),
    "n:m": lambda: NM(1, 4),
    "custom": lambda: Positive(),
}


@pytest.mark.parametrize("fmt", ["csr", "coo", torch.Tensor])
@pytest.mark.parametrize("name", list(SPARSIFIERS))
def test_each_sparsifier_on_an_output(name, fmt):
    x, w = _pair((4, 8), 7)
    op = scorch.sparsified_op(torch.mul, out_fmt=[(SPARSIFIERS[name](), fmt)])
    z = op(x, w)
    ref = x * w
    mask = SPARSIFIERS[name]().mask(ref.detach())  # (RandomFraction: a fresh one draws the same first pattern)
    assert isinstance(z, scorch.SparseTensor) == (fmt is not torch.Tensor)
    dense = z.to_dense() if isinstance(z, scorch.SparseTensor) else z
    torch.testing.assert_close(dense, ref * mask)
    dense.sum().backward()
    torch.testing.assert_close(x.grad, (w * mask).detach())


@pytest.mark.parametrize("name", list(SPARSIFIERS))
def test_each_sparsifier_on_an_output_gradient(name):
    x, w = _pair((4, 8), 8)
    op = scorch.sparsified_op(torch.mul, grad_out_fmt=[(SPARSIFIERS[name](), "coo")])
    z = op(x, w)
    assert not isinstance(z, scorch.SparseTensor)
    torch.testing.assert_close(z, x * w)
    upstream = torch.randn(4, 8, dtype=z.dtype, generator=torch.Generator().manual_seed(9))
    (z * upstream).sum().backward()
    kept = upstream * SPARSIFIERS[name]().mask(upstream)
    torch.testing.assert_close(x.grad, (kept * w).detach())
    torch.testing.assert_close(w.grad, (kept * x).detach())


def test_inline_then_external_stage():
    """(ScalarThreshold(0.5) into COO, then 2:4 of what it kept, in nm(2, 4)): the external sparsifier sees the
    temporary's values, zero where the inline one dropped an entry, and keeps stored entries only."""
    x, y = _pair((3, 8), 11)
    spec = (ScalarThreshold(0.5), "coo", NM(2, 4), "nm(2, 4)")
    z = scorch.sparsified_op(torch.sub, out_fmt=[spec])(x, y)
    ref = (x - y).detach()
    inline = ref.abs() > 0.5
    mask = inline & NM(2, 4).mask(ref * inline)
    assert z.format == scorch.formats.named.resolve("nm(2, 4)", 2)
    torch.testing.assert_close(z.to_dense(), ref * mask)
    z.to_dense().sum().backward()
    torch.testing.assert_close(x.grad, mask.to(x.dtype))


def test_multiple_outputs_none_entries_and_named_results():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    op = scorch.sparsified_op(torch.max, out_fmt=[(ScalarThreshold(1.0), "coo"), None])
    values, indices = op(x, 1)
    ref = torch.max(x, 1)
    assert isinstance(op(x, 1), torch.return_types.max) and torch.equal(indices, ref.indices)
    keep = ref.values.detach().abs() > 1.0
    torch.testing.assert_close(values.to_dense(), ref.values * keep)

    def split(t):
        return t[:, :3] * 2, t[:, 3:].exp()
    two = scorch.sparsified_op(split, out_fmt=[None, (ScalarFraction(0.5), "csr")],
                               grad_out_fmt=[(ScalarFraction(0.5), torch.Tensor), None])
    a, b = two(x)
    ra, rb = split(x)
    assert not isinstance(a, scorch.SparseTensor) and isinstance(b, scorch.SparseTensor)
    torch.testing.assert_close(a, ra)
    mb = ScalarFraction(0.5).mask(rb.detach())
    torch.testing.assert_close(b.to_dense(), rb * mb)
    up = torch.randn(5, 3, generator=g, dtype=torch.float64)
    ((a * up).sum() + b.to_dense().sum()).backward()
    expected = torch.autograd.grad((ra * up * ScalarFraction(0.5).mask(up)).sum() + (rb * mb).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)


def test_gradient_spec_on_a_non_leaf_and_a_dense_leaf_format():
    x, w = _pair((4, 8), 13)
    h = x * 3  # not a leaf: its gradient flows on, dense, with the kept values
    op = scorch.sparsified_op(torch.mul, grad_inp_fmt=[(ScalarFraction(0.5), "coo"), (NM(2, 4), torch.Tensor)])
    up = torch.randn(4, 8, dtype=x.dtype, generator=torch.Generator().manual_seed(1))
    (op(h, w) * up).sum().backward()
    gh, gw = (up * w).detach(), (up * h).detach()
    torch.testing.assert_close(x.grad, 3 * gh * ScalarFraction(0.5).mask(gh))
    assert w.grad.layout == torch.strided
    torch.testing.assert_close(w.grad, gw * NM(2, 4).mask(gw))


def test_gradient_spec_on_a_sparse_result():
    a = scorch.asformat(torch.randn(4, 8, generator=torch.Generator().manual_seed(2)).relu(), "csr")
    w = torch.randn(4, 8, generator=torch.Generator().manual_seed(4), requires_grad=True)
    op = scorch.sparsified_op(torch.mul, grad_out_fmt=[(ScalarFraction(0.5), "coo")])
    z = op(a, w)
    assert isinstance(z, scorch.SparseTensor) and z.format == a.format
    torch.testing.assert_close(z.to_dense(), a.to_dense() * w)
    up = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    (z.to_dense() * up).sum().backward()
    seen = up * (a.to_dense() != 0)  # the gradient with respect to the result: on its pattern
    torch.testing.assert_close(w.grad, seen * ScalarFraction(0.5).mask(seen) * a.to_dense())


def test_no_specs_is_the_op_itself():
    x, y = _pair()
    op = scorch.sparsified_op(torch.add)
    assert torch.equal(op(x, y), x + y) and "sparsified_op" in repr(op)


# --- bad specs -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    ({"out_fmt": (NM(2, 4), "nm(2, 4)")}, TypeError, "one spec per tensor output"),
    ({"out_fmt": [(NM, "csr")]}, TypeError, "instance, not the class NM"),
    ({"out_fmt": [(3, "csr")]}, TypeError, "inline sparsifier"),
    ({"out_fmt": [(KeepAll(), "csr", "x", "csr")]}, TypeError, "external sparsifier"),
    ({"out_fmt": [(KeepAll(), "blah")]}, ValueError, "temporary format: unknown format 'blah'"),
    ({"out_fmt": [(KeepAll(), 5)]}, TypeError, "a format is"),
    ({"out_fmt": [(KeepAll(), "csr", KeepAll())]}, TypeError, "a spec is"),
    ({"out_fmt": [None], "grad_out_fmt": [None, None]}, ValueError, "one per tensor output"),
    ({"grad_inp_fmt": {-1: None}}, TypeError, "positions"),
    ({"grad_inp_fmt": (KeepAll(), "coo")}, TypeError, "grad_inp_fmt is a list"),
])
def test_bad_specs_raise_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        scorch.sparsified_op(torch.add, **kwargs)


def test_bad_calls_raise_clear_errors():
    x, y = _pair()
    with pytest.raises(TypeError, match="callable"):
        scorch.sparsified_op("add")
    with pytest.raises(ValueError, match="returned 1 tensor"):
        scorch.sparsified_op(torch.add, out_fmt=[None, None])(x, y)
    with pytest.raises(ValueError, match="only as sparse COO"):
        scorch.sparsified_op(torch.add, grad_inp_fmt=[(KeepAll(), "csr")])(x, y)
    with pytest.raises(ValueError, match="argument is sparse"):
        scorch.sparsified_op(torch.add, grad_inp_fmt=[(KeepAll(), "coo")])(
            torch.nn.Parameter(scorch.asformat(torch.eye(4, 8, dtype=x.dtype), "csr")), y)
    with pytest.raises(TypeError, match="not a tensor"):
        scorch.sparsified_op(torch.add, grad_inp_fmt=[None, (KeepAll(), "coo")])(x, 2.0)
    with pytest.raises(ValueError, match="positional argument 2"):
        scorch.sparsified_op(torch.add, grad_inp_fmt=[None, None, (KeepAll(), "coo")])(x, y)
    with pytest.raises(ValueError, match="keyword argument 'other'"):
        scorch.sparsified_op(torch.add, grad_inp_fmt={"other": (KeepAll(), "coo")})(x, y)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        scorch.sparsified_op(torch.add, out_fmt=[(NM(2, 4), "nm(2, 4)")])(x[:, :6], y[:, :6])


# --- the same as a schedule rule: s.grad(name) (STen's set_weight_grad) -------------------------------------

def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6)).double()


def test_schedule_grad_rule_trains_as_dense_with_the_masked_gradient():
    model, ref = _mlp(), _mlp()
    s = scorch.schedule(model)
    s.grad("0.weight").sparsify(ScalarFraction(0.75))  # COO by default
    s.grad(re.compile(r"2\.weight")).spec(ScalarThreshold(0.01), "csr", NM(2, 4), torch.Tensor)
    s["2.bias"]  # selecting alone changes nothing
    s.apply()
    assert "gradient of 0.weight" in repr(s) and isinstance(model[0].weight, torch.nn.Parameter)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(7, 12, generator=g, dtype=torch.float64)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt_ref.zero_grad()
        ref(x).pow(2).sum().backward()
        w0, w2 = ref[0].weight.grad, ref[2].weight.grad
        w0 *= ScalarFraction(0.75).mask(w0)
        inline = w2.abs() > 0.01
        w2 *= inline & NM(2, 4).mask(w2 * inline)
        assert model[0].weight.grad.layout == torch.sparse_coo and model[2].weight.grad.layout == torch.strided
        torch.testing.assert_close(model[0].weight.grad.to_dense(), w0)
        torch.testing.assert_close(model[2].weight.grad, w2)
        opt.step()
        opt_ref.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())
    s.undo()
    model.zero_grad()
    model(x).sum().backward()
    assert model[0].weight.grad.layout == torch.strided


def test_schedule_grad_rule_restores_the_parameter_when_forward_raises_and_on_a_shared_module():
    torch.manual_seed(6)
    lin = torch.nn.Linear(4, 4).double()
    model = torch.nn.Sequential(lin, torch.nn.Tanh(), lin)  # one module used twice: each use's gradient masked
    s = scorch.schedule(model)
    s.grad("0.weight").sparsify(ScalarFraction(0.5))
    s.apply()
    with pytest.raises(RuntimeError):
        model(torch.randn(3, 5, dtype=torch.float64))
    assert lin._parameters["weight"] is s._parameters()["0.weight"]
    x = torch.randn(3, 4, dtype=torch.float64)
    model(x).sum().backward()
    # each use's gradient masked on its own: the first use (through tanh) and the second, as two copies of w
    w1, w2 = (lin.weight.detach().clone().requires_grad_() for _ in range(2))
    F.linear(torch.tanh(F.linear(x, w1, lin.bias.detach())), w2, lin.bias.detach()).sum().backward()
    expected = sum(gw * ScalarFraction(0.5).mask(gw) for gw in (w1.grad, w2.grad))
    torch.testing.assert_close(lin.weight.grad.to_dense(), expected)


def test_schedule_grad_rule_errors():
    model = _mlp()
    s = scorch.schedule(model)
    with pytest.raises(ValueError, match="only as sparse COO"):
        s.grad("0.weight").set_format("csr")
    with pytest.raises(KeyError, match="no parameter matches"):
        s.grad("1")  # a module (its output), not a parameter
    s.grad("0.weight").sparsify(ScalarFraction(0.5))
    s["0.weight"].sparsify(ScalarFraction(0.5))
    with pytest.raises(ValueError, match="is made sparse"):
        s.apply()


def test_schedule_grad_selection_edits_each_parameters_own_spec():
    model = _mlp()
    s = scorch.schedule(model)
    s.grad("0.weight").set_format(torch.Tensor)
    s.grad(re.compile(r"\d\.weight")).sparsify(ScalarFraction(0.5))  # both: 0.weight stays dense, 2.weight COO
    s.apply()
    x = torch.randn(3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    model(x).sum().backward()
    g0, g2 = model[0].weight.grad, model[2].weight.grad
    assert g0.layout == torch.strided and g2.layout == torch.sparse_coo
    assert int((g0 != 0).sum()) <= g0.numel() // 2 and g2.coalesce()._nnz() == g2.numel() // 2
