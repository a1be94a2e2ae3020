"""The sparse linear layer (issue 6's target): ``F.linear(x, W, b)`` with a 90%-sparse ``n x n`` weight in CSR
(unstructured, magnitude-pruned) and BSR (block-pruned), forward and forward + backward, against the dense
``nn.Linear`` and torch.sparse, in one process.

Each format has its own pattern (unstructured or whole blocks kept), so each peer is checked against a dense
layer holding *its* masked weight; the dense layer's time does not depend on the mask. Forward + backward
runs ``y = layer(x); y.backward(g)`` with ``x`` and the weight requiring gradients, and returns ``x.grad``;
the weight's gradient is checked once, outside the timed calls, against the dense gradient on the pattern.
"""
from __future__ import annotations

import torch

import scorch

from . import data
from .cases import Config, _ratio_target, relative_error, run_peers, TOLERANCE
from .timing import Table

DENSE = "dense nn.Linear"
SPARSITY = 0.9
FORMATS = ("csr", "bsr(16, 16)", "bsr(32, 32)")


def _scorch_name(fmt):
    return f"scorch {fmt}"


def size(cfg: Config) -> tuple[int, tuple]:
    """The layer's width and the batch sizes."""
    return (1024, (64,)) if cfg.quick else (4096, (64, 256, 512))


def masked_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """``w`` with the 90% smallest entries (csr) or blocks (bsr) zeroed."""
    if fmt == "csr":
        keep = scorch.nn.ScalarFraction(SPARSITY).mask(w)
    else:
        b = scorch.formats.named.block_size(scorch.formats.named.resolve(fmt))
        keep = scorch.nn.BlockFraction(SPARSITY, b).mask(w)
    return w * keep


def bert_shapes(cfg: Config) -> list:
    """``(out, in, tokens)`` of the BERT-base feed-forward Linears at 8 x 128 tokens (issue 43's one-layer target:
    forward >= 4x dense, forward + backward >= 3x); a smaller pair in the quick run."""
    return [(768, 192, 128), (192, 768, 128)] if cfg.quick else [(3072, 768, 1024), (768, 3072, 1024)]


def linear_layer(cfg: Config, n: int, batch: int, backward: bool, n_in: int = None, goals=(3.0, 2.0),
                 targeted: bool = None) -> Table:
    """``F.linear`` with an ``n x n_in`` weight (square by default) at ``batch`` tokens; ``goals``: the forward and
    forward + backward speedups over dense asked for, checked where ``targeted`` (default: the issue's 4096)."""
    n_in = n if n_in is None else n_in
    mode = "forward + backward" if backward else "forward"
    t = Table("linear", f"Sparse linear layer, {n_in} -> {n}, batch {batch}, {mode}",
              f"F.linear(x, W, bias): W {n} x {n_in} float32 at {SPARSITY:.0%} sparsity, x {batch} x {n_in}; "
              + ("y.backward(g) with x and W requiring gradients" if backward else "no gradients"))
    torch.manual_seed(0)
    w = torch.randn(n, n_in) / n_in ** 0.5
    bias = torch.randn(n)
    x = data.dense((batch, n_in), seed=90 + batch).requires_grad_(backward)
    g = data.dense((batch, n), seed=91 + batch)
    masked = {fmt: masked_weight(w, fmt) for fmt in FORMATS}
    sparse = {fmt: torch.nn.Parameter(scorch.asformat(masked[fmt], fmt), requires_grad=backward) for fmt in FORMATS}
    torch_csr = masked["csr"].to_sparse_csr().requires_grad_(backward)
    torch_bsr = masked["bsr(16, 16)"].to_sparse_bsr((16, 16)).requires_grad_(backward)
    dense_w = {fmt: masked[fmt].clone().requires_grad_(backward) for fmt in FORMATS}

    def call(f, wt):
        if not backward:
            with torch.no_grad():
                return f(x, wt)
        x.grad = None
        y = f(x, wt)
        y.backward(g)
        return x.grad

    linear = (lambda x_, wt: torch.nn.functional.linear(x_, wt, bias))
    by_torch = (lambda x_, wt: torch.sparse.mm(wt, x_.t()).t() + bias)
    peers = {DENSE: lambda: call(linear, dense_w["csr"])}
    peers.update({_scorch_name(fmt): (lambda fmt=fmt: call(linear, sparse[fmt])) for fmt in FORMATS})
    peers["torch.sparse CSR"] = lambda: call(by_torch, torch_csr)
    peers["torch.sparse BSR 16x16"] = lambda: call(by_torch, torch_bsr)
    refs = {_scorch_name(fmt): (lambda fmt=fmt: call(linear, dense_w[fmt])) for fmt in FORMATS}
    refs["torch.sparse BSR 16x16"] = lambda: call(linear, dense_w["bsr(16, 16)"])
    t.scorch, t.torch = _scorch_name("bsr(16, 16)"), DENSE
    run_peers(t, peers, DENSE, cfg, refs)
    if backward:  # the weight's gradient: the dense one on the pattern
        errs = []
        for fmt in FORMATS:
            for p in (sparse[fmt], dense_w[fmt]):
                p.grad = None
            call(linear, sparse[fmt])
            call(linear, dense_w[fmt])
            got = sparse[fmt].grad.to_dense()
            err = relative_error(got, dense_w[fmt].grad * (got != 0))
            if err > TOLERANCE:
                raise AssertionError(f"scorch {fmt}: the weight's gradient is wrong (relative error {err:.1e})")
            errs.append(f"{fmt}: {err:.1e}")
        t.notes.append("Weight gradient checked against the dense gradient on the pattern: " + "; ".join(errs) + ".")
    goal = goals[1] if backward else goals[0]
    for fmt in FORMATS if (n >= 4096 if targeted is None else targeted) else ():  # (the quick run's are smaller)
        t.targets.append(_ratio_target(t, f"scorch {fmt} >= {goal:g}x faster than dense nn.Linear ({mode})", goal,
                                       DENSE, _scorch_name(fmt)))
    dense_bytes = n * n_in * 4
    stored = {fmt: scorch.nn.storage_bytes(sparse[fmt]) for fmt in FORMATS}
    t.notes.append(f"Weight bytes: dense {dense_bytes / 1e6:.1f} MB; " + "; ".join(
        f"{fmt} {b / 1e6:.1f} MB ({dense_bytes / b:.1f}x less)" for fmt, b in stored.items()) + ".")
    return t


#: relative error a bfloat16 result may have against the float32 product of the same (bfloat16) operands: one
#: rounding of each result, 8 bits
BF16_TOLERANCE = 1e-2
BF16_DENSE = "dense nn.Linear, bf16"


def bf16_layer(cfg: Config, n: int, n_in: int, batch: int) -> Table:
    """``F.linear`` in bfloat16 at BERT shapes, forward (issue 43: bsr(16, 16) 90% >= 2x the dense bfloat16
    Linear, which runs on the CPU's bfloat16 instructions (AMX where it has them); 90% unstructured in bfloat16
    faster than in float32). Every peer is checked against the float32 product of its own bfloat16 operands."""
    t = Table("linear", f"bfloat16 linear layer, {n_in} -> {n}, batch {batch}, forward",
              f"F.linear(x, W, bias) with W {n} x {n_in} and x {batch} x {n_in} in bfloat16 (90% sparse: csr "
              "unstructured, bsr(16, 16) whole blocks), against the dense bfloat16 Linear and the same csr weight "
              "in float32; no gradients")
    torch.manual_seed(0)
    w = torch.randn(n, n_in) / n_in ** 0.5
    bias = torch.randn(n).bfloat16()
    x = data.dense((batch, n_in), seed=92 + batch).bfloat16()
    masked = {fmt: masked_weight(w, fmt).bfloat16() for fmt in ("csr", "bsr(16, 16)")}
    sparse = {fmt: scorch.asformat(m, fmt) for fmt, m in masked.items()}
    csr32 = scorch.asformat(masked["csr"].float(), "csr")
    dense = masked["csr"].clone()

    def f(xx, ww, bb):
        with torch.no_grad():
            return torch.nn.functional.linear(xx, ww, bb)

    def ref(ww):  # (the float32 product of the bfloat16 operands)
        return lambda: f(x.float(), ww.float(), bias.float())
    names = {fmt: f"scorch {fmt} 90%, bf16" for fmt in sparse}
    csr32_name = "scorch csr 90%, fp32"
    peers = {BF16_DENSE: lambda: f(x, dense, bias)}
    peers.update({names[fmt]: (lambda fmt=fmt: f(x, sparse[fmt], bias)) for fmt in sparse})
    peers[csr32_name] = lambda: f(x.float(), csr32, bias.float())
    refs = {names[fmt]: ref(masked[fmt]) for fmt in sparse}
    refs[csr32_name] = ref(masked["csr"])
    t.scorch, t.torch = names["bsr(16, 16)"], BF16_DENSE
    run_peers(t, peers, BF16_DENSE, cfg, refs, tolerances={name: BF16_TOLERANCE for name in peers})
    if not cfg.quick:
        t.targets.append(_ratio_target(t, f"{names['bsr(16, 16)']} >= 2x faster than the dense bf16 Linear", 2.0,
                                       BF16_DENSE, names["bsr(16, 16)"]))
        t.targets.append(_ratio_target(t, f"{names['csr']} faster than {csr32_name}", 1.0, csr32_name, names["csr"]))
    return t
