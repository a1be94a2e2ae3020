"""The demo behind the README's main command: one matrix in many formats, and zero-copy torch interop.

    python -m scorch.demo [--size 6x10] [--density 0.3] [--seed 0]
"""
from __future__ import annotations

import argparse

import torch

import scorch

FORMATS = ["coo", "csr", "csc", "dcsr", "ell", "dia", "bsr(2, 3)",
           "(i, j) -> (i + j : compressed, i : dense)",
           "(i, j) -> (i / 2 : dense, j / 5 : compressed, i % 2 : dense, j % 5 : dense)"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="6x10", help="rows x cols of the demo matrix")
    p.add_argument("--density", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rows, cols = (int(n) for n in a.size.lower().split("x"))
    g = torch.Generator().manual_seed(a.seed)
    x = torch.randn(rows, cols, generator=g) * (torch.rand(rows, cols, generator=g) < a.density)
    print(f"A dense {rows}x{cols} matrix with {int((x != 0).sum())} nonzeros, stored in {len(FORMATS)} formats.")
    print("In the pictures '#' is a stored nonzero, '0' a stored zero (block or diagonal padding), '.' nothing.\n")
    for spec in FORMATS:
        s = scorch.asformat(x, spec)
        assert torch.equal(s.to_dense(), x), spec
        print(f"--- {spec}\n    {s.format}")
        print("    arrays:", ", ".join(f"L{k}.{n}={a.tolist()}" for k, st in enumerate(s.levels)
                                       for n, a in st.arrays().items()) or "(none)")
        print(s, "\n")
    t = x.to_sparse_csr()
    s = scorch.from_torch(t)
    same = s.levels[1].crd.data_ptr() == t.col_indices().data_ptr() and s.values().data_ptr() == t.values().data_ptr()
    back = s.to_torch()
    print(f"torch CSR -> scorch -> torch: arrays shared: {same}, round trip shares values:"
          f" {back.values().data_ptr() == t.values().data_ptr()}")
    print("every format converted back to the same dense matrix: yes\n")

    # ops on sparse tensors run through the compiler: one generated, cached C++ kernel each
    X = torch.randn(cols, 4, generator=g)
    Y = torch.randn(rows, 4, generator=g)
    checks = [
        ("S @ X  (SpMM)", lambda: s @ X, x @ X),
        ("sampled_addmm(S, Y, X.T)  (SDDMM)", lambda: torch.sparse.sampled_addmm(s, Y, X.T), x + (Y @ X.T) * (x != 0)),
        ("S + S.relu()", lambda: s + torch.relu(s), x + x.relu()),
        ("S.sum(1)", lambda: s.sum(1), x.sum(1)),
        ("einsum('ij,jk,kl->il', S, X, X.T @ X)", lambda: scorch.einsum("ij,jk,kl->il", s, X, X.T @ X), x @ X @ (X.T @ X)),
    ]
    for what, fn, expected in checks:
        r = fn()
        got = r.to_dense() if isinstance(r, scorch.SparseTensor) else r
        kind = f"SparseTensor ({r.format.name or r.format})" if isinstance(r, scorch.SparseTensor) else "dense tensor"
        ok = torch.allclose(got, expected, atol=1e-5)
        print(f"{what:42s} -> {kind:24s} matches dense torch: {'yes' if ok else 'NO'}")
    print("\nThe plan and generated kernel for S @ X (scorch.explain):")
    print(scorch.explain("ij,jk->ik", s, X, source=True))


if __name__ == "__main__":
    main()
