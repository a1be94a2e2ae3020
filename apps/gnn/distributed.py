"""Full-batch GNN training across processes: ``torchrun --nproc_per_node N -m apps.gnn --distributed``.

The graph's nodes are split into N parts (``partition``); rank r holds the rows of its part: its block of the
normalized adjacency (a scorch CSR matrix whose columns are its own rows, then its *halo*: the other parts' rows
its block reads), its nodes' features, labels and split. A layer computes its dense features on its own rows,
fetches the halo rows of them from their owners (``Halo.fetch``: one ``all_to_all_single`` of exactly the rows each
part needs, with a gradient that goes back the same way) and multiplies its block by [own rows; halo rows]. The
model's weights are replicated under torch's ``DistributedDataParallel``; each rank's loss is its share of the whole
graph's loss, so the gradients, and the training, are those of one process. ``docs/distributed.md`` gives the
communication volume.
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from .. import common

MODELS = ("gcn", "sage")  # GAT's attention reads edge scores of the halo nodes too: not split (yet)


# --- partitioning -------------------------------------------------------------------------------------------------

def partition(indptr: np.ndarray, indices: np.ndarray, parts: int, method: str = "spectral", seed: int = 0,
              iterations: int = 50):
    """The part (0..parts-1) of every node, parts of equal size (to one node). ``contiguous``: blocks of node ids.
    ``spectral``: the nodes ordered by an approximate second eigenvector of the normalized adjacency (``iterations``
    steps of the power method on ``(I + D^-1/2 (A + I) D^-1/2) / 2``, the first eigenvector projected out, nodes
    without edges held at 0), cut into ``parts`` ranges: a graph's communities lie in ranges, so few edges cross
    parts. On a 100k-node generated graph it cuts 12% of the edges, against 50% for blocks of ids
    (``docs/distributed.md``)."""
    import torch
    n = len(indptr) - 1
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if method not in ("contiguous", "spectral"):
        raise ValueError(f"unknown partition method {method!r}: choose spectral or contiguous")
    order = np.arange(n)
    if method == "spectral" and parts > 1 and n:
        degree = np.diff(indptr)
        scale = 1.0 / np.sqrt(degree + 1.0)
        rows = np.repeat(np.arange(n), degree)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Ss]parse.*(beta|invariant)")
            a = torch.sparse_csr_tensor(torch.from_numpy(indptr), torch.from_numpy(indices),
                                        torch.from_numpy(0.5 * scale[rows] * scale[indices]), (n, n))
        diagonal = torch.from_numpy(0.5 * scale ** 2 + 0.5)            # the self loop's half, and I / 2
        first = torch.from_numpy(1.0 / scale)
        first /= first.norm()
        connected = torch.from_numpy((degree > 0).astype(np.float64))
        x = torch.from_numpy(np.random.default_rng(seed).standard_normal(n))
        for _ in range(iterations):
            x = (a @ x + diagonal * x) * connected
            x -= (x @ first) * first
            x /= x.norm().clamp_min(1e-300)
        order = np.argsort(x.numpy(), kind="stable")
    part = np.empty(n, dtype=np.int64)
    part[order] = np.arange(n) * parts // max(n, 1)
    return part


# --- a rank's block of the graph ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Halo:
    """How a rank gets the rows its block reads from other ranks: ``send`` (its own rows' local indices that other
    ranks read, grouped by destination rank, ``send_splits`` of them to each) and ``recv_splits`` (rows from each
    rank, in the order of the block's halo columns)."""
    send: object
    send_splits: list
    recv_splits: list

    def fetch(self, torch, h):
        """[``h``'s rows; the halo rows of the same features at the other ranks], differentiably."""
        from scorch.nn.distributed import exchange_rows
        return torch.cat([h, exchange_rows(h.index_select(0, self.send), self.send_splits, self.recv_splits)])


@dataclasses.dataclass
class Block:
    """What rank ``rank`` holds: its rows (global ids, in local order) and halo (global ids, grouped by owner), the
    graph tensors of its rows (``GraphTensors`` fields: ``x``, ``adj``, ``mean``, labels, split as local indices)
    and the halo exchange. ``aggregate`` makes it a stand-in for ``GraphTensors`` in ``model.py``'s GCN and SAGE."""
    rank: int
    rows: np.ndarray
    halo_nodes: np.ndarray
    halo: Halo
    x: object
    adj: object
    mean: object
    labels: object
    train_idx: object
    val_idx: object
    test_idx: object
    num_nodes: int                         # of the whole graph

    def aggregate(self, torch, matrix, h):
        return torch.sparse.mm(matrix, self.halo.fetch(torch, h))

    def dropout(self, F, h, p, training):
        if not training or p == 0:
            return h
        mask = F.dropout(h.new_ones(self.num_nodes, *h.shape[1:]), p=p, training=True)
        return h * mask[self._rows]

    @property
    def _rows(self):
        if getattr(self, "_rows_t", None) is None or self._rows_t.device != self.labels.device:
            import torch
            self._rows_t = torch.from_numpy(self.rows).to(self.labels.device)
        return self._rows_t


def _rows_of(indptr, indices, values, rows):
    """The CSR arrays of the rows ``rows`` (in that order) of a CSR matrix."""
    counts = indptr[rows + 1] - indptr[rows]
    ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    take = np.repeat(indptr[rows] - ptr[:-1], counts) + np.arange(ptr[-1])
    return ptr, indices[take], values[take]


def block(torch, g, part: np.ndarray, rank: int, world: int, group=None, device="cpu") -> Block:
    """Rank ``rank``'s ``Block`` of graph ``g`` under the partition ``part``. Collective: the ranks tell each other
    which rows they read (one ``all_to_all_single`` of counts, one of node ids, on ``device``: the process group's,
    a GPU under NCCL)."""
    import torch as real_torch
    import torch.distributed as dist
    from scorch.nn.distributed import exchange_rows
    from .model import graph_tensors

    full = graph_tensors(real_torch, g)                    # the normalized matrices, as arrays to slice
    local_of = np.zeros(g.num_nodes, dtype=np.int64)       # a node's index among its owner's rows
    for r in range(world):
        mine = np.flatnonzero(part == r)
        local_of[mine] = np.arange(len(mine))
    rows = np.flatnonzero(part == rank)
    csr = {name: tuple(a.numpy() for a in (m.crow_indices(), m.col_indices(), m.values()))
           for name, m in (("adj", full.adj), ("mean", full.mean), ("x", full.x))}
    # the halo: the columns of this block's adjacency owned by other ranks, by owner, then by their local index
    cols = np.unique(np.concatenate([_rows_of(*csr[m], rows)[1] for m in ("adj", "mean")]))
    halo_nodes = cols[part[cols] != rank]
    halo_nodes = halo_nodes[np.lexsort((local_of[halo_nodes], part[halo_nodes]))]
    recv_splits = np.bincount(part[halo_nodes], minlength=world).tolist()
    # tell each owner which of its rows to send: counts first, then the node ids
    wanted = real_torch.tensor(recv_splits, dtype=real_torch.int64, device=device)
    send_counts = real_torch.empty_like(wanted)
    dist.all_to_all_single(send_counts, wanted, group=group)
    send_splits = send_counts.tolist()
    asked = exchange_rows(real_torch.from_numpy(halo_nodes).to(device), recv_splits, send_splits, group).cpu()
    from scorch.nn.distributed import traffic
    traffic.reset()                                        # (setup traffic is not an epoch's)
    column = np.full(g.num_nodes, -1, dtype=np.int64)
    column[rows] = np.arange(len(rows))
    column[halo_nodes] = len(rows) + np.arange(len(halo_nodes))

    def local(name, width=None, remap=True):
        ptr, ind, val = _rows_of(*csr[name], rows)
        if remap:  # the local column numbers, sorted again within each row
            ind = column[ind]
            order = np.lexsort((ind, np.repeat(np.arange(len(rows)), np.diff(ptr))))
            ind, val = ind[order], val[order]
        shape = (len(rows), width if width is not None else len(rows) + len(halo_nodes))
        return torch.sparse_csr_tensor(*(real_torch.from_numpy(a) for a in (ptr, ind, val)), shape)

    def split(idx):
        return real_torch.from_numpy(np.sort(local_of[idx[part[idx] == rank]]))

    return Block(rank=rank, rows=rows, halo_nodes=halo_nodes,
                 halo=Halo(real_torch.from_numpy(local_of[asked.numpy()]), send_splits, recv_splits),
                 x=local("x", g.num_features, remap=False), adj=local("adj"), mean=local("mean"),
                 labels=real_torch.from_numpy(g.labels[rows]), train_idx=split(g.train_idx), val_idx=split(g.val_idx),
                 test_idx=split(g.test_idx), num_nodes=g.num_nodes)


# --- training -----------------------------------------------------------------------------------------------------

def run(backend: str = "scorch", model: str = "gcn", dataset: str = "cora", epochs: int = 200, threads: int = 1,
        seed: int = 0, data=None, hidden=None, lr=None, weight_decay=None, dropout=None, graph=None,
        method: str = "spectral", quiet: bool = True) -> dict:
    """``apps.gnn.run`` across the processes of a ``torchrun`` launch: the same model, optimizer and recipe; the
    loss and accuracies are the whole graph's (summed over ranks). Returns rank 0's result with ``ranks``: each
    rank's rows, stored entries, halo rows and bytes sent / received in a training epoch, against an all-gather."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from scorch.nn.distributed import traffic
    from . import DEFAULTS
    from .model import build
    from .data import dataset as load

    if backend != "scorch":
        raise ValueError(f"--distributed runs the scorch backend, got {backend!r}")
    if model not in MODELS:
        raise ValueError(f"--distributed trains {', '.join(MODELS)}, not {model!r}")
    rank, world, device = common.init_distributed("gnn")
    threads = common.threads_per_process(threads)
    common.set_threads(threads)
    g = graph if graph is not None else load(dataset, common.data_root(data), seed=seed)
    d = DEFAULTS[model]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*(beta|invariant)")
        part = [partition(g.indptr, g.indices, world, method, seed) if rank == 0 else None]
        dist.broadcast_object_list(part, src=0)             # (rank 0's: float rounding may differ between ranks)
        part = part[0]
        scorch = common.backend_module("scorch")
        b = common.to_device(block(scorch, g, part, rank, world, device=device), device)
        torch.manual_seed(seed)          # the same initial weights and dropout masks (Block.dropout) as one process
        net = build(scorch, model, g.num_features, hidden or d["hidden"], g.num_classes, heads=d["heads"],
                    dropout=d["dropout"] if dropout is None else dropout)
        net = DistributedDataParallel(net.to(device))
        opt = torch.optim.Adam(net.parameters(), lr=lr or d["lr"],
                               weight_decay=d["weight_decay"] if weight_decay is None else weight_decay)
        n_train = len(g.train_idx)
        train_watch, epoch_traffic, losses = common.Stopwatch(), [], []
        best_val, test_at_best = -1.0, 0.0
        for _ in common.progress(range(epochs), f"{model} distributed {g.name}", quiet or rank != 0):
            traffic.reset()
            with train_watch:
                net.train()
                opt.zero_grad()
                out = net(b.x, b)
                # this rank's share of the mean over every training node; DDP averages the ranks' gradients
                loss = torch.nn.functional.cross_entropy(out[b.train_idx], b.labels[b.train_idx],
                                                         reduction="sum") * (world / n_train)
                loss.backward()
                opt.step()
            epoch_traffic.append(traffic.reset())
            with torch.no_grad():
                net.eval()
                pred = net(b.x, b).argmax(1)
                counts = torch.tensor([loss.item() / world, *((pred[i] == b.labels[i]).sum().item()
                                                              for i in (b.val_idx, b.test_idx))], dtype=torch.float64,
                                      device=device)
            dist.all_reduce(counts)
            losses.append(counts[0].item())
            val, test = counts[1].item() / len(g.val_idx), counts[2].item() / len(g.test_idx)
            if val > best_val:
                best_val, test_at_best = val, test
    mine = summary(b, g, model, hidden or d["hidden"], epoch_traffic[-1] if epoch_traffic else traffic)
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    warm = min(3, max(epochs - 1, 0))
    return {"backend": "scorch", "model": model, "data": g.name, "nodes": g.num_nodes, "edges": g.num_edges,
            "epochs": epochs, "processes": world, "partition": method, "train_loss": losses[-1] if losses else
            float("nan"), "losses": losses, "val_acc": best_val, "test_acc": test_at_best,
            "epoch_s": train_watch.median(skip=warm), "threads": threads, "device": device,
            "sent_bytes": sum(r["sent_bytes"] for r in ranks), "allgather_bytes": sum(r["allgather_bytes"]
                                                                                      for r in ranks),
            "ranks": ranks}


def summary(b: Block, g, model: str, hidden: int, t) -> dict:
    """What rank ``b.rank`` holds and sends in a training epoch, and what an all-gather of the same features would
    move: each exchanged matrix's other ranks' rows, forward and again backward (a reduce-scatter)."""
    widths = (hidden, g.num_classes)                        # the features each layer exchanges (4-byte floats)
    others = g.num_nodes - len(b.rows)
    return {"rank": b.rank, "rows": len(b.rows), "nnz": int(b.adj.values().numel()), "halo_rows": len(b.halo_nodes),
            "rows_sent": int(sum(b.halo.send_splits)), "sent_bytes": t.sent, "received_bytes": t.received,
            "allgather_bytes": sum(2 * others * w * 4 for w in widths)}


def report(result: dict) -> None:
    """``common.report`` of rank 0's result, then one line per rank."""
    common.report(f"apps.gnn: {result['model']} on {result['data']}, {result['processes']} processes", result)
    for r in result["ranks"]:
        print(f"  rank {r['rank']}: rows {r['rows']}, nnz {r['nnz']}, halo rows received {r['halo_rows']}, rows "
              f"sent {r['rows_sent']}; per training epoch: sent {r['sent_bytes']} B, received {r['received_bytes']}"
              f" B (an all-gather: {r['allgather_bytes']} B received)")


def main(a) -> dict:
    """``python -m apps.gnn --distributed``'s run from the parsed options; rank 0 prints the summary."""
    import torch.distributed as dist
    result = run(a.backend, a.model, a.dataset, a.epochs, a.threads, a.seed, a.data, a.hidden, a.lr, a.weight_decay,
                 a.dropout, method=a.partition, quiet=a.quiet)
    if dist.get_rank() == 0:
        report(result)
    dist.destroy_process_group()
    return result
