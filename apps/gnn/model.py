"""GCN, GraphSAGE (mean aggregation) and GAT, written once as ordinary PyTorch against the ``torch`` module
passed in: the real ``torch`` (torch.sparse kernels) or ``scorch`` (``import scorch as torch``: scorch's
generated kernels). The sparse operands are the graph's matrices (``GraphTensors``) and the bag-of-words
features; everything else is dense.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .data import Graph


@dataclasses.dataclass
class GraphTensors:
    """A graph's tensors, built by the backend's ``torch`` module."""
    x: object               # node features: a sparse CSR tensor (num_nodes x num_features)
    adj: object             # GCN: D^-1/2 (A + I) D^-1/2, sparse CSR
    mean: object            # GraphSAGE: D^-1 A (mean over neighbours), sparse CSR
    row: object             # GAT: the edges of A + I, by target (row) then source (col), int64
    col: object
    crow: object            # ... and the same pattern's CSR row pointers
    attention_layout: str   # "csr" or "coo": the layout GAT's attention matrices are built in
    labels: object
    train_idx: object
    val_idx: object
    test_idx: object
    num_nodes: int
    _heads: dict = dataclasses.field(default_factory=dict, init=False, repr=False)  # heads -> (row, col, crow)

    def edges(self, torch, heads=1):
        """``(row, col, crow)`` of the pattern of A + I, or with ``heads`` > 1 of its block-diagonal version for
        every head at once: an (n * heads) x (n * heads) pattern whose row ``i * heads + k`` holds head ``k``'s
        edges of node ``i``, at columns ``j * heads + k``. A row-major (n, heads) array flattened indexes its rows
        and columns, so the heads' scores, softmax and products are one sparse op each (no loop over heads)."""
        if heads == 1:
            return self.row, self.col, self.crow
        got = self._heads.get(heads)
        if got is None:
            deg = self.crow[1:] - self.crow[:-1]
            big_deg = deg.repeat_interleave(heads)                       # row i * heads + k: node i's degree
            big_crow = torch.zeros(len(big_deg) + 1, dtype=self.crow.dtype, device=self.crow.device)
            big_crow[1:] = torch.cumsum(big_deg, 0)
            big_row = torch.arange(len(big_deg), device=self.crow.device).repeat_interleave(big_deg)
            node, head = big_row // heads, big_row % heads
            edge = self.crow[node] + torch.arange(len(big_row), device=self.crow.device) - big_crow[big_row]
            got = self._heads[heads] = (big_row, self.col[edge] * heads + head, big_crow)
        return got

    def aggregate(self, torch, matrix, h):
        """``matrix @ h``: each node's sum of its neighbours' rows of ``h``, weighted by ``matrix`` (``adj`` or
        ``mean``). A graph split across processes (``apps.gnn.distributed``) first fetches the rows of ``h`` its
        block of ``matrix`` reads from other processes."""
        return torch.sparse.mm(matrix, h)

    def dropout(self, F, h, p, training):
        """``F.dropout`` of the nodes' features ``h`` (a graph split across processes draws the whole graph's mask
        and keeps its rows: the same masks as one process)."""
        return F.dropout(h, p=p, training=training)

    def on_pattern(self, torch, values, heads=1):
        """A sparse matrix on the pattern of ``edges(torch, heads)`` holding ``values`` (one per entry, in
        row-major order)."""
        row, col, crow = self.edges(torch, heads)
        n = self.num_nodes * heads
        if self.attention_layout == "coo":
            return torch.sparse_coo_tensor(torch.stack([row, col]), values, (n, n), is_coalesced=True)
        return torch.sparse_csr_tensor(crow, col, values, (n, n))


def graph_tensors(torch, g: Graph, attention_layout: str = "csr", dense_features: bool = False) -> GraphTensors:
    """Build the normalized adjacency matrices and features with the backend's ``torch`` module."""
    n = g.num_nodes
    deg = np.diff(g.indptr)
    rows = np.repeat(np.arange(n), deg)
    # A + I: insert each row's diagonal entry in order
    key = np.concatenate([rows * n + g.indices, np.arange(n) * (n + 1)])
    key.sort()
    loop_row, loop_col = key // n, key % n
    loop_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(loop_row, minlength=n), out=loop_ptr[1:])
    d_inv_sqrt = 1.0 / np.sqrt(deg + 1.0)
    gcn_vals = (d_inv_sqrt[loop_row] * d_inv_sqrt[loop_col]).astype(np.float32)
    mean_vals = (1.0 / np.maximum(deg, 1))[rows].astype(np.float32)

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a))

    # features normalized to sum 1 per node (the usual preprocessing of bag-of-words features)
    feat_sum = np.add.reduceat(g.feat_data, g.feat_indptr[:-1]) if len(g.feat_data) else np.zeros(n)
    feat_sum = np.where(np.diff(g.feat_indptr) > 0, feat_sum, 1.0)
    feat = (g.feat_data / np.repeat(feat_sum, np.diff(g.feat_indptr))).astype(np.float32)
    x = torch.sparse_csr_tensor(t(g.feat_indptr), t(g.feat_indices), t(feat), (n, g.num_features))
    if dense_features:
        x = x.to_dense()
    return GraphTensors(
        x=x,
        adj=torch.sparse_csr_tensor(t(loop_ptr), t(loop_col), t(gcn_vals), (n, n)),
        mean=torch.sparse_csr_tensor(t(g.indptr), t(g.indices), t(mean_vals), (n, n)),
        row=t(loop_row), col=t(loop_col), crow=t(loop_ptr), attention_layout=attention_layout,
        labels=t(g.labels), train_idx=t(g.train_idx), val_idx=t(g.val_idx), test_idx=t(g.test_idx), num_nodes=n)


def build(torch, arch: str, d_in: int, d_hidden: int, d_out: int, heads: int = 8, dropout: float = 0.5):
    """The model ``arch`` (gcn, sage, gat) as a ``torch.nn.Module`` whose ``forward(x, graph)`` gives logits."""
    nn, F = torch.nn, torch.nn.functional

    class GCN(nn.Module):
        """Kipf & Welling: H' = A_hat (H W) + b, two layers, ReLU and dropout between."""

        def __init__(self):
            super().__init__()
            self.lin1 = nn.Linear(d_in, d_hidden, bias=False)
            self.lin2 = nn.Linear(d_hidden, d_out, bias=False)
            self.bias1 = nn.Parameter(torch.zeros(d_hidden))
            self.bias2 = nn.Parameter(torch.zeros(d_out))

        def forward(self, x, g):
            h = g.aggregate(torch, g.adj, self.lin1(x)) + self.bias1
            h = g.dropout(F, F.relu(h), dropout, self.training)
            return g.aggregate(torch, g.adj, self.lin2(h)) + self.bias2

    class SAGE(nn.Module):
        """Hamilton et al., mean aggregator: H' = mean_{j in N(i)} H_j W_l + H_i W_r + b."""

        def __init__(self):
            super().__init__()
            self.neigh1 = nn.Linear(d_in, d_hidden, bias=False)
            self.root1 = nn.Linear(d_in, d_hidden)
            self.neigh2 = nn.Linear(d_hidden, d_out, bias=False)
            self.root2 = nn.Linear(d_hidden, d_out)

        def forward(self, x, g):
            h = g.aggregate(torch, g.mean, self.neigh1(x)) + self.root1(x)
            h = g.dropout(F, F.relu(h), dropout, self.training)
            return g.aggregate(torch, g.mean, self.neigh2(h)) + self.root2(h)

    class GATLayer(nn.Module):
        """Velickovic et al.: per head, e_ij = LeakyReLU(a_dst . W h_i + a_src . W h_j) on the edges of A + I,
        softmax over each row (a sparse softmax), then the attention-weighted sum of W h_j (an SpMM). Every head
        at once: the heads' attention matrices are the diagonal blocks of one sparse matrix (``edges``), so each
        step is one op over all heads' edges (a loop over heads costs each op's overhead once per head)."""

        def __init__(self, d_in_, d_out_, heads_, concat):
            super().__init__()
            self.heads, self.d, self.concat = heads_, d_out_, concat
            self.lin = nn.Linear(d_in_, heads_ * d_out_, bias=False)
            self.att_src = nn.Parameter(torch.empty(heads_, d_out_))
            self.att_dst = nn.Parameter(torch.empty(heads_, d_out_))
            self.bias = nn.Parameter(torch.zeros(heads_ * d_out_ if concat else d_out_))
            nn.init.xavier_uniform_(self.att_src)
            nn.init.xavier_uniform_(self.att_dst)

        def forward(self, x, g):
            if torch.__name__ == "torch":
                return self.per_head(x, g)
            n, heads = x.shape[0], self.heads
            h = self.lin(x).view(n, heads, self.d)
            src = (h * self.att_src).sum(-1).reshape(-1)         # (nodes * heads): node i's head k at i * heads + k
            dst = (h * self.att_dst).sum(-1).reshape(-1)
            row, col, _ = g.edges(torch, heads)
            scores = F.leaky_relu(dst.index_select(0, row) + src.index_select(0, col), 0.2)
            attention = torch.sparse.softmax(g.on_pattern(torch, scores, heads), dim=1)
            out = torch.sparse.mm(attention, h.reshape(n * heads, self.d))  # row i * heads + k: node i, head k
            out = out.reshape(n, heads * self.d) if self.concat else out.reshape(n, heads, self.d).mean(1)
            return out + self.bias

        def per_head(self, x, g):
            """The same layer with one sparse softmax and product per head: torch.sparse's fastest form (on the
            heads' block-diagonal pattern its softmax and product took 10x as long: Cora 117 ms -> 1.2 s an
            epoch), so the torch.sparse baseline runs this one."""
            h = self.lin(x).view(-1, self.heads, self.d)
            src = (h * self.att_src).sum(-1).t()                  # (heads, nodes)
            dst = (h * self.att_dst).sum(-1).t()
            scores = F.leaky_relu(dst[:, g.row] + src[:, g.col], 0.2)   # (heads, edges)
            outs = []
            for k in range(self.heads):
                attention = torch.sparse.softmax(g.on_pattern(torch, scores[k]), dim=1)
                outs.append(torch.sparse.mm(attention, h[:, k]))
            out = torch.cat(outs, dim=1) if self.concat else torch.stack(outs).mean(0)
            return out + self.bias

    class GAT(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = GATLayer(d_in, d_hidden, heads, concat=True)
            self.conv2 = GATLayer(d_hidden * heads, d_out, 1, concat=False)

        def forward(self, x, g):
            h = F.dropout(F.elu(self.conv1(x, g)), p=dropout, training=self.training)
            return self.conv2(h, g)

    models = {"gcn": GCN, "sage": SAGE, "gat": GAT}
    if arch not in models:
        raise ValueError(f"unknown model {arch!r}: choose {', '.join(models)}")
    return models[arch]()
