"""Multi-channel edge-weighted message passing (an MPNN-style layer): an MLP on the edge features gives K
weights per edge, ``w`` of shape (E, K); channel k aggregates the neighbours with its own adjacency
``torch.sparse_coo_tensor(edge_index, w[:, k], (N, N))`` and ``torch.sparse.mm``; the channels are concatenated.
A few Adam steps. (``w[:, k]`` is a strided view: the sparse tensor's values are not contiguous.)
"""

DTYPE = "float32"
SPARSE_KEYS = ("adj",)
SCORCH_OPS = ("torch.sparse.mm",)


def run(torch):
    nn = torch.nn
    F = torch.nn.functional
    torch.manual_seed(0)

    N, D_edge, D_in, D_hid, K, C = 100, 4, 8, 8, 3, 3
    edge_index = torch.unique(torch.randint(0, N, (2, 400)), dim=1)   # (dst, src) pairs, each once
    edge_attr = torch.randn(edge_index.size(1), D_edge)
    x = torch.randn(N, D_in)
    labels = torch.randint(0, C, (N,))

    class EdgeWeightedConv(nn.Module):
        def __init__(self, d_in, d_out, d_edge, channels):
            super().__init__()
            self.edge_mlp = nn.Sequential(nn.Linear(d_edge, 16), nn.ReLU(), nn.Linear(16, channels))
            self.lin = nn.Linear(d_in, d_out)

        def forward(self, x, edge_index, edge_attr):
            n = x.size(0)
            w = torch.sigmoid(self.edge_mlp(edge_attr))                  # (E, channels)
            h = self.lin(x)
            outs = []
            for k in range(w.size(1)):
                adj = torch.sparse_coo_tensor(edge_index, w[:, k], (n, n))
                outs.append(torch.sparse.mm(adj, h))
            return torch.cat(outs, dim=1), adj

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = EdgeWeightedConv(D_in, D_hid, D_edge, K)
            self.out = nn.Linear(K * D_hid, C)

        def forward(self, x, edge_index, edge_attr):
            h, adj = self.conv(x, edge_index, edge_attr)
            return self.out(F.relu(h)), adj

    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(10):
        opt.zero_grad()
        logits, _ = model(x, edge_index, edge_attr)
        loss = F.cross_entropy(logits, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())

    with torch.no_grad():
        logits, adj = model(x, edge_index, edge_attr)
    return {"losses": torch.tensor(losses), "logits": logits, "adj": adj,
            "edge_mlp_weight": model.conv.edge_mlp[0].weight.detach()}
