"""A top-2 gated mixture-of-experts layer with sparse dispatch (Shazeer et al.): gate logits -> ``torch.topk``
-> softmax over the k kept logits -> a sparse (tokens x experts) gate tensor from ``torch.sparse_coo_tensor``.
Experts are one ``(n_experts, d_in, d_out)`` parameter; each token's expert outputs are combined with
``torch.sparse.mm`` by a sparse (tokens x tokens*experts) combine matrix built from the same gates, and a
load-balancing loss reads the per-expert importance with ``torch.sparse.sum``. A few Adam steps.
"""

DTYPE = "float32"
SPARSE_KEYS = ("gates",)
SCORCH_OPS = ("torch.sparse.mm", "torch.sparse.sum|torch._sparse_sum")  # torch.sparse.sum calls _sparse_sum


def run(torch):
    nn = torch.nn
    F = torch.nn.functional
    torch.manual_seed(0)

    B, D_in, D_out, N_experts, K = 64, 32, 16, 8, 2

    class TopKMoE(nn.Module):
        def __init__(self, d_in, d_out, n_experts, k):
            super().__init__()
            self.n_experts, self.k = n_experts, k
            self.gate = nn.Linear(d_in, n_experts, bias=False)
            self.experts = nn.Parameter(torch.randn(n_experts, d_in, d_out) / d_in ** 0.5)

        def forward(self, x):
            b = x.size(0)
            logits = self.gate(x)
            top_vals, top_idx = torch.topk(logits, self.k, dim=1)          # (b, k)
            weights = F.softmax(top_vals, dim=1)
            tokens = torch.arange(b).repeat_interleave(self.k)            # (b*k,)
            experts = top_idx.reshape(-1)
            gates = torch.sparse_coo_tensor(torch.stack([tokens, experts]), weights.reshape(-1),
                                            (b, self.n_experts))
            # every expert on every token (small sizes), then the sparse combine picks k per token
            y_experts = torch.einsum("bd,ndh->bnh", x, self.experts)       # (b, n, d_out)
            combine = torch.sparse_coo_tensor(torch.stack([tokens, tokens * self.n_experts + experts]),
                                              weights.reshape(-1), (b, b * self.n_experts))
            y = torch.sparse.mm(combine, y_experts.reshape(b * self.n_experts, -1))
            importance = torch.sparse.sum(gates, dim=0).to_dense()          # (n_experts,)
            aux = importance.var() / importance.mean() ** 2
            return y, gates, aux

    model = TopKMoE(D_in, D_out, N_experts, K)
    x = torch.randn(B, D_in)
    target = torch.randn(B, D_out)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(8):
        opt.zero_grad()
        y, gates, aux = model(x)
        loss = F.mse_loss(y, target) + 0.01 * aux
        loss.backward()
        opt.step()
        losses.append(loss.item())

    with torch.no_grad():
        y, gates, aux = model(x)
    return {"losses": torch.tensor(losses), "y": y, "gates": gates, "aux": aux.item(),
            "gate_weight": model.gate.weight.detach()}      # trained through the sparse gates' values
