"""The CUDA backend without a GPU: every kernel of the compiler's test matrix (``test_einsum_matrix``) rendered as
CUDA, run through the CPU emulation of ``codegen.cuda`` (blocks of one warp as OpenMP threads: lane splits,
warp shuffles, grid-stride and nnz-balanced worker loops, scratch workspaces) against dense torch, and compiled
by nvcc to PTX for sm_80 and sm_90. The tests that need a GPU are in ``tests/cuda``.
"""
from __future__ import annotations

import re
import shutil

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import scorch
from scorch import engine
from scorch.compiler import pipeline, runtime
from scorch.engine import bind
from scorch import loopir as L
from scorch.compiler.codegen import cuda
from scorch.compiler.mapping import map_to_gpu

from conftest import assert_matches_dense, compile_ahead
from test_einsum_matrix import _one_thread  # noqa: F401  (the same fixture: kernels on one thread)
from test_einsum_matrix import MATRIX, MATRIX_IDS, Spec, build, check_format, dense_einsum, matrix_jobs

EMU = "cuda-emulate"

# shapes for every matrix entry: empty, fully dense (whole blocks), partial blocks, more rows than workers
SPECS = [Spec((0, 4, 3), 0.5, 1), Spec((4, 6, 2), 1.0, 5), Spec((5, 7, 3), 0.6, 6), Spec((41, 23, 6), 0.3, 93)]


@pytest.fixture(scope="module", autouse=True)
def _compile_ahead(request):
    compile_ahead(request, matrix_jobs(lambda case, ops: engine.einsum(case.eq, *ops, backend=EMU), plain=False))


def _run(case, fmt, dtype, itype, spec):
    ops, dense_ops, _ = build(case, fmt, dtype, itype, spec, cap3=12)
    result = engine.einsum(case.eq, *ops, backend=EMU)
    assert_matches_dense(result, dense_einsum(case.eq, *dense_ops))
    check_format(case, fmt, ops[case.sparse], result)


@pytest.mark.parametrize("case,fmt,dtype,itype", MATRIX, ids=MATRIX_IDS)
@settings(max_examples=1)
@given(spec=st.builds(Spec, st.tuples(*[st.integers(0, 9)] * 3), st.sampled_from([0.0, 0.4, 1.0]),
                      st.integers(0, 2 ** 16)))
@example(spec=SPECS[0])
def test_emulated_cuda_matches_dense(case, fmt, dtype, itype, spec):
    """Each matrix entry's CUDA kernels, run by the emulation, equal torch (fixed shapes plus a drawn one)."""
    for s in SPECS[1:] + [spec]:
        _run(case, fmt, dtype, itype, s)


TWO_SPARSE = [("ij,jk->ik", "csr", "csr"), ("ij,jk->ik", "csr", "csc"), ("ij,ij->ij", "csr", "coo"),
              ("ij,ij->ij", "csr", "csr"), ("ij,jk->ik", "dcsr", "csr")]


@pytest.mark.parametrize("eq,fa,fb", TWO_SPARSE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_emulated_cuda_two_sparse_operands(eq, fa, fb, dtype):
    """Co-iteration on the GPU: SpGEMM's count and fill kernels (thread workers with scratch workspaces and a
    per-row sort) and merges of two patterns."""
    g = torch.Generator().manual_seed(7)
    for m, k, n in [(0, 3, 4), (9, 13, 11), (40, 30, 25)]:
        a = (torch.randint(-3, 4, (m, k), generator=g) * (torch.rand(m, k, generator=g) < 0.3)).to(dtype)
        b = (torch.randint(-3, 4, (k, n) if eq.startswith("ij,jk") else (m, k), generator=g)
             * (torch.rand((k, n) if eq.startswith("ij,jk") else (m, k), generator=g) < 0.3)).to(dtype)
        r = engine.einsum(eq, scorch.asformat(a, fa), scorch.asformat(b, fb), backend=EMU)
        assert_matches_dense(r, torch.einsum(eq, a, b))


@pytest.mark.parametrize("reduce", ["amax", "amin"])
def test_emulated_cuda_max_min(reduce):
    """Max/min reductions over stored entries (with the implicit zeros) through CUDA kernels."""
    x = (torch.randn(30, 17) * (torch.rand(30, 17) < 0.4)).double()
    s = scorch.asformat(x, "csr")
    from scorch.compiler.einsum import parse
    inputs, out = parse("ij->i", [2])
    r = engine.run(inputs, out, [s], backend=EMU, reduce=reduce[1:])
    assert_matches_dense(r, getattr(x, reduce)(1))


def test_warp_mapping_for_spmm_and_sddmm():
    """SpMM and SDDMM get a warp per row with the dense loop across the lanes; SpGEMM a thread per row."""
    a = scorch.asformat(torch.randn(20, 30) * (torch.rand(20, 30) < 0.3), "csr")
    x, y = torch.randn(30, 64), torch.randn(20, 64)
    sparse = scorch.asformat(torch.randn(200, 300) * (torch.rand(200, 300) < 0.01), "csr")  # (fused, not a GEMM)
    kinds = {}
    for eq, ops in [("ij,jk->ik", (a, x)), ("ij,ik,jk->ij", (sparse, torch.randn(200, 64), torch.randn(300, 64)))]:
        text = _explain(eq, *ops)
        kinds[eq] = text
    assert "a warp per iteration" in kinds["ij,jk->ik"] and "+ scorch_warp_add(" not in kinds["ij,jk->ik"]
    assert "a warp per iteration" in kinds["ij,ik,jk->ij"] and "+ scorch_warp_add(" in kinds["ij,ik,jk->ij"]
    b = scorch.asformat(torch.randn(30, 10) * (torch.rand(30, 10) < 0.3), "csr")
    assert "a thread per iteration" in _explain("ij,jk->ik", a, b)


def _explain(eq, *ops):
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        engine.einsum(eq, *ops, backend=EMU, explain=True)
    return buf.getvalue()


def test_hazards_keep_thread_workers():
    """A loop is split across lanes only when no lane reads what another wrote: a store outside the lane loop
    that a later statement reads, or a store not indexed by the loop variable, keeps thread workers."""
    i, k = L.Var("i"), L.Var("k")
    out = L.Param("out", "array", "f32", True)
    n = L.Param("n", "scalar", "i64")
    lane = L.For(k, L.Const(0), L.Const(64), L.block(L.Store("out", L.binary("add", L.binary("mul", i, L.Const(64)), k),
                                                           L.Const(1.0, "f32"), "add")), simd=True)
    good = L.Kernel("g", (out, n), L.block(L.For(i, L.Const(0), L.Var("n"), L.block(lane),
                                                 parallel=L.Parallel("static"))))
    assert map_to_gpu(good).mode == "warp"
    same = L.For(k, L.Const(0), L.Const(64), L.block(L.Store("out", i, L.Const(1.0, "f32"), "add")), simd=True)
    bad1 = L.Kernel("b", (out, n), L.block(L.For(i, L.Const(0), L.Var("n"), L.block(same),
                                                 parallel=L.Parallel("static"))))
    assert map_to_gpu(bad1).mode == "thread"
    read_back = L.Store("out", i, L.Load("out", L.binary("add", i, L.Const(1)), "f32"))
    bad2 = L.Kernel("b", (out, n), L.block(L.For(i, L.Const(0), L.Var("n"), L.block(lane, read_back),
                                                 parallel=L.Parallel("static"))))
    assert map_to_gpu(bad2).mode == "thread"
    serial = L.Kernel("s", (out, n), L.block(L.Store("out", L.Const(0), L.Const(1.0, "f32")), lane))
    assert map_to_gpu(serial).mode == "serial"


def test_backend_selection(monkeypatch):
    """CUDA tensors select the CUDA backend; the emulation refuses them; mixed devices are refused."""
    a = scorch.asformat(torch.eye(3), "csr")
    x = torch.ones(3, 2)
    assert engine.backend_for([a, x], "cpp", "mm") == "cpp"
    assert engine.backend_for([a, x], EMU, "mm") == EMU
    with pytest.raises(ValueError, match="takes CUDA tensors"):
        engine.backend_for([a, x], "cuda", "mm")
    with pytest.raises(ValueError, match="unknown backend"):
        engine.backend_for([a, x], "fortran", "mm")
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(bind, "device_of", lambda t: cuda0 if t is a else torch.device("cpu"))
    with pytest.raises(ValueError, match="same device"):
        engine.backend_for([a, x], "cpp", "mm")
    monkeypatch.setattr(bind, "device_of", lambda t: cuda0)
    assert engine.backend_for([a, x], "cpp", "mm") == "cuda"
    with pytest.raises(ValueError, match="runs on the CPU"):
        engine.backend_for([a, x], EMU, "mm")


# --- nvcc: every CUDA source of the matrix compiles for sm_80 and sm_90 ------------------------------------------

def _matrix_kernels():
    """Every CUDA kernel the matrix entries lower to (lowered, not compiled)."""
    for case, fmt, dtype, itype in MATRIX:  # (planned and compiled once per process: the caches keep them)
        ops, _, _ = build(case, fmt, dtype, itype, Spec((5, 7, 3), 0.6, 6))
        engine.einsum(case.eq, *ops, backend=EMU)
    kernels = {}
    for key, plan in pipeline.compiled_plans():
        if key[-1] == "cuda":
            lows = [plan.lowered] if isinstance(plan, pipeline.Plan) else list(plan.lowered.values())
            for low in lows:
                kernels[cuda.generate(low.kernel, map_to_gpu(low.kernel), prelude=False, symbol="k")] = low.kernel
    return list(kernels.values())


@pytest.mark.skipif(shutil.which("nvcc") is None and shutil.which("nvcc", path="/usr/local/cuda/bin") is None,
                    reason="nvcc (the CUDA toolkit) is not installed: the CUDA compile check needs it, not a GPU")
@pytest.mark.parametrize("arch", [pytest.param("sm_80", marks=pytest.mark.slow), "sm_90"])  # (sm_80: -m slow)
def test_matrix_cuda_sources_compile(arch):
    kernels = _matrix_kernels()
    assert len(kernels) > 100
    unit = cuda.PRELUDE + cuda.HELPERS + "\n".join(
        cuda.generate(k, map_to_gpu(k), prelude=False, symbol=f"scorch_m{n}") for n, k in enumerate(kernels))
    text = runtime.ptx(unit, arch)
    entries = set(re.findall(r"\.entry\s+(scorch_m\d+)_dev", text))
    assert len(entries) == len(kernels)


# --- library kernels: recognized, equal to the compiler's result, chosen by measurement -----------------------

def test_library_candidates_compute_the_same():
    """The library calls the GPU dispatcher may take instead of a kernel give the kernel's results (run here on
    the CPU, where torch.sparse has the same calls)."""
    from scorch.compiler import library
    from scorch.compiler.einsum import parse, to_index_notation
    from scorch.compiler.ir import Assignment
    s = scorch.asformat(torch.randn(30, 20) * (torch.rand(30, 20) < 0.3), "csr")
    x, a, b = torch.randn(20, 8), torch.randn(30, 8), torch.randn(20, 8)
    for eq, ops in [("ij,jk->ik", [s, x]), ("ij,ik,jk->ij", [s, a, b])]:
        inputs, out = parse(eq, [o.dim() for o in ops])
        asg = Assignment(out, to_index_notation(inputs), tuple(engine.tensor_type(o) for o in ops))
        name, fn = library.candidate(asg)
        assert "cuSPARSE" in name
        assert_matches_dense(fn(ops), engine.einsum(eq, *ops).to_dense() if eq.endswith("ij") else
                             engine.einsum(eq, *ops))
    inputs, out = parse("ij,jk->ki", [2, 2])
    asg = Assignment(out, to_index_notation(inputs), (engine.tensor_type(s), engine.tensor_type(x)))
    assert library.candidate(asg) is None  # another output order: no library call


def test_library_choice_is_measured_once():
    from scorch.compiler import library
    calls = []
    times = {"scorch": 2.0, "lib": 1.0}

    def clock(fn):
        return times[fn()]
    c = library.choose(("test-key",), "lib", lambda: calls.append("s") or "scorch", lambda: "lib", clock)
    assert c.path == "lib" and c.scorch_ms == 2000.0 and "measured" in c.describe()
    n = len(calls)
    assert library.choose(("test-key",), "lib", lambda: calls.append("s") or "scorch", lambda: "lib", clock) is c
    assert len(calls) == n  # kept: not measured again
    times["scorch"] = 0.5
    assert library.choose(("other-key",), "lib", lambda: "scorch", lambda: "lib", clock).path == "scorch"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_gpu_benchmark_without_a_gpu(capsys):
    from benchmarks import gpu
    assert gpu.main(["--quick"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
