"""Timing and the shape of results: peers timed in interleaved rounds, results as tables of rows and targets.

Peers of one case are timed in rounds (one call of each per round, in a new random order every round), so a
burst of load from another process on the machine lands on all of them alike instead of on one peer's block
of runs, and each peer follows every other one about equally often. (The order was rotated at first; a
rotation keeps the cyclic order, so the first peer always ran right after the last one: on Cora, scorch's
SpMM always followed a 29 MB dense product that had just evicted its operands from the cache, 158 us median
against 65 us after the others.) Each peer is called ``warmup`` times first (the first scorch call compiles); the reported figure is
the median of the timed calls, with the minimum beside it.
"""
from __future__ import annotations

import gc
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass(frozen=True)
class Timing:
    median: float  # seconds
    min: float
    runs: int


def measure(peers: dict[str, Callable[[], object]], repeat: int, warmup: int = 2,
            budget_s: Optional[float] = None, min_rounds: int = 3, min_s: float = 0.0,
            max_rounds: Optional[int] = None) -> dict[str, Timing]:
    """Median and minimum time of each zero-argument callable over interleaved rounds: ``repeat`` rounds, and
    more while the rounds so far took under ``min_s`` seconds (up to ``max_rounds``), so that a case of
    sub-millisecond calls gets a median of hundreds of rounds rather than of 20 (one burst of another process's
    work moves a median of 20 rounds of 0.2 ms). With ``budget_s``, rounds stop early once that many seconds
    have passed (never before ``min_rounds``)."""
    names = list(peers)
    order = random.Random(len(names))  # (seeded: a run's orders repeat)
    for name in names:
        for _ in range(warmup):
            peers[name]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    most = max(repeat, max_rounds or repeat)
    start = time.perf_counter()
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(most):
            order.shuffle(names)
            for name in names:
                fn = peers[name]
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
            elapsed = time.perf_counter() - start
            if budget_s is not None and r + 1 >= min_rounds and elapsed > budget_s:
                break
            if r + 1 >= repeat and elapsed >= min_s:
                break
    finally:
        if enabled:
            gc.enable()
    return {n: Timing(statistics.median(s), min(s), len(s)) for n, s in samples.items()}


def copy_bandwidth(nbytes: int, rounds: int = 10) -> float:
    """Memory bandwidth in bytes per second: a torch copy of an ``nbytes`` float32 buffer into another (read and
    write both counted, so 2 * nbytes move), on torch's threads; the fastest of ``rounds`` copies, so the floor it
    gives is the lowest the machine allows."""
    import torch
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - t0)
    return 2 * x.numel() * 4 / best


def per_call(fns: dict[str, Callable[[], object]], batch_s: float, rounds: int) -> dict[str, Timing]:
    """Seconds per call of very fast callables: the median over ``rounds`` batches, each about ``batch_s``
    seconds of calls (the count per callable set from a first estimate), the callables' batches interleaved."""
    calls = {}
    for name, fn in fns.items():
        fn()
        t0, n = time.perf_counter(), 0
        while n < 10 or (time.perf_counter() - t0 < batch_s / 4 and n < 100000):
            fn()
            n += 1
        calls[name] = max(10, int(batch_s / ((time.perf_counter() - t0) / n)))
    batches: dict[str, list[float]] = {n: [] for n in fns}
    gc.collect()
    order, names = random.Random(len(fns)), list(fns)
    for _ in range(rounds):
        order.shuffle(names)  # (as ``measure``: each callable's batch follows every other one alike)
        for name in names:
            fn, n = fns[name], calls[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            batches[name].append((time.perf_counter() - t0) / n)
    return {n: Timing(statistics.median(b), min(b), rounds * calls[n]) for n, b in batches.items()}


# --- results -----------------------------------------------------------------------------------------------

@dataclass
class Row:
    """One implementation in a table: timed, or a ``status`` saying why not ("not supported yet: ...")."""
    name: str
    timing: Optional[Timing] = None
    status: str = ""
    infer: Optional[Timing] = None   # apps: the time of an inference batch (``timing`` is a training epoch)
    metric: str = ""                 # apps: the quality reached ("test accuracy 0.815")


@dataclass
class Target:
    """A goal from the issue. ``value`` is the measured figure in ``unit``; ``higher`` says which way is good."""
    text: str
    goal: float
    value: Optional[float]
    unit: str = "x"
    higher: bool = True
    why_missing: str = ""

    def __post_init__(self):
        # the goal and the text must agree: a text saying "aim 1.5x" over a goal of 1.0 once read "met" at 1.02x
        number = r"(?<![\w.])(\d+(?:\.\d+)?)"
        pattern = number + (r"x\b" if self.unit == "x" else rf" {self.unit}\b")
        said = [float(n) for n in re.findall(pattern, self.text)]
        if said and self.goal not in said:
            raise ValueError(f"target {self.text!r} has the goal {self.goal:g}{self.unit}, which its text does not say")

    @property
    def met(self) -> Optional[bool]:
        if self.value is None:
            return None
        return self.value >= self.goal if self.higher else self.value <= self.goal


@dataclass
class Table:
    """One case: ``rows`` (peers), ``scorch`` (the row ratios are taken against), ``torch`` (the row the
    speedup plot uses), the targets, and notes (checks, sizes, diagnostics)."""
    group: str
    title: str
    setup: str
    kind: str = "ratios"  # "ratios": peers compared with scorch; "measurements": figures of their own;
    #                       "app": an app's backends (training epoch, inference batch, quality), ratios to scorch;
    #                       "series": times against a size (``series``), for a plot
    rows: list = field(default_factory=list)
    scorch: str = ""
    torch: str = ""
    targets: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    series: dict = field(default_factory=dict)  # "series": peer -> [(x, seconds)], x named by ``x_label``
    x_label: str = ""
    anchors: list = field(default_factory=list)  # rows that are anchors (torch, scipy, MKL, GraphBLAS): the
    #                                              fastest of them that ran is the case's best anchor
    floor_s: Optional[float] = None  # the memory floor: bytes that must move / measured copy bandwidth
    floor_bytes: int = 0

    def row(self, name: str) -> Optional[Row]:
        return next((r for r in self.rows if r.name == name), None)

    def ratio(self, name: str, against: Optional[str] = None) -> Optional[float]:
        """``name``'s median over ``against``'s (default: scorch's): how many times faster ``against`` is."""
        a, b = self.row(name), self.row(against or self.scorch)
        if a is None or b is None or a.timing is None or b.timing is None:
            return None
        return a.timing.median / b.timing.median

    def best_anchor(self) -> Optional[Row]:
        """The fastest anchor row that was timed, or None."""
        timed = [r for r in (self.row(n) for n in self.anchors) if r is not None and r.timing is not None]
        return min(timed, key=lambda r: r.timing.median, default=None)

    def infer_ratio(self, name: str) -> Optional[float]:
        """Apps: ``name``'s inference median over scorch's."""
        a, b = self.row(name), self.row(self.scorch)
        if a is None or b is None or a.infer is None or b.infer is None:
            return None
        return a.infer.median / b.infer.median
