"""apps.gnn: the data (Planetoid files, generated SBM graphs), the three models under each backend on a small
generated graph (scorch and torch run the same code and must agree step by step), and the command line."""

import numpy as np
import pytest
import torch

import scorch
from conftest import run_app
from apps import common
from apps.gnn import data as gdata
from apps.gnn import model as gmodel
from apps import gnn

pytestmark = [pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
              pytest.mark.filterwarnings("ignore:Sparse invariant checks")]


@pytest.fixture(scope="module")
def small():
    return gdata.generate_sbm(num_nodes=300, num_classes=3, num_features=60, avg_degree=6.0, words_per_node=15,
                              seed=1)


def test_generated_graph_is_symmetric_and_split(small):
    g = small
    n = g.num_nodes
    rows = np.repeat(np.arange(n), np.diff(g.indptr))
    a = set(zip(rows.tolist(), g.indices.tolist()))
    assert a == {(j, i) for i, j in a}, "adjacency must be symmetric"
    assert all(i != j for i, j in a), "no self loops"
    for r in range(n):   # sorted, unique columns per row
        seg = g.indices[g.indptr[r]:g.indptr[r + 1]]
        assert np.all(np.diff(seg) > 0)
    assert len(np.intersect1d(g.train_idx, g.test_idx)) == 0 and len(np.intersect1d(g.val_idx, g.test_idx)) == 0
    assert set(np.unique(g.labels[g.train_idx]).tolist()) == set(range(g.num_classes))
    same = (g.labels[rows] == g.labels[g.indices]).mean()
    assert same > 0.6, f"homophily {same}"


def test_unknown_inputs_are_named():
    with pytest.raises(ValueError, match="unknown data set"):
        gdata.dataset("nope", None)
    with pytest.raises(ValueError, match="unknown backend"):
        gnn.run(backend="jax", epochs=1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        common.data_root("/no/such/folder")


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_a_named_data_set_that_is_not_found_is_an_error_saying_how_to_point_at_it(name, tmp_path):
    """Not a generated stand-in under the real name (issue 42: "cora" without data trained on a generated graph and
    reported 0.97 test accuracy, where Cora gives 0.83)."""
    for root in (None, tmp_path):
        with pytest.raises(FileNotFoundError, match=f"(?s)data set '{name}' not found.*--data DIR.*SCORCH_DATA"
                                                    f".*--dataset sbm-like-{name}"):
            gdata.dataset(name, root)


def test_the_generated_stand_in_is_only_had_by_its_own_name():
    g = gdata.dataset("sbm-like-cora", None)
    assert g.name == "sbm-like-cora"
    assert (g.num_nodes, g.num_features, g.num_classes) == (2708, 1433, 7)
    with pytest.raises(ValueError, match="unknown data set 'sbm-like-nope'"):
        gdata.dataset("sbm-like-nope", None)


def test_the_command_names_the_missing_data_and_the_way_to_give_it(tmp_path):
    out = run_app("gnn", "--dataset", "cora", "--data", str(tmp_path), "--epochs", "1", "--quiet")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "data set 'cora' not found" in out.stderr and "--data DIR" in out.stderr and "SCORCH_DATA" in out.stderr
    assert "test_acc" not in out.stdout


def test_planetoid_files_load_when_present():
    root = common.data_root(None)
    if root is None or not (root / "planetoid" / "cora.npz").is_file():
        pytest.skip("../shared/data/planetoid is not beside this checkout")
    g = gdata.dataset("cora", root)
    assert (g.num_nodes, g.num_edges, g.num_features, g.num_classes) == (2708, 10556, 1433, 7)
    assert (len(g.train_idx), len(g.val_idx), len(g.test_idx)) == (140, 500, 1000)


def test_normalized_adjacency_matches_dense(small):
    gt = gmodel.graph_tensors(scorch, small)
    n = small.num_nodes
    a = torch.zeros(n, n)
    rows = np.repeat(np.arange(n), np.diff(small.indptr))
    a[torch.from_numpy(rows), torch.from_numpy(small.indices)] = 1
    a_hat = a + torch.eye(n)
    d = a_hat.sum(1).rsqrt()
    assert isinstance(gt.adj, scorch.SparseTensor) and gt.adj.format.name == "csr"
    torch.testing.assert_close(gt.adj.to_dense(), d[:, None] * a_hat * d[None, :])
    deg = a.sum(1).clamp(min=1)
    torch.testing.assert_close(gt.mean.to_dense(), a / deg[:, None])
    torch.testing.assert_close(gt.x.to_dense().sum(1)[np.diff(small.feat_indptr) > 0],
                               torch.ones(int((np.diff(small.feat_indptr) > 0).sum())))


@pytest.mark.parametrize("arch", ["gcn", "sage", "gat"])
def test_scorch_and_torch_train_alike(small, arch):
    seen = []
    original = scorch.SparseTensor.__dict__["__torch_function__"]

    def spy(cls, func, types, args=(), kwargs=None):
        seen.append(func)
        return original.__func__(cls, func, types, args, kwargs)

    scorch.SparseTensor.__torch_function__ = classmethod(spy)
    try:
        s = gnn.run("scorch", arch, epochs=30, graph=small, hidden=8, heads=2, lr=0.05)
    finally:
        scorch.SparseTensor.__torch_function__ = original
    t = gnn.run("torch", arch, epochs=30, graph=small, hidden=8, heads=2, lr=0.05)
    assert torch.sparse.mm in seen, "the scorch backend must run its propagation through scorch"
    if arch == "gat":
        assert torch.sparse.softmax in seen
    np.testing.assert_allclose(s["losses"], t["losses"], rtol=2e-4, atol=2e-5)
    assert s["losses"][-1] < 0.6 * s["losses"][0], s["losses"]
    assert s["test_acc"] > 0.6, s   # three classes: chance is 1/3
    assert abs(s["test_acc"] - t["test_acc"]) < 0.02


@pytest.mark.parametrize("arch", ["gcn", "sage", "gat"])
def test_pyg_backend_trains(small, arch):
    pytest.importorskip("torch_geometric")
    r = gnn.run("pyg", arch, epochs=30, graph=small, hidden=8, heads=2, lr=0.05)
    assert r["losses"][-1] < 0.6 * r["losses"][0] and r["test_acc"] > 0.6, r


def test_interleaved_trainings_train_as_they_do_alone(small):
    """``apps.common.interleave`` steps each backend's ``training`` in turn (the benchmarks' interleaved tables):
    each keeps its own random stream (dropout), so its losses are those of a run alone."""
    options = dict(epochs=12, graph=small, hidden=8, lr=0.05, seed=3)
    alone = {b: gnn.run(b, "gcn", **options)["losses"] for b in ("scorch", "torch")}
    together = common.interleave({b: gnn.training(b, "gcn", **options) for b in ("scorch", "torch")}, block=5)
    for b in alone:
        assert len(together[b]["losses"]) == 12
        # (the same dropout masks; the last bits of a sum may differ: a kernel's first call and its kept one)
        np.testing.assert_allclose(together[b]["losses"], alone[b], rtol=1e-4)


def test_interleave_rotates_blocks_and_reports_failures():
    order = []

    def steps(name, n, fail=False):
        for k in range(n):
            order.append((name, k))
            yield
        if fail:
            raise RuntimeError(f"{name} broke")
        return name

    def cannot_start():
        raise ValueError("no backend")

    got = common.interleave({"a": steps("a", 4), "b": steps("b", 3, fail=True), "c": cannot_start}, block=2)
    assert got["a"] == "a" and isinstance(got["b"], RuntimeError) and isinstance(got["c"], ValueError)
    assert list(got) == ["a", "b", "c"]
    # a's and b's first blocks, then b's first (the order rotated), a's second
    assert order == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2), ("a", 2), ("a", 3)]


def test_command_line():
    help_run = run_app("gnn", "--help")
    assert help_run.returncode == 0, help_run.stderr
    assert "--backend" in help_run.stdout and "--dataset" in help_run.stdout
    out = run_app("gnn", "--dataset", "sbm-500", "--epochs", "3", "--quiet", "--model", "gat", "--heads", "2")
    assert out.returncode == 0, out.stderr
    assert "test_acc" in out.stdout and "epoch_s" in out.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("arch", ["gcn", "sage", "gat"])
def test_scorch_trains_on_the_gpu_as_on_the_cpu(small, arch):
    """--device cuda: the same losses as on the CPU (the sparse ops run generated CUDA kernels). Without dropout:
    the CPU and CUDA generators draw different masks from the same seed (on an H200 the losses parted by 0.19)."""
    c = gnn.run("scorch", arch, epochs=20, graph=small, hidden=8, heads=2, lr=0.05, dropout=0.0)
    g = gnn.run("scorch", arch, epochs=20, graph=small, hidden=8, heads=2, lr=0.05, dropout=0.0, device="cuda")
    assert g["device"] == "cuda"
    np.testing.assert_allclose(g["losses"], c["losses"], rtol=1e-3, atol=1e-4)
    assert abs(g["test_acc"] - c["test_acc"]) < 0.02


def test_to_device_moves_dataclass_fields(small):
    """The helper behind --device moves every tensor field of the graph tensors (here to the CPU: the same)."""
    gt = gmodel.graph_tensors(scorch, small)
    moved = common.to_device(gt, "cpu")
    assert type(moved) is type(gt) and moved.num_nodes == gt.num_nodes
    assert torch.equal(moved.labels, gt.labels) and isinstance(moved.adj, scorch.SparseTensor)
    assert common.to_device(gt, None) is gt


@pytest.mark.parametrize("backend", ["scorch", "torch"])
def test_gat_layer_matches_dense_attention_per_head(small, backend):
    """The GAT layer (scorch: every head at once on the block-diagonal pattern, ``GraphTensors.edges``; torch.sparse:
    one head at a time, its faster form): its output and gradients equal each head's dense masked softmax
    attention, computed one head at a time."""
    tmod = common.backend_module(backend)
    gt = gmodel.graph_tensors(tmod, small, attention_layout="csr" if backend == "scorch" else "coo")
    torch.manual_seed(0)
    net = gmodel.build(tmod, "gat", small.num_features, 4, small.num_classes, heads=3, dropout=0.0)
    layer = net.conv1
    x = torch.randn(small.num_nodes, small.num_features)
    out = layer(x, gt)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [layer.lin.weight, layer.att_src, layer.att_dst], grad)

    n, heads, d = small.num_nodes, 3, 4
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[gt.row, gt.col] = True
    w, a_src, a_dst = (p.detach().clone().requires_grad_() for p in (layer.lin.weight, layer.att_src,
                                                                        layer.att_dst))
    h = (x @ w.T).view(n, heads, d)
    outs = []
    for k in range(heads):
        e = torch.nn.functional.leaky_relu((h[:, k] @ a_dst[k])[:, None] + (h[:, k] @ a_src[k])[None, :], 0.2)
        att = torch.softmax(e.masked_fill(~mask, float("-inf")), dim=1)
        outs.append(att @ h[:, k])
    ref = torch.cat(outs, dim=1) + layer.bias.detach()
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=1e-4, atol=1e-5)
    want = torch.autograd.grad(ref, [w, a_src, a_dst], grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    row, col, crow = gt.edges(tmod, heads)
    assert row.numel() == col.numel() == heads * gt.col.numel() and crow[-1] == row.numel()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gcn", "sage", "gat"])
def test_compiled_trains_as_eager(small, arch):
    """``--compile`` (``run(compile=True)``): the model under ``torch.compile`` trains as eager scorch, step by step
    (no dropout: compiled code draws other random numbers)."""
    opts = dict(epochs=6, graph=small, hidden=8, heads=2, lr=0.05, dropout=0.0)
    eager, compiled = gnn.run("scorch", arch, **opts), gnn.run("scorch", arch, compile=True, **opts)
    assert compiled["compiled"] and not eager["compiled"]
    np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=1e-4, atol=1e-5)
