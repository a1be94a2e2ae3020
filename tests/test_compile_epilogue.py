"""The bias and activation of a sparse-weight ``F.linear`` in its kernel's store under ``torch.compile`` (issue 46,
``scorch/dynamo_fuse.py``): the pre-grad pass rewrites what it should and nothing else, values equal eager with and
without gradients, one graph, and the pass is chained after passes already set."""
import pytest
import torch
import torch._dynamo

import scorch
from scorch import dynamo_fuse
from scorch.engine import weights
from test_compile import fresh_dynamo  # noqa: F401  (every test compiles anew)

F = torch.nn.functional


class Block(torch.nn.Module):
    """Linears followed by each activation spelling the pass knows, one without its activation, one without bias."""

    def __init__(self):
        super().__init__()
        sizes = [(32, 64, True), (64, 48, True), (48, 40, True), (40, 24, False), (24, 16, True)]
        self.lins = torch.nn.ModuleList(torch.nn.Linear(i, o, bias=b) for i, o, b in sizes)
        self.act = torch.nn.GELU()

    def forward(self, x):
        x = self.act(self.lins[0](x))                          # F.gelu
        x = F.gelu(self.lins[1](x), approximate="tanh")
        x = torch.relu(self.lins[2](x))
        x = F.silu(self.lins[3](x))                            # no bias
        return self.lins[4](x) * 2                             # bias only


def _model(fmt="csr", sparse=True):
    torch.manual_seed(0)
    m = Block()
    if sparse:
        s = scorch.schedule(m)
        sel = s.regex(r".*weight")
        if fmt == "csr":
            sel.sparsify(scorch.nn.ScalarFraction(0.7)).set_format("csr")
        else:
            sel.sparsify(scorch.nn.NM(2, 4)).set_format(scorch.formats.named.nm(2, 4))
        s.apply()
    return m


def _capture(counts, graphs=None):
    """A backend running the pass on Dynamo's graph (as Inductor's pre-grad passes would), then the graph as it is."""
    def backend(gm, example_inputs):
        before = gm.code
        counts.append(dynamo_fuse.fuse(gm.graph))
        gm.recompile()
        if graphs is not None:
            graphs.append((before, gm.code))
        return gm.forward
    return backend


@pytest.mark.parametrize("fmt", ["csr", "nm"])
def test_pass_rewrites_each_linear_and_values_equal_eager(fmt):
    m = _model(fmt)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        ref = m(x)
        counts = []
        out = torch.compile(m, backend=_capture(counts), fullgraph=True)(x)
    assert counts == [5]  # (four activations and a bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_graphs_without_sparse_weights_are_left_alone():
    m = _model(sparse=False)
    counts, graphs = [], []
    with torch.no_grad():
        torch.compile(m, backend=_capture(counts, graphs), fullgraph=True)(torch.randn(3, 32))
    assert counts == [0] and graphs[0][0] == graphs[0][1]


def test_gradients_through_the_rewritten_graph_equal_eager(monkeypatch):
    """With a gradient needed, ``fused_linear`` is the unfused calls: values and gradients as eager, and no
    activation runs in a kernel (its derivative needs the value before it)."""
    m = _model()
    x = torch.randn(5, 32, requires_grad=True)
    ref = m(x).square().sum()
    ref.backward()
    grads = [p.grad.values().clone() if isinstance(p.grad, scorch.SparseTensor) else p.grad.clone()
             for p in m.parameters()]
    gx, x.grad = x.grad.clone(), None
    m.zero_grad()
    acts = []
    real = weights.linear
    monkeypatch.setattr(weights, "linear", lambda *a, **k: acts.append(a[3:]) or real(*a, **k))
    counts = []
    out = torch.compile(m, backend=_capture(counts), fullgraph=True)(x).square().sum()
    out.backward()
    assert counts == [5] and not any(a and a[0] for a in acts)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, gx)
    for p, g in zip(m.parameters(), grads):
        torch.testing.assert_close(p.grad.values() if isinstance(p.grad, scorch.SparseTensor) else p.grad, g)


def test_inductor_runs_the_epilogues_in_one_graph(monkeypatch):
    """Inductor (the default backend) with the pass installed: one graph, no break, values equal eager, the kernels
    called with each activation, a linear read only by the next chained with it."""
    from torch._inductor.custom_graph_pass import get_custom_graph_passes
    assert dynamo_fuse.PASS in get_custom_graph_passes(torch._inductor.config.pre_grad_custom_pass)
    m = _model()
    x = torch.randn(3, 11, 32)
    with torch.no_grad():
        ref = m(x)
        explained = torch._dynamo.explain(m)(x)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained
        torch._dynamo.reset()
        seen, chains = [], []
        real, chain = weights.linear, weights.linear_chain
        monkeypatch.setattr(weights, "linear", lambda w, x, b=None, act=None: seen.append(act) or real(w, x, b, act))
        monkeypatch.setattr(weights, "linear_chain", lambda *a: chains.append((a[3], a[6])) or chain(*a))
        monkeypatch.setattr(weights, "CHAIN_TILES_PER_THREAD", 0)  # (one kernel whatever the threads)
        out = torch.compile(m, fullgraph=True)(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # (the first two linears and the next two are each one chain: the first's output feeds only the second)
    assert chains == [("gelu", "gelu_tanh"), ("relu", "silu")] and seen == [None]


def test_install_keeps_the_passes_already_set():
    import torch._inductor.config as inductor_config

    def user_pass(graph):
        pass
    with inductor_config.patch(pre_grad_custom_pass=user_pass):
        dynamo_fuse.install()
        assert inductor_config.pre_grad_custom_pass == [user_pass, dynamo_fuse.PASS]
        dynamo_fuse.install()
        assert inductor_config.pre_grad_custom_pass == [user_pass, dynamo_fuse.PASS]
    from torch._inductor.custom_graph_pass import get_custom_graph_passes
    assert dynamo_fuse.PASS in get_custom_graph_passes(inductor_config.pre_grad_custom_pass)


def test_linear_epilogue_opcheck():
    from scorch.dynamo import _flatten
    m = _model()
    w, b = m.lins[0].weight.detach(), m.lins[0].bias.detach()
    meta, arrays, sizes = _flatten([torch.randn(4, 32), w])
    torch.library.opcheck(torch.ops.scorch.linear_epilogue.default, (meta, arrays, sizes, b, "gelu"),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="activation"):
        torch.ops.scorch.linear_epilogue(meta, arrays, sizes, b, "tanh")


class Attention(torch.nn.Module):
    """Three linears of one input (a layer's query, key and value), one with an activation."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        return self.q(x) * self.k(x).relu() + self.v(x)


def test_linears_of_one_input_share_its_panels(monkeypatch):
    torch.manual_seed(0)
    m = Attention()
    s = scorch.schedule(m)
    s.regex(r".*weight").sparsify(scorch.nn.ScalarFraction(0.7)).set_format("csr")
    s.apply()
    x = torch.randn(2, 9, 32)
    shared, real = [], weights.linear_stacked
    monkeypatch.setattr(weights, "linear_stacked", lambda *a: shared.append((len(a[0]), a[3])) or real(*a))
    with torch.no_grad():
        ref = m(x)
        out = torch.compile(m, fullgraph=True)(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # (the query and value: one product of their rows stacked; the key, with its activation, alone)
    assert shared == [(2, None)]


def test_linear_shared_opcheck():
    """The stacked op's schema and fake result (the weights' rows side by side), and the separate products where a
    weight is not one the family serves (a COO weight)."""
    from scorch.dynamo import _flatten
    torch.manual_seed(0)
    ws = [scorch.asformat(torch.randn(o, 32) * (torch.rand(o, 32) < 0.4), f) for o, f in ((16, "csr"), (8, "coo"))]
    x, b = torch.randn(5, 32), torch.randn(16)
    meta, arrays, sizes = _flatten(ws)
    torch.library.opcheck(torch.ops.scorch.linear_shared.default, (x, meta, arrays, sizes, [b, None], "relu"),
                          test_utils=("test_schema", "test_faketensor"))
    out = torch.ops.scorch.linear_shared(x, meta, arrays, sizes, [b, None], "relu")
    want = torch.cat([torch.relu(F.linear(x, ws[0].to_dense(), b)), torch.relu(F.linear(x, ws[1].to_dense()))], 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
