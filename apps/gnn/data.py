"""Graphs for node classification: Cora / CiteSeer from Planetoid ``.npz`` files, or, asked for by name, a generated
stochastic-block-model graph with label-correlated bag-of-words features of similar size.

A ``Graph`` holds NumPy arrays only; each backend builds its own tensors from them (``apps.gnn.tensors``).
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np


@dataclasses.dataclass
class Graph:
    name: str
    indptr: np.ndarray            # symmetric adjacency, CSR, no self loops, sorted columns
    indices: np.ndarray
    feat_indptr: np.ndarray       # node features, CSR (bag of words)
    feat_indices: np.ndarray
    feat_data: np.ndarray
    num_features: int
    labels: np.ndarray            # int64, -1 for unlabelled nodes
    train_idx: np.ndarray
    val_idx: np.ndarray
    test_idx: np.ndarray

    @property
    def num_nodes(self) -> int:
        return len(self.indptr) - 1

    @property
    def num_edges(self) -> int:
        return len(self.indices)

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1

    def describe(self) -> str:
        return (f"{self.name}: {self.num_nodes} nodes, {self.num_edges} directed edges, {self.num_features} "
                f"features ({len(self.feat_indices)} nonzeros), {self.num_classes} classes, "
                f"{len(self.train_idx)}/{len(self.val_idx)}/{len(self.test_idx)} train/val/test")


def load_planetoid(name: str, root: pathlib.Path) -> Graph:
    """``root/planetoid/<name>.npz`` (or ``root/<name>.npz``), in the format of ``../shared/data/README.md``."""
    for path in (root / "planetoid" / f"{name}.npz", root / f"{name}.npz"):
        if path.is_file():
            break
    else:
        raise FileNotFoundError(_not_found(name, f"no {name}.npz under {str(root)!r} (looked in planetoid/ and the"
                                           " folder itself)"))
    z = np.load(path)
    return Graph(name=name, indptr=z["adj_indptr"].astype(np.int64), indices=z["adj_indices"].astype(np.int64),
                 feat_indptr=z["feat_indptr"].astype(np.int64), feat_indices=z["feat_indices"].astype(np.int64),
                 feat_data=z["feat_data"].astype(np.float32), num_features=int(z["feat_shape"][1]),
                 labels=z["labels"].astype(np.int64), train_idx=z["train_idx"].astype(np.int64),
                 val_idx=z["val_idx"].astype(np.int64), test_idx=z["test_idx"].astype(np.int64))


def _csr(rows: np.ndarray, cols: np.ndarray, n: int):
    """Sorted, duplicate-free CSR arrays of the pairs (rows, cols) in an n x ? matrix."""
    key = np.unique(rows.astype(np.int64) * (np.int64(cols.max(initial=0)) + 1) + cols)
    width = np.int64(cols.max(initial=0)) + 1
    r, c = key // width, key % width
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(r, minlength=n), out=indptr[1:])
    return indptr, c.astype(np.int64)


def generate_sbm(num_nodes: int = 2708, num_classes: int = 7, num_features: int = 1433, avg_degree: float = 4.0,
                 homophily: float = 0.8, words_per_node: int = 18, seed: int = 0, name: str | None = None) -> Graph:
    """A stochastic-block-model graph: each node draws ``avg_degree / 2`` partners, of its own class with
    probability ``homophily``, else uniformly; edges are made symmetric. Each class prefers a tenth of the
    vocabulary: a node's words come from its class's share with probability 0.5, else from anywhere. The split
    is Planetoid's: 20 training nodes per class, 500 validation, 1000 test (scaled down for small graphs)."""
    rng = np.random.default_rng(seed)
    n, c = num_nodes, num_classes
    labels = rng.integers(0, c, n)
    by_class = [np.flatnonzero(labels == k) for k in range(c)]
    draws = max(1, int(round(n * avg_degree / 2)))
    src = rng.integers(0, n, draws)
    same = rng.random(draws) < homophily
    dst = rng.integers(0, n, draws)
    for k in range(c):                                   # same-class partner: uniform within the class
        pick = same & (labels[src] == k)
        if pick.any() and len(by_class[k]):
            dst[pick] = by_class[k][rng.integers(0, len(by_class[k]), int(pick.sum()))]
    keep = src != dst
    src, dst = src[keep], dst[keep]
    indptr, indices = _csr(np.concatenate([src, dst]), np.concatenate([dst, src]), n)

    share = max(1, num_features // 10)
    words = np.minimum(rng.poisson(words_per_node, n) + 1, num_features)
    rows = np.repeat(np.arange(n), words)
    own = rng.random(len(rows)) < 0.5
    offsets = (labels[rows] * share) % max(1, num_features - share + 1)
    cols = np.where(own, offsets + rng.integers(0, share, len(rows)), rng.integers(0, num_features, len(rows)))
    feat_indptr, feat_indices = _csr(rows, cols, n)

    order = rng.permutation(n)
    per_class = 20 if n >= 40 * c else max(1, n // (4 * c))
    train = np.concatenate([order[labels[order] == k][:per_class] for k in range(c)])
    rest = np.setdiff1d(order, train, assume_unique=True)
    rest = rest[rng.permutation(len(rest))]
    n_val, n_test = min(500, len(rest) // 3), min(1000, len(rest) // 3)
    return Graph(name=name or f"sbm-{n}", indptr=indptr, indices=indices, feat_indptr=feat_indptr,
                 feat_indices=feat_indices, feat_data=np.ones(len(feat_indices), dtype=np.float32),
                 num_features=num_features, labels=labels.astype(np.int64), train_idx=np.sort(train),
                 val_idx=np.sort(rest[:n_val]), test_idx=np.sort(rest[n_val:n_val + n_test]))


#: Planetoid's data sets by name, and the sizes of their generated stand-ins (``sbm-like-<name>``)
PLANETOID = {"cora": dict(num_nodes=2708, num_classes=7, num_features=1433, avg_degree=3.9),
             "citeseer": dict(num_nodes=3327, num_classes=6, num_features=3703, avg_degree=2.7, words_per_node=31)}


def _not_found(name: str, where: str) -> str:
    return (f"data set {name!r} not found: {where}. Point at the folder that holds planetoid/{name}.npz with --data DIR"
            " or the SCORCH_DATA environment variable (../shared/data/README.md describes the files); for a generated"
            f" graph of the same size instead, ask for it by name: --dataset sbm-like-{name}")


def dataset(name: str, root: pathlib.Path | None, seed: int = 0) -> Graph:
    """``cora`` / ``citeseer`` from ``root`` (a ``FileNotFoundError`` saying how to point at them when ``root`` is None
    or lacks them: a named data set is never replaced silently), or a generated graph, only by its own name:
    ``sbm-like-cora`` / ``sbm-like-citeseer`` (a stand-in of the same size), ``sbm`` (Cora-sized) or ``sbm-<nodes>``
    (e.g. ``sbm-100000``)."""
    if name in PLANETOID:
        if root is None:
            # (a generated stand-in trained under the name "cora" reported 0.97 test accuracy, where Cora gives 0.83)
            raise FileNotFoundError(_not_found(name, "no data folder was given (--data, SCORCH_DATA) and there is no"
                                               " ../shared/data beside the checkout"))
        return load_planetoid(name, root)
    if name.startswith("sbm-like-") and name[len("sbm-like-"):] in PLANETOID:
        return generate_sbm(**PLANETOID[name[len("sbm-like-"):]], seed=seed, name=name)
    if name == "sbm":
        return generate_sbm(seed=seed)
    if name.startswith("sbm-") and name[4:].isdigit():
        n = int(name[4:])
        return generate_sbm(num_nodes=n, num_classes=10, num_features=500, avg_degree=10.0, words_per_node=10,
                            seed=seed)
    raise ValueError(f"unknown data set {name!r}: choose cora, citeseer (Planetoid's, from --data), sbm-like-cora,"
                     " sbm-like-citeseer, sbm or sbm-<nodes> (generated)")
