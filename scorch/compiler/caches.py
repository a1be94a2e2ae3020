"""One owner for scorch's memo tables: every module-level cache is made here, by name, so that all of them can be
listed (``scorch.cache_info()``) and emptied (``scorch.clear_caches()``) together.

A cache is a dict with a name and a line saying what it maps; its keys are values (equations, operand types,
formats, sizes), never ``id()`` of an object that may die. The compiler's caches (plans, kernels) and the execution
layer's (prepared calls, contraction paths, conversions) register here alike; the loaded libraries stay in
``runtime`` (unloading a shared library a kernel may still run in is not safe), and are listed with the others.
"""
from __future__ import annotations


#: entries a cache holds at most: a new key past that evicts the oldest one (first in, first out; a process that
#: meets ever new signatures, such as sampled subgraphs or varying batch sizes, keeps the recent ones)
LIMIT = 4096


class Cache(dict):
    """A named memo table (a plain dict otherwise, read at dict speed) of at most ``limit`` entries: writing a new
    key into a full cache evicts its oldest entry (``evicted`` counts them). An evicted entry is made again when
    next needed; one copied elsewhere (onto a tensor) stays valid, since eviction changes no entry.
    ``generation`` counts its ``clear()``s: a copy of an entry kept elsewhere is valid while the generation it
    was taken in is the cache's."""

    def __init__(self, name: str, what: str, limit: int = LIMIT):
        super().__init__()
        self.name, self.what, self.limit = name, what, limit
        self.generation = self.evicted = 0

    def __setitem__(self, key, value):
        if len(self) >= self.limit and key not in self:
            del self[next(iter(self))]
            self.evicted += 1
        super().__setitem__(key, value)

    def clear(self):
        self.generation += 1
        super().clear()

    def __repr__(self):
        return f"<cache {self.name}: {len(self)} entries: {self.what}>"


_REGISTRY: dict = {}
_CLEARERS: dict = {}


def cache(name: str, what: str, limit: int = LIMIT) -> Cache:
    """The cache called ``name`` of at most ``limit`` entries (made on first request; the same object after
    that)."""
    c = _REGISTRY.get(name)
    if c is None:
        c = _REGISTRY[name] = Cache(name, what, limit)
    return c


def register(name: str, what: str, size, clear):
    """A memo table kept elsewhere in another shape (an LRU, a weak map): listed by ``size()``, emptied by
    ``clear()``."""
    _CLEARERS[name] = (what, size, clear)


def cache_info() -> dict:
    """``{name: (entries, what it maps)}`` for every cache."""
    info = {name: (len(c), c.what) for name, c in sorted(_REGISTRY.items())}
    info.update({name: (size(), what) for name, (what, size, _) in sorted(_CLEARERS.items())})
    return info


def clear_caches() -> None:
    """Empty every cache: the next call plans, compiles (or loads from the disk cache) and prepares again."""
    for c in _REGISTRY.values():
        c.clear()
    for _, _, clear in _CLEARERS.values():
        clear()
