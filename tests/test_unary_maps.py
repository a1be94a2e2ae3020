"""The table of unary maps (``scorch/unary_maps.py``) against what each layer does with it: every spelling of a
zero-preserving map keeps the pattern in eager mode with dense torch's values, in place too; every traced map stays
sparse under ``torch.compile`` (one graph); every epilogue map fuses into a product's kernel under
``scorch.compile``. Each layer's table is the one record's, so a map added there is checked here."""
import warnings

import pytest
import torch

import scorch
from scorch import dynamo, fusion_epilogue, loopir
from scorch.sparse_tensor import IMPLEMENTATIONS
from scorch.unary_maps import MAPS

from conftest import assert_matches_dense
from test_compile import fresh_dynamo  # noqa: F401  (every test compiles anew)

#: arguments for the maps torch calls only with some (the others are called with the tensor alone)
ARGS = {"clamp": (-0.5, 0.5), "clip": (-0.5, 0.5), "clamp_min": (-0.5,), "clamp_max": (0.5,), "pow": (2,),
        "threshold": (0.1, 0.0)}


def _label(f):
    return getattr(f, "__qualname__", None) or getattr(f, "__name__", repr(f))


def _cases(maps, attr):
    return [pytest.param(m, f, id=f"{m.name}-{_label(f)}") for m in maps for f in getattr(m, attr)]


def _operand(fmt="csr"):
    """A sparse operand and its dense form (+0.0 where nothing is stored: signbit(-0.0) is True, 1 / -0.0 is -inf),
    values inside every map's domain (atanh, erfinv, asin)."""
    g = torch.Generator().manual_seed(0)
    keep = torch.rand(6, 5, generator=g) < 0.4
    d = torch.where(keep, torch.rand(6, 5, generator=g) * 1.8 - 0.9, 0.0)
    return d, scorch.asformat(d, fmt)


def _dense(r):
    """A result as a dense tensor, nan and infinities as numbers (sqrt of a negative value is nan on both sides)."""
    r = r.to_dense() if isinstance(r, scorch.SparseTensor) else r
    return torch.nan_to_num(r) if r.dtype.is_floating_point else r


def test_each_spelling_belongs_to_one_map_and_has_an_eager_rule():
    seen = {}
    for m in MAPS:
        for f in m.funcs + m.inplace:
            assert seen.setdefault(f, m.name) == m.name, f"{_label(f)} is a spelling of {seen[f]} and {m.name}"
            assert f in IMPLEMENTATIONS, f"{m.qualname}: {_label(f)} has no eager rule"
        assert getattr({"torch": torch, "torch.nn.functional": torch.nn.functional}[m.namespace], m.name) is m.funcs[0]
        # (a map that takes no arguments runs on the values unchecked: it must keep zero)
        assert m.probe or (m.zero and m.name not in ARGS)


def test_traced_and_epilogue_tables_are_the_records():
    for m in MAPS:
        for f in m.funcs:
            assert (f in dynamo.TRACED) == m.traced, f"{_label(f)}: traced is {m.traced}"
            assert fusion_epilogue._MAPS.get(f) == (m.name if m.epilogue else None)
        assert not m.traced or m.zero, f"{m.name} is traced, but f(0) != 0"
        assert not m.epilogue or m.name in loopir.UNARY or m.name == "sigmoid", \
            f"{m.name}: the epilogue kernel has no expression for it"


@pytest.mark.parametrize("m, f", _cases([m for m in MAPS if m.zero], "funcs"))
def test_zero_preserving_map_keeps_the_pattern(m, f):
    d, s = _operand()
    args = ARGS.get(m.name, ())
    got = f(s, *args)
    assert isinstance(got, scorch.SparseTensor) and got.format == s.format
    for a, b in zip(got.levels, s.levels):
        for x, y in ((a.pos, b.pos), (a.crd, b.crd)):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
    assert_matches_dense(_dense(got), _dense(f(d, *args)))


@pytest.mark.parametrize("m, f", _cases([m for m in MAPS if not m.zero], "funcs"))
def test_densifying_map_gives_torch_dense_result(m, f):
    d, s = _operand()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        got = f(s, *ARGS.get(m.name, ()))
    assert not isinstance(got, scorch.SparseTensor)
    assert_matches_dense(_dense(got), _dense(f(d, *ARGS.get(m.name, ()))))


@pytest.mark.parametrize("m, f", _cases([m for m in MAPS if m.zero], "inplace"))
def test_zero_preserving_map_in_place(m, f):
    d, s = _operand()
    args = ARGS.get(m.name, ())
    assert f(s, *args) is s
    assert_matches_dense(_dense(s), _dense(f(d.clone(), *args)))


def test_traced_maps_stay_sparse_in_one_graph():
    """Every spelling of every traced map, in one ``fullgraph`` compile: the values equal eager's."""
    calls = [(f, ARGS.get(m.name, ())) for m in MAPS if m.traced for f in m.funcs]
    _, s = _operand()

    def fn(x):
        return [f(x, *args).values() for f, args in calls]

    want = fn(s)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(s)
    for (f, _), a, b in zip(calls, got, want):
        assert a.dtype == b.dtype, _label(f)
        torch.testing.assert_close(a, b, equal_nan=True, msg=lambda text: f"{_label(f)}: {text}")


@pytest.mark.parametrize("m", [m for m in MAPS if m.epilogue], ids=lambda m: m.name)
def test_epilogue_maps_fuse_into_the_product(m, monkeypatch):
    kernels = []  # (what epilogue_kernel returned: None where the product and its steps did not fuse)
    monkeypatch.setattr(fusion_epilogue, "epilogue_kernel",
                        lambda e, kernel=fusion_epilogue.epilogue_kernel: kernels.append(kernel(e)) or kernels[-1])
    g = torch.Generator().manual_seed(1)
    d = torch.randn(7, 5, generator=g, dtype=torch.float64) * (torch.rand(7, 5, generator=g) < 0.5)
    x, b = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    f = m.funcs[0]
    got = scorch.compile(lambda s, x, b: f(s @ x + b))(scorch.asformat(d, "csr"), x, b)
    assert len(kernels) == 1 and kernels[0] is not None
    assert_matches_dense(_dense(got), _dense(f(d @ x + b)))


@pytest.mark.parametrize("call", [lambda x: torch.nn.functional.hardtanh(x, 0.5, 1.0),
                                  lambda x: torch.nn.functional.leaky_relu(x, inplace=True),
                                  lambda x: torch.clamp(x, min=torch.tensor(0.5)), lambda x: torch.nn.functional.relu(x, inplace=True)],
                         ids=["f0-not-0", "inplace", "tensor-argument", "plain-map-inplace"])
def test_traced_map_refuses_what_would_not_keep_the_pattern(call):
    _, s = _operand()
    with pytest.raises(Exception, match="maps 0 to 0"):
        torch.compile(lambda x: call(x).values(), fullgraph=True, backend="aot_eager")(s)


def test_traced_map_with_arguments_matches_eager():
    _, s = _operand()

    def fn(x):
        return [torch.nn.functional.leaky_relu(x, 0.2).values(),
                torch.nn.functional.gelu(x, approximate="tanh").values(),
                torch.nn.functional.hardtanh(x, -0.25, 0.5).values()]

    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(s), fn(s))
