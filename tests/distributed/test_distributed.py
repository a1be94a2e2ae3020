"""Training across 2 processes (gloo; ``worker.py`` holds the checks that run inside them) against one process:
torch's DistributedDataParallel over SparseLinear models, apps.gnn's split graph and apps.moe's experts placed on
ranks. The default checks share one ``torchrun`` launch (each launch imports torch, scorch and torch._dynamo in
every process: seconds); the slow ones launch their own, and run the apps' command lines."""
import gc
import json
import pathlib
import re

import numpy as np

import pytest
import torch

import scorch
from conftest import run_app, run_torchrun

WORKER = str(pathlib.Path(__file__).with_name("worker.py"))
GNN = dict(nodes=400, epochs=6)


def _ok(done, *checks):
    out = done.stdout + done.stderr[-6000:]
    assert done.returncode == 0, out
    for check in checks:
        assert f"OK {check} 0" in done.stdout and f"OK {check} 1" in done.stdout, out


@pytest.fixture(scope="module")
def launch():
    """One launch of the default checks: DDP with Adam and SGD, the split graph (GCN, SAGE), expert parallelism."""
    return run_torchrun(WORKER, "ddp:adam,sgd", f"gnn:{GNN['nodes']}:{GNN['epochs']}:spectral", "moe", timeout=180)


def test_ddp_sparse_linear_adam_matches_one_process(launch):
    """Each rank on half of every batch ends with the weights of one process on the whole batch, equal on both
    ranks; with Adam and SGD, no_sync, a comm hook, and ranks that start with different patterns."""
    _ok(launch, "ddp")


def _gnn_results(done):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]


def _check_gnn(results, nodes, epochs):
    from apps import gnn
    from apps.gnn import data
    assert [r["model"] for r in results] == ["gcn", "sage"]
    g = data.generate_sbm(num_nodes=nodes, num_classes=4, num_features=80, avg_degree=6.0, words_per_node=12, seed=3)
    for r in results:
        one = gnn.run("scorch", r["model"], epochs=epochs, graph=g, threads=1)
        np.testing.assert_allclose(r["losses"], one["losses"], rtol=2e-4, atol=1e-5)
        assert (r["val_acc"], r["test_acc"]) == pytest.approx((one["val_acc"], one["test_acc"]), abs=1e-6)
        ranks = r["ranks"]
        assert sum(k["rows"] for k in ranks) == nodes
        assert [k["halo_rows"] for k in ranks] == [k["rows_sent"] for k in reversed(ranks)]
        # each exchanged row: (hidden 16 + classes 4) floats forward, and again backward
        assert r["sent_bytes"] == sum(k["rows_sent"] + k["halo_rows"] for k in ranks) * (16 + 4) * 4
        assert 0 < r["sent_bytes"] < r["allgather_bytes"]


def test_gnn_split_graph_trains_as_one_process(launch):
    """GCN and SAGE with the graph's rows on 2 ranks: the losses and accuracies of one process (same weights and
    dropout masks), fewer bytes than an all-gather."""
    _check_gnn(_gnn_results(launch), **GNN)


def test_moe_expert_parallel_matches_one_process(launch):
    """Experts on 2 ranks, tokens sent with all_to_all: outputs, gradients and trained weights of one process."""
    _ok(launch, "moe")


@pytest.mark.slow
def test_ddp_every_optimizer_matches_one_process():
    _ok(run_torchrun(WORKER, "ddp:adam,sgd,adamw,rmsprop,nadam,radam,asgd,adagrad,adamax,adadelta",
                     timeout=300), "ddp")


@pytest.mark.slow
def test_gnn_contiguous_partition_trains_as_one_process():
    _check_gnn(_gnn_results(run_torchrun(WORKER, "gnn:300:4:contiguous")), 300, 4)


def _metric(text, name):
    return float(re.search(rf"^\s+{name}\s+([0-9.]+)", text, re.M).group(1))


def _cora_present() -> bool:
    from apps import common
    root = common.data_root(None)
    return root is not None and (root / "planetoid" / "cora.npz").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not _cora_present(), reason="Cora's planetoid/cora.npz is not in the data folder (SCORCH_DATA or"
                    " ../shared/data); the command names it as an error rather than training on a stand-in")
def test_gnn_command_on_cora_reaches_one_process_accuracy():
    """The issue's command: test accuracy within 1 point of one process, and at least 0.79."""
    two = run_torchrun("-m", "apps.gnn", "--backend", "scorch", "--model", "gcn", "--dataset", "cora",
                       "--distributed", "--threads", "1", "--quiet", timeout=600)
    assert two.returncode == 0, two.stdout + two.stderr[-4000:]
    one = run_app("gnn", "--backend", "scorch", "--model", "gcn", "--dataset", "cora", "--quiet", timeout=600)
    assert one.returncode == 0, one.stderr[-4000:]
    acc2, acc1 = _metric(two.stdout, "test_acc"), _metric(one.stdout, "test_acc")
    assert acc2 >= 0.79 and abs(acc2 - acc1) <= 0.01, (acc1, acc2)
    assert _metric(two.stdout, "sent_bytes") < _metric(two.stdout, "allgather_bytes")
    assert two.stdout.count("halo rows received") == 2


@pytest.mark.slow
def test_gnn_100k_graph_exchanges_fewer_bytes_than_an_all_gather():
    two = run_torchrun("-m", "apps.gnn", "--backend", "scorch", "--model", "gcn", "--dataset", "sbm-100000",
                       "--epochs", "2", "--distributed", "--threads", "1", "--quiet", timeout=600)
    assert two.returncode == 0, two.stdout + two.stderr[-4000:]
    sent, allgather = _metric(two.stdout, "sent_bytes"), _metric(two.stdout, "allgather_bytes")
    assert 0 < sent < 0.8 * allgather, (sent, allgather)


@pytest.mark.slow
def test_moe_command_trains_as_one_process():
    args = ("--backend", "scorch", "--epochs", "2", "--tokens", "256", "--dim", "32", "--batches", "4",
            "--experts", "6", "--threads", "1", "--quiet")
    two = run_torchrun("-m", "apps.moe", *args, "--distributed", timeout=600)
    assert two.returncode == 0, two.stdout + two.stderr[-4000:]
    one = run_app("moe", *args, timeout=600)
    assert one.returncode == 0, one.stderr[-4000:]
    for name in ("first_loss", "train_loss", "loss"):
        assert _metric(two.stdout, name) == pytest.approx(_metric(one.stdout, name), rel=1e-3), name
    assert two.stdout.count("pairs sent") == 2


def test_ddp_patch_is_installed_in_torch_class():
    from torch.nn.parallel import DistributedDataParallel
    assert getattr(DistributedDataParallel, "_scorch_sparse", False)


def test_exchange_rows_checks_its_splits():
    with pytest.raises(ValueError, match="send_splits add up to"):
        scorch.nn.distributed.exchange_rows(torch.zeros(3, 2), [1, 1], [2, 1])
    with pytest.raises(ValueError, match="non-negative"):
        scorch.nn.distributed.exchange_rows(torch.zeros(2, 2), [3, -1], [2, 0])


def test_exchange_rows_with_nothing_to_send_in_a_one_process_group(tmp_path):
    """A rank with no rows to send (here the only rank of a one-process group: a launch with
    ``--nproc_per_node 1``) exchanges an empty block, forward and backward, and counts no bytes."""
    import torch.distributed as dist
    from scorch.nn import distributed as sd
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        before = sd.traffic.sent
        x = torch.zeros(0, 4, requires_grad=True)
        out = sd.exchange_rows(x, [0], [0])
        assert out.shape == (0, 4)
        out.sum().backward()
        assert x.grad.shape == (0, 4) and sd.traffic.sent == before
    finally:
        dist.destroy_process_group()


def test_broadcast_sparse_takes_sparse_tensors_only():
    with pytest.raises(TypeError, match="SparseTensors"):
        scorch.nn.distributed.broadcast_sparse([torch.zeros(3)])


def test_partition_is_balanced_and_cuts_few_edges():
    from apps.gnn import data
    from apps.gnn.distributed import partition
    g = data.generate_sbm(num_nodes=2000, num_classes=4, num_features=50, avg_degree=8.0, seed=2)
    rows = np.repeat(np.arange(g.num_nodes), np.diff(g.indptr))
    cut = {}
    for method in ("contiguous", "spectral"):
        part = partition(g.indptr, g.indices, 3, method)
        assert np.bincount(part).tolist() in ([667, 667, 666], [667, 666, 667], [666, 667, 667])
        cut[method] = (part[rows] != part[g.indices]).mean()
    assert cut["spectral"] < 0.6 * cut["contiguous"], cut
    with pytest.raises(ValueError, match="partition method"):
        partition(g.indptr, g.indices, 2, "metis")


@pytest.mark.parametrize("app", ["gnn", "moe"])
def test_distributed_flag_needs_torchrun(app, monkeypatch):
    import importlib
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="runs under torchrun"):
        importlib.import_module(f"apps.{app}").main(["--distributed", "--epochs", "1", "--quiet"])


def test_collectives_refuse_sparse_tensors_and_ddp_takes_sparse_buffers(tmp_path):
    """A collective writes into its tensor in place: on a SparseTensor it ran on a dense copy and left the tensor
    as it was (a silent no-op); it now raises, naming ``values()``. DDP of a module with a sparse buffer (a
    graph's adjacency) was refused by DDP's in-place buffer copies; the buffer is broadcast once with the
    parameters and kept out of those copies."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        s = scorch.asformat(torch.tensor([[0., 1.], [2., 0.]]), "coo")
        for call in (lambda: dist.all_reduce(s), lambda: dist.broadcast(s, 0)):
            with pytest.raises(NotImplementedError, match="values"):
                call()
        dist.all_reduce(s.values())  # (the stored entries: fine)

        class Graph(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(2, 2)
                self.register_buffer("adj", scorch.asformat(torch.tensor([[0., 1.], [2., 0.]]), "csr"))

            def forward(self, x):
                return self.adj @ self.lin(x)
        model = Graph()
        ddp = DDP(model)
        for _ in range(2):
            ddp(torch.ones(2, 2)).sum().backward()
        assert isinstance(model.adj, scorch.SparseTensor) and model.lin.weight.grad is not None
        # (DDP's reducer goes first, while its group is alive: destroyed after the group, at the test's end, its
        # gloo group's destructor once hung joining a worker thread in CI)
        del ddp
        gc.collect()
    finally:
        dist.destroy_process_group()
