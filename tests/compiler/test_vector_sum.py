"""A sum over a row's stored entries held in one vector of partial sums (``vectors.vector_sum``: SpMV's
``y[i] = sum_p vals[p] * x[crd[p]]``): whole vectors, with ``x`` gathered at the row's coordinates, then the row's
last, partial vector with its lanes past the row's end off (``For.tail``: they read no memory and add nothing).
Checked on every tail length, every index width, values that would poison a sum if an off lane were read, row
slices, and the helpers' portable (non-AVX2) versions, against a float64 reference."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import scorch
from scorch.compiler.codegen.prelude import VECTOR_BYTES
from scorch.compiler.target import CPU


def _rows_of_every_length(dtype, lengths=range(0, 19), n=24, seed=0):
    """A matrix whose row ``r`` has ``lengths[r]`` entries (every tail length of 4- and 8-lane vectors, empty rows
    too), values in eighths (exact in float32)."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.zeros(len(lengths), n, dtype=torch.float64)
    for r, k in enumerate(lengths):
        cols = torch.randperm(n, generator=g)[:k]
        dense[r, cols] = torch.randint(-8, 9, (k,), generator=g).double().add(0.5) / 8
    return dense.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_every_tail_length_and_index_width(dtype, index_dtype):
    a = _rows_of_every_length(dtype, range(0, 16) if index_dtype == torch.int8 else range(0, 19))  # (int8: <= 127)
    x = (torch.arange(a.shape[1], dtype=torch.float64) / 4 - 2).to(dtype)
    s = scorch.asformat(a, "csr").asformat("csr", index_dtype=index_dtype)
    torch.testing.assert_close(s @ x, (a.double() @ x.double()).to(dtype))


def test_lanes_past_a_row_read_nothing():
    """The entries right after each row (the next row's) are NaN and sit at columns where ``x`` is inf: a lane
    past the row's end that read either would turn the row's sum into NaN."""
    n = 40
    a = torch.zeros(2 * 19, n)
    for r in range(19):
        a[2 * r, :r] = 1.0 + r            # the row under test: r entries, columns 0 .. r-1
        a[2 * r + 1, 20:] = float("nan")  # the next row: NaN at columns 20 .. 39
    x = torch.ones(n)
    x[20:] = float("inf")
    y = scorch.asformat(a, "csr") @ x
    want = torch.tensor([float(r * (1 + r)) for r in range(19)])
    torch.testing.assert_close(y[0::2], want)
    assert torch.isnan(y[1::2]).all()


def test_a_row_slice_sums_its_own_entries():
    a = _rows_of_every_length(torch.float32, seed=3)
    x = torch.linspace(-1, 1, a.shape[1])
    s = scorch.asformat(a, "csr")
    torch.testing.assert_close(s[5:13] @ x, a[5:13] @ x)
    torch.testing.assert_close(scorch.einsum("ij,j->i", s, x), a @ x)


def test_the_loop_is_vectorized_with_gathers():
    s, x = scorch.asformat(_rows_of_every_length(torch.float32), "csr"), torch.ones(24)
    text = scorch.explain("ij,j->i", s, x, source=True)
    # (a row sum's vectors are at most 32 bytes: where the machine's are 64, the half-width helpers)
    pre = "scorch_hv" if VECTOR_BYTES == 64 else "scorch_"
    assert all(f"{pre}{h}(" in text for h in ("gather", "gathern", "keep", "hsum")), text
    # (the lead vectors, by the row's mean length: not where gathers run as slowly with their lanes off, AMD)
    assert ("t0_l1_mean" in text and ">= 3" in text) == CPU.lead_gathers, text


def test_lead_vectors_of_a_contiguous_sum_whatever_the_machine():
    """A row sum without gathers (``ij->i``) has its lead vectors on every machine."""
    s = scorch.asformat(_rows_of_every_length(torch.float32), "csr")
    text = scorch.explain("ij->i", s, source=True)
    assert "t0_l1_mean" in text and ">= 3" in text, text
    torch.testing.assert_close(scorch.einsum("ij->i", s), s.to_dense().sum(1))


@pytest.mark.parametrize("gathers", ["0", "1"])
def test_lead_gathers_either_way(gathers, tmp_path):
    """``$SCORCH_LEAD_GATHERS`` (``target.native_lead_gathers``: off on AMD CPUs): this module's tests of the lead
    vectors and the gathers, in a child process with lead vectors that gather on (1) or off (0), whatever this
    machine's choice is; the kernels built with ASan and UBSan where the compiler has them (the sanitizer matrix,
    tests/compiler/test_sanitize.py, covers this machine's own setting)."""
    if gathers == str(int(CPU.lead_gathers)):
        pytest.skip("this machine's own setting: the tests of this process cover it")
    from scorch.compiler import runtime
    try:
        env = {**runtime.sanitizer_env(), "SCORCH_SANITIZE": "1", "SCORCH_CACHE_DIR": str(tmp_path / "cache"),
               "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
    except RuntimeError:  # (no sanitizer runtime: the same tests, unsanitized)
        env = dict(os.environ)
    env["SCORCH_LEAD_GATHERS"] = gathers
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          os.path.abspath(__file__), "-k", "(lead or gathers) and not either_way and not setting"],
                         env=env, cwd=root, capture_output=True, text=True, timeout=600)
    text = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0 and " passed" in out.stdout, text
    assert "AddressSanitizer" not in out.stdout + out.stderr and "runtime error" not in out.stdout + out.stderr, text
    if env.get("SCORCH_SANITIZE"):
        assert list((tmp_path / "cache").rglob("*.so")), "the child built no sanitized kernels"


@pytest.mark.parametrize("filler", [0, 8, 16, 24, 40, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lead_vectors_read_nothing_past_a_row(filler, dtype):
    """``For.lead``: up to 3 vectors run before the loop whatever a row's length, as many as the matrix's mean row
    length fills. Rows of every length 0 .. 40 between rows of ``filler`` NaN entries at columns where ``x`` is
    inf (moving the mean: 1, 2, 3 lead vectors and more than 3): a lead vector past its row's end that read the
    next row's entries, or the row's own past its end, would show as NaN."""
    n = 48 + filler
    lengths = range(0, 41)
    a = torch.zeros(2 * len(lengths), n, dtype=dtype)
    for r, k in enumerate(lengths):
        a[2 * r, :k] = torch.arange(1, k + 1, dtype=dtype) / 8
        a[2 * r + 1, 48:48 + filler] = float("nan")
    x = torch.ones(n, dtype=dtype)
    x[48:] = float("inf")
    y = scorch.asformat(a, "csr") @ x
    want = torch.tensor([k * (k + 1) / 16 for k in lengths], dtype=dtype)
    torch.testing.assert_close(y[0::2], want)
    assert torch.isnan(y[1::2]).all() if filler else (y[1::2] == 0).all()


def test_the_mean_row_length_follows_the_pattern():
    """The kept mean (``args.mean_length``, a per-call hint) is read again when the level's arrays change."""
    from scorch.engine.args import mean_length
    a = scorch.asformat(_rows_of_every_length(torch.float32, range(0, 19)), "csr")
    assert mean_length(a, 1) == 9  # (171 entries in 19 rows)
    b = scorch.asformat(torch.ones(19, 30), "csr")  # (the same rows, another pattern)
    a._levels[1].pos, a._levels[1].crd = b._levels[1].pos, b._levels[1].crd
    assert mean_length(a, 1) == 30
    assert mean_length(scorch.asformat(torch.zeros(0, 5), "csr"), 1) == 0


@pytest.mark.slow  # (each builds its kernels afresh in a child process: ~5 s, more from an empty cache)
@pytest.mark.parametrize("vector_bytes", ["16", "32", "64"])
def test_portable_helpers(vector_bytes):
    """Every vector width (``$SCORCH_VECTOR_BYTES``) gives the same sums: 16 bytes is always the lane-by-lane
    versions; 32 is AVX2's instructions where the machine has them, 64 AVX-512's, each the lane-by-lane ones
    elsewhere."""
    code = (
        "import torch, scorch\n"
        "from tests.compiler.test_vector_sum import _rows_of_every_length\n"
        "for dt in (torch.float32, torch.float64):\n"
        "    for it in (torch.int32, torch.int64):\n"
        "        a = _rows_of_every_length(dt)\n"
        "        x = (torch.arange(a.shape[1], dtype=torch.float64) / 4 - 2).to(dt)\n"
        "        s = scorch.asformat(a, 'csr').asformat('csr', index_dtype=it)\n"
        "        torch.testing.assert_close(s @ x, (a.double() @ x.double()).to(dt))\n"
        "print('ok')\n")
    env = {**os.environ, "SCORCH_VECTOR_BYTES": vector_bytes}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("n", [3, 13, 40, 200])
def test_lead_vectors_on_an_inner_level(n):
    """A sum over the third level of a CSF tensor: the lead count is that level's positions per fiber (the
    mean of ``t0_l2_mean``), empty slices and fibers included; x is inf at a column no entry holds."""
    g = torch.Generator().manual_seed(n)
    a = torch.randn(5, 7, n, generator=g) * (torch.rand(5, 7, n, generator=g) < 0.5)
    a[1] = 0
    a[2, 3] = 0
    a[:, :, 0] = 0
    x = torch.randn(n, generator=g)
    x[0] = float("inf")
    s = scorch.asformat(a, "csf")
    text = scorch.explain("ijk,k->ij", s, x, format="dense", source=True)
    assert ("t0_l2_mean" in text) == CPU.lead_gathers, text  # (see test_the_loop_is_vectorized_with_gathers)
    want = torch.einsum("ijk,k->ij", a.double(), torch.where(torch.isinf(x), 0, x).double()).float()
    torch.testing.assert_close(scorch.einsum("ijk,k->ij", s, x, format="dense"), want)


def test_lead_gathers_setting(monkeypatch):
    """``native_lead_gathers``: ``$SCORCH_LEAD_GATHERS`` 0 / 1 wins; anything else is refused by name; without it,
    the CPU's maker decides (AMD: off), and the choice is part of the target's key."""
    from scorch.compiler import target
    monkeypatch.setenv("SCORCH_LEAD_GATHERS", "0")
    assert target.native_lead_gathers() is False
    monkeypatch.setenv("SCORCH_LEAD_GATHERS", "1")
    assert target.native_lead_gathers() is True
    monkeypatch.setenv("SCORCH_LEAD_GATHERS", "yes")
    with pytest.raises(ValueError, match="SCORCH_LEAD_GATHERS"):
        target.native_lead_gathers()
    monkeypatch.delenv("SCORCH_LEAD_GATHERS")
    with open("/proc/cpuinfo") as f:
        amd = any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in f)
    assert target.native_lead_gathers() is not amd
    keys = {target.Target("cpu", 64, lead_gathers=g).key for g in (False, True)}
    assert len(keys) == 2
