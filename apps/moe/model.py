"""A mixture-of-experts block with top-1 / top-2 gating in the einsum style, written as ordinary PyTorch against a
``torch`` module passed in (the real ``torch``, or ``scorch``: ``import scorch as torch``).

    probs = softmax(x W_g)                        (tokens x experts)
    top-k of probs -> gates G                     G[b, n] = the gate weight of expert n for token b, else 0
    y[b, h] = sum_n G[b, n] * sum_d x[b, d] E[n, d, h]      (experts E: one (experts, dim, hidden) tensor)

Top-1 keeps the chosen expert's probability as its weight (Switch Transformer style, so the gate is trained
through it); top-k with k > 1 renormalizes the k kept probabilities (Shazeer et al.).

``einsum`` picks one of four ordinary spellings of the same function (all give the same numbers, up to rounding),
or the plain PyTorch peer:

* ``"fused"`` (the default): ``einsum("bn,bd,ndh->bh", G, x, E)`` with the (tokens x experts) gate ``G``, one
  einsum. With a sparse gate scorch runs it as a grouped product: the gate's entries sorted by expert once, one
  matrix product per expert over its tokens' contiguous rows, and a backward on the same order
  (``scorch/engine/grouped.py``).
* ``"slots"``, GShard / Switch Transformer style: every expert gets ``C`` slots, ``C`` the most tokens
  any expert received in this batch (so no token is dropped), and token ``b``'s choice of expert ``n`` takes
  the next free slot ``s = n * C + c`` of that expert. Two gate matrices follow from the top-k:
  ``dispatch`` (slots x tokens, a 1 where slot ``s`` holds token ``b``) and ``combine`` (tokens x slots, the gate
  weight there). Then
      ``xe = einsum("sb,bd->sd", dispatch, x)``          gather each expert's tokens  (-> experts, C, dim)
      ``ye = einsum("ncd,ndh->nch", xe, E)``             the experts, a batched matmul on their own tokens
      ``y  = einsum("bs,sh->bh", combine, ye)``          weighted sum of each token's k expert outputs
  (the batched matmul runs on every slot, the empty ones too: ``C`` is the fullest expert's count);
* ``"dispatch"``: ``xd = einsum("bn,bd->bnd", G, x)`` (each token's input placed at its experts, weighted), then
  ``einsum("bnd,ndh->bh", xd, E)``;
* ``"combine"``: ``ye = einsum("bd,ndh->bnh", x, E)`` (every expert on every token), then
  ``einsum("bn,bnh->bh", G, ye)`` (the issue's ``bnd,bn->bd`` combine; dense work whatever ``G`` is);
* ``"loop"``: no gate tensor, the plain PyTorch way to route: for each expert, its tokens gathered
  (``index_select``), one ``torch.mm``, the weighted rows added back (``index_add_``). The benchmarks' peer.

The only switch between the backends is how the gate tensors (``G``; ``dispatch`` and ``combine``) are held:

* ``sparse_gate=True`` (the scorch backend): ``torch.sparse_csr_tensor``, built straight from ``topk``'s indices
  and weights (``k`` entries a token). Every einsum that meets one runs sparse, its loops driven by the gate.
* ``sparse_gate=False`` (the torch backend): dense tensors with zeros outside the top-k (``index_put``). With
  ``G`` the einsum computes every expert for every token and multiplies the unselected ones by 0; with
  ``dispatch`` / ``combine`` it multiplies by one-hot (slots x tokens) matrices, the same order of work.
"""

SPELLINGS = ("fused", "slots", "dispatch", "combine", "loop")


def _static_capacity(tokens: int):
    """The slot capacity while ``torch.compile`` traces without ``capture_scalar_outputs``: ``tokens``, the most any
    expert can receive (each token picks an expert once), so that the graph does not break on reading the
    capacity from data. The result is the same (the extra slots hold no token); the expert product runs on
    ``experts * tokens`` rows. None otherwise: the capacity is read from the routing (with
    ``capture_scalar_outputs``, inside the graph)."""
    import torch as real_torch
    if real_torch.compiler.is_compiling() and not real_torch._dynamo.config.capture_scalar_outputs:
        return tokens
    return None


def build(torch, dim: int, hidden: int, experts: int, top_k: int, sparse_gate: bool, einsum: str = "fused"):
    """The MoE block as an ``nn.Module``: ``forward(x)`` maps (tokens, dim) to (tokens, hidden)."""
    if einsum not in SPELLINGS:
        raise ValueError(f"einsum spelling {einsum!r}: choose from {', '.join(SPELLINGS)}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be between 1 and the number of experts ({experts}), got {top_k}")
    nn = torch.nn
    F = torch.nn.functional

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k = top_k
            self.sparse_gate = sparse_gate
            self.gate = nn.Linear(dim, experts, bias=False)
            self.experts = nn.Parameter(torch.randn(experts, dim, hidden) / dim ** 0.5)

        def route(self, x):
            """Each token's ``k`` experts in increasing order (tokens, k) and their gate weights."""
            probs = F.softmax(self.gate(x), dim=-1)
            weights, index = torch.topk(probs, self.top_k, dim=-1)
            if self.top_k > 1:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            index, order = index.sort(dim=-1)          # CSR wants each row's columns in order
            return index, weights.gather(1, order)

        def _matrix(self, rows, cols, values, shape):
            """The (rows x cols) matrix with ``values`` at ``(rows, cols)``: dense, or CSR when the gate is sparse
            (``rows`` must then be sorted)."""
            if not self.sparse_gate:
                return torch.zeros(shape, dtype=values.dtype).index_put((rows, cols), values)
            # (each row's count by index_add, not bincount: its size is known, so torch.compile keeps one graph)
            counts = torch.zeros(shape[0], dtype=torch.int64).index_add(0, rows, torch.ones_like(rows))
            crow = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
            return torch.sparse_csr_tensor(crow, cols, values, shape, check_invariants=False)

        def gates(self, x):
            """The (tokens x experts) gate tensor ``G``: sparse CSR (k entries a row) or dense with zeros."""
            index, weights = self.route(x)
            tokens = torch.arange(x.shape[0]).repeat_interleave(self.top_k)
            return self._matrix(tokens, index.reshape(-1), weights.reshape(-1), (x.shape[0], experts))

        def slots(self, x):
            """``(dispatch, combine, C)``: the (experts*C x tokens) 0/1 matrix placing each token in its experts'
            slots, and the (tokens x experts*C) matrix of gate weights at those slots."""
            index, weights = self.route(x)
            expert = index.reshape(-1)                              # token-major: (token 0, choice 0), ...
            onehot = F.one_hot(expert, experts)
            slot = (onehot.cumsum(0) * onehot).sum(1) - 1           # the rank among that expert's tokens
            capacity = _static_capacity(x.shape[0])
            capacity = int(onehot.sum(0).max()) if capacity is None else capacity
            column = expert * capacity + slot
            tokens = torch.arange(x.shape[0]).repeat_interleave(self.top_k)
            n_slots = experts * capacity
            combine = self._matrix(tokens, column, weights.reshape(-1), (x.shape[0], n_slots))
            by_slot = column.argsort()
            dispatch = self._matrix(column[by_slot], tokens[by_slot], torch.ones_like(weights.reshape(-1)),
                                    (n_slots, x.shape[0]))
            return dispatch, combine, capacity

        def loop(self, x):
            """The plain PyTorch peer, no gate tensor: a loop over the experts, each gathering its tokens
            (``index_select``), one matrix product (``torch.mm``: BLAS) and the weighted rows added back into the
            output (``index_add_``), as Mixtral's reference code routes. The experts are taken apart with ``unbind``
            (their gradients stacked once), not indexed one by one: ``self.experts[n]`` would give each expert's
            gradient as a zero-filled tensor of all the experts', summed 16 times, doubling the training step."""
            index, weights = self.route(x)
            expert, w = index.reshape(-1), weights.reshape(-1)
            tokens = torch.arange(x.shape[0]).repeat_interleave(self.top_k)
            y = torch.zeros(x.shape[0], hidden, dtype=x.dtype)
            for n, weight in enumerate(self.experts.unbind(0)):
                pairs = (expert == n).nonzero().squeeze(1)
                at = tokens[pairs]
                y.index_add_(0, at, torch.mm(x.index_select(0, at), weight) * w[pairs, None])
            return y

        def forward(self, x):
            if einsum == "loop":
                return self.loop(x)
            if einsum == "slots":
                dispatch, combine, capacity = self.slots(x)
                xe = torch.einsum("sb,bd->sd", dispatch, x).reshape(experts, capacity, dim)
                ye = torch.einsum("ncd,ndh->nch", xe, self.experts).reshape(experts * capacity, hidden)
                return torch.einsum("bs,sh->bh", combine, ye)
            g = self.gates(x)
            if einsum == "fused":
                return torch.einsum("bn,bd,ndh->bh", g, x, self.experts)
            if einsum == "dispatch":
                return torch.einsum("bnd,ndh->bh", torch.einsum("bn,bd->bnd", g, x), self.experts)
            return torch.einsum("bn,bnh->bh", g, torch.einsum("bd,ndh->bnh", x, self.experts))

    return MoE()
