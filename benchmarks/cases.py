"""The kernel cases: each builds its inputs, runs every peer once and checks it against the reference, then
times the peers that gave a right answer (interleaved, median after warm-up) into a ``Table``.

A scorch call that raises ``NotImplementedError`` becomes a row saying "not supported yet", so the suite runs
on a compiler that lacks an op and fills the row in once it has it; any other exception is recorded as an
error row. Peers keep running either way.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import scipy.sparse as sp
import torch

import scorch

from . import data, hand, peers
from .timing import Row, Table, Target, Timing, copy_bandwidth, measure

TOLERANCE = 1e-4  # max |got - ref| / max |ref| for float32 results


@dataclass(frozen=True)
class Config:
    quick: bool
    repeat: int
    uniform_n: int
    uniform_density: float
    graph_n: int
    graph_mean: float
    graph_max: int
    spmm_k: tuple
    sddmm_k: int
    chain_k: int
    mttkrp_shape: tuple
    mttkrp_density: float
    mttkrp_rank: int
    budget_s: float       # time budget per table; rounds stop early past it (at least 3 rounds)
    slow_s: float         # a peer whose first call takes longer is timed on one more call only
    tune_rounds: int      # rounds for choosing the fastest hand-kernel variant
    compile_runs: int     # fresh processes for the compile / disk-cache measurements
    min_s: float = 0.0    # a table's rounds go on past ``repeat`` until they took this long (cheap cases) ...
    max_rounds: int = 0   # ... up to this many rounds (``timing.measure``)


FULL = Config(quick=False, repeat=20, uniform_n=20000, uniform_density=1e-3, graph_n=100000, graph_mean=21,
              graph_max=12000, spmm_k=(32, 128), sddmm_k=64, chain_k=32, mttkrp_shape=(200, 200, 200),
              mttkrp_density=1e-3, mttkrp_rank=16, budget_s=40.0, slow_s=3.0, tune_rounds=5, compile_runs=3,
              min_s=2.0, max_rounds=400)
QUICK = Config(quick=True, repeat=5, uniform_n=2000, uniform_density=1e-2, graph_n=10000, graph_mean=21,
               graph_max=1200, spmm_k=(32, 128), sddmm_k=64, chain_k=32, mttkrp_shape=(60, 60, 60),
               mttkrp_density=1e-2, mttkrp_rank=16, budget_s=2.0, slow_s=0.5, tune_rounds=2, compile_runs=1)


class Inputs:
    """The matrices, built on first use and shared by the cases."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._cache = {}

    def _get(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def matrix(self, which: str) -> data.Matrix:
        return {"uniform": self.uniform, "power-law": self.graph}[which]

    @property
    def uniform(self) -> data.Matrix:
        c = self.cfg
        return self._get("uniform", lambda: data.uniform(c.uniform_n, c.uniform_density, seed=0))

    @property
    def uniform2(self) -> data.Matrix:
        c = self.cfg
        return self._get("uniform2", lambda: data.uniform(c.uniform_n, c.uniform_density, seed=1))

    @property
    def graph(self) -> data.Matrix:
        c = self.cfg
        return self._get("graph", lambda: data.power_law(c.graph_n, c.graph_mean, c.graph_max, seed=0))

    def second(self, which: str) -> data.Matrix:
        """A second matrix like ``matrix(which)`` (same sizes and degrees, another pattern: seed 1)."""
        if which == "uniform":
            return self.uniform2
        c = self.cfg
        return self._get("graph2", lambda: data.power_law(c.graph_n, c.graph_mean, c.graph_max, seed=1))

    @property
    def bandwidth(self) -> float:
        """The machine's memory bandwidth (bytes/s, a large copy), measured once per run for the floors."""
        return self._get("bandwidth", lambda: copy_bandwidth((64 if self.cfg.quick else 512) << 20))


# --- checking ----------------------------------------------------------------------------------------------

def comparable(x):
    """A numpy array or scipy CSR matrix with ``x``'s values, from any result type the peers return."""
    converted = peers.comparable(x)  # a GraphBLAS result
    if converted is not None:
        return converted
    if isinstance(x, scorch.SparseTensor):
        if x.dim() == 2:
            try:
                x = x.to_torch()
            except Exception:  # no torch layout for this format: densify (small outputs only)
                return x.to_dense().numpy()
        else:
            return x.to_dense().numpy()
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:  # (NumPy has no bfloat16: its values, exactly, in float32)
            x = x.float()
        if x.layout == torch.strided:
            return x.detach().numpy()
        if x.layout == torch.sparse_csr:
            return sp.csr_matrix((x.values().numpy(), x.col_indices().numpy(), x.crow_indices().numpy()),
                                 shape=tuple(x.shape))
        if x.layout == torch.sparse_coo and x.dim() == 2:
            x = x.coalesce()
            i = x.indices().numpy()
            return sp.csr_matrix((x.values().numpy(), (i[0], i[1])), shape=tuple(x.shape))
        return x.to_dense().numpy()
    if sp.issparse(x):
        return x.tocsr()
    if hasattr(x, "todense") and not isinstance(x, np.ndarray):  # pydata sparse
        return np.asarray(x.todense())
    return np.asarray(x)


def relative_error(got, ref) -> float:
    g, r = comparable(got), comparable(ref)
    if tuple(g.shape) != tuple(r.shape):
        raise AssertionError(f"shape {tuple(g.shape)} != reference shape {tuple(r.shape)}")
    if sp.issparse(g) or sp.issparse(r):
        g, r = sp.csr_matrix(g), sp.csr_matrix(r)
        diff, scale = abs(g - r).max(), abs(r).max()
    else:
        diff, scale = np.abs(g - r).max(initial=0.0), np.abs(r).max(initial=0.0)
    return float(diff) / max(float(scale), 1e-30)


def _status(e: Exception) -> str:
    msg = " ".join(str(e).split())
    if len(msg) > 160:
        msg = msg[:157] + "..."
    if isinstance(e, NotImplementedError):
        return f"not supported yet ({msg})"
    if isinstance(e, peers.NotInstalled):
        return f"not installed ({msg})"
    return f"error: {type(e).__name__}: {msg}"


def run_peers(table: Table, peers: dict[str, Callable], reference: str, cfg: Config,
              refs: dict[str, Callable] | None = None, tolerances: dict[str, float] | None = None,
              compiles: frozenset = frozenset()) -> None:
    """Call each peer once (the first warm-up call: scorch compiles here), check it against the result of
    ``reference`` (or of ``refs[name]()`` where given: a peer that computes something else) within ``TOLERANCE``
    (or ``tolerances[name]``: a 16-bit peer), then time the peers that ran and were right. A peer whose first
    call took over ``cfg.slow_s`` is timed on one more call instead of the rounds; for the peers named in
    ``compiles`` (a ``torch.compile``d model: its first call is the graph's compilation) the second call decides.
    Rows are added to ``table`` in the order of ``peers``."""
    results, status, slow = {}, {}, set()
    for name, fn in peers.items():
        try:
            t0 = time.perf_counter()
            results[name] = fn()
            if name in compiles:
                t0 = time.perf_counter()
                results[name] = fn()
            if time.perf_counter() - t0 > cfg.slow_s:
                slow.add(name)
        except Exception as e:  # noqa: BLE001  (any failure of one peer becomes its row's status)
            status[name] = _status(e)
    if reference not in results:
        raise RuntimeError(f"the reference {reference!r} failed: {status.get(reference)}")
    checks = []
    for name in list(results):
        if name == reference:
            continue
        try:
            ref = refs[name]() if refs and name in refs else results[reference]
            err = relative_error(results[name], ref)
        except Exception as e:  # noqa: BLE001
            status[name] = f"check failed: {_status(e)}"
            del results[name]
            continue
        tol = (tolerances or {}).get(name, TOLERANCE)
        ok = err <= tol
        checks.append(f"{name}: {err:.1e}{'' if tol == TOLERANCE else f' (tolerance {tol:g})'}"
                      f"{'' if ok else ' (WRONG)'}")
        if not ok:
            status[name] = f"WRONG RESULT: max |diff| / max |ref| = {err:.1e} > {tol:g}"
            del results[name]
    del results
    table.notes.insert(0, f"Checked against {reference} (max |diff| / max |ref|, tolerance {TOLERANCE:g}): "
                          + ("; ".join(checks) or "nothing to check") + ".")
    timings = measure({n: fn for n, fn in peers.items() if n not in status and n not in slow}, cfg.repeat,
                      warmup=1, budget_s=cfg.budget_s, min_s=cfg.min_s, max_rounds=cfg.max_rounds)
    for name in slow - set(status):
        t0 = time.perf_counter()
        peers[name]()
        sec = time.perf_counter() - t0
        timings[name] = Timing(sec, sec, 1)
    if slow - set(status):
        table.notes.append(f"Slow peers (first call over {cfg.slow_s:g} s) were timed on one further call: "
                           + ", ".join(sorted(slow - set(status))) + ".")
    for name in peers:
        table.rows.append(Row(name, timings.get(name), status.get(name, "")))


def _ratio_target(table: Table, text: str, goal: float, num: str, den: str, higher: bool = True) -> Target:
    """A target on ``num``'s median over ``den``'s."""
    t = Target(text, goal, table.ratio(num, den), "x", higher)
    if t.value is None:
        missing = [n for n in (num, den) if table.row(n) is None or table.row(n).timing is None]
        t.why_missing = "; ".join(f"{n}: {table.row(n).status if table.row(n) else 'absent'}" for n in missing)
    return t


# --- anchors and the memory floor ------------------------------------------------------------------------------

def csr_bytes(m) -> int:
    """Bytes of a float32 CSR matrix with int32 indices (a ``data.Matrix`` or scipy matrix)."""
    s = m.scipy if isinstance(m, data.Matrix) else m
    return (s.shape[0] + 1) * 4 + s.nnz * 8


def anchored(t: Table, inputs: Inputs, anchors, floor_bytes: int) -> None:
    """Name the table's anchor rows and set its memory floor: ``floor_bytes`` (what must move at least once:
    the operands read, the result written) over the machine's measured bandwidth."""
    t.anchors = list(anchors)
    t.floor_bytes = floor_bytes
    t.floor_s = floor_bytes / inputs.bandwidth


def anchor_target(t: Table, goal: float) -> Target:
    """scorch's speedup over the fastest anchor that ran."""
    best = t.best_anchor()
    tg = _ratio_target(t, f"scorch >= {goal:g}x faster than the best anchor"
                          f" ({best.name.split()[0] if best else 'none ran'})", goal,
                       best.name if best else t.scorch, t.scorch)
    if best is None:
        tg.value, tg.why_missing = None, "no anchor ran: " + "; ".join(
            f"{n}: {t.row(n).status if t.row(n) else 'absent'}" for n in t.anchors)
    return tg


def floor_target(t: Table, goal: float = 3.0) -> Target:
    """scorch's time over the memory floor (lower is better; 1 would move every byte at copy speed)."""
    s = t.row(t.scorch)
    value = s.timing.median / t.floor_s if s is not None and s.timing is not None and t.floor_s else None
    return Target(f"scorch within {goal:g}x of the memory floor (scorch time / floor time)", goal, value,
                  higher=False, why_missing="" if value is not None else (s.status if s else "no scorch row"))


# --- SpMM ----------------------------------------------------------------------------------------------------

SCORCH_SPMM, TORCH_SPMM, SCIPY_SPMM = "scorch  S @ X", "torch CSR  A @ X", "scipy csr @ ndarray"
SPMM_ANCHORS = (TORCH_SPMM, SCIPY_SPMM, peers.MKL_SPMM, peers.GB_SPMM)


def spmm_bytes(a: data.Matrix, k: int) -> int:
    """SpMM's floor: A once, X (columns x K) once, Y (rows x K) once."""
    m, n = a.torch.shape
    return csr_bytes(a) + (m + n) * k * 4


def spmm(inputs: Inputs, which: str, k: int, variants: dict) -> Table:
    """CSR x dense. ``variants`` collects the median of every hand-kernel variant (for the variants table)."""
    cfg = inputs.cfg
    a = inputs.matrix(which)
    x = data.dense((a.torch.shape[1], k), seed=10 + k)
    xn = x.numpy()
    t = Table("spmm", f"SpMM, {which}, K={k}", f"{a.describe()}; X: {x.shape[0]:,} x {k} float32, Y = A @ X")
    t.scorch, t.torch = SCORCH_SPMM, TORCH_SPMM

    # the yardstick: time every hand variant (and the ablation builds) on this case, keep the fastest candidate
    kernels = {f"hand {n}": f for n, f in hand.spmm_kernels(k).items()}
    kernels.update({f"ablation {n}": f for n, f in hand.ablation_kernels(k).items()})
    ref = a.torch @ x
    calls = {}
    for name, f in kernels.items():
        err = relative_error(f(a.torch, x), ref)
        if err > TOLERANCE:
            raise AssertionError(f"{name} is wrong on {t.title}: relative error {err:.1e}")
        calls[name] = (lambda f=f: f(a.torch, x))
    tuned = measure(calls, cfg.tune_rounds, warmup=1, budget_s=cfg.budget_s / 2, min_rounds=2)
    variants[t.title] = {n: v.median for n, v in tuned.items()}
    best = min((n for n in tuned if n.startswith("hand ")), key=lambda n: tuned[n].median)
    best_fn = kernels[best]
    hand_name = f"hand C++ ({best.split(' ', 1)[1]})"

    calls = {SCORCH_SPMM: lambda: a.scorch @ x, TORCH_SPMM: lambda: a.torch @ x,
             SCIPY_SPMM: lambda: a.scipy @ xn, **peers.spmm(a, xn), hand_name: lambda: best_fn(a.torch, x)}
    run_peers(t, calls, TORCH_SPMM, cfg)
    anchored(t, inputs, SPMM_ANCHORS, spmm_bytes(a, k))
    t.targets.append(_ratio_target(t, "scorch >= 2x faster than torch CSR", 2.0, TORCH_SPMM, SCORCH_SPMM))
    t.targets += [anchor_target(t, 2.0), floor_target(t)]
    t.targets.append(_ratio_target(t, "scorch within 1.3x of the hand kernel (scorch time / hand time)", 1.3,
                                   SCORCH_SPMM, hand_name, higher=False))
    hand_vs_torch = t.ratio(TORCH_SPMM, hand_name)
    if hand_vs_torch is not None and hand_vs_torch < 2.0:
        t.notes.append(f"The hand kernel itself is {hand_vs_torch:.2f}x faster than torch CSR here (torch uses MKL): "
                       "2x over torch is beyond this CSR kernel design on this machine.")
    t.notes.append(f"Hand kernel: the fastest of {len([n for n in kernels if n.startswith('hand ')])} variants "
                   f"in a {cfg.tune_rounds}-round trial on this case ({best.split(' ', 1)[1]}); all variants are in"
                   " the SpMM variants table.")
    return t


# --- SDDMM ---------------------------------------------------------------------------------------------------

SCORCH_SDDMM = "scorch  sampled_addmm(S, A, B)"
TORCH_SDDMM = "torch  sampled_addmm(A_csr, A, B)"
SCORCH_SDDMM_EINSUM = "scorch  einsum('ij,ik,kj->ij', S, A, B)"
SCORCH_SDDMM_BT = "scorch  einsum('ij,ik,jk->ij', S, A, Bt)  (B stored transposed)"


def sddmm(inputs: Inputs, which: str = "uniform") -> Table:
    cfg = inputs.cfg
    s, k = inputs.matrix(which), cfg.sddmm_k
    n, m = s.torch.shape
    a, b = data.dense((n, k), seed=20), data.dense((k, m), seed=21)
    bt = b.t().contiguous()
    t = Table("sddmm", f"SDDMM, {which}, K={k}",
              f"{s.describe()}; A: {n:,} x {k}, B: {k} x {m:,}; sampled_addmm = S + (A @ B) at S's nonzeros")
    t.scorch, t.torch = SCORCH_SDDMM, TORCH_SDDMM

    def einsum_ref():  # S * (A @ B) at the nonzeros: torch's sampled product (beta=0) times S's values
        prod = torch.sparse.sampled_addmm(s.torch, a, b, beta=0.0)
        return torch.sparse_csr_tensor(prod.crow_indices(), prod.col_indices(), prod.values() * s.torch.values(),
                                       prod.shape)
    calls = {SCORCH_SDDMM: lambda: torch.sparse.sampled_addmm(s.scorch, a, b),
             TORCH_SDDMM: lambda: torch.sparse.sampled_addmm(s.torch, a, b),
             **peers.sddmm(s, a.numpy(), bt.numpy()),
             SCORCH_SDDMM_EINSUM: lambda: scorch.einsum("ij,ik,kj->ij", s.scorch, a, b),
             SCORCH_SDDMM_BT: lambda: scorch.einsum("ij,ik,jk->ij", s.scorch, a, bt)}
    run_peers(t, calls, TORCH_SDDMM, cfg, refs={SCORCH_SDDMM_EINSUM: einsum_ref, SCORCH_SDDMM_BT: einsum_ref})
    # the floor: S once, A and B once, the result's values written (its pattern is S's)
    anchored(t, inputs, (TORCH_SDDMM, peers.GB_SDDMM), csr_bytes(s) + s.nnz * 4 + (n + m) * k * 4)
    t.targets.append(_ratio_target(t, "scorch sampled_addmm >= 1.5x faster than torch", 1.5, TORCH_SDDMM,
                                   SCORCH_SDDMM))
    t.targets += [anchor_target(t, 2.0), floor_target(t)]
    kernel_only = t.ratio(SCORCH_SDDMM, SCORCH_SDDMM_BT)
    if kernel_only is not None:
        t.notes.append(f"scorch's sampled_addmm takes {kernel_only:.2f}x the time of its einsum kernel alone on a "
                       "transposed B (last row): the rest is the work sampled_addmm does around the kernel "
                       "(scorch/ops/linalg.py).")
    t.notes.append("The einsum rows compute S * (A @ B) at S's nonzeros (the kernel alone, without "
                   "sampled_addmm's scaling and addition of S); they are checked against torch's product times S's"
                   " values. The last row passes B as its transpose, stored row-major, to show the cost of the "
                   "column-order reads of B.")
    return t


# --- SpMV ----------------------------------------------------------------------------------------------------

SCORCH_SPMV, TORCH_SPMV, SCIPY_SPMV = "scorch  S @ v", "torch CSR  A @ v", "scipy csr @ ndarray"


def spmv(inputs: Inputs, which: str) -> Table:
    cfg = inputs.cfg
    a = inputs.matrix(which)
    v = data.dense((a.torch.shape[1],), seed=30)
    vn = v.numpy()
    t = Table("spmv", f"SpMV, {which}", f"{a.describe()}; y = A @ v")
    t.scorch, t.torch = SCORCH_SPMV, TORCH_SPMV
    calls = {SCORCH_SPMV: lambda: a.scorch @ v, TORCH_SPMV: lambda: a.torch @ v, SCIPY_SPMV: lambda: a.scipy @ vn,
             **peers.spmv(a, vn)}
    run_peers(t, calls, TORCH_SPMV, cfg)
    m, n = a.torch.shape
    anchored(t, inputs, (TORCH_SPMV, SCIPY_SPMV, peers.MKL_SPMV, peers.GB_SPMV), csr_bytes(a) + (m + n) * 4)
    t.targets += [anchor_target(t, 1.1), floor_target(t)]
    return t


# --- sparse x sparse -------------------------------------------------------------------------------------------

def spgemm(inputs: Inputs) -> Table:
    cfg = inputs.cfg
    a = inputs.uniform
    t = Table("spgemm", "SpGEMM, uniform, A @ A", f"{a.describe()}; C = A @ A (sparse result)")
    t.scorch, t.torch = "scorch  S @ S", "torch CSR  A @ A"
    calls = {t.scorch: lambda: a.scorch @ a.scorch, t.torch: lambda: a.torch @ a.torch,
             "scipy csr @ csr": lambda: a.scipy @ a.scipy, **peers.spgemm(a)}
    run_peers(t, calls, "scipy csr @ csr", cfg)
    product = a.scipy @ a.scipy
    # the floor: A read once, C written once (a bound no SpGEMM reaches: A's rows are read once per use)
    anchored(t, inputs, (t.torch, "scipy csr @ csr", peers.MKL_SPGEMM, peers.GB_SPGEMM),
             csr_bytes(a) + csr_bytes(product))
    t.targets.append(_ratio_target(t, "scorch faster than scipy", 1.0, "scipy csr @ csr", t.scorch))
    t.targets.append(_ratio_target(t, "scorch >= 1.5x faster than torch CSR @ CSR", 1.5, t.torch, t.scorch))
    t.targets.append(anchor_target(t, 1.2))
    t.notes.append(f"The product has {product.nnz:,} nonzeros.")
    return t


def add_mul(inputs: Inputs, op: str, which: str = "uniform") -> Table:
    cfg = inputs.cfg
    a, b = inputs.matrix(which), inputs.second(which)
    sym = "+" if op == "add" else "*"
    t = Table("addmul", f"sparse {sym} sparse, {which}",
              f"{a.describe()}; B: same size and degrees, another pattern (seed 1); C = A {sym} B")
    t.scorch, t.torch = f"scorch  S1 {sym} S2", f"torch CSR  A {sym} B"
    if op == "add":
        calls = {t.scorch: lambda: a.scorch + b.scorch, t.torch: lambda: a.torch + b.torch,
                 "scipy  A + B": lambda: a.scipy + b.scipy, **peers.add(a, b)}
        reference, result = "scipy  A + B", a.scipy + b.scipy
    else:
        calls = {t.scorch: lambda: a.scorch * b.scorch, t.torch: lambda: a.torch * b.torch,
                 "scipy  A.multiply(B)": lambda: a.scipy.multiply(b.scipy), **peers.mul(a, b)}
        reference, result = "scipy  A.multiply(B)", a.scipy.multiply(b.scipy).tocsr()
    run_peers(t, calls, reference, cfg)
    # the floor: A and B read once, C written once
    anchored(t, inputs, (t.torch, reference, *(n for n in calls if n.startswith("GraphBLAS"))),
             csr_bytes(a) + csr_bytes(b) + csr_bytes(result))
    if op == "add":
        t.targets.append(anchor_target(t, 1.2))
        t.notes.append("MKL has no row here: sparse_dot_mkl does not wrap MKL's sparse + sparse.")
    return t


# --- multi-operand einsum ------------------------------------------------------------------------------------

def chain(inputs: Inputs) -> Table:
    cfg = inputs.cfg
    a, k = inputs.uniform, cfg.chain_k
    n = a.torch.shape[1]
    b, c = data.dense((n, k), seed=40), data.dense((k, k), seed=41)
    t = Table("chain", "einsum 'ij,jk,kl->il', sparse first operand",
              f"{a.describe()}; B: {n:,} x {k}, C: {k} x {k}")
    t.scorch, t.torch = "scorch  einsum('ij,jk,kl->il', S, B, C)", "torch  (A_csr @ B) @ C"
    peers = {t.scorch: lambda: scorch.einsum("ij,jk,kl->il", a.scorch, b, c),
             t.torch: lambda: (a.torch @ b) @ c,
             "scorch  (S @ B) @ C, by hand": lambda: (a.scorch @ b) @ c}
    run_peers(t, peers, t.torch, cfg)
    t.targets.append(_ratio_target(t, "scorch no slower than torch's (A @ B) @ C", 1.0, t.torch, t.scorch))
    return t


# --- MTTKRP ----------------------------------------------------------------------------------------------------

def mttkrp(inputs: Inputs) -> Table:
    import sparse as pydata

    cfg = inputs.cfg
    shape, r = cfg.mttkrp_shape, cfg.mttkrp_rank
    x = data.random_3d(shape, cfg.mttkrp_density, seed=50)
    s = scorch.asformat(x, "csf")
    xp = pydata.COO.from_numpy(x.numpy())
    b, c = data.dense((shape[1], r), seed=51), data.dense((shape[2], r), seed=52)
    bn, cn = b.numpy(), c.numpy()
    eq = "ijk,jr,kr->ir"
    t = Table("mttkrp", f"MTTKRP '{eq}'",
              f"3-d tensor {'x'.join(map(str, shape))}, density {cfg.mttkrp_density:g}, nnz {int(s.values().numel()):,};"
              f" B: {shape[1]} x {r}, C: {shape[2]} x {r}")
    t.scorch, t.torch = "scorch  einsum (csf)", "torch  einsum (dense tensor)"
    peers = {t.scorch: lambda: scorch.einsum(eq, s, b, c),
             "scorch  einsum (csf, format='dense')": lambda: scorch.einsum(eq, s, b, c, format="dense"),
             "pydata sparse.einsum (COO)": lambda: pydata.einsum(eq, xp, bn, cn),
             "pydata sparse.tensordot (COO), then numpy": lambda: _tensordot_mttkrp(pydata, xp, bn, cn),
             t.torch: lambda: torch.einsum(eq, x, b, c)}
    run_peers(t, peers, t.torch, cfg)
    t.notes.append("scorch's default output for this expression is sparse (rows of the result follow the tensor's "
                   "first level: format (i : compressed, r : dense)); the second row asks for a dense result.")
    return t


def _tensordot_mttkrp(pydata, x, b, c):
    """MTTKRP through pydata's tensordot: Y[i, j, r] = sum_k X[i, j, k] C[k, r], then sum_j Y[i, j, r] B[j, r]."""
    y = pydata.tensordot(x, c, axes=([2], [0]))
    y = y.todense() if hasattr(y, "todense") else y
    return np.einsum("ijr,jr->ir", y, b)


def sources_of(explained: str) -> list[str]:
    """The generated sources in ``scorch.explain``'s text: each ``source:`` block, up to the next header line
    (``word(s): ...`` at the start of a line) or the end."""
    return [m.group(1) for m in re.finditer(r"^source:\n(.*?)(?=^[a-z][a-z ]*: |\Z)", explained, flags=re.M | re.S)]


# --- real graphs -----------------------------------------------------------------------------------------------

SCORCH_AGG, PYG_AGG = "scorch  A @ X", "PyG scatter  (messages x[src] * w, summed at dst)"


def real_spmm(inputs: Inputs, name: str, k: int) -> Table:
    """SpMM on a real graph's normalized adjacency: the propagation step of a GCN layer, against torch CSR,
    scipy and PyG's message passing (gather, scale, scatter-add: what GCNConv runs without torch_sparse)."""
    cfg = inputs.cfg
    a = inputs._get(("planetoid", name), lambda: data.planetoid(name))
    if a is None:
        t = Table("real", f"SpMM, {name}, K={k}", "the Planetoid files are not available (../shared/data or "
                  "$SCORCH_DATA): case skipped", kind="measurements")
        return t
    n = a.torch.shape[0]
    x = data.dense((n, k), seed=60 + k)
    t = Table("real", f"SpMM, {name}, K={k}", f"{a.describe()}; X: {n:,} x {k}, Y = A @ X")
    t.scorch, t.torch = SCORCH_AGG, TORCH_SPMM
    dense_a = a.torch.to_dense()
    xn = x.numpy()
    calls = {SCORCH_AGG: lambda: a.scorch @ x, TORCH_SPMM: lambda: a.torch @ x, SCIPY_SPMM: lambda: a.scipy @ xn,
             **peers.spmm(a, xn), "torch dense  A @ X": lambda: dense_a @ x}
    try:
        from torch_geometric.utils import scatter
        coo = a.torch.to_sparse_coo()
        dst, src = coo.indices()
        w = coo.values()[:, None]
        calls[PYG_AGG] = lambda: scatter(x[src] * w, dst, dim=0, dim_size=n, reduce="sum")
    except ImportError:
        t.notes.append("torch_geometric is not installed: no PyG row.")
    run_peers(t, calls, TORCH_SPMM, cfg)
    anchored(t, inputs, SPMM_ANCHORS, spmm_bytes(a, k))
    t.targets.append(_ratio_target(t, "scorch faster than PyG's message passing", 1.0, PYG_AGG, SCORCH_AGG))
    if name == "cora":
        t.targets.append(anchor_target(t, 1.5))
    t.notes.append("Anchors are the sparse kernels of torch, scipy, MKL and GraphBLAS (not torch's dense matmul, "
                   "nor PyG). The whole graph fits in cache, so the floor (DRAM bandwidth) is far below any call.")
    return t


# --- SpMM time against nnz ---------------------------------------------------------------------------------------

def spmm_nnz(inputs: Inputs, n: int, densities, k: int = 32) -> Table:
    """SpMM median time against the number of nonzeros (uniform n x n matrices of growing density)."""
    cfg = inputs.cfg
    t = Table("scaling", f"SpMM time against nnz, K={k}", f"uniform {n:,} x {n:,} matrices, densities "
              f"{', '.join(f'{d:g}' for d in densities)}; X: {n:,} x {k}", kind="series")
    t.x_label = "nonzeros"
    t.series = {SCORCH_SPMM: [], TORCH_SPMM: [], SCIPY_SPMM: []}
    for d in densities:
        a = data.uniform(n, d, seed=70)
        x = data.dense((n, k), seed=71)
        ref = a.torch @ x
        if relative_error(a.scorch @ x, ref) > TOLERANCE:
            raise AssertionError(f"scorch SpMM is wrong at density {d:g}")
        timings = measure({SCORCH_SPMM: lambda: a.scorch @ x, TORCH_SPMM: lambda: a.torch @ x,
                           SCIPY_SPMM: lambda: a.scipy @ x.numpy()}, cfg.repeat, warmup=1, budget_s=cfg.budget_s / 4)
        for name, tm in timings.items():
            t.series[name].append((a.nnz, tm.median))
    return t
