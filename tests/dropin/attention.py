"""A masked sparse (local-window) self-attention block: a CSR band mask from ``torch.sparse_csr_tensor``,
scores = QK^T sampled on the mask with ``torch.sparse.sampled_addmm``, ``torch.sparse.softmax`` over each
row (on the COO view: torch's sparse softmax has no CSR kernel), output = ``torch.sparse.mm(attn, V)``;
forward + backward.
"""

DTYPE = "float32"
SPARSE_KEYS = ("mask", "attn")
SCORCH_OPS = ("torch.sparse.sampled_addmm", "torch.sparse.softmax", "torch.sparse.mm")


def run(torch):
    nn = torch.nn
    F = torch.nn.functional
    torch.manual_seed(0)

    T, D, W = 64, 16, 4                                   # sequence length, model width, half window

    # CSR band mask |i - j| <= W
    cols, crow = [], [0]
    for i in range(T):
        lo, hi = max(0, i - W), min(T, i + W + 1)
        cols.extend(range(lo, hi))
        crow.append(len(cols))
    mask = torch.sparse_csr_tensor(torch.tensor(crow), torch.tensor(cols), torch.ones(len(cols)), (T, T))

    class LocalAttention(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.q = nn.Linear(d, d)
            self.k = nn.Linear(d, d)
            self.v = nn.Linear(d, d)
            self.o = nn.Linear(d, d)
            self.scale = d ** -0.5

        def forward(self, x, mask):
            q, k, v = self.q(x), self.k(x), self.v(x)
            scores = torch.sparse.sampled_addmm(mask, q, k.transpose(0, 1), beta=0.0, alpha=self.scale)
            attn = torch.sparse.softmax(scores.to_sparse_coo(), dim=1)   # torch's sparse softmax takes COO
            return self.o(torch.sparse.mm(attn, v)), attn

    block = LocalAttention(D)
    x = torch.randn(T, D, requires_grad=True)
    out, attn = block(x, mask)
    loss = (out ** 2).mean()
    loss.backward()
    grads = {f"grad_{name}": p.grad for name, p in block.named_parameters()}
    return {"out": out.detach(), "loss": loss.item(), "grad_x": x.grad, "mask": mask, "attn": attn, **grads}
