"""A 2-layer GCN (Kipf & Welling) trained with Adam on a small stochastic-block-model graph.

The adjacency is the usual symmetric-normalized D^-1/2 (A + I) D^-1/2, built with ``torch.sparse_coo_tensor``;
layer 1 propagates with ``torch.sparse.mm``, layer 2 with ``torch.spmm``.
"""

DTYPE = "float64"
SPARSE_KEYS = ("adj",)                          # under scorch these must be scorch.SparseTensor
SCORCH_OPS = ("torch.sparse.mm", "torch.spmm")  # under scorch these must reach SparseTensor.__torch_function__


def run(torch):
    nn = torch.nn
    F = torch.nn.functional
    torch.manual_seed(0)

    # --- data: 200 nodes, 4 communities ---------------------------------------------------------------------
    N, C, D_in, D_hid = 200, 4, 16, 32
    labels = torch.arange(N) % C
    same = labels[:, None] == labels[None, :]
    prob = torch.where(same, torch.tensor(0.10), torch.tensor(0.01))
    upper = torch.triu(torch.rand(N, N) < prob, diagonal=1)
    src, dst = upper.nonzero(as_tuple=True)
    loops = torch.arange(N)
    row = torch.cat([src, dst, loops])
    col = torch.cat([dst, src, loops])

    deg = torch.zeros(N, dtype=torch.float64).scatter_add_(0, row, torch.ones(row.numel(), dtype=torch.float64))
    d_inv_sqrt = deg.pow(-0.5)
    norm = d_inv_sqrt[row] * d_inv_sqrt[col]
    adj = torch.sparse_coo_tensor(torch.stack([row, col]), norm, (N, N)).coalesce()

    x = torch.randn(N, D_in, dtype=torch.float64)
    x[:, :C] += 0.5 * F.one_hot(labels, C).double()       # weakly informative features
    train_mask = torch.rand(N) < 0.5

    # --- model ----------------------------------------------------------------------------------------------
    class GCN(nn.Module):
        def __init__(self, d_in, d_hid, d_out, dropout=0.5):
            super().__init__()
            self.lin1 = nn.Linear(d_in, d_hid)
            self.lin2 = nn.Linear(d_hid, d_out)
            self.dropout = dropout

        def forward(self, x, adj):
            h = torch.sparse.mm(adj, self.lin1(x))
            h = F.relu(h)
            h = F.dropout(h, p=self.dropout, training=self.training)
            return torch.spmm(adj, self.lin2(h))

    model = GCN(D_in, D_hid, C).double()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)

    losses = []
    for epoch in range(30):
        model.train()
        opt.zero_grad()
        out = model(x, adj)
        loss = F.cross_entropy(out[train_mask], labels[train_mask])
        loss.backward()
        opt.step()
        losses.append(loss.item())

    model.eval()
    with torch.no_grad():
        logits = model(x, adj)
    acc = (logits.argmax(1) == labels)[~train_mask].double().mean().item()
    return {"losses": torch.tensor(losses, dtype=torch.float64), "logits": logits, "test_acc": acc, "adj": adj}
