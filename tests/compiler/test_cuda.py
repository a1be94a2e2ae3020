"""The CUDA backend without a GPU: every kernel of the compiler's test matrix (``test_einsum_matrix``) rendered as
CUDA, run through the CPU emulation of ``codegen.cuda`` (blocks of one warp as OpenMP threads: lane splits,
warp shuffles, grid-stride and nnz-balanced worker loops, scratch workspaces) against dense torch, and compiled
by nvcc to PTX for sm_80 and sm_90; bf16 and f16 kernels against the float32 result rounded once. The tests that
need a GPU are in ``tests/cuda``.
"""
from __future__ import annotations

import dataclasses
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


# --- 16-bit values: bf16 and f16 in memory, float32 arithmetic, one rounding per stored result ------------------

HALF = [torch.bfloat16, torch.float16]
#: (equation, format of the sparse first operand, what it exercises); the dense operands' sizes follow the letters
HALF_CASES = [
    ("ij,j->i", "csr", "SpMV: a thread per row, rounded at the store"),
    ("ij,jk->ik", "csr", "SpMM: a warp per row, the columns across the lanes"),
    ("ij,ik,jk->ij", "csr", "SDDMM: warp sums (scorch_warp_add) of float products"),
    ("ij,jk->ik", "coo", "COO: adds into the output, so a float32 buffer rounded once after"),
    ("ij,i->j", "csr", "x^T A, a transposed product: adds into the output (float32 buffer)"),
    ("ij->i", "csr", "row sums"),
    ("ij->j", "csr", "column sums: adds into the output (float32 buffer)"),
    ("ij,ij->ij", "csr", "a sparse output on the operand's pattern"),
]
HALF_SLOW = [("ij->", "csr", "the total"), ("ki,ij->kj", "csr", "dense times sparse"),
             ("ij,j->i", "coo", "COO SpMV (float32 buffer)"), ("ij->ji", "csr", "a transpose (16-bit copies)"),
             ("ij,jk->ik", "dcsr", "doubly compressed rows")]


def _half_operands(eq, fmt, dtype, shape=(23, 19), k=40, seed=0, density=0.4):
    """(16-bit operands, their float32 values): quarters in [-2, 2] (``conftest.quarters``), so products and sums
    are exact in float32 but need more bits than the 16-bit types keep: a kernel that rounded every step, or
    rounded otherwise than to nearest even, gives another result than the float32 one rounded once."""
    from conftest import quarters
    lhs = eq.split("->")[0].split(",")
    sizes = {lhs[0][0]: shape[0], lhs[0][1]: shape[1]}
    a = quarters(shape, seed, density)
    ops, ref = [scorch.asformat(a.to(dtype), fmt)], [a]
    g = torch.Generator().manual_seed(seed + 1)
    for letters in lhs[1:]:
        x = torch.randint(-8, 9, tuple(sizes.get(c, k) for c in letters), generator=g) / 4
        ops.append(x.to(dtype))
        ref.append(x)
    return ops, ref


def _half_check(result, ref32, dtype):
    got = result.to_dense() if isinstance(result, scorch.SparseTensor) else result
    assert got.dtype == dtype and tuple(got.shape) == tuple(ref32.shape)
    assert torch.equal(got, ref32.to(dtype)), (got, ref32.to(dtype))


def _half_case(eq, fmt, dtype, **kw):
    ops, ref = _half_operands(eq, fmt, dtype, **kw)
    text = _explain(eq, *ops)
    _half_check(engine.einsum(eq, *ops, backend=EMU), torch.einsum(eq, *ref), dtype)
    return text


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("eq,fmt,what", HALF_CASES, ids=[f"{e}|{f}" for e, f, _ in HALF_CASES])
def test_emulated_cuda_16_bit_matches_float32_rounded_once(eq, fmt, what, dtype):
    """The CUDA kernels of bf16 and f16 operands, run by the emulation (the C++ backend's 16-bit types: the same
    rounding as ``__float2bfloat16_rn`` / ``__float2half_rn``), equal the float32 result rounded once."""
    shape = (60, 50) if eq == "ij,ik,jk->ij" else (23, 19)  # (sparse enough for the SDDMM kernel)
    text = _half_case(eq, fmt, dtype, shape=shape, density=0.05 if eq == "ij,ik,jk->ij" else 0.4)
    name = {torch.bfloat16: "scorch_bf16", torch.float16: "scorch_f16"}[dtype]
    assert "scorch_f32(" in text and "_Float16" not in text[text.index("__global__ void"):]  # (scorch_f16)
    if "float32 buffer" in what:
        assert f"{name}* out" not in text and "float* out" in text, text
    if eq == "ij,ik,jk->ij":
        assert "scorch_warp_add(" in text, text


@pytest.mark.slow
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("eq,fmt,what", HALF_SLOW, ids=[f"{e}|{f}" for e, f, _ in HALF_SLOW])
def test_emulated_cuda_16_bit_more(eq, fmt, what, dtype):
    _half_case(eq, fmt, dtype)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_emulated_cuda_16_bit_sums_accumulate_in_float32(fmt, dtype):
    """1024 and 32 quarters sum to 1032, which both types hold; summed in 16 bits it stays 1024 (1024 + 0.25
    rounds back). Every order of the terms must give 1032: thread sums, warp sums and the float32 buffers."""
    a = torch.full((5, 33), 0.25)
    a[:, 0] = 1024
    for m in (a, a.flip(1)):
        s = scorch.asformat(m.to(dtype), fmt)
        ones = torch.ones(33, 40, dtype=dtype)
        _half_check(engine.einsum("ij,jk->ik", s, ones, backend=EMU), m @ torch.ones(33, 40), dtype)
        _half_check(engine.einsum("ij->i", s, backend=EMU), m.sum(1), dtype)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_emulated_cuda_16_bit_two_sparse_operands(dtype):
    """Co-iteration with 16-bit values: the sum of two patterns (count and fill kernels, a workspace of floats per
    worker, each entry rounded once when it is written)."""
    from conftest import quarters
    a, b = quarters((23, 19), 2, 0.3), quarters((23, 19), 3, 0.3)
    s, t = scorch.asformat(a.to(dtype), "csr"), scorch.asformat(b.to(dtype), "csr")
    with engine.cpu_backend(EMU):
        _half_check(s + t, a + b, dtype)
        if dtype == torch.bfloat16:
            c = quarters((19, 17), 4, 0.3)
            _half_check(s @ scorch.asformat(c.to(dtype), "csr"), a @ c, dtype)  # (SpGEMM)


def _atomic_kernel(t):
    """``out[i % 3] += vals[i]`` for every ``i``, atomically, into a 16-bit ``out`` (the IR allows it though the
    lowering adds into a float32 buffer instead)."""
    i = L.Var("i")
    out, vals, n = L.Param("out", "array", t, True), L.Param("vals", "array", t), L.Param("n", "scalar", "i64")
    value = L.Cast(L.Load("vals", i, t), "f32")
    store = L.Store("out", L.binary("mod", i, L.Const(3)), value, "add", atomic=True)
    return L.Kernel(f"atomic_{t}", (out, vals, n), L.block(L.For(i, L.Const(0), L.Var("n"), L.block(store),
                                                                   parallel=L.Parallel("static"))))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_emulated_cuda_16_bit_atomic_add(dtype):
    """An atomic add into a 16-bit array is a compare-and-swap loop on its 16 bits (each add rounded: in the
    order the threads come, so the values here are exact in both types); max and min are refused."""
    t = L.FROM_TORCH[dtype]
    k = _atomic_kernel(t)
    launcher = pipeline.load(cuda.generate(k, map_to_gpu(k)), k, EMU, map_to_gpu(k))
    vals = (torch.arange(90) % 7 - 3).to(dtype) / 4
    out = torch.zeros(3, dtype=dtype)
    launcher(out.data_ptr(), vals.data_ptr(), 90)
    assert torch.equal(out, vals.float().reshape(30, 3).sum(0).to(dtype))
    store = next(s for s in L.walk(k.body) if isinstance(s, L.Store))
    bad = L.Kernel("m", k.params, L.block(L.For(L.Var("i"), L.Const(0), L.Var("n"),
                                                L.block(dataclasses.replace(store, op="max")),
                                                parallel=L.Parallel("static"))))
    with pytest.raises(ValueError, match="atomic max into the 16-bit"):
        cuda.generate(bad, map_to_gpu(bad))


@pytest.mark.skipif(shutil.which("nvcc") is None and shutil.which("nvcc", path="/usr/local/cuda/bin") is None,
                    reason="nvcc (the CUDA toolkit) is not installed: the CUDA compile check needs it, not a GPU")
@pytest.mark.parametrize("arch", [pytest.param("sm_80", marks=pytest.mark.slow), "sm_90"])
def test_16_bit_cuda_sources_compile(arch):
    """The 16-bit kernels (those of the tests above that ran in this process, at least SpMV and SpMM, and the
    atomic adds) compile with ``__nv_bfloat16`` and ``__half`` for sm_80 and sm_90."""
    for dtype in HALF:
        for eq, fmt, _ in HALF_CASES[:2]:
            engine.einsum(eq, *_half_operands(eq, fmt, dtype)[0], backend=EMU)
    kernels = {}
    for key, plan in pipeline.compiled_plans():
        if key[-1] == "cuda":
            for low in [plan.lowered] if isinstance(plan, pipeline.Plan) else list(plan.lowered.values()):
                if any(p.type in L.NARROW for p in low.kernel.params):
                    kernels[cuda.generate(low.kernel, map_to_gpu(low.kernel), prelude=False, symbol="k")] = low.kernel
    kernels = list(kernels.values()) + [_atomic_kernel("bf16"), _atomic_kernel("f16")]
    unit = cuda.PRELUDE + cuda.HALF + cuda.HELPERS + "\n".join(
        cuda.generate(k, map_to_gpu(k), prelude=False, symbol=f"scorch_h{n}") for n, k in enumerate(kernels))
    text = runtime.ptx(unit, arch)
    assert set(re.findall(r"\.entry\s+(scorch_h\d+)_dev", text)) == {f"scorch_h{n}" for n in range(len(kernels))}
    assert "cvt.rn.bf16.f32" in text and "cvt.rn.f16.f32" in text and "atom.global.cas.b16" in text


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


def test_library_choice_key_tells_skewed_rows_from_even_ones():
    """A uniform matrix and a power-law one of the same shape and nnz get different choice keys (on an H200 the
    graph took the uniform matrix's kept kernel, 3.4x slower than cuSPARSE's SpMM); the skew is read once a
    pattern; dense operands and other formats carry none."""
    from scorch.compiler import library
    n = 512
    even = torch.zeros(n, n)
    even[torch.arange(n).repeat_interleave(8), torch.randint(0, n, (8 * n,), generator=torch.Generator().manual_seed(0))] = 1
    nnz = int(even.count_nonzero())
    skewed = torch.zeros(n, n)
    skewed[0, :] = 1  # one full row, the rest spread over the others
    rest = torch.randperm((n - 1) * n, generator=torch.Generator().manual_seed(1))[:nnz - n]
    skewed[1 + rest // n, rest % n] = 1
    a, b = scorch.asformat(even, "csr"), scorch.asformat(skewed, "csr")
    assert a.nnz == b.nnz
    x = torch.randn(n, 4)
    ka, kb = library.key_of(("k",), (a, x)), library.key_of(("k",), (b, x))
    assert ka != kb and ka[:1] == kb[:1]
    assert library.row_skew(a) <= 4 and library.row_skew(b) >= 32 and library.row_skew(x) == 0
    assert library.row_skew(scorch.asformat(skewed, "coo")) == 0
    assert "_row_skew" in b._levels[1].__dict__  # kept: the next call reads nothing
    assert library.row_skew(scorch.asformat(torch.zeros(3, 3), "csr")) == 1


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
