"""The mixture-of-experts app (apps/moe): both backends learn the teacher task on a tiny size and agree step by
step, the scorch backend's gate is a scorch.SparseTensor that goes through scorch's einsum (forward and
backward), every einsum spelling gives the same numbers, and the command line works."""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import math
import pathlib

import pytest
import torch

import scorch
from conftest import import_app, run_app
from scorch import engine

ROOT = pathlib.Path(__file__).resolve().parents[2]




moe = import_app("moe")
moe_model = importlib.import_module(moe.__name__ + ".model")
moe_data = importlib.import_module(moe.__name__ + ".data")
TINY = dict(tokens=256, dim=12, hidden=6, experts=4, batches=4, test_batches=1, lr=0.05)

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
]


@functools.cache
def tiny(backend, top_k=1, dtype="float32", epochs=8, einsum="slots"):
    return moe.run(backend, epochs=epochs, threads=1, seed=0, top_k=top_k, dtype=dtype, einsum=einsum, **TINY)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("backend", moe.BACKENDS)
def test_learns(backend, top_k):
    r = tiny(backend, top_k)
    assert r["backend"] == backend and r["top_k"] == top_k and r["experts"] == 4
    assert r["gate"] == ("sparse (csr)" if backend == "scorch" else "dense")
    assert len(r["losses"]) == 8 * 4
    assert r["losses"][-1] < 0.5 * r["losses"][0], r["losses"]
    assert r["loss"] < 0.5 * r["target_var"], (r["loss"], r["target_var"])   # held out: r2 above 0.5
    assert r["r2"] > 0.5
    for key in ("epoch_s", "step_s", "infer_s", "first_epoch_s"):
        assert r[key] > 0 and math.isfinite(r[key]), key


@pytest.mark.parametrize("top_k", [1, 2])
def test_backends_agree(top_k):
    """Same seed, same math: the sparse gate (scorch) and the dense gate (torch) give the same training curve."""
    s, t = tiny("scorch", top_k), tiny("torch", top_k)
    assert s["losses"] == pytest.approx(t["losses"], rel=2e-4, abs=1e-6)
    assert s["loss"] == pytest.approx(t["loss"], rel=2e-4)
    s64 = moe.run("scorch", epochs=2, threads=1, top_k=top_k, dtype="float64", **TINY)
    t64 = moe.run("torch", epochs=2, threads=1, top_k=top_k, dtype="float64", **TINY)
    assert s64["losses"] == pytest.approx(t64["losses"], rel=1e-10)


@pytest.mark.parametrize("einsum", ["fused", "dispatch", "combine", "loop"])
def test_spellings_agree(einsum):
    """The other einsum spellings of the product train the same way, under either backend."""
    want = tiny("torch", 2)["losses"][:4]
    for backend in moe.BACKENDS:
        got = moe.run(backend, epochs=1, threads=1, top_k=2, einsum=einsum, **TINY)["losses"]
        assert got == pytest.approx(want, rel=2e-4, abs=1e-6), (backend, einsum)


@contextlib.contextmanager
def record_einsums():
    """The (equation, operand types) of every call to scorch's einsum dispatcher, top-level and nested (the
    autograd Function's forward and the gradient einsums call it again)."""
    seen = []
    original = engine.einsum

    def spy(equation, *operands, **kwargs):
        ops = operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
        seen.append((equation, tuple(type(x).__name__ for x in ops)))
        return original(equation, *operands, **kwargs)

    engine.einsum = spy
    try:
        yield seen
    finally:
        engine.einsum = original


SPARSE_EINSUMS = {"slots": {"sb,bd->sd", "bs,sh->bh"}, "fused": {"bn,bd,ndh->bh"},
                  "dispatch": {"bn,bd->bnd"}, "combine": {"bn,bnh->bh"}}


@pytest.mark.parametrize("einsum", [s for s in moe_model.SPELLINGS if s != "loop"])  # (the loop has no gate)
@pytest.mark.parametrize("top_k", [1, 2])
def test_scorch_gate_is_sparse(top_k, einsum):
    """Under scorch the gate tensors are scorch.SparseTensors (CSR) that reach scorch's einsum, forward and
    backward, the gradients flow through their values to the gate's weights, and the numbers are the dense
    gates'."""
    sizes = dict(dim=10, hidden=7, experts=5, top_k=top_k, einsum=einsum)
    scorch.manual_seed(0)
    sparse = moe_model.build(scorch, **sizes, sparse_gate=True)
    torch.manual_seed(0)
    dense = moe_model.build(torch, **sizes, sparse_gate=False)
    dense.load_state_dict(sparse.state_dict())
    x = torch.randn(33, 10)

    g = sparse.gates(x)
    assert type(g) is scorch.SparseTensor and g.format.name == "csr"
    assert g.shape == (33, 5) and g.nnz == 33 * top_k
    torch.testing.assert_close(g.to_dense(), dense.gates(x))
    assert torch.equal((dense.gates(x) != 0).sum(1), torch.full((33,), top_k))
    dispatch, combine, capacity = sparse.slots(x)
    want_dispatch, want_combine, want_capacity = dense.slots(x)
    assert capacity == want_capacity and 33 * top_k <= 5 * capacity <= 33 * 5
    for got, want in ((dispatch, want_dispatch), (combine, want_combine)):
        assert type(got) is scorch.SparseTensor and got.format.name == "csr" and got.nnz == 33 * top_k
        torch.testing.assert_close(got.to_dense(), want)
    assert torch.equal(want_dispatch.sum(0), torch.full((33,), float(top_k)))   # each token in k slots
    assert want_dispatch.sum(1).max() == 1                                        # a slot holds one token
    torch.testing.assert_close(want_combine @ want_dispatch, dense.gates(x).sum(1).diag())

    with record_einsums() as seen:
        y = sparse(x)
        y.pow(2).sum().backward()
    assert type(y) is torch.Tensor and y.shape == (33, 7)
    with_sparse = [eq for eq, types in seen if "SparseTensor" in types]
    assert SPARSE_EINSUMS[einsum] <= set(with_sparse), seen
    # the backward runs in scorch too: the grouped product's own Function (``fused``, and ``combine`` when its
    # inner einsum is deferred into the gated one: its backward reuses the forward's sorted entries), or einsums
    # with the gate or its pattern as an operand (gradients through the gate's values, and the experts')
    grouped = type(y.grad_fn).__name__ == "_GroupedProductBackward"
    assert grouped or einsum != "fused"
    assert grouped or len(with_sparse) > len(SPARSE_EINSUMS[einsum]), seen

    yd = dense(x)
    yd.pow(2).sum().backward()
    torch.testing.assert_close(y, yd)
    for name in ("gate.weight", "experts"):
        gs, gd = sparse.get_parameter(name).grad, dense.get_parameter(name).grad
        assert type(gs) is torch.Tensor and gs.abs().sum() > 0, name
        torch.testing.assert_close(gs, gd, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_teacher_is_the_model():
    """The teacher's expert-by-expert outputs are the einsum model's with the teacher's parameters."""
    g = torch.Generator().manual_seed(1)
    gate, experts = torch.randn(9, 6, generator=g, dtype=torch.float64), torch.randn(6, 9, 4, generator=g,
                                                                                     dtype=torch.float64)
    x = torch.randn(40, 9, generator=g, dtype=torch.float64)
    for top_k in (1, 2):
        m = moe_model.build(torch, 9, 4, 6, top_k, sparse_gate=False).double()
        with torch.no_grad():
            m.gate.weight.copy_(gate.t())
            m.experts.copy_(experts)
            torch.testing.assert_close(moe_data.teacher(x, gate, experts, top_k), m(x))


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        moe.run("jax", epochs=1, **TINY)
    with pytest.raises(TypeError, match="unknown options"):
        moe.run("torch", epochs=1, rank=3, **TINY)
    with pytest.raises(ValueError, match="top_k"):
        moe.run("torch", epochs=1, top_k=5, **TINY)
    with pytest.raises(ValueError, match="spelling"):
        moe.run("torch", epochs=1, einsum="gshard", **TINY)


def _cli(*args, timeout=120):
    return run_app("moe", *args, timeout=timeout)


def test_cli():
    r = _cli("--help")
    assert r.returncode == 0, r.stderr
    for option in ("--backend", "--data", "--epochs", "--threads", "--experts", "--top-k", "--tokens", "--dim",
                   "--hidden", "--batches", "--einsum"):
        assert option in r.stdout, option
    r = _cli("--backend", "scorch", "--epochs", "2", "--threads", "1", "--quiet", "--tokens", "256", "--dim", "12",
             "--hidden", "6", "--experts", "4", "--top-k", "2", "--batches", "2", "--test-batches", "1")
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(None, 1) for line in r.stdout.splitlines()[1:])
    assert r.stdout.startswith("moe (scorch)")
    assert lines["gate"] == "sparse (csr)" and lines["experts"] == "4" and lines["top_k"] == "2"
    for key in ("loss", "r2", "epoch_s", "step_s", "infer_s"):
        assert key in lines, key
    assert lines["step_s"].endswith(" ms")


def test_benchmark_compares_with_the_per_expert_loop():
    """The benchmark's MoE case times scorch's two spellings and the per-expert loop interleaved, one table for
    the training step and one for inference, each with the issue's target over the loop."""
    from benchmarks import apps as bench_apps
    tables = bench_apps.moe_steps(1, tokens=64, dim=8, experts=4, repeats=2)
    assert [t.title.split(",")[0] for t in tables] == ["MoE training step", "MoE inference forward"]
    for t in tables:
        assert [r.name for r in t.rows] == ["scorch, sparse gate (fused)", "scorch, sparse gate (slots)",
                                            bench_apps.MOE_LOOP]
        assert all(r.timing.runs == 2 and 0 < r.timing.min <= r.timing.median for r in t.rows)
        (target,) = t.targets
        assert target.goal == 1.2 and target.value == t.ratio(bench_apps.MOE_LOOP)
