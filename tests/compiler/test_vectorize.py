"""The generated kernels' innermost dense loops vectorize: g++'s own vectorization report says so."""
import re
import subprocess

import pytest
import torch

import scorch
from scorch.compiler import runtime
from scorch.compiler.target import CPU


def _kernel_source(eq, *ops):
    text = scorch.explain(eq, *ops, source=True)
    return text[text.index("#include"):]


def _vectorized_lines(source, tmp_path):
    cpp = tmp_path / "k.cpp"
    cpp.write_text(source)
    flags = [f for f in runtime.flags() if f not in ("-shared",)]
    out = subprocess.run([runtime.compiler(), *flags, "-fopt-info-vec-optimized", "-c", str(cpp), "-o",
                          str(tmp_path / "k.o")], capture_output=True, text=True, check=True)
    return {int(m.group(1)) for m in re.finditer(r"k\.cpp:(\d+):\d+: optimized: loop vectorized", out.stderr)}


def _report(source, tmp_path):
    cpp = tmp_path / "r.cpp"
    cpp.write_text(source)
    flags = [f for f in runtime.flags() if f not in ("-shared",)]
    return subprocess.run([runtime.compiler(), *flags, "-fopt-info-vec-optimized", "-c", str(cpp), "-o",
                           str(tmp_path / "r.o")], capture_output=True, text=True, check=True).stderr


def _innermost_loop_line(source, var_prefix="x"):
    """The hot loop: the dense-index loop whose body accumulates (``+=``)."""
    lines = source.splitlines()
    loops = [i + 1 for i, line in enumerate(lines[:-1]) if re.search(rf"for \(int64_t {var_prefix}\d+ =", line)
             and "+=" in lines[i + 1]]
    return loops[-1]


@pytest.mark.parametrize("eq, k", [("ij,jk->ik", 32), ("ij,jk->ik", 128), ("ij,ik,jk->ij", 64)])
def test_inner_dense_loop_vectorizes(eq, k, tmp_path):
    torch.manual_seed(0)
    a = torch.randn(400, 300) * (torch.rand(400, 300) < 0.01)  # sparse enough that SDDMM runs fused
    s = scorch.asformat(a, "csr")
    ops = (s, torch.randn(300, k)) if eq == "ij,jk->ik" else (s, torch.randn(400, k), torch.randn(300, k))
    src = _kernel_source(eq, *ops)
    # (as a loop bound, or as the row stride of a register tile walking the extent in tiles)
    assert f"< INT64_C({k})" in src or f"* INT64_C({k}))" in src, "the dense extent should be compiled in"
    if eq == "ij,jk->ik":
        # SpMM's output tile is held in explicit vectors across the row's entries (a register tile)
        assert re.search(r"scorch_vf32 wtile\[\d+\]", src) and f"bv += {CPU.lanes('f32')}" in src
        assert re.search(r"\(\*\(const scorch_vf32u\*\)\(&t1\[", src), "the dense operand is read as vectors"
        return
    # SDDMM: a vector's lanes of entries at a time (16 with AVX-512), each a vector of partial sums over k, added
    # up together (a transposed tree);
    # the entries left over one at a time, each in one vector of partial sums added up at its end
    assert re.search(rf"scorch_vf32 esum\[{CPU.lanes('f32')}\]", src) and src.count("scorch_tsum(esum, etot)") == 1
    assert "e_rest" in src and "scorch_vf32 vsum[1]" in src and "scorch_hsum(vsum[INT64_C(0)])" in src
    assert re.search(r"\(\*\(const scorch_vf32u\*\)\(&t2\[", src), "the dense operands are read as vectors"
    src = _kernel_source(eq, ops[0], ops[1][:, :k - 1].contiguous(), ops[2][:, :k - 1].contiguous())
    line = _innermost_loop_line(src)  # g++ names the loop's line or its body's
    assert "64 byte vectors" in _report(src, tmp_path) or "32 byte vectors" in _report(src, tmp_path)
    assert {line, line + 1} & _vectorized_lines(src, tmp_path)


def test_reduction_loops_allow_reassociation():
    s = scorch.asformat(torch.eye(400), "csr")
    # (15 columns: not whole vectors, so the plain reduction loop runs; 16 run as explicit vectors, see above)
    src = _kernel_source("ij,ik,jk->ij", s, torch.randn(400, 15), torch.randn(400, 15))
    assert "#pragma omp simd reduction(+:acc)" in src


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dot_tile_interpreted_matches_compiled(dtype):
    """The SDDMM dot tile (whole vectors of entries, their lane sums added up together, then the entries left
    over) through the bounds-checked loop-IR interpreter gives the compiled kernel's values, and torch's."""
    from scorch import engine
    lanes = CPU.lanes("f32" if dtype == torch.float32 else "f64")  # (the machine's vector width: target.py)
    torch.manual_seed(1)
    dense = torch.randn(6, 2000, dtype=dtype) * (torch.rand(6, 2000) < 0.02)  # sparse: the planner samples
    dense[2] = 0  # an empty row
    dense[3, :lanes + 3] = 1.5  # a full tile and a remainder at least
    s = scorch.asformat(dense, "csr")
    a, b = torch.randn(6, 2 * lanes, dtype=dtype), torch.randn(2000, 2 * lanes, dtype=dtype)
    src = _kernel_source("ij,ik,jk->ij", s, a, b)
    assert "scorch_tsum(" in src
    cpp = engine.einsum("ij,ik,jk->ij", s, a, b, backend="cpp")
    ref = engine.einsum("ij,ik,jk->ij", s, a, b, backend="interp")
    torch.testing.assert_close(cpp.to_dense(), ref.to_dense())
    torch.testing.assert_close(cpp.to_dense(), dense * (a @ b.T))


@pytest.mark.parametrize("fmt", ["csr", "bsr(2, 2)", "bsr(4, 4)"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_register_tile_interpreted_matches_compiled(fmt, dtype):
    """SpMM's register tile (with copies of a small tile for groups of entries, then the entries left over, the
    copies added up) through the bounds-checked loop-IR interpreter gives the compiled kernel's values, and
    torch's."""
    from scorch import engine
    torch.manual_seed(2)
    dense = torch.randn(8, 12, dtype=dtype) * (torch.rand(8, 12) < 0.6)
    dense[4:6] = 0  # empty rows (and an empty block row)
    dense[1] = 1.0  # a row of whole groups and a remainder
    s = scorch.asformat(dense, fmt)
    x = torch.randn(12, 32, dtype=dtype)
    src = _kernel_source("ij,jk->ik", s, x)
    assert "wtile" in src
    cpp = engine.einsum("ij,jk->ik", s, x, backend="cpp")
    ref = engine.einsum("ij,jk->ik", s, x, backend="interp")
    torch.testing.assert_close(cpp, ref)
    torch.testing.assert_close(cpp, dense @ x)


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc", "bsr(2, 2)", "dcsr"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dot_tile_writes_every_entry(fmt, dtype, monkeypatch):
    """The dot tile writes every stored entry of its output, so the output is not zero-filled first: with
    uninitialized memory made NaN, every entry (empty rows, whole tiles, left-over entries) still comes out
    right."""
    from scorch import engine
    real = torch.empty

    def poisoned(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)
    scorch.clear_caches()  # (prepared calls keep the allocator they were made with)
    lanes = CPU.lanes("f32")
    g = torch.Generator().manual_seed(4)
    dense = torch.randn(40, 300, generator=g) * (torch.rand(40, 300, generator=g) < 0.03)
    dense[5] = 0  # an empty row
    dense[7, :2 * lanes + 3] = 1.5  # whole tiles and a remainder
    dense[9, :1] = 2.0  # one entry
    dense = dense.to(dtype)
    s = scorch.asformat(dense, fmt)
    a, b = torch.randn(40, 32, generator=g).to(dtype), torch.randn(300, 32, generator=g).to(dtype)
    for _ in range(2):  # the first call and the prepared one
        got = engine.einsum("ij,ik,jk->ij", s, a, b)
        want = dense.float() * (a.float() @ b.float().T)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(got.to_dense().float(), want, **tol)
        got = torch.sparse.sampled_addmm(s, a, b.T, beta=0)
        stored = s.with_values(torch.ones_like(s.values())).to_dense() != 0  # (a block's zeros are stored)
        torch.testing.assert_close(got.to_dense().float(), stored * (a.float() @ b.float().T), **tol)
    scorch.clear_caches()


@pytest.mark.parametrize("fmt, dtype", [("csr", torch.float32), ("dcsr", torch.float32), ("coo", torch.float32),
                                        ("csr", torch.bfloat16), ("csr", torch.float64)])
@pytest.mark.parametrize("backend", ["cpp", "interp"])
def test_dot_tile_prefetches_rows_of_a_large_operand(fmt, dtype, backend):
    """SDDMM whose rows of B (read at each entry's column) take more than ``DOT_TILE_BYTES``: the kernel runs the
    entries one at a time with B's row 16 entries later prefetched (the later entry clamped to the last one of
    the matrix), and the dot tile where B is smaller; both give the dense product. The interpreter checks each
    hint's address is in bounds."""
    from scorch import engine
    from scorch.compiler.lower import DOT_TILE_BYTES
    g = torch.Generator().manual_seed(6)
    if backend == "interp" and dtype == torch.bfloat16:
        pytest.skip("the loop-IR interpreter takes no bfloat16 values")
    tol = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-5, atol=1e-5)}.get(dtype, {})
    for cols in (DOT_TILE_BYTES // (16 * dtype.itemsize) + 1, 300):
        a = torch.randn(12, cols, generator=g) * (torch.rand(12, cols, generator=g) < 40 / cols)
        a[1], a[10:] = 0, 0  # an empty row, the last rows empty
        a[4, :2 * CPU.lanes("f32") + 3] = 1.5  # whole tiles and a remainder
        a[9] = 0
        a[9, cols - 1] = 2.0  # the last entry alone in its row
        a = a.to(dtype)
        s = scorch.asformat(a, fmt)
        y, x = torch.randn(12, 16, generator=g).to(dtype), torch.randn(cols, 16, generator=g).to(dtype)
        if fmt == "csr" and backend == "cpp":
            assert "__builtin_prefetch(&t2[" in _kernel_source("ij,ik,jk->ij", s, y, x)  # (chosen at run time)
        for _ in range(2):  # the first call and the prepared one
            got = engine.einsum("ij,ik,jk->ij", s, y, x, backend=backend)
            torch.testing.assert_close(got.to_dense().double(), (a.double() * (y.double() @ x.double().T)), **tol)
        empty = scorch.asformat(torch.zeros(3, cols, dtype=dtype), fmt)
        torch.testing.assert_close(engine.einsum("ij,ik,jk->ij", empty, y[:3], x, backend=backend).to_dense(),
                                   torch.zeros(3, cols, dtype=dtype))


@pytest.mark.parametrize("fmt, shape, k", [("csr", (40, 30), 64), ("csr", (1, 1), 32), ("dcsr", (50, 20), 32),
                                           ("ell", (12, 9), 32), ("csr", (0, 5), 32), ("coo", (30, 25), 32)])
@pytest.mark.parametrize("backend", ["cpp", "interp"])
def test_register_tile_prefetches_rows_found_through_coordinates(fmt, shape, k, backend):
    """SpMM's register tile prefetches (into L2) the row of X that an entry 16 positions later reads (one hint per
    cache line of the tile), the later entry clamped to the last entry of the whole matrix; no tile, no hint. The
    interpreter checks each hint's address is in bounds."""
    from scorch import engine
    g = torch.Generator().manual_seed(5)
    a = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.3)
    s, x = scorch.asformat(a, fmt), torch.randn(shape[1], k, generator=g)
    if fmt == "csr" and backend == "cpp":
        source = _kernel_source("ij,jk->ik", s, x)
        assert "__builtin_prefetch(&t1[" in source and ", 0, 2);" in source  # (into L2: prefetch.PREFETCH_LOCALITY)
        assert "__builtin_prefetch" not in _kernel_source("ij,jk->ik", s, torch.randn(shape[1], 5))  # (no tile)
    got = engine.einsum("ij,jk->ik", s, x, backend=backend)
    torch.testing.assert_close(got, a @ x)
