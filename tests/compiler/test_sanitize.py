"""A subset of the einsum matrix under AddressSanitizer and UndefinedBehaviorSanitizer.

The kernels are built with ``SCORCH_SANITIZE=1`` into a fresh cache, in a subprocess started with
``scorch.compiler.runtime.sanitizer_env()`` (an ASan library cannot be loaded into a process started without
the ASan runtime). The cases are the ones where an index computation is most likely to step outside an array:
partial blocks (bsr/bsc), diagonals that leave the matrix (dia and the DSL diagonal formats), ELL padding,
empty and 1x1 operands, fewer rows than threads. Every result is also compared with torch, in the subprocess.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from test_runtime import OOB  # the kernel that reads one past its buffer

from scorch.compiler import runtime

# Mixed index widths through every compressed constructor, and products with the results and their transposed
# views; shared by the matrix subset and the cache check below. ``values(shape, gen, density)`` as in SCRIPT.
MIXED_WIDTH = textwrap.dedent(r'''
    def mixed_width_checks(values, layouts=("csr", "csc", "bsr", "bsc")):
        import torch, scorch
        gen = torch.Generator().manual_seed(3)
        bad, n = [], 0
        for layout in layouts:
            ctor = f"sparse_{layout}_tensor"
            a = values((6, 4), gen, 0.5)
            convert = getattr(a, f"to_sparse_{layout}")
            t = convert((2, 2)) if layout.startswith("b") else convert()
            pos, crd = ((t.crow_indices(), t.col_indices()) if layout.endswith("r") else
                        (t.ccol_indices(), t.row_indices()))
            for pos_dtype, crd_dtype in ((torch.int64, torch.int32), (torch.int32, torch.int64)):
                s = getattr(scorch, ctor)(pos.to(pos_dtype), crd.to(crd_dtype), t.values(), a.shape,
                                          check_invariants=False)
                x, y = values((4, 3), gen), values((6, 3), gen)
                for r, expected in ((s @ x, a @ x), (s.t() @ y, a.T @ y), (s.to_dense(), a), (s.sum(1), a.sum(1))):
                    n += 1
                    got = r.to_dense() if isinstance(r, scorch.SparseTensor) else r
                    if not (got.shape == expected.shape and torch.allclose(got, expected)):
                        bad.append(f"{ctor} pos {pos_dtype} crd {crd_dtype}")
        # a repeated S @ X and W @ S: from the second call on, the prepared call's direct (C) form, and the
        # operators' C form once a product is kept (engine.direct)
        for shape, density in (((5, 7), 0.5), ((0, 7), 0.5), ((1, 1), 1.0), ((6, 4), 0.0)):
            a = values(shape, gen, density)
            s, x, w = scorch.asformat(a, "csr"), values((shape[1], 3), gen), values((2, shape[0]), gen)
            for _ in range(3):
                n += 2
                if not torch.allclose(s @ x, a @ x):
                    bad.append(f"repeated csr @ dense {shape}")
                if not torch.allclose(w @ s, w @ a):
                    bad.append(f"repeated dense @ csr {shape}")
        return n, bad
''')

SCRIPT = MIXED_WIDTH + textwrap.dedent(r'''
    import concurrent.futures, os, sys
    import torch
    import scorch
    from scorch import engine

    BACKEND = os.environ.get("SCORCH_TEST_BACKEND", "cpp")  # cuda-emulate: the CUDA kernels, run on the CPU

    EXTRA = 3
    # (equation, which operand is sparse, formats)
    CASES = [
        ("ij,j->i", 0, ["csr", "bsr(2, 3)", "dia", "ell", "(i, j) -> (i + j : compressed, j : dense)"]),
        ("ij,jk->ik", 0, ["bsc(2, 2)", "ell", "(i, j) -> (j - i : compressed, j : dense)"]),
        ("ki,ij->kj", 1, ["bsr(2, 3)", "(i, j) -> (j - i : compressed, i : dense)"]),
        ("ij,ik,jk->ij", 0, ["bsr(2, 3)", "dia", "ell"]),
        ("ij->j", 0, ["bsc(2, 2)", "dia"]),
        ("ij->ji", 0, ["bsr(2, 3)"]),
        ("ii->", 0, ["dia"]),
        ("ijk,jr,kr->ir", 0, ["csf", "(i, j, k) -> (k : dense, i : compressed, j : compressed)"]),
        ("ijk->kij", 0, ["coo"]),
    ]
    SHAPES_2D = [((5, 7), 0.5), ((0, 7), 0.5), ((5, 0), 0.5), ((1, 1), 1.0), ((4, 6), 1.0), ((4, 6), 0.0),
                 ((2, 9), 0.7)]
    SHAPES_SQUARE = [((5, 5), 0.5), ((0, 0), 0.5), ((1, 1), 1.0), ((3, 3), 0.0)]
    SHAPES_3D = [((3, 4, 5), 0.4), ((0, 2, 3), 0.5), ((1, 1, 1), 1.0), ((2, 0, 3), 0.5)]


    def values(shape, gen, density=1.0):
        mag = torch.randint(1, 9, shape, generator=gen)
        sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
        return (mag * sign * (torch.rand(shape, generator=gen) < density)).to(torch.float64) / 4


    def close(r, expected):
        got = r.to_dense() if isinstance(r, scorch.SparseTensor) else r
        return tuple(got.shape) == tuple(expected.shape) and torch.allclose(got, expected)


    def run(job):
        eq, sp, fmt = job
        lhs, out = eq.split("->")
        inputs = lhs.split(",")
        shapes = SHAPES_3D if len(inputs[sp]) == 3 else SHAPES_SQUARE if inputs[sp] == "ii" else SHAPES_2D
        bad = []
        for k, (shape, density) in enumerate(shapes):
            gen = torch.Generator().manual_seed(k)
            a = values(shape, gen, density)
            sizes = dict(zip(inputs[sp], shape))
            ops = [scorch.asformat(a, fmt) if i == sp else values(tuple(sizes.get(c, EXTRA) for c in t), gen)
                   for i, t in enumerate(inputs)]
            dense = [a if i == sp else x for i, x in enumerate(ops)]
            r = scorch.einsum(eq, *ops) if BACKEND == "cpp" else engine.einsum(eq, *ops, backend=BACKEND)
            if isinstance(r, scorch.SparseTensor):
                r.check_invariants()
            if not close(r, torch.einsum(eq, *dense)):
                bad.append(f"{eq} {fmt} {shape}")
        return len(shapes), bad


    def ops_checks():
        """Ops outside einsum that run kernels: transposition, sums, SDDMM, scatter into dense, S + S."""
        gen = torch.Generator().manual_seed(99)
        bad, n = [], 0
        for fmt in ("bsr(2, 3)", "dia", "csr"):
            for shape in ((5, 7), (0, 3), (1, 1)):
                a = values(shape, gen, 0.5)
                s = scorch.asformat(a, fmt)
                m1, m2 = values((shape[0], 2), gen), values((2, shape[1]), gen)
                mask = a != 0 if fmt == "csr" else None
                checks = [(s.sum(0), a.sum(0)), (s.t(), a.T), (s + a, 2 * a)]
                if fmt == "csr":
                    b = scorch.asformat(values(shape, gen, 0.5), "csr")
                    checks += [(s * a, a * a), (torch.sparse.sampled_addmm(s, m1, m2), a + (m1 @ m2) * mask),
                               (s + b, a + b.to_dense()), (s * b, a * b.to_dense())]
                for r, expected in checks:
                    n += 1
                    if not close(r, expected):
                        bad.append(f"op on {fmt} {shape}")
                if fmt == "csr":  # the row softmax kernels (loop IR), forward and backward, log-space too
                    from scorch.ops import segment
                    pos = s.levels[1].pos
                    for log in (False, True):
                        vals = s.values().clone().requires_grad_()
                        y = segment.softmax(vals, pos, log)
                        y.backward(torch.ones_like(y))
                        n += 1
                        if not (close(y.detach(), segment.forward_ops(vals.detach(), pos, log)) and close(
                                vals.grad, segment.backward_ops(y.detach(), torch.ones_like(y), pos, log))):
                            bad.append(f"segment softmax {shape} log={log}")
        # S @ S with rows of hundreds of entries: the radix sort of the touched list
        a, b = values((6, 300), gen, 0.5), values((300, 300), gen, 0.5)
        n += 1
        if not close(scorch.asformat(a, "csr") @ scorch.asformat(b, "csr"), a @ b):
            bad.append("csr @ csr, long rows")
        return n, bad


    def tile_checks():
        """Register tiles and dot tiles (dense extents a multiple of the vector width), partial blocks, n:m,
        and a sparse-weight linear layer in batch tiles (``linalg._batch_tiles``, its thresholds lowered) with its
        backward (output order, BSR -> BSC)."""
        gen = torch.Generator().manual_seed(7)
        bad, n = [], 0
        for fmt, shape in (("csr", (5, 7)), ("bsr(4, 4)", (5, 7)), ("bsr(2, 8)", (9, 16)), ("nm(2, 4)", (6, 8)),
                           ("bsr(4, 4)", (0, 8)), ("csr", (1, 1))):
            a = values(shape, gen, 0.5)
            if fmt.startswith("nm"):
                a = a * (torch.arange(shape[1]) % 4 < 2)
            s = scorch.asformat(a, fmt)
            for k in (16, 64):
                x, y = values((shape[1], k), gen), values((shape[0], k), gen)
                checks = [(scorch.einsum("ij,jk->ik", s, x), a @ x), (scorch.einsum("ij,ik->jk", s, y), a.T @ y),
                          (scorch.einsum("ij,ik,jk->ij", s, y, x), (y @ x.T) * a)]
                for r, expected in checks:
                    n += 1
                    if not close(r, expected):
                        bad.append(f"tile {fmt} {shape} k={k}")
        for dtype in (torch.float64, torch.float32):  # SDDMM rows of whole dot tiles (8 or 16 entries) and more
            a = values((3, 300), gen, 0.2)
            a[1] = 0
            s = scorch.asformat(a.to(dtype), "csr")
            x, y = values((300, 32), gen).to(dtype), values((3, 32), gen).to(dtype)
            n += 1
            if not close(scorch.einsum("ij,ik,jk->ij", s, y, x), (y @ x.T) * a.to(dtype)):
                bad.append(f"dot tile {dtype}")
        # SDDMM whose B is larger than DOT_TILE_BYTES: entries one at a time, B's row prefetched 16 entries ahead
        # (clamped to the last entry: the last rows empty, a row of one entry, rows longer than the distance)
        from scorch.compiler.lower import DOT_TILE_BYTES
        cols = DOT_TILE_BYTES // (16 * 4) + 100
        a = values((9, cols), gen, 0.002)
        a[2], a[7:] = 0, 0
        a[3, :40] = values((1, 40), gen)
        a[6] = 0
        a[6, cols - 1] = 1.5
        s = scorch.asformat(a, "csr")
        x, y = values((cols, 16), gen), values((9, 16), gen)
        n += 1
        if not close(scorch.einsum("ij,ik,jk->ij", s, y, x), (y @ x.T) * a):
            bad.append("dot entries with prefetches")
        w = values((48, 32), gen, 0.3)
        from scorch.ops import linalg
        linalg.TILE_MIN_BYTES, linalg.TILE_MIN_ROWS = 0, 0  # (a child process: nothing to restore)
        for fmt in ("csr", "bsr(16, 16)"):
            p = torch.nn.Parameter(scorch.asformat(w, fmt))
            x = values((160, 32), gen).requires_grad_()
            y = torch.nn.functional.linear(x, p)
            y.backward(torch.ones_like(y))
            n += 1
            stored = p.detach()
            mask = stored.with_values(torch.ones_like(stored.values())).to_dense() != 0  # blocks keep zeros
            if not (close(y, x.detach() @ w.T) and close(x.grad, torch.ones(160, 48, dtype=w.dtype) @ w)
                    and close(p.grad.to_dense(), (torch.ones(48, 160, dtype=w.dtype) @ x.detach()) * mask)):
                bad.append(f"linear {fmt}")
            with torch.no_grad():
                n += 1
                if not close(torch.nn.functional.linear(x.detach(), p), x.detach() @ w.T):
                    bad.append(f"linear {fmt}, no gradient")
        return n, bad


    def coiteration_checks():
        """Two sparse operands through the CUDA kernels: SpGEMM's count and fill (scratch workspaces, the
        per-row sort of long rows) and a merge."""
        gen = torch.Generator().manual_seed(5)
        bad, n = [], 0
        for (m, k, c), d in (((6, 300, 300), 0.5), ((0, 4, 5), 0.5), ((9, 7, 8), 0.3)):
            a, b = values((m, k), gen, d), values((k, c), gen, d)
            n += 1
            r = engine.einsum("ij,jk->ik", scorch.asformat(a, "csr"), scorch.asformat(b, "csr"), backend=BACKEND)
            if not close(r, a @ b):
                bad.append(f"csr @ csr {(m, k, c)}")
            n += 1
            r = engine.einsum("ij,ij->ij", scorch.asformat(a, "csr"), scorch.asformat(a, "coo"), backend=BACKEND)
            if not close(r, a * a):
                bad.append(f"csr * coo {(m, k)}")
        return n, bad


    def fusion_checks():
        """The fused attention kernel (scorch.compile: SDDMM, row softmax and SpMM under one row loop): empty rows,
        empty and 1x1 patterns, more keys than queries, and the reverse."""
        gen = torch.Generator().manual_seed(11)
        bad, n = [], 0

        @scorch.compile
        def attend(q, k, v, mask):
            s = torch.sparse.sampled_addmm(mask, q, k.T, beta=0.0, alpha=0.5)
            return torch.sparse.mm(torch.sparse.softmax(s, dim=1), v)

        for (rows, cols), d in (((5, 7), 0.4), ((0, 0), 0.5), ((1, 1), 1.0), ((9, 3), 0.6), ((4, 6), 0.0)):
            keep = torch.rand(rows, cols, generator=gen) < d
            mask = scorch.asformat(keep.to(torch.float64), "csr")
            q, k, v = values((rows, 4), gen), values((cols, 4), gen), values((cols, 16), gen)
            s = (q @ k.T * 0.5).masked_fill(~keep, float("-inf"))
            expected = torch.softmax(s, dim=1).nan_to_num(0.0) @ v
            n += 2
            if not close(attend(q, k, v, mask), expected):
                bad.append(f"fused attention {(rows, cols)}")
            qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
            got = attend(qg, kg, v, mask)  # (probabilities kept), then the fused backward kernel
            if not close(got.detach(), expected):
                bad.append(f"fused attention with a gradient {(rows, cols)}")
            got.sum().backward()
            qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
            s_r = (qr @ kr.T * 0.5).masked_fill(~keep, float("-inf"))
            (torch.softmax(s_r, dim=1).nan_to_num(0.0) @ v).sum().backward()
            n += 1
            if not (close(qg.grad, qr.grad) and close(kg.grad, kr.grad)):
                bad.append(f"fused attention backward {(rows, cols)}")
            # a product with a bias and relu after it, as one kernel
            b = values((16,), gen)
            n += 1
            if not close(scorch.compile(lambda s, x: torch.relu(s @ x + b))(mask, v), torch.relu(keep.double() @ v + b)):
                bad.append(f"product epilogue {(rows, cols)}")
        for dtype in (torch.bfloat16, torch.float16):  # float32 row buffers, probabilities rounded into 16 bits
            keep = torch.rand(9, 7, generator=gen) < 0.4
            mask = scorch.asformat(keep.to(dtype), "csr")
            q, k, v = (values(shape, gen).to(dtype) for shape in ((9, 4), (7, 4), (7, 16)))
            s = (q.double() @ k.double().T * 0.5).masked_fill(~keep, float("-inf"))
            expected = torch.softmax(s, dim=1).nan_to_num(0.0) @ v.double()
            qg = q.clone().requires_grad_()
            for got in (attend(q, k, v, mask), attend(qg, k, v, mask)):
                n += 1
                if not torch.allclose(got.detach().double(), expected, atol=0.05, rtol=0.02):
                    bad.append(f"{dtype} fused attention")
            got.float().sum().backward()
            n += 1
            if qg.grad is None or not torch.isfinite(qg.grad.float()).all():
                bad.append(f"{dtype} fused attention backward")
        return n, bad


    def workspace_checks():
        """Hash workspaces (probing, the slots list, compaction) and 16-bit values (the vector widen and narrow
        of register and dot tiles, a float32 buffer for a 16-bit output added to)."""
        gen = torch.Generator().manual_seed(13)
        bad, n = [], 0
        for (m, k, c), d in (((6, 300, 300), 0.5), ((0, 4, 5), 0.5), ((9, 7, 8), 0.3), ((1, 1, 1), 1.0)):
            a, b = values((m, k), gen, d), values((k, c), gen, d)
            n += 2
            hashed = {"workspace": "hash"}
            if not close(scorch.einsum("ij,jk->ik", scorch.asformat(a, "csr"), scorch.asformat(b, "csr"),
                                       schedule=hashed), a @ b):
                bad.append(f"hash csr @ csr {(m, k, c)}")
            if not close(scorch.einsum("ij,ij->ij", scorch.asformat(a, "csr"), scorch.asformat(a, "coo"),
                                       schedule=hashed), a * a):
                bad.append(f"hash csr * coo {(m, k)}")
        # the dense workspace's bitmap rows: a count pass guessing each row from the last (rows alternating between
        # many entries and a few), the fill's bitmap and touched-list rows, rows of B prefetched two entries ahead
        b = torch.cat([values((30, 200), gen, 0.9), values((30, 200), gen, 0.05)])
        a = torch.zeros(12, 60, dtype=b.dtype)
        a[0::2, :30] = values((6, 30), gen, 0.6)
        a[1::2, 30:] = values((6, 30), gen, 0.1)
        n += 1
        if not close(scorch.einsum("ij,jk->ik", scorch.asformat(a, "csr"), scorch.asformat(b, "csr")), a @ b):
            bad.append("bitmap rows csr @ csr")
        big = 2**40
        keys = torch.randint(0, big, (400,), generator=gen).unique()
        v = scorch.sparse_coo_tensor(keys.unsqueeze(0), torch.ones(keys.numel(), dtype=torch.float64), (big,))
        n += 1
        r = v + v
        if not (torch.equal(r.indices()[0], keys) and torch.equal(r.values(), torch.full((keys.numel(),), 2.0,
                                                                                          dtype=torch.float64))):
            bad.append("hash vector add")
        for dtype in (torch.bfloat16, torch.float16):
            for fmt, shape in (("csr", (5, 7)), ("bsr(2, 2)", (5, 7)), ("coo", (5, 7)), ("csr", (0, 3))):
                a = values(shape, gen, 0.5)
                s = scorch.asformat(a.to(dtype), fmt)
                x = values((shape[1], 32), gen)
                n += 1
                if not close((s @ x.to(dtype)).double(), (a @ x).to(dtype).double()):
                    bad.append(f"{dtype} {fmt} {shape} spmm")
            a = values((40, 30), gen, 0.05)
            s = scorch.asformat(a.to(dtype), "csr")
            y, x = values((40, 16), gen), values((30, 16), gen)
            n += 1
            got = torch.sparse.sampled_addmm(s, y.to(dtype), x.T.to(dtype), beta=0)
            if not close(got.to_dense().double(), ((y @ x.T) * (a != 0)).to(dtype).double()):
                bad.append(f"{dtype} sddmm")
        return n, bad


    def weight_checks():
        """The dense-activation x sparse-weight family (``compiler.weights``): F.linear with CSR, BSR and n:m
        float32 and bfloat16 weights, one token (row dots), partial and several token tiles, row chunks (fewer
        tiles than threads), all-zero rows; forward, input and weight gradients (BSR's in slices of a block, over
        strips of tokens, and through the transposed blocks)."""
        gen = torch.Generator().manual_seed(11)
        bad, n = [], 0
        from scorch.engine import weights as family_engine
        family_engine.PAIR_TILES = True  # (bfloat16 CSR at 40% and 7 or 70 tokens: pair tiles, on any CPU)
        # (float32 n:4 at 70 tokens: the rows in a vector's lanes, ``compiler.weights_picks``, on any CPU; depth
        #  blocks, which 8-lane CPUs take first, are checked below)
        import dataclasses
        family_engine.CPU = dataclasses.replace(family_engine.CPU, lane_picks=True)
        depth_on, family_engine._depth = family_engine._depth, lambda plan, tokens: False
        # (one token of a CSR at 40% reads the bitmap; of an n:4 weight, the rows in a vector's lanes with 8 or 16
        #  float lanes (``weights_picks.decode``), padded groups (density 0.4) and full ones)
        def check(fmt, a, dtype, tol, tokens, tag=""):
            nonlocal n
            w = a.to(dtype)
            p = scorch.asformat(w, fmt).requires_grad_()
            x = values((tokens, a.shape[1]), gen).to(dtype).requires_grad_()
            y = torch.nn.functional.linear(x, p, torch.ones(a.shape[0], dtype=dtype))
            y.backward(torch.ones_like(y))
            n += 1
            ref = x.detach().double() @ w.double().T + 1
            gx = torch.ones(tokens, a.shape[0], dtype=torch.float64) @ w.double()
            gw = (torch.ones(a.shape[0], tokens, dtype=torch.float64) @ x.detach().double()) * (a != 0)
            got_w = p.grad.to_dense().double() * (a != 0)
            if not (torch.allclose(y.double(), ref, rtol=tol, atol=tol) and
                    torch.allclose(x.grad.double(), gx, rtol=tol, atol=tol) and
                    torch.allclose(got_w, gw, rtol=tol, atol=tol)):
                bad.append(f"weight family {fmt} {dtype} tokens={tokens}{tag}")

        for fmt, (o, i), density in (("csr", (37, 19), 0.4), ("csr", (9, 70), 0.1), ("bsr(16, 16)", (48, 32), 0.4),
                                     ("bsr(2, 8)", (6, 24), 0.4), ("nm(2, 4)", (21, 12), 0.4),
                                     ("nm(2, 4)", (5, 68), 1.0), ("nm(3, 4)", (19, 20), 0.8),
                                     ("csr", (1, 1), 0.4), ("bsr(32, 32)", (64, 96), 0.5)):
            a = values((o, i), gen, density)
            a[o // 2] = 0
            if fmt.startswith("nm"):
                a = a * (torch.arange(i) % 4 < 2)
            # (bfloat16 where its kernels differ: BSR's pairs, n:m's widened token, the bitmap's 16-bit values, the
            # 10% CSR's bfloat16 panel read in pairs of tokens; every format in float32)
            half = fmt in ("bsr(16, 16)", "nm(2, 4)") or (o, i) in ((37, 19), (9, 70))
            for dtype, tol in ((torch.float32, 1e-5),) + (((torch.bfloat16, 3e-2),) if half else ()):
                for tokens in (1, 7, 70):
                    check(fmt, a, dtype, tol, tokens)
        # (bfloat16 BSR on matrix tiles, ``compiler.weights_amx``, through the scalar model of AMX's instructions on
        #  any CPU: a partial tile's padded copy of the tokens, whole tiles, blocks of 16 x 16, 16 x 32 and 2 x 8)
        from scorch.engine import amx
        amx.FORCE = "model"
        for fmt, (o, i) in (("bsr(16, 16)", (48, 32)), ("bsr(16, 32)", (32, 64)), ("bsr(2, 8)", (6, 24))):
            a = values((o, i), gen, 0.4)
            a[o // 2] = 0
            for tokens in (7, 70):
                check(fmt, a, torch.bfloat16, 3e-2, tokens, " on matrix tiles")
        amx.FORCE = None
        # (float32 n:m in depth blocks, ``compiler.weights_depth``, with 8-lane vectors on any CPU: store blocks of 6
        #  rows and depth blocks of 2 groups, both ragged; 48 and 32 tokens a tile, partial ones)
        from scorch.compiler import weights_depth
        from scorch.compiler.codegen import cpp
        family_engine._depth, native = depth_on, family_engine.CPU
        if cpp.VECTOR_BYTES == 32:  # (8 float lanes: where the renderer's vectors are 8 floats)
            family_engine.CPU = dataclasses.replace(native, vector_bytes=32)
        weights_depth.DEPTH_ROWS, weights_depth.DEPTH_PANEL_BYTES = 6, 2 * 4 * 48 * 4
        for fmt, (o, i) in (("nm(2, 4)", (21, 20)), ("nm(3, 4)", (19, 12)), ("nm(2, 8)", (13, 24))):
            a = values((o, i), gen, 0.8)
            a = a * (torch.arange(i) % int(fmt[-2]) < int(fmt[3]))
            for tokens in (41, 70):
                check(fmt, a, torch.float32, 1e-5, tokens, " in depth blocks")
        # (2:4 convolutions: 72 output pixels through depth blocks, the panel packed from the padded buffer in runs
        #  along output rows; 35 with the rows in lanes)
        conv = torch.nn.Conv2d(8, 6, 3, stride=(1, 2), padding=1)
        schedule = scorch.schedule(conv)
        schedule["weight"].sparsify(scorch.nn.NM(2, 4))
        schedule.apply()
        for shape in ((2, 8, 9, 7), (1, 8, 5, 13)):
            x = values(shape, gen).float()
            n += 1
            with torch.no_grad():
                got = conv(x).double()
                want = torch.nn.functional.conv2d(x.double(), conv.weight.to_dense().double(), conv.bias.double(),
                                                  (1, 2), 1)
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                bad.append(f"2:4 convolution {shape}")
        family_engine.CPU = native
        # (two products in one kernel, the intermediate in a per-thread panel; the rows of two weights stacked)
        family_engine.CHAIN_TILES_PER_THREAD = 0
        w1, w2, w3 = values((37, 19), gen, 0.4), values((21, 37), gen, 0.4), values((5, 19), gen, 0.4)
        s1, s2, s3 = (scorch.asformat(w, "csr") for w in (w1, w2, w3))
        for tokens in (7, 70):
            x = values((tokens, 19), gen)
            n += 2
            mid = torch.nn.functional.gelu(x.double() @ w1.double().T + 1)
            got = family_engine.linear_chain(s1, x, torch.ones(37), "gelu", s2, None, None)
            if not torch.allclose(got.double(), mid @ w2.double().T, rtol=1e-4, atol=1e-4):
                bad.append(f"weight family chained tokens={tokens}")
            # (with the residual and LayerNorm in the tile, in float32, the kernel's type: one width both ways)
            n += 1
            w4, g4 = values((19, 37), gen, 0.4), values((19,), gen)
            got = family_engine.linear_chain(scorch.asformat(w1.float(), "csr"), x.float(), None, "relu",
                                             scorch.asformat(w4.float(), "csr"), None, None,
                                             norm=(g4.float(), None, 1e-5))
            want = torch.nn.functional.layer_norm(
                torch.relu(x.double() @ w1.double().T) @ w4.double().T + x.double(), (19,), g4, None, 1e-5)
            if not torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4):
                bad.append(f"weight family chained with norm tokens={tokens}")
            got = family_engine.linear_stacked([s1, s3], x, [None, torch.ones(5)], "relu")
            want = torch.relu(torch.cat([x.double() @ w1.double().T, x.double() @ w3.double().T + 1], 1))
            if not torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5):
                bad.append(f"weight family stacked tokens={tokens}")
        return n, bad


    def fault_checks():
        """Faults found with bad inputs (tests/test_faults.py): index arrays of mixed widths given to the
        constructors (int64 pos beside int32 crd overflowed the kernels' reads), transposed views."""
        return mixed_width_checks(values)


    torch.set_num_threads(3)  # more threads than some inputs have rows
    jobs = [(eq, sp, f) for eq, sp, fmts in CASES for f in fmts]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # kernels compile in parallel
        extra = ([ops_checks(), tile_checks(), weight_checks(), fusion_checks(), fault_checks(), workspace_checks()]
                 if BACKEND == "cpp" else
                 [coiteration_checks()])
        results = list(pool.map(run, jobs)) + extra
    bad = [b for _, bs in results for b in bs]
    print("checked", sum(n for n, _ in results), "results in", len(jobs), "kernels")
    for b in bad:
        print("MISMATCH", b)
    sys.exit(1 if bad else 0)
''')


def _sanitized_env(tmp_path):
    """The environment of a subprocess that builds and loads sanitized kernels, in a fresh cache."""
    env = runtime.sanitizer_env()
    env["SCORCH_SANITIZE"] = "1"
    env["SCORCH_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def _sanitizer_available():
    try:
        runtime.sanitizer_env()
        return shutil.which(runtime.compiler()) is not None
    except RuntimeError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ASan preloading is set up for Linux")
@pytest.mark.parametrize("backend", ["cpp", pytest.param("cuda-emulate", marks=pytest.mark.slow)])
def test_matrix_subset_under_sanitizers(tmp_path, backend):
    """The C++ kernels, and the CUDA kernels run by the emulation (their index arithmetic, lane and worker
    splits, scratch slices)."""
    if not _sanitizer_available():
        pytest.skip("the C++ compiler has no ASan/UBSan runtime")
    env = _sanitized_env(tmp_path)
    env["SCORCH_TEST_BACKEND"] = backend
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    # (the timeout guards against a hang: alone on 2 cores the run takes ~4.5 minutes, beside the suite's other
    # worker longer)
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = run.stdout + run.stderr
    assert "AddressSanitizer" not in out, out[-6000:]
    assert "runtime error" not in out, out[-6000:]
    assert run.returncode == 0, out[-6000:]
    assert "checked" in run.stdout and "MISMATCH" not in run.stdout, out[-6000:]
    # the kernels really were sanitized builds, in the fresh cache
    built = list((tmp_path / "cache").rglob("*.so"))
    assert len(built) >= 15, len(built)
    sources = list((tmp_path / "cache").rglob("*.cpp" if backend == "cpp" else "*.cu"))
    assert sources


def test_sanitizer_catches_an_out_of_bounds_read(tmp_path):
    """The set-up can fail: a kernel that reads one past its buffer is reported by ASan in this subprocess."""
    if not _sanitizer_available():
        pytest.skip("the C++ compiler has no ASan/UBSan runtime")
    env = _sanitized_env(tmp_path)
    script = textwrap.dedent(f'''
        import ctypes, importlib.util, sys
        spec = importlib.util.spec_from_file_location("rt", sys.argv[1])
        rt = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(rt)
        k = rt.load({OOB!r}, "oob", [ctypes.c_long], ctypes.c_long)
        print(k(8))
    ''')
    run = subprocess.run([sys.executable, "-c", script, runtime.__file__], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert "AddressSanitizer" in run.stderr


CACHE_SCRIPT = MIXED_WIDTH + textwrap.dedent(r'''
    import sys
    import torch
    from scorch.compiler import runtime

    def values(shape, gen, density=1.0):
        return ((torch.rand(shape, generator=gen) < density) * torch.randint(1, 9, shape, generator=gen)).double()

    n, bad = mixed_width_checks(values, ("csr", "bsc"))
    print("checked", n)
    for b in bad:
        print("MISMATCH", b)
    sys.exit(1 if bad else 0)
''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ASan preloading is set up for Linux")
def test_damaged_cache_entries_under_sanitizers(tmp_path):
    """Sanitized kernels cached by one process, then damaged (a zeroed body under intact headers, or another
    entry's library in its place): the next sanitized process verifies, rebuilds and runs them cleanly."""
    if not _sanitizer_available():
        pytest.skip("the C++ compiler has no ASan/UBSan runtime")
    from test_runtime import _zero_body
    env = _sanitized_env(tmp_path)
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def run():
        proc = subprocess.run([sys.executable, "-c", CACHE_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=300, cwd=root)
        out = proc.stdout + proc.stderr
        assert "AddressSanitizer" not in out and "runtime error" not in out, out[-6000:]
        assert proc.returncode == 0 and "checked" in proc.stdout, out[-6000:]

    run()
    built = sorted((tmp_path / "cache").rglob("*.so"))
    assert len(built) >= 4
    for k, path in enumerate(built):  # every other entry zeroed; the rest hold the next entry's library
        data = path.read_bytes()
        path.write_bytes(_zero_body(data) if k % 2 == 0 else built[(k + 1) % len(built)].read_bytes())
    run()
    for path in built:  # rebuilt: each entry is its own key's library again
        assert runtime.trailer_damage(str(path), path.stem) is None, path
