"""The direct (C) form of a kept product's prepared call (``engine.direct``): the same results as dense torch and
as the Python prepared call, taken only where the Python call would be, refusable, and safe on bad input."""
import functools
import os
import subprocess
import sys

import pytest
import torch

import scorch
from scorch.engine import direct, evaluate

needs_direct = pytest.mark.skipif(direct.function(wait=True) is None,
                                  reason="no direct call here (Python.h missing?)")


@pytest.fixture(autouse=True)
def _eager_products():
    """(Under ``SCORCH_DEFER=all`` products defer instead of taking a kept call: these run in the default mode.
    The in-memory caches start empty: they stop taking new calls at 4096 entries, which a long test process
    can reach, and then no product here would be kept.)"""
    scorch.clear_caches()
    with scorch.deferred.deferral("auto"):
        yield


def _kept(s, x, reps=3):
    for _ in range(reps):  # (the first call of a signature may plan; the direct form is made on its first call)
        torch.testing.assert_close(s @ x, s.to_dense() @ x)
    return evaluate.kept_product(s, x, True)


@needs_direct
@pytest.mark.parametrize("fmt", ["csr", "coo", "dcsr"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("k", [None, 1, 16, 33])
def test_direct_products_match_dense(fmt, dtype, index_dtype, k):
    g = torch.Generator().manual_seed(3)
    d = (torch.randn(41, 29, generator=g) * (torch.rand(41, 29, generator=g) < 0.2)).to(dtype)
    s = scorch.asformat(d, fmt, index_dtype=index_dtype)
    x = torch.randn(29, generator=g, dtype=dtype) if k is None else torch.randn(29, k, generator=g, dtype=dtype)
    fast = _kept(s, x)
    if fmt == "csr" or fast:  # (a format whose product has no kept prepared call goes the long way, as before)
        assert isinstance(fast, functools.partial) and fast.func is direct.function(), fast
    for _ in range(2):
        torch.testing.assert_close(s @ x, d @ x)
    s.values().mul_(-3)  # values changed in place: read at each call
    torch.testing.assert_close(s @ x, (-3 * d) @ x)
    x2 = torch.randn_like(x)  # another operand of the kept shape
    torch.testing.assert_close(s @ x2, (-3 * d) @ x2)


@needs_direct
@pytest.mark.parametrize("fmt", ["csr", "csc"])
def test_direct_products_from_the_left(fmt):
    """``X @ S`` keeps its call as ``S @ X`` does (the operands the other way round)."""
    g = torch.Generator().manual_seed(8)
    d = torch.randn(23, 31, generator=g) * (torch.rand(23, 31, generator=g) < 0.2)
    s = scorch.asformat(d, fmt)
    for w in (torch.randn(5, 23, generator=g), torch.randn(23, generator=g)):
        for _ in range(4):
            torch.testing.assert_close(w @ s, w @ d)
        fast = evaluate.kept_product(s, w, False)
        if fmt == "csc" and w.dim() == 1:  # (the others scatter, or convert first: not kept calls)
            assert isinstance(fast, functools.partial) and fast.func is direct.function(), fast
        w.mul_(2)  # the operand changed in place: read at each call
        torch.testing.assert_close(w @ s, w @ d)


@needs_direct
@pytest.mark.parametrize("shape, density", [((0, 5), 0.0), ((5, 0), 0.0), ((1, 1), 1.0), ((7, 6), 0.0),
                                            ((7, 6), 1.0)])
def test_direct_products_on_edge_shapes(shape, density):
    g = torch.Generator().manual_seed(4)
    d = torch.randn(*shape, generator=g) * (torch.rand(*shape, generator=g) < density)
    s = scorch.asformat(d, "csr")
    x = torch.randn(shape[1], 8, generator=g)
    _kept(s, x)
    for _ in range(2):
        torch.testing.assert_close(s @ x, d @ x)


@needs_direct
def test_direct_call_follows_what_the_python_call_checks():
    """The direct form is what ``kept_product`` hands out only where the kept call stands: a gradient to record,
    a non-contiguous operand or a changed pattern go the long way and are right."""
    g = torch.Generator().manual_seed(5)
    d = torch.randn(20, 12, generator=g) * (torch.rand(20, 12, generator=g) < 0.3)
    s = scorch.asformat(d, "csr")
    x = torch.randn(12, 4, generator=g)
    assert isinstance(_kept(s, x), functools.partial)
    xg = x.clone().requires_grad_(True)
    assert evaluate.kept_product(s, xg, True) is None
    (s @ xg).sum().backward()
    torch.testing.assert_close(xg.grad, d.t() @ torch.ones(20, 4))
    xt = torch.randn(4, 12, generator=g).t()
    torch.testing.assert_close(s @ xt, d @ xt)
    d2 = torch.randn(20, 12, generator=g) * (torch.rand(20, 12, generator=g) < 0.5)
    s.copy_(scorch.asformat(d2, "csr"))  # another pattern in place
    for _ in range(3):
        torch.testing.assert_close(s @ x, d2 @ x)


@needs_direct
def test_direct_call_refuses_bad_operands_with_an_exception():
    """Handed operands that are not what its program was made for, the direct call raises (no crash)."""
    g = torch.Generator().manual_seed(6)
    d = torch.randn(9, 7, generator=g) * (torch.rand(9, 7, generator=g) < 0.4)
    s = scorch.asformat(d, "csr")
    x = torch.randn(7, 3, generator=g)
    fast = _kept(s, x)
    with pytest.raises(KeyError, match="without its arrays"):
        fast((torch.randn(9, 7), x), None)  # a dense tensor where the sparse operand goes
    with pytest.raises(IndexError):
        fast((s,), None)  # an operand missing
    with pytest.raises(TypeError):
        direct.function()(fast.args[0], {0: s, 1: x}, None)  # operands not a tuple or list
    prog = list(fast.args[0])
    prog[3] = 10 ** 6  # the output's position out of range
    with pytest.raises(IndexError, match="out of range"):
        direct.function()(tuple(prog), (s, x), None)
    torch.testing.assert_close(fast((s, x), None), d @ x)


def test_direct_call_can_be_refused():
    """``SCORCH_DIRECT=0``: kept products stay in Python, with the same results, and so do the operators
    (``engine.direct.operators``)."""
    code = ("import torch, scorch\nfrom scorch.engine import evaluate\n"
            "d = torch.randn(9, 7) * (torch.rand(9, 7) < 0.4)\ns = scorch.asformat(d, 'csr')\nx = torch.randn(7, 3)\n"
            "for _ in range(3): torch.testing.assert_close(s @ x, d @ x)\n"
            "f = evaluate.kept_product(s, x, True)\n"
            "print(type(f).__name__, type(type(s).__dict__['__matmul__']).__name__)\n")
    env = dict(os.environ, SCORCH_DIRECT="0", SCORCH_DEFER="auto")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "function function"  # (the C form is an ``instancemethod``)


@needs_direct
def test_the_helper_builds_in_the_background(tmp_path):
    """With an empty kernel cache the helper (~0.4 s of g++) builds on a thread of its own: the first products
    take the Python path and are right (checked with ``allclose``: ``torch.testing`` imports sympy, ~0.6 s); once
    the build ends, a prepared call made during it runs its C form and the C operators are in place; a later
    process loads the helper from disk at its first use, without a thread. A child forked while the helper builds
    takes the Python path (the parent's thread is not in it), right and without waiting."""
    code = ("import functools, sys, time, torch, scorch\nfrom scorch.engine import direct, evaluate\n"
            "from scorch.sparse_tensor import SparseTensor\n"
            "d = torch.randn(9, 7) * (torch.rand(9, 7) < 0.4)\ns = scorch.asformat(d, 'csr')\nx = torch.randn(7, 3)\n"
            "for _ in range(3): assert torch.allclose(s @ x, d @ x, atol=1e-6)\n"
            "building = bool(direct._building) and not direct._loaded\n"
            "before = type(evaluate.kept_product(s, x, True)).__name__\n"
            "declared = type(SparseTensor.__dict__['__matmul__']).__name__\n"
            "module = direct.wait()\n"
            "f = evaluate.kept_product(s, x, True)\n"
            "assert torch.allclose(s @ x, d @ x, atol=1e-6) and torch.allclose(x.T @ s.T, (d @ x).T, atol=1e-6)\n"
            "print(building, before, declared, module is not None, isinstance(f, functools.partial) and "
            "f.func is direct.function(), type(SparseTensor.__dict__['__matmul__']).__name__)\n")
    env = dict(os.environ, SCORCH_CACHE_DIR=str(tmp_path), SCORCH_DEFER="auto")
    env.pop("SCORCH_DIRECT", None)
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["True", "function", "function", "True", "True", "instancemethod"], first.stdout
    fork = ("import os, torch, scorch\nfrom scorch.engine import direct\n"
            "d = torch.randn(9, 7) * (torch.rand(9, 7) < 0.4)\ns = scorch.asformat(d, 'csr')\nx = torch.randn(7, 3)\n"
            "for _ in range(3): assert torch.allclose(s @ x, d @ x, atol=1e-6)\n"
            "assert direct._building and not direct._loaded\npid = os.fork()\n"
            "if pid == 0:\n"
            "    s2 = scorch.asformat(d.T.contiguous(), 'csr')\n"
            "    ok = all(torch.allclose(s2 @ d, d.T @ d, atol=1e-5) for _ in range(3)) and direct.wait() is None\n"
            "    os._exit(0 if ok else 3)\n"
            "_, status = os.waitpid(pid, 0)\nprint(os.waitstatus_to_exitcode(status), direct.wait() is not None)\n")
    forked = subprocess.run([sys.executable, "-c", fork], env=dict(env, SCORCH_CACHE_DIR=str(tmp_path / "fork")),
                            capture_output=True, text=True, timeout=120)  # (a lock the child waits on: a hang)
    assert forked.returncode == 0 and forked.stdout.split() == ["0", "True"], (forked.stdout, forked.stderr)
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == ["False", "partial", "instancemethod", "True", "True", "instancemethod"], \
        again.stdout


@needs_direct
def test_direct_calls_from_several_threads():
    """The kernel runs with the GIL released: products from several Python threads at once, each right."""
    import concurrent.futures
    g = torch.Generator().manual_seed(9)
    d = torch.randn(300, 200, generator=g) * (torch.rand(300, 200, generator=g) < 0.05)
    s = scorch.asformat(d, "csr")
    xs = [torch.randn(200, 16, generator=g) for _ in range(8)]
    assert isinstance(_kept(s, xs[0]), functools.partial)

    def work(x):
        return all(torch.allclose(s @ x, d @ x, atol=1e-5) for _ in range(20))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, xs))
