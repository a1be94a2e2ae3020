"""A feed-forward block's residual and LayerNorm in its chained kernel under ``torch.compile`` (issue 46,
``dynamo_fuse._norm_chain``, ``compiler.weights_chain``'s ``norm``): ``LayerNorm(down(act(up(x))) + x)`` becomes one
``chained_linear`` with the norm, values equal eager, gradients through the unfused calls, and the pattern is left
alone where it is not exactly that."""
import pytest
import torch
import torch._dynamo

import scorch
from scorch import dynamo_fuse
from scorch.engine import weights
from test_compile import fresh_dynamo  # noqa: F401  (every test compiles anew)

F = torch.nn.functional


class Block(torch.nn.Module):
    """``norm(dropout(down(gelu(up(x)))) + x)`` as a BERT layer's output block spells it; ``variant`` changes one
    thing of it."""

    def __init__(self, variant="plain", affine=True):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.norm = torch.nn.LayerNorm(32, eps=1e-6, elementwise_affine=affine)
        self.drop = torch.nn.Dropout(0.1)
        self.variant = variant

    def forward(self, x, z):
        y = self.down(F.gelu(self.up(x)))
        v = self.variant
        if v == "plain":
            return self.norm(self.drop(y) + x)
        if v == "residual first":
            return self.norm(x + y)
        if v == "other residual":
            return self.norm(y + z)
        if v == "sum read twice":
            s = y + x
            return self.norm(s) + s
        if v == "output read twice":
            return self.norm(y + x) + y
        if v == "two dims":
            return F.layer_norm((y + x).view(x.shape[0], -1, 4, 8), (4, 8))
        raise ValueError(v)


def _block(variant="plain", affine=True):
    torch.manual_seed(0)
    m = Block(variant, affine)
    if affine:
        with torch.no_grad():
            m.norm.weight.uniform_(0.5, 1.5)
            m.norm.bias.uniform_(-0.5, 0.5)
    s = scorch.schedule(m)
    s.regex(r"(up|down)\.weight").sparsify(scorch.nn.ScalarFraction(0.7)).set_format("csr")
    s.apply()
    return m.eval()


def _fused(m, x, z):
    """The graph after the pass (as Inductor's pre-grad pass would see it) and the compiled values."""
    graphs = []

    def backend(gm, example_inputs):
        dynamo_fuse.fuse(gm.graph)
        gm.recompile()
        graphs.append(gm.graph)
        return gm.forward
    out = torch.compile(m, backend=backend, fullgraph=True)(x, z)
    return graphs[0], out


def _norms(graph):
    """The chained linears with the norm, and the layer norms left, in ``graph``."""
    chains = [n for n in graph.nodes if n.target is dynamo_fuse.chained_linear]
    return sum(len(n.args) == 10 for n in chains), sum(n.target is F.layer_norm for n in graph.nodes)


@pytest.mark.parametrize("variant,affine", [("plain", True), ("residual first", True), ("plain", False)])
def test_the_residual_and_norm_join_the_chain_and_values_equal_eager(variant, affine, monkeypatch):
    monkeypatch.setattr(weights, "CHAIN_TILES_PER_THREAD", 0)  # (the chain's one kernel whatever the threads)
    m = _block(variant, affine)
    x, z = torch.randn(3, 37, 32) * 2 + 0.5, torch.randn(3, 37, 32)
    with torch.no_grad():
        ref = m(x, z)
        graph, out = _fused(m, x, z)
    assert _norms(graph) == (1, 0)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["other residual", "sum read twice", "output read twice", "two dims"])
def test_other_patterns_keep_their_norm(variant):
    m = _block(variant)
    x, z = torch.randn(2, 9, 32), torch.randn(2, 9, 32)
    with torch.no_grad():
        ref = m(x, z)
        graph, out = _fused(m, x, z)
    assert _norms(graph)[0] == 0
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_a_dropout_in_training_keeps_the_norm():
    m = _block().train()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        graph, _ = _fused(m, x, x)
    assert _norms(graph) == (0, 1)


def test_gradients_through_the_fused_pattern_equal_eager():
    """With a gradient needed the chained call is the unfused calls and torch's norm: values and gradients (the
    sparse weights' values, the norm's weight and bias, the input) as eager."""
    m = _block()
    x = torch.randn(2, 9, 32, requires_grad=True)
    ref = m(x, x)
    ref.square().sum().backward()
    want = [p.grad.values() if isinstance(p.grad, scorch.SparseTensor) else p.grad.clone() for p in m.parameters()]
    want_x = x.grad.clone()
    m.zero_grad()
    x.grad = None
    graph, out = _fused(m, x, x)
    assert _norms(graph) == (1, 0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    got = [p.grad.values() if isinstance(p.grad, scorch.SparseTensor) else p.grad for p in m.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, want_x, rtol=1e-4, atol=1e-5)


def _csr(o, i, seed):
    g = torch.Generator().manual_seed(seed)
    return scorch.asformat(torch.randn(o, i, generator=g) * (torch.rand(o, i, generator=g) < 0.2), "csr")


@pytest.mark.parametrize("tokens", [2, 16, 33, 100])
@pytest.mark.parametrize("affine", [True, False])
def test_the_chain_kernel_norm_equals_torch(tokens, affine, monkeypatch):
    monkeypatch.setattr(weights, "CHAIN_TILES_PER_THREAD", 0)
    w1, w2 = _csr(96, 24, 0), _csr(24, 96, 1)
    b1, b2 = torch.randn(96), torch.randn(24)
    g, b = (torch.rand(24) + 0.5, torch.randn(24)) if affine else (None, None)
    x = torch.randn(tokens, 24) * 3 + 1
    out = weights.linear_chain(w1, x, b1, "gelu", w2, b2, None, norm=(g, b, 1e-5))
    y = F.linear(F.gelu(F.linear(x, w1.to_dense(), b1)), w2.to_dense(), b2)
    torch.testing.assert_close(out, F.layer_norm(y + x, (24,), g, b, 1e-5), rtol=1e-4, atol=1e-5)
    assert any(k[1] == "chain_norm" for k in weights._KERNELS.keys() if isinstance(k, tuple) and len(k) == 2)


def test_the_chain_norm_refuses_a_residual_of_another_width():
    w1, w2 = _csr(96, 24, 0), _csr(16, 96, 1)
    with pytest.raises(ValueError, match="residual and norm"):
        weights.linear_chain(w1, torch.randn(4, 24), None, None, w2, None, None, norm=(None, None, 1e-5))
