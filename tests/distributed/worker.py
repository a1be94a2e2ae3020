"""Run by ``torchrun --nproc_per_node 2`` (tests/distributed/): the 2-process checks, named on the command line and
run in one launch (a launch costs seconds: torch, scorch and, for DDP, torch._dynamo imported in every process).

- ``ddp:<optimizers>``: torch's DistributedDataParallel over a model with SparseLinear layers, each rank on its half
  of every batch, against one process on the whole batch. Rank r builds its model from seed r, so the ranks start
  with different weights and sparse patterns: DDP's construction must make them rank 0's. For each optimizer, DDP
  training and a one-process reference (a copy of the synchronized model) must end with the same weights, equal on
  both ranks. Also: ``no_sync``, a comm hook (it must see the sparse parameters' values in its buckets) with
  ``gradient_as_bucket_view``, ``find_unused_parameters`` with an unused and a frozen sparse layer, ``join`` with
  uneven inputs, and ranks whose sparse parameters differ in their number of stored entries.
  Prints ``OK ddp <rank>``.
- ``gnn:<nodes>:<epochs>:<partition>``: ``apps.gnn.distributed.run`` for GCN and SAGE on a small generated graph;
  rank 0 prints each result as a JSON line (``RESULT {...}``) for the test to compare with one process.
- ``moe``: expert parallelism (``apps.moe.distributed.ExpertParallel``) against the one-process MoE, top-1 and
  top-2: outputs, gradients, and weights after Adam steps. Prints ``OK moe <rank>``.
"""
import copy
import json
import sys

import scorch as torch
import scorch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.02),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.02),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.02),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.02),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.02),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "asgd": lambda p: torch.optim.ASGD(p, lr=0.05),
}


def make_model(seed, fmt="csr", density=0.3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(scorch.nn.SparseLinear(12, 24, format=fmt, density=density), torch.nn.ReLU(),
                               torch.nn.Linear(24, 16), torch.nn.Tanh(), scorch.nn.SparseLinear(16, 3, density=0.5))


def weights(model):
    return [p.detach().to_dense() if isinstance(p, scorch.SparseTensor) else p.detach().clone()
            for p in model.parameters()]


def assert_same(a, b, what):
    for x, y in zip(weights(a) if not isinstance(a, list) else a, weights(b) if not isinstance(b, list) else b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")


def assert_equal_across_ranks(model, what):
    mine = weights(model)
    theirs = [None] * dist.get_world_size()
    dist.all_gather_object(theirs, mine)
    for other in theirs:
        assert_same(mine, other, what + " (ranks differ)")


def batches(steps, n=16, seed=100):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


def half(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def train(model, opt, data, rank=None, world=1):
    F = torch.nn.functional
    for x, y in data:
        if rank is not None:
            x, y = half(x, rank, world), half(y, rank, world)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def check_ddp(names):
    """DDP over SparseLinear models, each rank on half of every batch, against one process (module docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(4)
    for name in names:
        model = make_model(seed=rank)
        ddp = DDP(model)
        assert isinstance(ddp.module[0].weight, scorch.SparseTensor)
        assert_equal_across_ranks(model, f"{name}: after construction")
        reference = copy.deepcopy(model)
        train(ddp, OPTIMIZERS[name](ddp.parameters()), data, rank, world)
        train(reference, OPTIMIZERS[name](reference.parameters()), data)
        assert isinstance(model[0].weight, scorch.SparseTensor)
        assert_equal_across_ranks(model, name)
        assert_same(model, reference, f"{name}: 2 processes vs 1")

    # no_sync: two half-batches accumulated without communication, the second synchronizes
    model = make_model(seed=rank)
    ddp = DDP(model)
    reference = copy.deepcopy(model)
    opt, opt_ref = torch.optim.Adam(ddp.parameters(), lr=0.02), torch.optim.Adam(reference.parameters(), lr=0.02)
    F = torch.nn.functional
    for x, y in data:
        opt.zero_grad()
        xs, ys = half(x, rank, world), half(y, rank, world)
        with ddp.no_sync():
            (F.cross_entropy(ddp(xs[:4]), ys[:4]) / 2).backward()
        (F.cross_entropy(ddp(xs[4:]), ys[4:]) / 2).backward()
        opt.step()
        opt_ref.zero_grad()
        for k in range(world):
            xk, yk = half(x, k, world), half(y, k, world)
            (F.cross_entropy(reference(xk[:4]), yk[:4]) / (2 * world)).backward()
            (F.cross_entropy(reference(xk[4:]), yk[4:]) / (2 * world)).backward()
        opt_ref.step()
    assert_equal_across_ranks(model, "no_sync")
    assert_same(model, reference, "no_sync: 2 processes vs 1")

    # a comm hook sees the sparse parameters' values in its buckets; gradient_as_bucket_view
    model = make_model(seed=rank)
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.0001)
    seen = []

    def hook(state, bucket):
        seen.extend(id(p) for p in bucket.parameters())
        t = bucket.buffer() / world
        return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    reference = copy.deepcopy(model)
    train(ddp, torch.optim.Adam(ddp.parameters(), lr=0.02), data, rank, world)
    train(reference, torch.optim.Adam(reference.parameters(), lr=0.02), data)
    assert id(model[0].weight.values()) in seen and id(model[4].weight.values()) in seen, "hook never saw values"
    assert_same(model, reference, "comm hook: 2 processes vs 1")

    # find_unused_parameters with an unused sparse layer, and a frozen one (broadcast at construction, not reduced)
    class WithUnused(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.used = make_model(seed)
            self.unused = scorch.nn.SparseLinear(4, 4, density=0.5)
            self.frozen = scorch.nn.SparseLinear(3, 3, density=0.5)
            self.frozen.weight.requires_grad_(False)

        def forward(self, x):
            return self.frozen(self.used(x))

    model = WithUnused(seed=rank)
    ddp = DDP(model, find_unused_parameters=True)
    assert_equal_across_ranks(model, "find_unused_parameters: after construction")
    reference = copy.deepcopy(model)
    train(ddp, torch.optim.Adam(ddp.parameters(), lr=0.02), data, rank, world)
    train(reference, torch.optim.Adam(reference.parameters(), lr=0.02), data)
    assert_same(model, reference, "find_unused_parameters: 2 processes vs 1")

    # join: uneven inputs (rank 1 stops early); the last joiner's model, sparse parameters too, is broadcast at the end
    model = make_model(seed=rank)
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.02)
    with ddp.join():
        for x, y in data[:len(data) - rank]:
            opt.zero_grad()
            F.cross_entropy(ddp(half(x, rank, world)), half(y, rank, world)).backward()
            opt.step()
    assert_equal_across_ranks(model, "join")

    # a different number of stored entries on each rank (density by rank): rank 0's pattern wins
    model = make_model(seed=rank, density=0.2 + 0.3 * rank)
    ddp = DDP(model)
    assert_equal_across_ranks(model, "different nnz")
    reference = copy.deepcopy(model)
    train(ddp, torch.optim.Adam(ddp.parameters(), lr=0.02), data, rank, world)
    train(reference, torch.optim.Adam(reference.parameters(), lr=0.02), data)
    assert_same(model, reference, "different nnz: 2 processes vs 1")
    print(f"OK ddp {rank}", flush=True)



def check_gnn(nodes, epochs, method):
    from apps.gnn import data, distributed
    g = data.generate_sbm(num_nodes=nodes, num_classes=4, num_features=80, avg_degree=6.0, words_per_node=12, seed=3)
    for model in ("gcn", "sage"):
        result = distributed.run("scorch", model, epochs=epochs, graph=g, method=method)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({k: result[k] for k in ("model", "losses", "val_acc", "test_acc", "ranks",
                                                                  "sent_bytes", "allgather_bytes")}), flush=True)


def check_moe():
    from apps.moe import model as moe_model
    from apps.moe.distributed import ExpertParallel
    rank, world = dist.get_rank(), dist.get_world_size()
    dim, hidden, experts, tokens = 16, 12, 5, 48
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(tokens, dim, generator=g) for _ in range(3)]
    ys = [torch.randn(tokens, hidden, generator=g) for _ in range(3)]
    share = tokens // world
    mine = slice(rank * share, (rank + 1) * share)
    for top_k in (1, 2):
        torch.manual_seed(0)
        one = moe_model.build(scorch, dim, hidden, experts, top_k, sparse_gate=True)
        torch.manual_seed(0)
        ep = ExpertParallel(scorch, moe_model.build(scorch, dim, hidden, experts, top_k, sparse_gate=True), rank,
                            world)
        lo, hi = ep.bounds[rank], ep.bounds[rank + 1]
        opt, opt_one = torch.optim.Adam(ep.module.parameters(), lr=0.05), torch.optim.Adam(one.parameters(), lr=0.05)
        for step, (x, y) in enumerate(zip(xs, ys)):
            opt.zero_grad()
            out = ep(x[mine])
            (((out - y[mine]) ** 2).sum() / (tokens * hidden)).backward()
            ep.sync_gradients()
            opt_one.zero_grad()
            out_one = one(x)
            torch.nn.functional.mse_loss(out_one, y).backward()
            what = f"moe top-{top_k} step {step}"
            torch.testing.assert_close(out, out_one[mine].detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")
            torch.testing.assert_close(ep.module.experts.grad, one.experts.grad[lo:hi], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{what}, experts' gradient: {m}")
            torch.testing.assert_close(ep.module.gate.weight.grad, one.gate.weight.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{what}, gate's gradient: {m}")
            opt.step()
            opt_one.step()
        torch.testing.assert_close(ep.module.experts.detach(), one.experts.detach()[lo:hi], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ep.module.gate.weight.detach(), one.gate.weight.detach(), rtol=1e-4, atol=1e-5)
    print(f"OK moe {rank}", flush=True)


def main():
    dist.init_process_group("gloo")
    for job in sys.argv[1:]:
        name, _, rest = job.partition(":")
        if name == "ddp":
            check_ddp(rest.split(","))
        elif name == "gnn":
            nodes, epochs, method = rest.split(":")
            check_gnn(int(nodes), int(epochs), method)
        elif name == "moe":
            check_moe()
        else:
            raise SystemExit(f"unknown check {job!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
