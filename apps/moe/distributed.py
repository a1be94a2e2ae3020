"""Expert parallelism: ``torchrun --nproc_per_node N -m apps.moe --backend scorch --distributed``.

The experts are split across the ranks (rank r holds experts ``bounds[r]`` to ``bounds[r + 1] - 1``, a slice of the
``(experts, dim, hidden)`` tensor); the gate is replicated. Each rank takes its share of every batch's tokens, routes
them with the gate, and sends each (token, chosen expert) pair's input row to the expert's rank with one
``all_to_all_single`` (split sizes: the pairs for each rank); there the received rows run through the rank's experts
as one scorch grouped product (``einsum("bn,bd,ndh->bh", G, x, E)`` with ``G`` a CSR matrix holding each row's one
local expert), and the outputs go back with the reversed splits, to be weighted by the gate where the token lives.
Gradients take the same ways back (``scorch.nn.distributed.exchange_rows``): an expert's gradient is complete on its
rank; the gate's, summed over the ranks (``all_reduce``). Each rank's loss is its share of the whole batch's mean, so
the outputs, gradients and training are those of one process with every expert.
"""
from __future__ import annotations

import time

from .. import common


def bounds(experts: int, world: int) -> list:
    """The first expert of each rank, then ``experts``: ranks hold ``experts // world`` or one more."""
    if experts < world:
        raise ValueError(f"--distributed places experts on ranks: {experts} experts for {world} processes")
    return [r * experts // world for r in range(world + 1)]


class ExpertParallel:
    """Builds the rank's module from a one-process ``model.build`` MoE (``sparse_gate=True``): ``module`` keeps
    its gate and router, and its ``experts`` parameter becomes this rank's slice (a copy)."""

    def __init__(self, torch, moe, rank: int, world: int, group=None):
        import torch.distributed as dist
        self.torch, self.rank, self.world, self.group = torch, rank, world, group
        n, self.hidden = moe.experts.shape[0], moe.experts.shape[2]
        self.bounds = bounds(n, world)
        lo, hi = self.bounds[rank], self.bounds[rank + 1]
        for p in moe.gate.parameters():                       # the replicated part: rank 0's everywhere
            dist.broadcast(p.data, src=0, group=group)
        moe.experts = torch.nn.Parameter(moe.experts.detach()[lo:hi].clone())
        self.module = moe
        self.owner = torch.zeros(n, dtype=torch.int64, device=moe.experts.device)  # expert -> rank
        for r in range(world):
            self.owner[self.bounds[r]:self.bounds[r + 1]] = r
        self.pairs_sent = self.pairs_received = 0       # (token, expert) pairs to / from other ranks

    def replicated(self):
        """The parameters every rank holds (their gradients are summed over the ranks)."""
        return list(self.module.gate.parameters())

    def __call__(self, x):
        """The MoE's output for this rank's tokens ``x`` (collective: every rank calls it)."""
        import torch.distributed as dist
        from scorch.nn.distributed import exchange_rows
        torch = self.torch
        moe, k = self.module, self.module.top_k
        index, weights = moe.route(x)                        # (tokens, k)
        expert = index.reshape(-1)                           # token-major (token, choice) pairs
        order = torch.argsort(self.owner[expert], stable=True)
        send = torch.bincount(self.owner[expert], minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send, recv = send.tolist(), recv.tolist()
        rows = exchange_rows(x.index_select(0, order // k), send, recv, self.group)
        local = exchange_rows(expert[order], send, recv, self.group) - self.bounds[self.rank]
        y = exchange_rows(self.experts(rows, local), recv, send, self.group)
        pairs = torch.empty_like(order)
        pairs[order] = torch.arange(len(order), device=order.device)
        out = y.index_select(0, pairs).reshape(x.shape[0], k, self.hidden)
        self.pairs_sent += sum(send) - send[self.rank]
        self.pairs_received += sum(recv) - recv[self.rank]
        return (weights.unsqueeze(-1) * out).sum(1)

    def experts(self, rows, local):
        """Row ``t`` of ``rows`` through this rank's expert ``local[t]``: one grouped product, driven by a CSR
        matrix with one entry a row."""
        torch = self.torch
        n = rows.shape[0]
        if n == 0:
            return rows.new_zeros((0, self.hidden))
        gate = torch.sparse_csr_tensor(torch.arange(n + 1, device=rows.device), local,
                                       torch.ones(n, dtype=rows.dtype, device=rows.device),
                                       (n, self.module.experts.shape[0]), check_invariants=False)
        return torch.einsum("bn,bd,ndh->bh", gate, rows, self.module.experts)

    def sync_gradients(self):
        """Sum the replicated parameters' gradients over the ranks."""
        import torch.distributed as dist
        for p in self.replicated():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)


def run(backend: str = "scorch", epochs: int = 8, threads: int = 1, seed: int = 0, quiet: bool = True,
        data=None, **options) -> dict:
    """``apps.moe.run`` with the experts across the processes of a ``torchrun`` launch (same options). The losses
    are the whole batch's; ``ranks`` lists each rank's experts, tokens and bytes sent / received in an epoch."""
    import torch as real_torch
    import torch.distributed as dist
    from scorch.nn.distributed import traffic
    from . import DEFAULTS, data as data_mod, model as model_mod

    if backend != "scorch":
        raise ValueError(f"--distributed runs the scorch backend, got {backend!r}")
    opt = {**DEFAULTS, **options}
    opt["hidden"] = opt["hidden"] or opt["dim"]
    rank, world, device = common.init_distributed("moe")
    threads = common.threads_per_process(threads)
    common.set_threads(threads)
    torch = common.backend_module("scorch")
    dtype = getattr(real_torch, opt["dtype"])
    task = data_mod.make(opt["tokens"], opt["dim"], opt["hidden"], opt["experts"], opt["top_k"], opt["batches"],
                         opt["test_batches"], seed, dtype=dtype)
    if opt["tokens"] % world:
        raise ValueError(f"--tokens ({opt['tokens']}) must split evenly over {world} processes")
    torch.manual_seed(seed)
    moe = model_mod.build(torch, opt["dim"], opt["hidden"], opt["experts"], opt["top_k"], sparse_gate=True,
                          einsum=opt["einsum"]).to(dtype).to(device)
    ep = ExpertParallel(torch, moe, rank, world)
    optimizer = torch.optim.Adam(moe.parameters(), lr=opt["lr"])
    share = opt["tokens"] // world

    def mine(t):
        return t[rank * share:(rank + 1) * share].to(device)

    def global_mse(pred, y):                                 # this rank's share of the whole batch's mean
        return ((pred - y) ** 2).sum() / (opt["tokens"] * y.shape[1])

    order_gen = real_torch.Generator().manual_seed(seed + 1)
    epoch_watch, losses, test_curve, epoch_traffic = common.Stopwatch(), [], [], []
    start = time.perf_counter()
    for _ in common.progress(range(epochs), f"moe distributed[{world}]", quiet or rank != 0):
        traffic.reset()
        ep.pairs_sent = ep.pairs_received = 0
        with epoch_watch:
            for b in real_torch.randperm(len(task.train_x), generator=order_gen).tolist():
                optimizer.zero_grad()
                loss = global_mse(ep(mine(task.train_x[b])), mine(task.train_y[b]))
                loss.backward()
                ep.sync_gradients()
                optimizer.step()
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(total.item())
        epoch_traffic.append((traffic.reset(), ep.pairs_sent, ep.pairs_received))
        with real_torch.no_grad():
            total = real_torch.zeros((), dtype=real_torch.float64, device=device)
            for x, y in zip(task.test_x, task.test_y):
                total += global_mse(ep(mine(x)), mine(y)).double()
            dist.all_reduce(total)
        test_curve.append(total.item() / len(task.test_x))
    t, pairs_sent, pairs_received = epoch_traffic[-1]
    lo, hi = ep.bounds[rank], ep.bounds[rank + 1]
    mine_summary = {"rank": rank, "experts": f"{lo}..{hi - 1}", "tokens": share * len(task.train_x),
                    "pairs_sent": pairs_sent, "pairs_received": pairs_received, "sent_bytes": t.sent,
                    "received_bytes": t.received}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine_summary)
    steps = len(task.train_x)
    return {"backend": "scorch", "processes": world, "experts": opt["experts"], "top_k": opt["top_k"],
            "tokens": opt["tokens"], "dim": opt["dim"], "hidden": opt["hidden"], "batches": steps, "epochs": epochs,
            "threads": threads,
            "target_var": task.target_var, "first_loss": losses[0], "train_loss": sum(losses[-steps:]) / steps,
            "loss": test_curve[-1], "r2": 1.0 - test_curve[-1] / task.target_var, "epoch_s": epoch_watch.median(1),
            "total_s": time.perf_counter() - start, "losses": losses, "test_loss_curve": test_curve, "ranks": ranks}


def main(args, options) -> dict:
    """``python -m apps.moe --distributed``: run, rank 0 prints the summary and one line per rank."""
    import torch.distributed as dist
    result = run(args.backend, epochs=args.epochs, threads=args.threads, seed=args.seed, quiet=args.quiet,
                 data=args.data, **{k: getattr(args, k) for k in options})
    if dist.get_rank() == 0:
        common.report(f"moe (scorch, experts across {result['processes']} processes)", result)
        for r in result["ranks"]:
            print(f"  rank {r['rank']}: experts {r['experts']}, {r['tokens']} tokens; per training epoch: (token, "
                  f"expert) pairs sent {r['pairs_sent']}, received {r['pairs_received']}; sent {r['sent_bytes']} B, "
                  f"received {r['received_bytes']} B (inputs there, outputs back, and their gradients)")
    dist.destroy_process_group()
    return result
