"""A 2-head graph attention layer (Velickovic et al.) with sparse attention: per-edge scores gathered by the
edge endpoints, ``leaky_relu``, a sparse score matrix from ``torch.sparse_coo_tensor``,
``torch.sparse.softmax(scores, dim=1)`` and ``torch.sparse.mm(attn, h)``; a few Adam steps.
"""

DTYPE = "float64"
SPARSE_KEYS = ("attn",)
SCORCH_OPS = ("torch.sparse.softmax", "torch.sparse.mm")


def run(torch):
    nn = torch.nn
    F = torch.nn.functional
    torch.manual_seed(0)

    N, C, D_in, D_hid, H = 120, 3, 12, 8, 2
    labels = torch.randint(0, C, (N,))
    A = torch.rand(N, N) < 0.05
    A = A | A.t()
    A.fill_diagonal_(True)                       # self-loops: every row has at least one entry
    dst, src = A.nonzero(as_tuple=True)         # edge src -> dst, row = dst (the node being updated)
    x = torch.randn(N, D_in, dtype=torch.float64)

    class GATLayer(nn.Module):
        def __init__(self, d_in, d_out, heads):
            super().__init__()
            self.heads, self.d_out = heads, d_out
            self.W = nn.Linear(d_in, heads * d_out, bias=False)
            self.a_src = nn.Parameter(torch.randn(heads, d_out) * 0.3)
            self.a_dst = nn.Parameter(torch.randn(heads, d_out) * 0.3)

        def forward(self, x, src, dst):
            n = x.size(0)
            h = self.W(x).view(n, self.heads, self.d_out)
            alpha_src = (h * self.a_src).sum(-1)               # (n, heads)
            alpha_dst = (h * self.a_dst).sum(-1)
            e = F.leaky_relu(alpha_src.index_select(0, src) + alpha_dst.index_select(0, dst), 0.2)  # (E, heads)
            outs, attns = [], []
            for k in range(self.heads):
                scores = torch.sparse_coo_tensor(torch.stack([dst, src]), e[:, k], (n, n))
                attn = torch.sparse.softmax(scores, dim=1)
                outs.append(torch.sparse.mm(attn, h[:, k]))
                attns.append(attn)
            return torch.cat(outs, dim=1), attns

    class GAT(nn.Module):
        def __init__(self):
            super().__init__()
            self.gat = GATLayer(D_in, D_hid, H)
            self.out = nn.Linear(H * D_hid, C)

        def forward(self, x, src, dst):
            h, attns = self.gat(x, src, dst)
            return self.out(F.elu(h)), attns

    model = GAT().double()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(10):
        opt.zero_grad()
        logits, attns = model(x, src, dst)
        loss = F.cross_entropy(logits, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())

    with torch.no_grad():
        logits, attns = model(x, src, dst)
    return {"losses": torch.tensor(losses, dtype=torch.float64), "logits": logits, "attn": attns[0]}
