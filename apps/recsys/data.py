"""Ratings and multi-hot side features for the recommender: MovieLens-100k, or a generated stand-in.

Sources, in order: ``--data DIR`` (the ML-100k files in ``DIR/ml-100k/`` or ``DIR`` itself), ``$SCORCH_DATA`` or
``../shared/data`` when they hold ML-100k, the copy bundled with the ``recbole`` package (located without
importing it: its dependencies need not be installed), else a generated ratings matrix of the same shape and
density (low rank + noise, ratings 1..5) with random multi-hot features, so that the app always runs.

Everything here is plain ``torch`` on index arrays; the backends turn the arrays into their own operands
(``apps/recsys/__init__.py``). Ratings are sorted by (user, item): row-major order, the order of a CSR pattern's
stored entries, so a backend's predictions on a pattern and on index pairs line up entry by entry.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import torch

from .. import common

FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
# ML-1M's age groups, applied to ML-100k's exact ages
AGE_EDGES = (18, 25, 35, 45, 50, 56)


@dataclasses.dataclass
class Ratings:
    """Observed (user, item, rating) triples, sorted by (user, item)."""
    users: torch.Tensor     # int64 (nnz,)
    items: torch.Tensor     # int64 (nnz,)
    ratings: torch.Tensor   # float32 (nnz,)

    def __len__(self):
        return self.users.numel()

    def crow(self, n_rows: int) -> torch.Tensor:
        """CSR row pointers of the (users x items) pattern."""
        counts = torch.bincount(self.users, minlength=n_rows)
        return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])


@dataclasses.dataclass
class MultiHot:
    """A multi-hot (rows x features) 0/1 matrix in CSR arrays: ``crow`` (rows + 1,) and ``col`` (nnz,).
    They are exactly ``nn.EmbeddingBag``'s ``offsets`` (``crow[:-1]``) and ``input`` (``col``)."""
    crow: torch.Tensor
    col: torch.Tensor
    names: list

    @property
    def shape(self):
        return (self.crow.numel() - 1, len(self.names))


@dataclasses.dataclass
class Dataset:
    source: str
    n_users: int
    n_items: int
    train: Ratings
    test: Ratings
    user_features: MultiHot
    item_features: MultiHot


# --- locating and reading ML-100k --------------------------------------------------------------------------

def recbole_dir() -> pathlib.Path | None:
    """``recbole``'s bundled ``dataset_example/ml-100k``, found without importing recbole."""
    try:
        spec = importlib.util.find_spec("recbole")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "dataset_example" / "ml-100k"
    return path if _has_files(path) else None


def _has_files(path: pathlib.Path) -> bool:
    return all((path / f).is_file() for f in FILES)


def _ml100k_in(folder: pathlib.Path) -> pathlib.Path | None:
    for path in (folder / "ml-100k", folder):
        if _has_files(path):
            return path
    return None


def locate(data: str | None) -> pathlib.Path | None:
    """The ML-100k folder to read, or None (generate). An explicit ``data`` folder must hold the files."""
    if data:
        root = common.data_root(data)
        found = _ml100k_in(root)
        if found is None:
            raise FileNotFoundError(f"no ML-100k files ({', '.join(FILES)}) in {str(root)!r} or its ml-100k/")
        return found
    root = common.data_root(None)          # $SCORCH_DATA or ../shared/data, when they exist
    if root is not None and _ml100k_in(root) is not None:
        return _ml100k_in(root)
    return recbole_dir()


def _rows(path: pathlib.Path):
    """The tab-separated rows of an atomic file, after its ``name:type`` header."""
    with open(path, encoding="utf-8", errors="replace") as f:
        next(f)
        for line in f:
            line = line.rstrip("\n")
            if line:
                yield line.split("\t")


def _vocab(tokens) -> dict:
    return {t: k for k, t in enumerate(sorted(set(tokens)))}


def _multihot(per_row: list, names: list) -> MultiHot:
    """Rows of feature indices -> CSR arrays (columns sorted within a row, each once)."""
    cols = [sorted(set(r)) for r in per_row]
    crow = torch.tensor([0] + [len(c) for c in cols], dtype=torch.int64).cumsum(0)
    col = torch.tensor([k for c in cols for k in c], dtype=torch.int64)
    return MultiHot(crow, col, names)


def _age_bucket(age: str) -> str:
    try:
        a = int(age)
    except ValueError:
        return "age:unknown"
    lo = 0
    for edge in AGE_EDGES:
        if a < edge:
            return f"age:{lo}-{edge - 1}"
        lo = edge
    return f"age:{lo}+"


def _decade(year: str) -> str:
    return f"decade:{year[:3]}0s" if year.isdigit() and len(year) == 4 else "decade:unknown"


def read_ml100k(path: pathlib.Path):
    """(n_users, n_items, users, items, ratings, user_features, item_features) from the atomic files."""
    user_rows = list(_rows(path / "ml-100k.user"))
    item_rows = list(_rows(path / "ml-100k.item"))
    user_ids = {r[0]: k for k, r in enumerate(sorted(user_rows, key=lambda r: int(r[0])))}
    item_ids = {r[0]: k for k, r in enumerate(sorted(item_rows, key=lambda r: int(r[0])))}

    # users: age group, gender, occupation (one of each)
    user_tokens = [None] * len(user_ids)
    for r in user_rows:
        user_tokens[user_ids[r[0]]] = [_age_bucket(r[1]), f"gender:{r[2]}", f"occupation:{r[3]}"]
    uvocab = _vocab(t for toks in user_tokens for t in toks)
    ufeat = _multihot([[uvocab[t] for t in toks] for toks in user_tokens], list(uvocab))

    # items: genres (space-separated) and release decade
    item_tokens = [None] * len(item_ids)
    for r in item_rows:
        genres = r[3].split() if len(r) > 3 else []
        item_tokens[item_ids[r[0]]] = [f"genre:{g}" for g in genres] + [_decade(r[2] if len(r) > 2 else "")]
    ivocab = _vocab(t for toks in item_tokens for t in toks)
    ifeat = _multihot([[ivocab[t] for t in toks] for toks in item_tokens], list(ivocab))

    users, items, ratings = [], [], []
    for r in _rows(path / "ml-100k.inter"):
        users.append(user_ids[r[0]])
        items.append(item_ids[r[1]])
        ratings.append(float(r[2]))
    return (len(user_ids), len(item_ids), torch.tensor(users), torch.tensor(items),
            torch.tensor(ratings, dtype=torch.float32), ufeat, ifeat)


# --- generated data ----------------------------------------------------------------------------------------

def generate(n_users: int, n_items: int, n_ratings: int, seed: int = 0, rank: int = 8):
    """A low-rank-plus-noise ratings matrix with ``n_ratings`` observed entries (items drawn with a long-tailed
    popularity, as in real ratings), ratings rounded into 1..5, and random multi-hot features (users: one age
    group, gender and occupation; items: 1-3 genres and a decade) that shift the latent factors."""
    if n_ratings > n_users * n_items:
        raise ValueError(f"{n_ratings} ratings do not fit a {n_users} x {n_items} matrix")
    g = torch.Generator().manual_seed(seed + 12345)
    # features: user (7 ages, 2 genders, 21 occupations), item (19 genres, 8 decades)
    ages, genders, occs, genres, decades = 7, 2, 21, 19, 8
    u_age = torch.randint(ages, (n_users,), generator=g)
    u_gen = torch.randint(genders, (n_users,), generator=g)
    u_occ = torch.randint(occs, (n_users,), generator=g)
    user_rows = [[int(a), ages + int(s), ages + genders + int(o)] for a, s, o in zip(u_age, u_gen, u_occ)]
    unames = [f"age:{k}" for k in range(ages)] + [f"gender:{k}" for k in range(genders)] + \
             [f"occupation:{k}" for k in range(occs)]
    n_gen = torch.randint(1, 4, (n_items,), generator=g)
    i_dec = torch.randint(decades, (n_items,), generator=g)
    item_rows = []
    for k in range(n_items):
        gs = torch.randperm(genres, generator=g)[: int(n_gen[k])].tolist()
        item_rows.append(gs + [genres + int(i_dec[k])])
    inames = [f"genre:{k}" for k in range(genres)] + [f"decade:{k}" for k in range(decades)]
    ufeat, ifeat = _multihot(user_rows, unames), _multihot(item_rows, inames)

    # latent factors: a per-feature part plus a per-row part
    def factors(feat: MultiHot, n: int):
        table = torch.randn(len(feat.names), rank, generator=g) * 0.5
        rows = torch.repeat_interleave(torch.arange(n), feat.crow.diff())
        from_features = torch.zeros(n, rank).index_add_(0, rows, table[feat.col])
        return from_features + torch.randn(n, rank, generator=g) * 0.7

    P, Q = factors(ufeat, n_users), factors(ifeat, n_items)
    # observed entries: distinct (user, item) pairs, items by a long-tailed popularity
    popularity = 1.0 / torch.arange(1, n_items + 1, dtype=torch.float64) ** 0.8
    popularity = popularity[torch.randperm(n_items, generator=g)]
    seen = torch.empty(0, dtype=torch.int64)
    while seen.numel() < n_ratings:
        want = 2 * (n_ratings - seen.numel()) + 16
        u = torch.randint(n_users, (want,), generator=g)
        i = torch.multinomial(popularity, want, replacement=True, generator=g)
        key = torch.cat([seen, u * n_items + i])
        _, first = _unique_first(key)
        seen = key[first]
    seen = seen[:n_ratings]
    users, items = seen // n_items, seen % n_items
    score = (P[users] * Q[items]).sum(1) / rank ** 0.5
    score = score + 0.3 * torch.randn(n_users, generator=g)[users] + 0.3 * torch.randn(n_items, generator=g)[items]
    score = score + 0.5 * torch.randn(n_ratings, generator=g)
    score = 3.5 + 1.1 * (score - score.mean()) / score.std()
    ratings = score.round().clamp(1, 5).to(torch.float32)
    return n_users, n_items, users, items, ratings, ufeat, ifeat


def _unique_first(key: torch.Tensor):
    """The distinct values of ``key`` and the position of each one's first occurrence (order kept)."""
    uniq, inverse = torch.unique(key, return_inverse=True)
    first = torch.full((uniq.numel(),), key.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(key.numel()), reduce="amin")
    return uniq, first.sort().values


# --- the dataset -------------------------------------------------------------------------------------------

def _sorted(users, items, ratings, n_items) -> Ratings:
    order = torch.argsort(users * n_items + items)
    return Ratings(users[order].contiguous(), items[order].contiguous(), ratings[order].contiguous())


def load(data: str | None = None, *, generated: bool = False, users: int = 943, items: int = 1682,
         ratings: int = 100_000, test_fraction: float = 0.1, seed: int = 0) -> Dataset:
    """The ratings split into train and test (a seeded random ``test_fraction``), and the side features."""
    path = None if generated else locate(data)
    if path is None:
        source = f"generated: {users} users, {items} items, {ratings} ratings"
        n_users, n_items, u, i, r, ufeat, ifeat = generate(users, items, ratings, seed=seed)
    else:
        source = f"ml-100k ({path})"
        n_users, n_items, u, i, r, ufeat, ifeat = read_ml100k(path)
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    perm = torch.randperm(u.numel(), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * u.numel()))
    test, train = perm[:n_test], perm[n_test:]
    return Dataset(source, n_users, n_items,
                   _sorted(u[train], i[train], r[train], n_items),
                   _sorted(u[test], i[test], r[test], n_items), ufeat, ifeat)
