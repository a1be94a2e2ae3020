"""Drop-in programs: small, complete PyTorch programs of the kind people write (``gcn``, ``gat``, ``moe``,
``attention``, ``issue_moe``, ``edge_mlp``), each run with ``torch`` and with ``scorch`` in its place, results compared.

Each program module defines ``run(torch) -> dict`` (the torch-like module is an argument; the program text is
ordinary PyTorch), and optionally ``reference(torch)`` where the plain-torch spelling differs (``issue_moe``).
It also declares
  DTYPE        "float32" or "float64" (sets the tolerances),
  SPARSE_KEYS  result keys that must be ``scorch.SparseTensor`` under scorch (no silent torch-sparse path),
  SCORCH_OPS   torch functions that must reach ``SparseTensor.__torch_function__`` (a SparseTensor operand)
               at least once while the program runs under scorch ("a|b": either one).

Results are compared key by key (sparse results densified; training curves step by step). A program that
scorch cannot run yet is a strict xfail naming the op that is missing: it turns into a failure (XPASS) once
scorch implements it, and the mark is then removed.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import pathlib

import pytest
import torch

import scorch
from conftest import record_sparse_ops

HERE = pathlib.Path(__file__).parent
PROGRAMS = ["gcn", "gat", "moe", "attention", "issue_moe", "edge_mlp"]

# program -> (the exception its scorch run raises now, why). Remove an entry when its test XPASSes.
MISSING: dict = {}

TOLERANCES = {"float32": dict(rtol=1e-4, atol=1e-5), "float64": dict(rtol=1e-7, atol=1e-9)}

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
]


@functools.cache
def program(name):
    spec = importlib.util.spec_from_file_location(f"dropin_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def torch_result(name):
    """The program under plain torch (its ``reference`` where it has one), run once per session."""
    prog = program(name)
    return getattr(prog, "reference", prog.run)(torch)


def _resolve(path):
    """'torch.sparse.mm' -> the torch function object itself."""
    obj = torch
    for part in path.split(".")[1:]:
        obj = getattr(obj, part)
    return obj




def _is_sparse(v):
    return isinstance(v, torch.Tensor) and (isinstance(v, scorch.SparseTensor) or v.layout != torch.strided)


def _plain(v):
    """A dense, detached torch.Tensor (or the float itself)."""
    if not isinstance(v, torch.Tensor):
        return v
    if _is_sparse(v):
        v = v.to_dense()
    return v.detach()


def _params():
    out = []
    for name in PROGRAMS:
        marks = ()
        if name in MISSING:
            exc, what = MISSING[name]
            marks = pytest.mark.xfail(strict=True, raises=exc, reason=what)
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", PROGRAMS)
def test_plain_torch(name):
    """The programs themselves are sound: they run under torch, give finite results, and training lowers the
    loss."""
    result = torch_result(name)
    assert result
    for key, value in result.items():
        value = _plain(value)
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                assert torch.isfinite(value).all(), key
        else:
            assert math.isfinite(value), key
    if "losses" in result:
        losses = result["losses"]
        assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", _params())
def test_scorch_matches_torch(name):
    prog = program(name)
    expected = torch_result(name)
    with record_sparse_ops() as seen:
        got = prog.run(scorch)

    # no silent fallback: the sparse tensors are scorch's, and the sparse ops were scorch's
    for key in prog.SPARSE_KEYS:
        assert isinstance(got[key], scorch.SparseTensor), (key, type(got[key]), getattr(got[key], "layout", None))
    for op in prog.SCORCH_OPS:
        assert any(seen[_resolve(alt)] for alt in op.split("|")), \
            f"{op} never reached scorch with a SparseTensor operand"

    tol = TOLERANCES[prog.DTYPE]
    assert set(got) == set(expected)
    for key, want in expected.items():
        have = got[key]
        if not isinstance(want, torch.Tensor):
            assert have == pytest.approx(want, rel=tol["rtol"], abs=tol["atol"]), key
            continue
        have, want = _plain(have), _plain(want)
        assert type(have) is torch.Tensor, (key, type(have))  # dense results are plain torch tensors
        if key == "losses":  # a training curve: say the first step that goes off
            assert have.shape == want.shape
            for step, (h, w) in enumerate(zip(have, want)):
                torch.testing.assert_close(h, w, **tol, msg=lambda m: f"loss at step {step}: {m}")
        else:
            torch.testing.assert_close(have, want, **tol, msg=lambda m: f"{key}: {m}")
