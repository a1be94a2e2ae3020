"""Matrix factorization with side features, written as ordinary PyTorch against a ``torch`` module passed in
(the real ``torch``, or ``scorch``: ``import scorch as torch``).

    pred(u, i) = <P_u + F_u W_u,  Q_i + G_i W_i> + b_u + b_i + mu

``F`` (users x user-features) and ``G`` (items x item-features) are multi-hot: ``F_u W_u`` is an embedding bag
(the sum of the rows of ``W_u`` at user u's features). The biases ride along in the dot product: the user side
gets the columns ``[b_u, 1]`` and the item side ``[1, b_i]``, so one product per rating gives
``<., .> + b_u + b_i``.

The model takes its inputs in one of two ordinary PyTorch spellings and computes the same numbers with either:

* **sparse** (the scorch backend): ``observed`` is a sparse (users x items) matrix whose pattern holds the
  ratings to predict, and the features are sparse multi-hot matrices. The predictions are an SDDMM,
  ``torch.sparse.sampled_addmm(observed, U, V.T)`` (only the observed entries are computed), and the
  embedding bags are SpMMs, ``torch.sparse.mm(F, W_u)``.
* **indices** (the torch backend): ``observed`` is a ``(users, items)`` pair of index tensors and the features
  are ``(input, offsets)`` pairs: the predictions gather the factor rows, ``(U[users] * V[items]).sum(1)``, and
  the embedding bags are ``nn.EmbeddingBag(mode="sum")``.

Either way ``forward`` returns the predictions at the observed entries as a dense vector, in the pattern's order
(row-major: by user, then item), which is the order the index pairs are given in.
"""


def build(torch, n_users: int, n_items: int, n_user_features: int, n_item_features: int, rank: int,
          mean: float, init_std: float = 0.1):
    nn = torch.nn

    class FactorizationWithFeatures(nn.Module):
        def __init__(self):
            super().__init__()
            self.mean = mean
            self.user_factors = nn.Embedding(n_users, rank)
            self.item_factors = nn.Embedding(n_items, rank)
            self.user_feature_bag = nn.EmbeddingBag(n_user_features, rank, mode="sum")
            self.item_feature_bag = nn.EmbeddingBag(n_item_features, rank, mode="sum")
            self.user_bias = nn.Embedding(n_users, 1)
            self.item_bias = nn.Embedding(n_items, 1)
            for table in (self.user_factors, self.item_factors, self.user_feature_bag, self.item_feature_bag):
                nn.init.normal_(table.weight, std=init_std)
            nn.init.zeros_(self.user_bias.weight)
            nn.init.zeros_(self.item_bias.weight)

        @staticmethod
        def embedding_bag(bag, features):
            """The sum of ``bag``'s rows at each row's features: a sparse multi-hot matrix times the table, or
            ``nn.EmbeddingBag`` on ``(input, offsets)``."""
            if isinstance(features, tuple):
                return bag(*features)
            return torch.sparse.mm(features, bag.weight)

        def factors(self, user_features, item_features):
            """The user and item sides, (users x rank + 2) and (items x rank + 2), biases included."""
            U = self.user_factors.weight + self.embedding_bag(self.user_feature_bag, user_features)
            V = self.item_factors.weight + self.embedding_bag(self.item_feature_bag, item_features)
            ones_u = torch.ones(U.shape[0], 1, dtype=U.dtype)
            ones_v = torch.ones(V.shape[0], 1, dtype=V.dtype)
            U = torch.cat([U, self.user_bias.weight, ones_u], dim=1)
            V = torch.cat([V, ones_v, self.item_bias.weight], dim=1)
            return U, V

        def forward(self, observed, user_features, item_features):
            U, V = self.factors(user_features, item_features)
            if isinstance(observed, tuple):                   # (users, items) index pairs: gather
                users, items = observed
                scores = (U[users] * V[items]).sum(dim=1)
            else:                                             # a sparse pattern: SDDMM
                scores = torch.sparse.sampled_addmm(observed, U, V.T, beta=0.0).values()
            return scores + self.mean

    return FactorizationWithFeatures()
