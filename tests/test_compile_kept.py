"""The compiled graph's sparse-weight ops make their one kernel call again from a kept call (issue 46,
``scorch/engine/weights_kept.py``): later calls with the same weights' arrays skip the Python between, read the
new input, see weights changed in place, and anything that is not certainly one call of ``x`` into ``y`` is never
kept."""
import pytest
import torch

import scorch
from scorch import dynamo
from scorch.engine import weights, weights_kept
from test_compile import fresh_dynamo  # noqa: F401  (every test compiles anew)

F = torch.nn.functional


class Layer(torch.nn.Module):
    """The ops a transformer layer's linears become: query, key and value of one input (``linear_shared``), a
    feed-forward pair (``linear_chain``), one linear alone (``linear_epilogue``)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(32, 32) for _ in range(3))
        self.o = torch.nn.Linear(32, 32)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        h = self.o(self.q(x) * self.k(x) + self.v(x))
        return self.down(F.gelu(self.up(h))) + h


def _layer():
    torch.manual_seed(0)
    m = Layer()
    s = scorch.schedule(m)
    s.regex(r".*weight").sparsify(scorch.nn.ScalarFraction(0.7)).set_format("csr")
    s.apply()
    return m


def test_later_calls_replay_the_kept_calls_on_the_new_input(monkeypatch):
    monkeypatch.setattr(weights, "CHAIN_TILES_PER_THREAD", 0)  # (the chain's one kernel whatever the threads)
    m = _layer()
    compiled = torch.compile(m, fullgraph=True)
    weights_kept._KEPT.clear()
    with torch.no_grad():
        x = torch.randn(3, 16, 32)
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-5)
        # (the stacked product, the linear, the chain; the eager model's own linears keep theirs: ``kept_linear``)
        assert len([k for k in weights_kept._KEPT if k[0][0] != "linear"]) == 3
        rebuilt = []
        real = dynamo._rebuild
        monkeypatch.setattr(dynamo, "_rebuild", lambda *a: rebuilt.append(a) or real(*a))
        import scorch.dynamo_fuse as fuse
        monkeypatch.setattr(fuse, "_rebuild", dynamo._rebuild)
        for _ in range(2):
            x = torch.randn(3, 16, 32)
            torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-5)
        assert rebuilt == []  # (no op wrapped its arrays again: each ran its kept call)


def test_a_weight_changed_in_place_is_seen():
    m = _layer()
    compiled = torch.compile(m, fullgraph=True)
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        compiled(x)
        for lin in (m.q, m.up, m.down, m.o):
            lin.weight._vals.mul_(-2.0)
        m.v.bias.add_(1.0)
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-5)


def test_a_new_thread_count_or_input_shape_is_its_own_entry():
    m = _layer()
    compiled = torch.compile(m, fullgraph=True, dynamic=False)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            for n, t in ((16, 1), (16, 2), (16, 1), (5, 2)):
                torch.set_num_threads(t)
                x = torch.randn(n, 32)
                torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def _csr(o, i, seed=0):
    g = torch.Generator().manual_seed(seed)
    return scorch.asformat(torch.randn(o, i, generator=g) * (torch.rand(o, i, generator=g) < 0.3), "csr")


def _guards(w):
    return [w._vals, *(a for st in w._levels for a in (st.pos, st.crd) if a is not None)]


def test_one_call_of_the_input_into_the_result_is_kept_and_replayed():
    w, b = _csr(24, 16), torch.randn(24)
    weights_kept._KEPT.clear()
    for _ in range(3):
        x = torch.randn(9, 16)
        out = weights_kept.kept(("t",), [*_guards(w), b], x, lambda x: weights.linear(w, x, b, "relu"))
        torch.testing.assert_close(out, torch.relu(F.linear(x, w.to_dense(), b)), rtol=1e-5, atol=1e-5)
    assert len(weights_kept._KEPT) == 1
    # (a non-contiguous input of the same shape: computed, not replayed on its strides)
    x = torch.randn(16, 9).t()
    out = weights_kept.kept(("t",), [*_guards(w), b], x, lambda x: weights.linear(w, x, b, "relu"))
    torch.testing.assert_close(out, torch.relu(F.linear(x, w.to_dense(), b)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["two calls", "converted result", "input copied", "inference arrays", "no kernel"])
def test_what_is_not_certainly_one_call_is_not_kept(case):
    w, w2 = _csr(24, 16), _csr(16, 24, seed=1)
    if case == "inference arrays":
        with torch.inference_mode():
            w = _csr(24, 16)
    compute = {
        "two calls": lambda x: weights.linear(w2, weights.linear(w, x)),
        "converted result": lambda x: weights.linear(w, x) * 2,
        "input copied": lambda x: weights.linear(w, (x + 1) - 1),
        "inference arrays": lambda x: weights.linear(w, x),
        "no kernel": lambda x: F.linear(x, w.to_dense()),
    }[case]
    weights_kept._KEPT.clear()
    for seed in range(3):
        x = torch.randn(9, 16, generator=torch.Generator().manual_seed(seed))
        out = weights_kept.kept(("t",), [*_guards(w), *_guards(w2)], x, compute)
        torch.testing.assert_close(out, compute(x), rtol=1e-5, atol=1e-5)
    assert len(weights_kept._KEPT) == 0


def test_an_entry_goes_with_its_arrays():
    import gc
    w = _csr(24, 16)
    weights_kept._KEPT.clear()
    weights_kept.kept(("t",), _guards(w), torch.randn(4, 16), lambda x: weights.linear(w, x))
    assert len(weights_kept._KEPT) == 1
    del w
    gc.collect()
    assert len(weights_kept._KEPT) == 0


def test_a_kept_call_inside_another_counts_toward_the_outer():
    """An outer compute that runs an inner ``kept`` (replayed from the second call on) and one call of its own made
    two calls, whatever the inner did: not kept."""
    w, w2 = _csr(24, 16), _csr(20, 16, seed=1)

    def outer(x):
        weights_kept.kept(("inner",), _guards(w), x, lambda x: weights.linear(w, x))
        return weights.linear(w2, x)
    weights_kept._KEPT.clear()
    for seed in range(3):
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(seed))
        out = weights_kept.kept(("outer",), [*_guards(w), *_guards(w2)], x, outer)
        torch.testing.assert_close(out, F.linear(x, w2.to_dense()), rtol=1e-5, atol=1e-5)
    assert [k[0] for k in weights_kept._KEPT] == [("inner",)]
