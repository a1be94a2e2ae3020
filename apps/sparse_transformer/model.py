"""The encoder, written as ordinary PyTorch against a ``torch`` module passed in (the real ``torch``, or
``scorch``: ``import scorch as torch``). Every backend runs this same code; only the mask differs:

- a sparse mask (a CSR tensor: ``scorch.SparseTensor`` under scorch, ``torch.sparse_csr`` under torch) runs
  attention as SDDMM -> sparse softmax -> SpMM, the heads of the batch in one call: their ``(n, dh)`` slices
  stacked, the pattern repeated along the diagonal of a ``(B H n)^2`` mask (``block_diagonal``, made once; where
  that would hold over ``GROUP_ENTRIES`` entries, a group of heads a call, as few as keep within it):
      scores = torch.sparse.sampled_addmm(mask, q, k.T, beta=0, alpha=1/sqrt(d))   # only the pattern's entries
      attn   = torch.sparse.softmax(scores, dim=1)                                  # implicit entries are -inf
      out    = torch.sparse.mm(attn, v)
  torch has no CSR kernel for sparse softmax on the CPU (``aten::_sparse_softmax`` is COO only), so where the
  CSR softmax raises ``NotImplementedError`` the scores go through COO first (``scores.to_sparse_coo()``), the
  closest torch.sparse spelling; scorch takes CSR directly. ``dim=1``, not ``dim=-1``: torch 2.13's COO
  softmax backward is wrong for a negative ``dim`` (the forward is right), see README.md. The caller may pass
  that ``(B H n)^2`` mask itself (the app does, made once per batch size): under torch.compile it is the only way
  to one call, since a traced graph takes the mask as an input and does not read its arrays to build it (given
  an ``n x n`` mask, a compiled layer runs one head at a time).
- a dense bool mask runs ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask)`` over all heads at once.

``routing`` (a dict: ``clusters``, ``n_globals``, ``sparse``) makes the pattern a function of the data instead
(``routing.py``): every forward assigns each head's queries and keys to clusters and builds the block-diagonal
mask of the same-cluster pairs, sparse (CSR, the path above) or dense (bool, ``(B, H, n, n)``, SDPA); the
``mask`` argument is then unused.

``fuse=True`` (scorch only) wraps the per-head attention in ``torch.compile`` (``scorch.compile``): the three
ops run as one fused kernel, one pass over each row of the pattern.
"""
from __future__ import annotations

import math


def is_sparse_mask(torch, mask) -> bool:
    # (a scorch.SparseTensor by its type: while torch.compile traces, its layout reads strided)
    sparse_type = getattr(torch, "SparseTensor", None)
    return (sparse_type is not None and isinstance(mask, sparse_type)) or mask.layout != torch.strided


def sparse_attention(torch, q, k, v, mask, state=None):
    """One head: ``q, k, v`` are ``(n, dh)``, ``mask`` an ``n x n`` sparse tensor (its pattern is used, its values
    are ignored). ``state`` (a dict) remembers whether the CSR softmax is supported."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.sparse.sampled_addmm(mask, q, k.transpose(0, 1), beta=0.0, alpha=scale)
    state = {} if state is None else state
    if not state.get("coo_softmax"):
        try:
            attn = torch.sparse.softmax(scores, dim=1)
        except NotImplementedError:
            state["coo_softmax"] = True
    if state.get("coo_softmax"):
        attn = torch.sparse.softmax(scores.to_sparse_coo(), dim=1)
    return torch.sparse.mm(attn, v)


#: stored entries of a group's block-diagonal mask at most (``group_size``): its scores and probabilities, 8 MiB in
#: float32. One head of a 4096-token BigBird pattern (window 64) has 543K entries: each head is its own group there,
#: while the app's training batches (512 tokens, 8 heads of a batch) stay one call
GROUP_ENTRIES = 1 << 20


def group_size(problems: int, nnz: int) -> int:
    """The problems (a sequence's head each, ``nnz`` entries each) attended in one call: the largest divisor of
    ``problems`` whose entries stay within ``GROUP_ENTRIES`` (1 where one problem alone exceeds it)."""
    return max(g for g in range(1, problems + 1) if problems % g == 0 and (g == 1 or g * nnz <= GROUP_ENTRIES))


def block_diagonal(torch, mask, copies: int, state: dict):
    """``mask`` (an ``n x n`` CSR tensor) repeated ``copies`` times along the diagonal of a ``copies n`` square CSR
    tensor, made once per mask and count (kept in ``state``)."""
    key = ("block_diagonal", id(mask), copies)
    found = state.get(key)
    if found is not None and found[0] is mask:
        return found[1]
    if copies == 1:
        return mask
    n, crow, col = mask.shape[0], mask.crow_indices(), mask.col_indices()
    nnz = col.numel()
    shift = torch.arange(copies, dtype=crow.dtype)
    big_crow = torch.cat([(crow[:-1][None, :] + shift[:, None] * nnz).reshape(-1), crow.new_tensor([copies * nnz])])
    big_col = (col[None, :] + shift[:, None].to(col.dtype) * n).reshape(-1)
    big = torch.sparse_csr_tensor(big_crow, big_col, torch.ones(copies * nnz, dtype=mask.dtype),
                                  (copies * n, copies * n))
    state[key] = (mask, big)
    return big


def sinusoidal(torch, n, d):
    """The fixed sine/cosine position encoding of "Attention Is All You Need", ``(n, d)``."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    enc = torch.zeros(n, d)
    enc[:, 0::2] = torch.sin(pos * freq)
    enc[:, 1::2] = torch.cos(pos * freq)
    return enc


def make_modules(torch):
    """The model's classes, built on the given torch-like module."""
    nn = torch.nn
    F = torch.nn.functional

    class Attention(nn.Module):
        """Multi-head self-attention; the mask decides the kernel (see the module docstring)."""

        def __init__(self, d_model, heads, fuse=False, routing=None):
            super().__init__()
            if d_model % heads:
                raise ValueError(f"d_model {d_model} is not divisible by heads {heads}")
            self.heads = heads
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.out = nn.Linear(d_model, d_model)
            self._state = {}
            self.routing = routing
            if routing is not None:
                from .routing import init_centroids
                # (drawn after the weights, from the same seeded generator: the same under every backend)
                self.register_buffer("centroids", init_centroids(heads, routing["clusters"], d_model // heads))
                self.last_pattern, self.last_nnz = None, 0  # the last forward's (crow, col), entries per problem
            self._attend = lambda q, k, v, mask: sparse_attention(torch, q, k, v, mask, self._state)
            if fuse:
                if not hasattr(torch, "fusion"):
                    raise ValueError("fuse=True needs scorch (scorch.compile fuses the attention ops)")
                self._attend = torch.compile(self._attend)

        def forward(self, x, mask):
            B, n, d = x.shape
            H = self.heads
            # (3, B, H, n, dh), each head's (n, dh) slice contiguous
            qkv = self.qkv(x).reshape(B, n, 3, H, d // H).permute(2, 0, 3, 1, 4).contiguous()
            q, k, v = qkv[0], qkv[1], qkv[2]
            if self.routing is not None:
                o = self._routed(q, k, v)
            elif is_sparse_mask(torch, mask) and mask.shape[0] == B * H * n:
                # the batch's block-diagonal mask, made by the caller (``block_diagonal``; the way under
                # torch.compile, whose graph takes the mask as an input and does not read its arrays)
                o = self._stacked(q, k, v, mask)
            elif is_sparse_mask(torch, mask) and torch.compiler.is_compiling():
                # (under torch.compile: one head at a time, as traced before; the block-diagonal mask is built from
                # the pattern's arrays, which a traced graph does not read)
                heads = [torch.stack([self._attend(q[b, h], k[b, h], v[b, h], mask) for h in range(H)])
                         for b in range(B)]
                o = torch.stack(heads)                                     # (B, H, n, dh)
            elif is_sparse_mask(torch, mask):
                # the (batch, head) problems a group at a time: their (n, dh) slices stacked into one (g n, dh)
                # operand and the pattern repeated along the diagonal of a (g n)^2 mask (rows never mix heads: the
                # softmax is per row), so that each op is one call over g heads instead of g calls; g as large as
                # keeps the group's scores within GROUP_ENTRIES (all of them where the pattern is small)
                g = group_size(B * H, mask._nnz())
                big = block_diagonal(torch, mask, g, self._state)
                parts = [self._stacked(*group, big) for group in zip(*(t.reshape(B * H, n, -1).split(g)
                                                                      for t in (q, k, v)))]
                o = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(B, H, n, d // H)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.out(o.transpose(1, 2).reshape(B, n, d))

        def _stacked(self, q, k, v, big):
            """Every problem of ``q, k, v`` (``(..., n, dh)``: batch and head, or a group of them) in one call on
            ``big``, their block-diagonal mask."""
            shape = q.shape
            o = self._attend(*(t.reshape(-1, shape[-1]) for t in (q, k, v)), big)
            return o.reshape(shape)

        def _routed(self, q, k, v):
            """Attention on the pattern the clusters of ``q`` and ``k`` give (``routing.py``), built now; in training
            mode the centroids then take one EMA step."""
            from . import routing as R
            B, H, n, dh = q.shape
            with torch.no_grad():
                cq, ck = R.assign(q.detach(), self.centroids), R.assign(k.detach(), self.centroids)
                crow, col = R.pattern(cq.reshape(B * H, n), ck.reshape(B * H, n), self.routing["n_globals"])
                if self.training:
                    R.update(self.centroids, (q.detach(), k.detach()), (cq, ck))
            self.last_pattern, self.last_nnz = (crow, col), int(crow[-1]) / (B * H)  # (a problem: a sequence's head)
            if not self.routing["sparse"]:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=R.dense_blocks(crow, col, B * H)
                                                      .reshape(B, H, n, n))
            # (valid by construction, tests/apps: the per-call validation was half of the forward at 2048 tokens)
            mask = torch.sparse_csr_tensor(crow.to(torch.int32), col.to(torch.int32), torch.ones(col.numel()),
                                           (B * H * n, B * H * n), check_invariants=False)
            return self._stacked(q, k, v, mask)

    class Layer(nn.Module):
        """A pre-norm encoder layer: attention and a feed-forward block, each with a residual."""

        def __init__(self, d_model, heads, ff=2, fuse=False, routing=None):
            super().__init__()
            self.norm1 = nn.LayerNorm(d_model)
            self.attn = Attention(d_model, heads, fuse, routing)
            self.norm2 = nn.LayerNorm(d_model)
            self.ff = nn.Sequential(nn.Linear(d_model, ff * d_model), nn.GELU(), nn.Linear(ff * d_model, d_model))

        def forward(self, x, mask):
            x = x + self.attn(self.norm1(x), mask)
            return x + self.ff(self.norm2(x))

    class Encoder(nn.Module):
        """A token embedding plus fixed sinusoidal positions, ``layers`` encoder layers, a per-token classifier."""

        def __init__(self, vocab, d_model, heads, layers, classes, fuse=False, routing=None):
            super().__init__()
            self.tok = nn.Embedding(vocab, d_model)
            self.d_model = d_model
            self.layers = nn.ModuleList([Layer(d_model, heads, fuse=fuse, routing=routing) for _ in range(layers)])
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, classes)

        def forward(self, tokens, mask):
            n = tokens.shape[1]
            x = self.tok(tokens)
            x = x + sinusoidal(torch, n, self.d_model).to(x.device)
            for layer in self.layers:
                x = layer(x, mask)
            return self.head(self.norm(x))

    return Attention, Layer, Encoder


def build_encoder(torch, vocab, d_model, heads, layers, classes, seed=0, fuse=False, routing=None):
    """The encoder with weights drawn from ``seed`` (the same weights under every backend); any sequence length
    (fixed sinusoidal positions). ``routing``: see the module docstring."""
    torch.manual_seed(seed)
    return make_modules(torch)[2](vocab, d_model, heads, layers, classes, fuse, routing)


def build_attention(torch, d_model, heads, seed=0, fuse=False, routing=None):
    """One attention layer with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return make_modules(torch)[0](d_model, heads, fuse, routing)


def make_mask(torch, crow, col, n, sparse=True):
    """The backend's mask from CSR arrays: a CSR tensor of ones (``torch.sparse_csr_tensor``: scorch's under
    scorch), or the dense bool matrix."""
    if sparse:
        return torch.sparse_csr_tensor(crow.to(torch.int32), col.to(torch.int32), torch.ones(col.numel()), (n, n))
    from .pattern import dense_mask
    return dense_mask(crow, col)
