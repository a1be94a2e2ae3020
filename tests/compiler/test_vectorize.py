"""The generated kernels' innermost dense loops vectorize: g++'s own vectorization report says so."""
import re
import subprocess

import pytest
import torch

import scorch
from scorch.compiler import runtime


def _kernel_source(eq, *ops):
    text = scorch.explain(eq, *ops, file=open("/dev/null", "w"))
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
    assert f"< INT64_C({k})" in src or f"< INT64_C({k // 64})" in src, "the dense extent should be compiled in"
    if eq == "ij,jk->ik":
        # SpMM's output tile is held in explicit vectors across the row's entries (a register tile)
        assert re.search(r"scorch_vf32 wtile\[\d+\]", src) and "bv += 16" in src
        assert re.search(r"\(\*\(const scorch_vf32u\*\)\(&t1\[", src), "the dense operand is read as vectors"
        return
    line = _innermost_loop_line(src)  # g++ names the loop's line or its body's
    assert "64 byte vectors" in _report(src, tmp_path) or "32 byte vectors" in _report(src, tmp_path)
    assert {line, line + 1} & _vectorized_lines(src, tmp_path)


def test_reduction_loops_allow_reassociation():
    s = scorch.asformat(torch.eye(400), "csr")
    src = _kernel_source("ij,ik,jk->ij", s, torch.randn(400, 16), torch.randn(400, 16))
    assert "#pragma omp simd reduction(+:acc)" in src
