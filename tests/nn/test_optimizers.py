"""Every ``torch.optim`` optimizer on a SparseLinear's SparseTensor weight steps as the same optimizer on a dense
``nn.Linear`` whose gradient is masked to the pattern (what training on a fixed pattern means), with and without
``foreach``; the weight stays a SparseTensor on its pattern. Rprop raises a clear error (its sign array sets the
entries where the gradient is 0 to 1, off the pattern too)."""
import warnings

import pytest
import torch

import scorch
from scorch.formats import storage

OPTIMIZERS = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "NAdam", "RAdam", "Adamax", "Adadelta", "ASGD", "LBFGS"]


def _pair(seed=0):
    torch.manual_seed(seed)
    sparse = scorch.nn.SparseLinear(12, 24, density=0.3)
    dense = torch.nn.Linear(12, 24)
    with torch.no_grad():
        dense.weight.copy_(sparse.weight.to_dense())
        dense.bias.copy_(sparse.bias)
    return sparse, dense, sparse.weight.to_dense() != 0


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_steps_sparse_weight_as_masked_dense(name, foreach):
    sparse, dense, mask = _pair()
    pattern = sparse.weight.levels
    kw = {} if name == "LBFGS" else {"foreach": foreach}
    opt = getattr(torch.optim, name)(sparse.parameters(), lr=0.01, **kw)
    opt_ref = getattr(torch.optim, name)(dense.parameters(), lr=0.01, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(3, 12, generator=g)

        def loss_sparse():
            opt.zero_grad()
            loss = sparse(x).pow(2).sum()
            loss.backward()
            return loss

        def loss_dense():
            opt_ref.zero_grad()
            loss = dense(x).pow(2).sum()
            loss.backward()
            dense.weight.grad *= mask
            return loss
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", scorch.DensifyWarning)  # (Adagrad's, Adadelta's dense state)
            opt.step(loss_sparse)
        opt_ref.step(loss_dense)
    assert isinstance(sparse.weight, scorch.SparseTensor) and sparse.weight.levels is pattern
    torch.testing.assert_close(sparse.weight.to_dense(), dense.weight.detach() * mask, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(sparse.bias.detach(), dense.bias.detach(), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("fmt", ["ell", "nm(2, 4)"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n != "LBFGS"])
def test_padded_weights_with_exact_zero_gradients_and_values_step_as_masked_dense(name, foreach, fmt):
    """ELL and n:m pad with zeros; a stored entry whose gradient (or optimizer state, or value) is exactly 0 is
    still an entry: dead input units give zero gradients to whole columns, and a kept weight at 0 trains. (Each
    read as padding made Adam's step 0 / 0 = nan, RAdam's foreach step 0, Adagrad refuse.)"""
    torch.manual_seed(3)
    w = torch.randn(8, 16, dtype=torch.float64)
    groups = w.abs().reshape(8, 4, 4).argsort(-1, descending=True)[..., :2]  # a 2:4 pattern
    mask = torch.zeros(8, 4, 4, dtype=torch.bool).scatter_(-1, groups, True).reshape(8, 16)
    w = w * mask
    w[0, mask[0]] = 0.0  # kept entries at exactly 0
    param = torch.nn.Parameter(scorch.nn.sparsify.masked(w, mask, fmt))
    ref = torch.nn.Parameter(w.clone())
    opt = getattr(torch.optim, name)([param], lr=0.05, foreach=foreach)
    opt_ref = getattr(torch.optim, name)([ref], lr=0.05, foreach=foreach)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(5, 16, generator=g, dtype=torch.float64)
        x[:, :4] = 0  # dead inputs: exact-zero gradients in those columns
        opt.zero_grad()
        opt_ref.zero_grad()
        (x @ param.T).pow(2).sum().backward()
        (x @ ref.T).pow(2).sum().backward()
        ref.grad *= mask
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", scorch.DensifyWarning)
            opt.step()
        opt_ref.step()
    got = param.detach().to_dense()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref.detach() * mask)


@pytest.mark.parametrize("fmt", ["csr", "ell", "nm(2, 4)"])
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_fused_optimizer_steps_on_the_stored_values(name, fmt):
    """``fused=True`` (torch._fused_adam_ ...) raised 'a sparse tensor cannot become dense in place': the fused
    step now runs on the stored values of the weight, its gradient and its state (one pattern)."""
    torch.manual_seed(5)
    w = torch.randn(8, 16) * (torch.rand(8, 16) < 0.5)
    if fmt == "nm(2, 4)":  # (a 2:4 pattern)
        keep = w.abs().reshape(8, 4, 4).argsort(-1, descending=True)[..., :2]
        mask = torch.zeros(8, 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(8, 16)
        w = w * mask
    mask = w != 0
    param = torch.nn.Parameter(scorch.asformat(w, fmt))
    ref = torch.nn.Parameter(w.clone())
    kw = {"momentum": 0.9} if name == "SGD" else {}
    opt = getattr(torch.optim, name)([param], lr=0.05, fused=True, **kw)
    opt_ref = getattr(torch.optim, name)([ref], lr=0.05, **kw)
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        x = torch.randn(5, 16, generator=g)
        opt.zero_grad()
        opt_ref.zero_grad()
        (x @ param.T).pow(2).sum().backward()
        (x @ ref.T).pow(2).sum().backward()
        ref.grad *= mask
        opt.step()
        opt_ref.step()
    assert isinstance(param, scorch.SparseTensor)
    torch.testing.assert_close(param.detach().to_dense(), ref.detach() * mask, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["dia", "bsr(2, 2)"])
@pytest.mark.parametrize("name", ["Adagrad", "Adam", "RMSprop", "SGD"])
def test_slots_outside_the_shape_stay_zero(fmt, name):
    """A DIA diagonal's ends and a BSR block past a 5 x 5 edge are stored slots outside the matrix: Adagrad wrote
    nan there (0 / 0 against its dense state), and sqrt's gradient there was nan; they stay 0 now."""
    torch.manual_seed(0)
    band = (torch.arange(5)[:, None] - torch.arange(5)[None, :]).abs() <= (1 if fmt == "dia" else 4)
    w0 = (torch.rand(5, 5, dtype=torch.float64) + 0.5) * band  # (every stored slot inside the matrix is nonzero)
    x = torch.randn(4, 5, dtype=torch.float64)
    w = torch.nn.Parameter(scorch.asformat(w0, fmt))
    inside = scorch.asformat(w0, fmt).values() != 0
    assert not bool(inside.all())  # (there are slots outside)
    opt = getattr(torch.optim, name)([w], lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", scorch.DensifyWarning)
            ((x @ w.t()).pow(2).sum() + torch.sqrt(w).sum()).backward()
            opt.step()
    assert torch.isfinite(w.grad.values()).all() and torch.isfinite(w.values()).all()
    assert bool((w.values().detach()[~inside] == 0).all())


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell", "nm(2, 4)", "bsr(2, 2)", "dia"])
def test_nn_init_refills_the_stored_values_of_a_sparse_weight(fmt):
    """``nn.init.normal_`` / ``uniform_`` / ``kaiming_uniform_`` (``nn.Linear.reset_parameters``) raised on a
    sparse weight (``model.apply(init)`` after sparsifying stopped); they draw each stored value, the pattern
    kept, padding and implicit zeros 0."""
    import math
    d = torch.tensor([[1.0, 0, 2, 0], [0, 3, 0, 0], [0, 0, 0, 4], [5, 0, 0, 0]])
    ref = scorch.asformat(d, fmt)
    slots = ref.with_values(torch.ones_like(ref.values())).to_dense() if not ref.format.padded else (d != 0).float()
    w = torch.nn.Parameter(scorch.asformat(d, fmt))
    g = torch.Generator().manual_seed(0)
    for init in (lambda p: torch.nn.init.normal_(p, 0.0, 1.0, generator=g),
                 lambda p: torch.nn.init.uniform_(p, 2.0, 3.0, generator=g),
                 lambda p: torch.nn.init.kaiming_uniform_(p, a=math.sqrt(5), generator=g),
                 torch.nn.init.xavier_normal_, torch.nn.init.trunc_normal_):
        before = w.to_dense().clone()
        init(w)
        after = w.to_dense()
        assert isinstance(w, scorch.SparseTensor) and w.requires_grad
        assert bool((after[slots == 0] == 0).all())
        assert not torch.equal(after, before)
    torch.nn.init.uniform_(w, 2.0, 3.0)
    vals = w.to_dense()[(d != 0)]
    assert bool(((vals >= 2.0) & (vals <= 3.0)).all())
    with pytest.raises(RuntimeError, match="leaf Variable"):
        w.normal_()  # (outside no_grad, as torch)


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell", "bsr(2, 2)"])
def test_rprop_steps_a_sparse_weight_as_the_dense_masked_one(fmt):
    """Rprop sets its state through boolean masks (``sign[sign.gt(0)] = etaplus``, ``sign[sign.eq(0)] = 1``): the
    assignment of a nonzero value through a mask raised on a sparse tensor. It sets the stored entries where the
    mask is True (padding stays 0); outside an optimizer step a mask True at an implicit zero raises."""
    g = torch.Generator().manual_seed(3)
    d = torch.randn(4, 6, generator=g) * (torch.rand(4, 6, generator=g) < 0.5)
    w = torch.nn.Parameter(scorch.asformat(d, fmt))
    mask = (w.detach().with_values(torch.ones_like(w.values())).to_dense() != 0).float() if not w.format.padded \
        else (d != 0).float()
    q = torch.nn.Parameter(d.clone())
    q.register_hook(lambda grad: grad * mask)
    x = torch.randn(5, 6, generator=g)
    ow, oq = torch.optim.Rprop([w], lr=0.05), torch.optim.Rprop([q], lr=0.05)
    for _ in range(3):
        for p, o in ((w, ow), (q, oq)):
            o.zero_grad()
            (x @ p.t()).square().sum().backward()
            o.step()
    torch.testing.assert_close(w.to_dense(), q.detach() * mask)
    s = scorch.asformat(d, fmt)
    s[s.gt(0)] = 7.0
    torch.testing.assert_close(s.to_dense(), torch.where(d > 0, 7.0, d))
    with pytest.raises(NotImplementedError, match="dense in place"):
        s[torch.ones(4, 6, dtype=torch.bool)] = 1.0


@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr(2, 2)", "dia", "ell"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("name, kw", [("Adagrad", {}), ("Adagrad", {"initial_accumulator_value": 0.1}),
                                      ("Adadelta", {})])
def test_adagrad_and_adadelta_keep_sparse_state(name, kw, foreach, fmt):
    """Their state is ``full_like(p, v)`` / ``zeros_like(p)`` and their step adds ``eps`` out of place: on the stored
    entries, so the state is as sparse as the parameter (it was dense: a sparse model's optimizer as large as the
    dense one's), and no step falls back. Steps as the dense optimizer with the gradient masked. A padded format
    (ELL) keeps a dense state where a value other than 0 fills it: a zero-valued state's padding cannot be told
    from an entry at coordinate 0 (row 3 here holds one, at 0)."""
    dense_state = fmt == "ell" and (name == "Adadelta" or kw)
    torch.manual_seed(3)
    d = torch.randn(6, 8) * (torch.rand(6, 8) < 0.4)
    w = torch.nn.Parameter(scorch.asformat(d, fmt))
    ref = torch.nn.Parameter(d.clone())
    mask = torch.zeros(6, 8, dtype=torch.bool)  # the stored entries (a DIA diagonal's zeros are entries too)
    mask[tuple(storage.entries(w.format, w.shape, w.levels, w.values())[1])] = True
    opt = getattr(torch.optim, name)([w], lr=0.05, foreach=foreach, **kw)
    opt_ref = getattr(torch.optim, name)([ref], lr=0.05, foreach=foreach, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 3, generator=g)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if dense_state else "error", scorch.DensifyWarning)
            opt.zero_grad()
            (w @ x).pow(2).sum().backward()
            opt.step()
        opt_ref.zero_grad()
        (ref @ x).pow(2).sum().backward()
        ref.grad *= mask
        opt_ref.step()
    for k, v in opt.state[w].items():
        if k != "step" and not dense_state:
            assert isinstance(v, scorch.SparseTensor) and v.format == w.format, k
            if w.format.padded:
                assert not v.values()[scorch.sparse_tensor.padding_of(v)].any()
    torch.testing.assert_close(w.detach().to_dense() * mask, ref.detach() * mask, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("fmt", ["csr", "ell", "bsr(2, 2)"])
def test_grad_scaler_unscales_sparse_gradients(fmt):
    """``torch.amp.GradScaler`` unscales and checks sparse gradients' stored values (it raised: its foreach unscale
    writes in place, and 0 stays 0); a step with an inf gradient is skipped and the scale halved."""
    torch.manual_seed(0)
    d = torch.randn(4, 4) * (torch.rand(4, 4) < 0.5)
    w, ref = torch.nn.Parameter(scorch.asformat(d, fmt)), torch.nn.Parameter(d.clone())
    mask = torch.zeros(4, 4, dtype=torch.bool)  # the stored entries (a block's zeros are entries too)
    mask[tuple(storage.entries(w.format, w.shape, w.levels, w.values())[1])] = True
    x = torch.randn(4, 2)
    for p in (w, ref):
        opt, scaler = torch.optim.SGD([p], lr=0.1), torch.amp.GradScaler("cpu", init_scale=1024.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", scorch.DensifyWarning)
            scaler.scale((p @ x).pow(2).sum()).backward()
            if p is ref:
                ref.grad *= mask
            scaler.step(opt)
            scaler.update()
    torch.testing.assert_close(w.detach().to_dense(), ref.detach() * mask)
    before = w.detach().to_dense().clone()
    opt, scaler = torch.optim.SGD([w], lr=0.1), torch.amp.GradScaler("cpu", init_scale=1024.0)
    w.grad = None
    scaler.scale((w @ torch.full((4, 2), float("inf"))).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(w.detach().to_dense(), before) and scaler.get_scale() == 512.0
