"""The same three models built from PyTorch Geometric's own layers (``GCNConv``, ``SAGEConv``, ``GATConv``), on
the same graph (``edge_index`` of A, without self loops: the layers add them as the GCN and GAT papers do)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .data import Graph


def edge_index(g: Graph) -> torch.Tensor:
    """PyG's (2, edges) tensor, row 0 the source j and row 1 the target i of each message j -> i."""
    targets = np.repeat(np.arange(g.num_nodes), np.diff(g.indptr))
    return torch.from_numpy(np.stack([g.indices, targets]).astype(np.int64))


def build(arch: str, d_in: int, d_hidden: int, d_out: int, heads: int = 8, dropout: float = 0.5):
    """``forward(x, edge_index)`` gives logits; the same layer sizes as ``apps.gnn.model.build``."""
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if arch == "gcn":
                self.conv1 = GCNConv(d_in, d_hidden, cached=True)
                self.conv2 = GCNConv(d_hidden, d_out, cached=True)
            elif arch == "sage":
                self.conv1 = SAGEConv(d_in, d_hidden, aggr="mean")
                self.conv2 = SAGEConv(d_hidden, d_out, aggr="mean")
            elif arch == "gat":
                self.conv1 = GATConv(d_in, d_hidden, heads=heads)
                self.conv2 = GATConv(d_hidden * heads, d_out, heads=1, concat=False)
            else:
                raise ValueError(f"unknown model {arch!r}: choose gcn, sage, gat")

        def forward(self, x, ei):
            h = self.conv1(x, ei)
            h = F.elu(h) if arch == "gat" else F.relu(h)
            h = F.dropout(h, p=dropout, training=self.training)
            return self.conv2(h, ei)

    return Net()
