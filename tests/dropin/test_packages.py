"""Third-party model packages from the registry, run unchanged with ``torch`` replaced by ``scorch``.

Each package (in the dev extra of pyproject.toml) is imported twice: as installed (plain torch), and fresh with
``sys.modules['torch']`` (and ``torch.nn``, ``torch.nn.functional``, ``torch.sparse``) set to scorch's modules,
so that every ``import torch`` / ``from torch import nn, einsum`` / ``import torch.nn.functional as F`` in the
package's own files binds scorch (checked). A package that cannot be imported twice in one process (PyTorch
Geometric registers names globally) is imported under the alias in a child process that installs the alias
first. The same model (same weights: the state_dict is copied) then runs under both, forward and backward, in
float64, and the outputs and every gradient must match:

- ``test_dense_under_alias``: the inputs as they are: the alias alone changes nothing.
- ``test_sparse_operand``: the model's natural sparse operand (the MoE gate, the attention mask, the graph's
  adjacency) is a ``scorch.SparseTensor``; the case's sparse ops must have reached scorch with a sparse
  operand (through ``SparseTensor.__torch_function__``, or scorch's own ``einsum``/``sparse.mm`` called
  directly): no silent dense path. A dense fallback (``scorch.DensifyWarning``) is allowed: it is right too.

A case that scorch cannot run yet is a strict xfail naming the op that is missing (``MISSING``): it turns
into a failure (XPASS) once scorch implements it, and the mark is then removed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import pathlib
import pickle
import subprocess
import sys
import traceback
import types
import warnings
from typing import Callable

import pytest
import torch

import scorch
from conftest import record_sparse_ops

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated"),  # x-transformers' decorators
]
ROOT = pathlib.Path(__file__).resolve().parents[2]

# The torch modules scorch shadows with its own; every other ``torch.X`` is the same object under both.
SHADOWED = ("torch", "torch.nn", "torch.nn.functional", "torch.sparse")
TORCH_MODULES = {name: importlib.import_module(name) for name in SHADOWED}
TOLERANCE = dict(rtol=1e-7, atol=1e-9)  # every case runs in float64


def _scorch_module(torch_name):
    return importlib.import_module("scorch" + torch_name[len("torch"):])


def _package_modules(package):
    return {name: m for name, m in sys.modules.items() if name == package or name.startswith(package + ".")}


def _pop_package(package):
    """Remove ``package`` and its submodules from sys.modules; return what was removed."""
    return {name: sys.modules.pop(name) for name in _package_modules(package)}


@contextlib.contextmanager
def torch_is_scorch():
    """Within the block, ``import torch`` (and the shadowed submodules) gives scorch's modules."""
    sys.modules.update({name: _scorch_module(name) for name in SHADOWED})
    try:
        yield
    finally:
        sys.modules.update(TORCH_MODULES)


@functools.cache
def load(case_name, alias):
    """The case's package's modules (name -> module), imported as installed (``alias=False``) or fresh with torch
    replaced by scorch. The plain import comes first, so the package's dependencies (einops, einx...) are
    loaded once, with torch; only the package's own files are imported again under the alias, and
    sys.modules is left as it was. A ``fresh_process`` case is imported under the alias only in a child
    process (``_child``), where the alias stays for good, as in a program that installed it first."""
    case = CASES[case_name]
    package = case.package
    imports = case.imports or (package,)
    if alias and case.fresh_process:
        assert os.environ.get(CHILD) == case_name, f"{package} is imported under the alias in a child process only"
        assert package not in sys.modules, f"{package} was imported before the alias"
        sys.modules.update({name: _scorch_module(name) for name in SHADOWED})
        for name in imports:
            importlib.import_module(name)
        return _package_modules(package)
    plain = [importlib.import_module(name) for name in imports][0]
    if not alias:
        return _package_modules(package)
    before = _pop_package(package)
    try:
        with torch_is_scorch():
            for name in imports:
                importlib.import_module(name)
        return _pop_package(package)
    finally:
        _pop_package(package)
        sys.modules.update(before)
        assert sys.modules[imports[0]] is plain


def assert_bound_to_scorch(modules):
    """No module-level name in the package's files is torch's own module where scorch has one; at least one
    is scorch's."""
    real = {id(m): name for name, m in TORCH_MODULES.items()}
    ours = {id(_scorch_module(name)) for name in SHADOWED}
    seen_ours = False
    for mod_name, mod in modules.items():
        for attr, value in vars(mod).items():
            if isinstance(value, types.ModuleType):
                assert id(value) not in real, f"{mod_name}.{attr} is {real[id(value)]}, not scorch's"
                seen_ours |= id(value) in ours
    assert seen_ours, f"no module of {sorted(modules)} imported torch"


# --- the cases ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One model of one package. ``build(modules)`` makes the model from the package's modules (name ->
    module: the package and ``imports``, the modules to import where the package's ``__init__`` does not);
    ``inputs()`` gives the call's (args, kwargs), dense, float64 where floating; ``sparsify(model, args,
    kwargs)`` puts the natural sparse operand in (it may wrap the forward of one of the model's modules);
    ``sparse_ops``: the torch functions (or scorch's own, called directly: "scorch.einsum") that must then
    reach scorch with a sparse operand ("a|b": either one); ``no_fallback``: the sparse run may not densify
    nor fall back to the dense form (``scorch.stats()`` unchanged); ``fresh_process``: a package that cannot be
    imported twice in one process (it registers names globally) runs under the alias in a child process."""
    package: str
    requirement: str
    build: Callable
    inputs: Callable
    sparsify: Callable | None = None
    sparse_ops: tuple = ()
    imports: tuple = ()
    no_fallback: bool = False
    fresh_process: bool = False


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# mixture-of-experts (lucidrains): top-2 gating; the gate's dispatch and combine tensors (batch, group,
# experts, capacity: at most 2 nonzeros per token) are the sparse operand of the two einsums around the experts.

def sparse_gate(gate):
    """The package's own gating module, its dispatch and combine tensors returned as COO SparseTensors
    (differentiable: the combine tensor's gradient reaches the gate's weights). Only this instance's forward is
    wrapped: the model's modules and parameter names stay as they are."""
    dense_forward = gate.forward

    def forward(*args, **kwargs):
        dispatch, combine, loss = dense_forward(*args, **kwargs)
        return scorch.asformat(dispatch, "coo"), scorch.asformat(combine, "coo"), loss

    gate.forward = forward


def _moe_build(m):
    return m["mixture_of_experts"].MoE(dim=8, num_experts=4, hidden_dim=16)


def _moe_inputs():
    return (torch.randn(2, 12, 8, generator=_gen(), dtype=torch.float64),), {}


def _moe_sparsify(model, args, kwargs):
    sparse_gate(model.gate)
    return args, kwargs


def _hierarchical_moe_build(m):
    return m["mixture_of_experts"].HeirarchicalMoE(dim=8, num_experts=(2, 3), hidden_dim=16)


def _hierarchical_moe_sparsify(model, args, kwargs):
    sparse_gate(model.gate_outer)
    sparse_gate(model.gate_inner)
    return args, kwargs


# fast-gat: a dense-adjacency graph attention network; the boolean adjacency (self loops included) is CSR.

def _adjacency(n, p, seed):
    a = torch.rand(n, n, generator=_gen(seed)) < p
    return a | torch.eye(n, dtype=torch.bool)


def _gat_build(m):
    return m["fast_gat"].DenseGraphAttentionNetwork(depth=2, heads=2, input_dim=6, inner_dim=8)


def _gat_inputs():
    return (torch.randn(10, 6, generator=_gen(), dtype=torch.float64), _adjacency(10, 0.25, 1)), {}


def _sparse_arg(index, fmt):
    def sparsify(model, args, kwargs):
        args = list(args)
        args[index] = scorch.asformat(args[index], fmt)
        return tuple(args), kwargs
    return sparsify


def _sparse_kwarg(key, fmt):
    def sparsify(model, args, kwargs):
        return args, {**kwargs, key: scorch.asformat(kwargs[key], fmt)}
    return sparsify


# x-transformers: an encoder with a banded attention mask (i, j) (a sliding window), sparse as CSR.

def _band(n, width):
    i = torch.arange(n)
    return (i[:, None] - i[None, :]).abs() <= width


def _xt_build(m):
    return m["x_transformers"].Encoder(dim=16, depth=1, heads=2, attn_dim_head=8)


def _xt_inputs():
    return (torch.randn(2, 10, 16, generator=_gen(), dtype=torch.float64),), {"attn_mask": _band(10, 2)}


# graph-transformer-pytorch: a graph transformer whose adjacency matrix (batch, nodes, nodes) is embedded as an
# edge feature; the adjacency is a COO SparseTensor.

def _gt_build(m):
    return m["graph_transformer_pytorch"].GraphTransformer(dim=8, depth=1, dim_head=4, heads=2,
                                                           accept_adjacency_matrix=True)


def _gt_inputs():
    nodes = torch.randn(1, 7, 8, generator=_gen(), dtype=torch.float64)
    return (nodes,), {"adj_mat": _adjacency(7, 0.3, 2)[None], "mask": torch.ones(1, 7, dtype=torch.bool)}


# PyTorch Geometric: a two-layer GCN (``torch_geometric.nn.models.GCN``); its edge_index, and as the sparse
# operand the (symmetric) adjacency itself, CSR, which GCNConv normalizes and multiplies (torch.sparse.mm).
# PyG registers names globally at import (datapipes), so it is imported under the alias in a child process.

def _gcn_build(m):
    return m["torch_geometric.nn"].models.GCN(in_channels=6, hidden_channels=8, num_layers=2, out_channels=3)


def _symmetric_adjacency(n, p, seed):
    a = torch.rand(n, n, generator=_gen(seed)) < p
    return (a | a.T) & ~torch.eye(n, dtype=torch.bool)


def _gcn_inputs():
    return (torch.randn(12, 6, generator=_gen(), dtype=torch.float64),
            _symmetric_adjacency(12, 0.2, 3).nonzero().T.contiguous()), {}


def _gcn_sparsify(model, args, kwargs):
    x, edge_index = args
    adjacency = torch.zeros(x.shape[0], x.shape[0], dtype=x.dtype)
    adjacency[edge_index[1], edge_index[0]] = 1.0  # adj_t: a row per target node
    return (x, scorch.asformat(adjacency, "csr")), kwargs


# torchfm: DeepFM on categorical fields (an index per field; no natural sparse operand: dense only).

def _fm_build(m):
    return m["torchfm.model.dfm"].DeepFactorizationMachineModel(field_dims=[4, 6, 3], embed_dim=4, mlp_dims=(8,),
                                                                  dropout=0.2)


def _fm_inputs():
    g = _gen()
    return (torch.stack([torch.randint(0, n, (16,), generator=g) for n in (4, 6, 3)], dim=1),), {}


CASES = {
    "mixture_of_experts": Case("mixture_of_experts", "mixture-of-experts==0.2.3", _moe_build, _moe_inputs,
                               _moe_sparsify, ("scorch.einsum",), no_fallback=True),
    "mixture_of_experts_hierarchical": Case("mixture_of_experts", "mixture-of-experts==0.2.3",
                                            _hierarchical_moe_build, _moe_inputs, _hierarchical_moe_sparsify,
                                            ("scorch.einsum",)),
    "fast_gat": Case("fast_gat", "fast-gat==0.2.0", _gat_build, _gat_inputs, _sparse_arg(1, "csr"),
                     ("torch.Tensor.__invert__",)),
    "x_transformers": Case("x_transformers", "x-transformers==2.31.10", _xt_build, _xt_inputs,
                           _sparse_kwarg("attn_mask", "csr"), ("torch.Tensor.__invert__",)),
    "graph_transformer_pytorch": Case("graph_transformer_pytorch", "graph-transformer-pytorch==0.1.1", _gt_build,
                                      _gt_inputs, _sparse_kwarg("adj_mat", "coo"), ("torch.Tensor.long",)),
    "torch_geometric": Case("torch_geometric", "torch_geometric", _gcn_build, _gcn_inputs, _gcn_sparsify,
                            ("scorch.sparse.mm|torch.sparse.mm|torch.matmul",), imports=("torch_geometric.nn",),
                            fresh_process=True),
    "torchfm": Case("torchfm", "torchfm==0.7.0", _fm_build, _fm_inputs, imports=("torchfm.model.dfm",)),
}

# (case, "loaded" | "dense" | "sparse") -> (the exception(s) scorch raises now, the op). Remove an entry when
# its test XPASSes.
MISSING: dict = {}


# --- running a case -------------------------------------------------------------------------------------------

def _resolve(path):
    """'torch.Tensor.long' -> the torch function object itself; 'scorch.einsum' -> scorch's."""
    root, *parts = path.split(".")
    obj = {"torch": torch, "scorch": scorch}[root]
    for part in parts:
        obj = getattr(obj, part)
    return obj


def _is_sparse(t):
    return isinstance(t, scorch.SparseTensor) or (isinstance(t, torch.Tensor) and t.layout != torch.strided)


@contextlib.contextmanager
def record_scorch_calls(paths, modules):
    """Counts the calls, with a sparse operand, of scorch's own functions named by ``paths`` ("scorch.einsum",
    "scorch.sparse.mm": called directly, so ``SparseTensor.__torch_function__`` never sees them): each is
    replaced by a counting wrapper in its own module and wherever the package's modules bound it
    (``from torch import einsum``). Yields a Counter keyed by the functions themselves."""
    import collections
    seen = collections.Counter()
    patched = []

    def spy(function):
        @functools.wraps(function)
        def counting(*args, **kwargs):
            flat = [x for a in (*args, *kwargs.values()) for x in (a if isinstance(a, (list, tuple)) else (a,))]
            if any(_is_sparse(x) for x in flat):
                seen[function] += 1
            return function(*args, **kwargs)
        return counting

    spies = {id(_resolve(path)): spy(_resolve(path)) for path in paths}
    owners = [_resolve(path.rpartition(".")[0]) for path in paths]
    try:
        for mod in (*owners, *modules):
            for attr, value in list(vars(mod).items()):
                if id(value) in spies:
                    patched.append((mod, attr, value))
                    setattr(mod, attr, spies[id(value)])
        yield seen
    finally:
        for mod, attr, value in reversed(patched):
            setattr(mod, attr, value)


def _dense(t):
    return t.to_dense() if _is_sparse(t) else t


def _tensors(out):
    """The floating tensors of a model's output (a tensor, or a tuple/list of them and other things)."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _float_leaves(args, kwargs):
    leaves = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    for leaf in leaves:
        leaf.requires_grad_(True)
    return leaves


def run_case(name, alias, state, sparse=False):
    """Build the case's model with the package loaded as installed or under the alias, give it the weights
    ``state``, and run it once forward and backward (a fixed random weighting of every output, so that no
    gradient is trivially uniform). Returns (outputs, parameter gradients by name, input gradients)."""
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build(load(name, alias)).double()
    model.load_state_dict(state)
    args, kwargs = case.inputs()
    leaves = _float_leaves(args, kwargs)
    if sparse:
        args, kwargs = case.sparsify(model, args, kwargs)
    torch.manual_seed(1)  # dropout and random gate policies draw the same numbers in both runs
    outputs = [_dense(t) for t in _tensors(model(*args, **kwargs))]
    g = _gen(2)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in outputs)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return [t.detach() for t in outputs], grads, [leaf.grad for leaf in leaves]


@functools.cache
def reference_state(name):
    torch.manual_seed(0)
    return {k: v.double() for k, v in CASES[name].build(load(name, False)).state_dict().items()}


@functools.cache
def reference(name):
    return run_case(name, False, reference_state(name))


def scorch_run(name, state, sparse):
    """The case with its package under the alias (after checking that the package's files bound scorch),
    with the natural sparse operand if ``sparse`` (then checking that the case's sparse ops reached scorch)."""
    case = CASES[name]
    modules = load(name, True)
    assert_bound_to_scorch(modules)
    if not sparse:
        return run_case(name, True, state)
    wanted = [alt for op in case.sparse_ops for alt in op.split("|") if alt.startswith("scorch.")]
    before = scorch.stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)  # a dense fallback is allowed; it is still right
        with record_sparse_ops() as seen, record_scorch_calls(wanted, modules.values()) as called:
            got = run_case(name, True, state, sparse=True)
    seen.update(called)
    for op in case.sparse_ops:
        assert any(seen[_resolve(alt)] for alt in op.split("|")), f"{op} never reached scorch with a sparse operand"
    if case.no_fallback:
        after = scorch.stats()
        dense_ops = {(kind, op) for kind, ops in after.items() for op, n in ops.items()
                     if n > before.get(kind, {}).get(op, 0)}
        assert not dense_ops, f"the sparse run went dense: {sorted(dense_ops)}"
    return got


CHILD = "SCORCH_TEST_PACKAGE_CHILD"


def _child(name, state_path, out_path):
    """In a child process: the case's package imported under the alias, then its runs under scorch (dense,
    sparse); each outcome ("ok", value) or ("error", exception) saved to ``out_path``. An import that failed
    is every part's outcome (a second import would meet the first one's half-initialized modules)."""
    state = torch.load(state_path)
    outcomes = {}
    for part, run in (("loaded", lambda: assert_bound_to_scorch(load(name, True))),
                      ("dense", lambda: scorch_run(name, state, sparse=False)),
                      ("sparse", lambda: scorch_run(name, state, sparse=True))):
        if outcomes.get("loaded", ("ok",))[0] == "error":
            outcomes[part] = outcomes["loaded"]
            continue
        try:
            outcomes[part] = ("ok", run())
        except Exception as exc:  # handed to the parent, which raises it in the test it belongs to
            if hasattr(exc, "add_note"):  # Python 3.11+: the child's traceback goes along
                exc.add_note("in the child process:\n" + traceback.format_exc())
            outcomes[part] = ("error", exc)
    with open(out_path, "wb") as f:  # pickle: torch.save gives a ModuleNotFoundError back as an ImportError
        pickle.dump(outcomes, f)


@functools.cache
def _fresh_outcomes(name, tmp):
    """The child process's outcomes for a ``fresh_process`` case (one child per session)."""
    state_path, out_path = tmp / f"{name}-state.pt", tmp / f"{name}-outcomes.pt"
    torch.save(reference_state(name), state_path)
    here = pathlib.Path(__file__).resolve().parent
    code = (f"import sys; sys.path[:0] = [{str(here.parent)!r}, {str(here)!r}]; import test_packages; "
            f"test_packages._child({name!r}, {str(state_path)!r}, {str(out_path)!r})")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, CHILD: name}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out_path, "rb") as f:
        return pickle.load(f)


def scorch_outcome(name, part, tmp_path_factory):
    """The case's ``part`` ("loaded", "dense", "sparse") under scorch: its value, or its exception raised."""
    if CASES[name].fresh_process:
        kind, value = _fresh_outcomes(name, tmp_path_factory.getbasetemp())[part]
        if kind == "error":
            raise value
        return value
    if part == "loaded":
        return assert_bound_to_scorch(load(name, True))
    return scorch_run(name, reference_state(name), sparse=part == "sparse")


def assert_same_run(got, want):
    (outs, grads, leaf_grads), (want_outs, want_grads, want_leaf_grads) = got, want
    assert len(outs) == len(want_outs)
    for i, (have, expect) in enumerate(zip(outs, want_outs)):
        assert type(have) is torch.Tensor, (i, type(have))  # dense results are plain torch tensors
        torch.testing.assert_close(have, expect, **TOLERANCE, msg=lambda m: f"output {i}: {m}")
    assert set(grads) == set(want_grads)
    for name, expect in want_grads.items():
        have = grads[name]
        assert (have is None) == (expect is None), name
        if expect is not None:
            torch.testing.assert_close(_dense(have), expect, **TOLERANCE, msg=lambda m: f"grad of {name}: {m}")
    for i, (have, expect) in enumerate(zip(leaf_grads, want_leaf_grads)):
        torch.testing.assert_close(_dense(have), expect, **TOLERANCE, msg=lambda m: f"grad of input {i}: {m}")


def _params(kind):
    out = []
    for name, case in CASES.items():
        if kind == "sparse" and case.sparsify is None:
            continue
        marks = ()
        if (name, kind) in MISSING:
            exc, what = MISSING[name, kind]
            marks = pytest.mark.xfail(strict=True, raises=exc, reason=what)
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _params("loaded"))
def test_loaded_under_alias(name, tmp_path_factory):
    """The package's own files bind scorch, and (imported in this process) the plain import is untouched."""
    scorch_outcome(name, "loaded", tmp_path_factory)
    if not CASES[name].fresh_process:
        aliased, plain = load(name, True), load(name, False)
        assert set(aliased) == set(plain)
        assert all(aliased[m] is not plain[m] for m in plain)
        package = CASES[name].package
        assert sys.modules[package] is plain[package] and sys.modules["torch"] is torch


@pytest.mark.parametrize("name", _params("dense"))
def test_dense_under_alias(name, tmp_path_factory):
    assert_same_run(scorch_outcome(name, "dense", tmp_path_factory), reference(name))


@pytest.mark.parametrize("name", _params("sparse"))
def test_sparse_operand(name, tmp_path_factory):
    assert_same_run(scorch_outcome(name, "sparse", tmp_path_factory), reference(name))


def test_checks_can_fail():
    """The checks are not vacuous: the plain import does not pass for one under the alias, and a run whose
    weights differ in one entry does not pass for the reference."""
    with pytest.raises(AssertionError, match="not scorch's"):
        assert_bound_to_scorch(load("fast_gat", False))
    state = {k: v.clone() for k, v in reference_state("fast_gat").items()}
    next(iter(state.values())).view(-1)[0] += 1e-6
    with pytest.raises(AssertionError):
        assert_same_run(run_case("fast_gat", False, state), reference("fast_gat"))


def test_pinned_and_named():
    """Every package is pinned in the dev extra (what CI installs) and named with its pin in docs/third-party.md,
    the page the README links for them."""
    extras = (ROOT / "pyproject.toml").read_text()
    page = (ROOT / "docs" / "third-party.md").read_text()
    assert "docs/third-party.md" in (ROOT / "README.md").read_text()
    for case in CASES.values():
        assert f'"{case.requirement}"' in extras, case.requirement
        assert f"`{case.requirement}`" in page, case.requirement
