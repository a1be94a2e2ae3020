"""An eager sparse-weight ``F.linear`` without gradients makes its one kernel call again from a kept call
(``engine.weights.kept_linear``, ``engine/weights_kept.py``): later calls with the same weight skip the plan and
the arguments' binding, read the new input, see the weight and the bias changed in place, take a new entry for a
new input shape, and a call that needs gradients is not kept."""
import pytest
import torch

import scorch
from scorch.engine import weights, weights_kept

F = torch.nn.functional


def _layer(fmt, sparsifier, out=48, inp=32):
    torch.manual_seed(0)
    lin = torch.nn.Linear(inp, out)
    s = scorch.schedule(lin)
    s.regex("weight").sparsify(sparsifier).set_format(fmt)
    s.apply()
    return lin


LAYERS = [("csr", scorch.nn.ScalarFraction(0.7)), ("bsr(16, 16)", scorch.nn.BlockFraction(0.5, (16, 16))),
          ("nm(2, 4)", scorch.nn.NM(2, 4))]


def _planned(monkeypatch):
    """A list that records each plan the family makes (a call not replayed from a kept one)."""
    plans, real = [], weights.plan_for
    monkeypatch.setattr(weights, "plan_for", lambda *a, **k: plans.append(1) or real(*a, **k))
    return plans


@pytest.mark.parametrize("fmt,sparsifier", LAYERS)
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_later_calls_replay_the_kept_call_on_the_new_input(fmt, sparsifier, tokens, monkeypatch):
    lin = _layer(fmt, sparsifier)
    dense = lin.weight.to_dense()
    weights_kept._KEPT.clear()
    plans = _planned(monkeypatch)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, tokens, 32)
            torch.testing.assert_close(lin(x), F.linear(x, dense, lin.bias), rtol=1e-5, atol=1e-5)
    kept = [k for k in weights_kept._KEPT if k[0][0] == "linear"]
    if kept:  # (where the product is one kernel call of x into y: the first call planned, the others replayed)
        assert len(kept) == 1 and len(plans) == 1
    else:  # (every call its own plan, or another path than the family: BSR at one token)
        assert len(plans) in (0, 3)
    if fmt == "csr" and tokens == 64:
        assert kept


def test_a_weight_or_bias_changed_in_place_is_seen():
    lin = _layer("csr", scorch.nn.ScalarFraction(0.7))
    x = torch.randn(64, 32)
    with torch.no_grad():
        lin(x)
        lin.weight._vals.mul_(-2.0)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight.to_dense(), lin.bias), rtol=1e-5, atol=1e-5)
        lin.bias.add_(1.0)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight.to_dense(), lin.bias), rtol=1e-5, atol=1e-5)


def test_a_new_input_shape_or_thread_count_is_its_own_entry(monkeypatch):
    lin = _layer("csr", scorch.nn.ScalarFraction(0.7))
    weights_kept._KEPT.clear()
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            for n, t in ((64, 1), (40, 1), (64, 2), (64, 1)):
                torch.set_num_threads(t)
                x = torch.randn(n, 32)
                torch.testing.assert_close(lin(x), F.linear(x, lin.weight.to_dense(), lin.bias), rtol=1e-5,
                                           atol=1e-5)
    finally:
        torch.set_num_threads(threads)
    assert len([k for k in weights_kept._KEPT if k[0][0] == "linear"]) == 3


def test_a_call_that_needs_gradients_is_not_kept():
    lin = _layer("csr", scorch.nn.ScalarFraction(0.7))
    weights_kept._KEPT.clear()
    x = torch.randn(64, 32, requires_grad=True)
    for _ in range(2):
        lin(x).sum().backward()
    assert not [k for k in weights_kept._KEPT if k[0][0] == "linear"]
    torch.testing.assert_close(x.grad, 2 * lin.weight.to_dense().sum(0).expand(64, 32), rtol=1e-5, atol=1e-5)


def test_two_weights_sharing_arrays_keep_their_own_calls():
    """A weight and another over the same arrays (its pattern and values) but another shape or format are not
    the same call: the tag holds the format and the shape."""
    lin = _layer("csr", scorch.nn.ScalarFraction(0.7), out=32)
    w = lin.weight.detach()
    t = w.t()  # (the same arrays read as CSC)
    x = torch.randn(64, 32)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(F.linear(x, w), x @ w.to_dense().T, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(F.linear(x, t), x @ w.to_dense(), rtol=1e-5, atol=1e-5)
