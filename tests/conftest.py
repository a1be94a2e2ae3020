import contextlib
import concurrent.futures
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

# bfloat16 BSR products on the vector kernels whatever the CPU, so that no test's path depends on whether it has AMX
# tiles: tests/ops/test_weight_amx.py runs the tile kernels through their model on any CPU, and on the CPU's own
# tiles where it has them
os.environ.setdefault("SCORCH_AMX", "0")

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True, scope="session")
def _direct_helper():
    """The C helper of kept products (``scorch.engine.direct``) had before the first test: with an empty cache it
    builds in the background, and the C operators would take over in the middle of whichever test ran then (a
    compiled test could count the swap as a recompile). ``tests/test_direct_call.py`` tests the background build
    in processes of their own."""
    from scorch.engine import direct
    direct.wait()
    yield


def is_dense_result(r) -> bool:
    """A dense result: a plain torch tensor, or a deferred one (``scorch.deferred.Deferred``, a ``torch.Tensor``
    subclass that computes itself when touched; under ``SCORCH_DEFER=all`` every dense product is one)."""
    from scorch import SparseTensor
    return isinstance(r, torch.Tensor) and not isinstance(r, SparseTensor) and r.layout == torch.strided


def assert_matches_dense(result, expected):
    """The one comparison every op test uses: a scorch result (sparse or dense) against the dense torch one."""
    from scorch import SparseTensor
    got = result.to_dense() if isinstance(result, SparseTensor) else result
    assert tuple(got.shape) == tuple(expected.shape), (got.shape, expected.shape)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    if expected.dtype.is_floating_point:
        torch.testing.assert_close(got, expected)
    else:
        assert torch.equal(got, expected)


# --- compiling a module's kernels ahead, on every core --------------------------------------------------------

def compile_ahead(request, job_for):
    """Run ``job_for(item)`` (a callable or None) for every selected test of this module on every core, before
    the tests run: a cold kernel costs ~0.4 s of g++ on one core, and the runtime builds different kernels in
    parallel. Errors are ignored here: the tests themselves report them."""
    jobs = [j for j in (job_for(item) for item in request.session.items if item.module is request.module) if j]
    workers = os.cpu_count() or 1
    # under pytest-xdist every test process collects every test: each compiles its share of the module's jobs
    # (the kernel cache on disk is shared) on its share of the cores; on 2 cores none (both already run tests)
    shards = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if shards > 1:
        jobs = jobs[int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])::shards]
        workers //= shards
    if workers < 2 or len(jobs) < 8:
        return

    def run(job):
        try:
            job()
        except BaseException:
            pass

    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                list(pool.map(run, jobs))
    finally:
        torch.set_num_threads(threads)


def plain_test_job(item):
    """The test body itself, for a test that takes only its parameters (no fixtures, no hypothesis)."""
    cs = getattr(item, "callspec", None)
    params = cs.params if cs else {}
    names = item._fixtureinfo.argnames
    if getattr(item.obj, "is_hypothesis_test", False) or not set(names) <= set(params):
        return None
    return lambda: item.obj(**{k: params[k] for k in names})


def quarters(shape, seed, density=1.0, dtype=torch.float32):
    """Nonzero multiples of 1/4 in [-2, 2], a ``density`` fraction of them kept."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.randint(1, 9, shape, generator=g)
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    keep = torch.rand(shape, generator=g) < density
    return ((mag * sign * keep).to(torch.float64) / 4).to(dtype)


# --- spying on scorch ------------------------------------------------------------------------------------------

def lane_picks_on(monkeypatch, module, name: str) -> list:
    """The weight family's target with n:4 rows in lanes on (``Target.lane_picks``, whatever the CPU) and depth
    blocks off (``compiler.weights_depth``, which 8-lane CPUs take first from 40 tokens), and a list recording the
    plan (the 4th argument) of each call of ``module.name``."""
    import dataclasses

    from scorch.engine import weights
    monkeypatch.setattr(weights, "CPU", dataclasses.replace(weights.CPU, lane_picks=True))
    monkeypatch.setattr(weights, "_depth", lambda plan, n: False)
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(a[3]) or real(*a))
    return calls


def takes_from(calls: list, w: torch.Tensor, fmt: str, minimum: int, tokens: tuple, threads: int) -> None:
    """``F.linear`` on ``w`` held as ``fmt`` with a bias, at ``tokens`` tokens and ``threads`` threads, equals the
    dense layer's, and runs the kernel ``calls`` records from ``minimum`` tokens on."""
    import scorch
    s, bias = scorch.asformat(w, fmt), torch.ones(w.shape[0])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in tokens:
            calls.clear()
            x = torch.randn(n, w.shape[1])
            y = torch.nn.functional.linear(x, s, bias)
            torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), rtol=1e-4, atol=1e-4)
            assert len(calls) == (n >= minimum)
    finally:
        torch.set_num_threads(old)


def values_laid_out_again(w: torch.Tensor, tokens: int, pattern_copy) -> None:
    """A 2:4 weight's values changed in place (an optimizer step) reach the next product (a kernel's copy of them
    remade), while ``pattern_copy(s)``, the kernel's copy of what depends on the pattern alone, is kept."""
    import scorch
    F = torch.nn.functional
    s = scorch.asformat(w, "nm(2, 4)")
    x = torch.randn(tokens, w.shape[1])
    results = []
    for scale in (1, -2):
        with torch.no_grad():
            s._vals.copy_(scale * s._vals.abs() * torch.sign(s._vals))
            y = F.linear(x, s)
        results.append((pattern_copy(s), y))
    assert results[0][0] is not None and results[0][0] is results[1][0]
    torch.testing.assert_close(results[0][1], F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results[1][1], F.linear(x, -2 * w), rtol=1e-4, atol=1e-4)


def trains_like_dense(calls: list, w: torch.Tensor, tokens: int) -> None:
    """A 2:4 weight's forward (through the kernel ``calls`` records) and gradients equal the masked dense layer's,
    and an SGD step's values reach the next forward."""
    import scorch
    F = torch.nn.functional
    s = scorch.asformat(w, "nm(2, 4)").requires_grad_()
    d = w.clone().requires_grad_()
    x1 = torch.randn(tokens, w.shape[1], requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    F.linear(x1, s).square().sum().backward()
    F.linear(x2, d).square().sum().backward()
    assert calls
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-4)
    mask = w != 0
    torch.testing.assert_close(s.grad.to_dense() * mask, d.grad * mask, rtol=1e-4, atol=1e-4)
    scorch.optim.SGD([s], lr=0.1).step()
    with torch.no_grad():
        stepped = (d - 0.1 * d.grad) * mask
    torch.testing.assert_close(F.linear(x1.detach(), s), F.linear(x1.detach(), stepped), rtol=1e-4, atol=1e-4)


def chains_take_two_calls(calls: list, w1: torch.Tensor, w2: torch.Tensor, tokens: int) -> None:
    """A chain (``w1`` then ``w2``) and a stack (``w1`` twice) of 2:4 products whose kernel ``calls`` records run
    as separate calls of it: two each, the same values as dense."""
    import scorch
    from scorch.engine import weights as kernels
    F = torch.nn.functional
    s1, s2 = scorch.asformat(w1, "nm(2, 4)"), scorch.asformat(w2, "nm(2, 4)")
    x = torch.randn(tokens, w1.shape[1])
    y = kernels.linear_chain(s1, x, None, "relu", s2, None, None)
    torch.testing.assert_close(y, F.linear(F.relu(F.linear(x, w1)), w2), rtol=1e-4, atol=1e-4)
    assert len(calls) == 2
    calls.clear()
    bias = torch.ones(w1.shape[0])
    y = kernels.linear_stacked([s1, s1], x, [None, bias])
    torch.testing.assert_close(y, torch.cat([F.linear(x, w1), F.linear(x, w1, bias)], 1), rtol=1e-4, atol=1e-4)
    assert len(calls) == 2


@contextlib.contextmanager
def record_sparse_ops():
    """Counts, per torch function, the calls that reached ``SparseTensor.__torch_function__``."""
    import collections

    import scorch
    seen = collections.Counter()
    cls = scorch.SparseTensor
    original = cls.__dict__["__torch_function__"]

    def spy(c, func, types, args=(), kwargs=None):
        seen[func] += 1
        return original.__func__(c, func, types, args, kwargs)

    cls.__torch_function__ = classmethod(spy)
    try:
        yield seen
    finally:
        cls.__torch_function__ = original


def import_app(app):
    """``apps.<app>`` of this checkout (the repository root is on the path when pytest runs from it)."""
    import importlib
    import pathlib
    import sys
    root = str(pathlib.Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"apps.{app}")


def run_app(app, *args, timeout=120):
    """``python -m apps.<app> *args`` in a new process from the repository root (warnings silenced); the
    completed process, output captured as text."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", f"apps.{app}", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)


def run_torchrun(*args, nproc=2, timeout=120):
    """``torchrun --standalone --nproc_per_node nproc *args`` (a script, or ``-m module``) from the repository root,
    with this checkout first on the path and one thread a process; the completed process, output captured as text.
    The timeout ends a launch that hangs (a collective waiting for a process that died)."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=path, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def conv_input(batch, cin, kernel, dilation, padding, extra, cl, seed):
    """A random (batch, cin, h, w) input for a 2-d convolution: the least plane the dilated ``kernel`` fits on
    with ``padding`` (at least 1), plus ``extra`` rows and columns; channels_last where ``cl``."""
    h, w = (max(1, dl * (k - 1) + 1 - 2 * p) + e for k, dl, p, e in zip(kernel, dilation, padding, extra))
    x = torch.randn(batch, cin, h, w, generator=torch.Generator().manual_seed(seed))
    return x.contiguous(memory_format=torch.channels_last) if cl else x
