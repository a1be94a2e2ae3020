"""Checkpoints plain torch loads (issue 44): ``scorch.save_portable`` writes torch tensors, ``scorch.load_portable``
gives the SparseTensors back in their formats."""
import io
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch

import scorch

FORMATS = ["csr", "csc", "coo", "bsr(2, 4)", "bsc(2, 2)", "dcsr", "ell", "dia", "dense"]
# the torch layout each is saved as: its own where torch has it, else COO (never densified); a dense format dense
LAYOUT = {"csr": torch.sparse_csr, "csc": torch.sparse_csc, "coo": torch.sparse_coo, "bsr(2, 4)": torch.sparse_bsr,
          "bsc(2, 2)": torch.sparse_bsc, "dcsr": torch.sparse_coo, "ell": torch.sparse_coo,
          "dia": torch.sparse_coo, "dense": torch.strided}


def _matrix(seed=0, shape=(8, 12)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * (torch.rand(*shape, generator=g) < 0.3)


def _plain_torch_load(path) -> str:
    """``torch.load(path)`` in a process that never imports scorch (weights_only=True, torch's default); what each
    entry is, one line each."""
    code = ("import sys, torch\n"
            f"sd = torch.load({str(path)!r})\n"
            "assert not any(m.startswith('scorch') for m in sys.modules), 'scorch was imported'\n"
            "for k, v in sd.items():\n"
            "    print(k, v.layout, tuple(v.shape), float(v.to_dense().sum()), sep='|')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(path.parent))
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_plain_torch_loads_a_portable_checkpoint(tmp_path):
    d = _matrix()
    sd = {f: scorch.asformat(d, f) for f in FORMATS}
    sd["bias"] = torch.arange(3.0)
    path = tmp_path / "portable.pt"
    scorch.save_portable(sd, path)
    lines = {line.split("|")[0]: line.split("|")[1:] for line in _plain_torch_load(path).splitlines()}
    assert set(lines) == set(sd)
    total = float(d.sum())
    for f in FORMATS:
        layout, shape, s = lines[f]
        assert layout == str(LAYOUT[f]) and shape == "(8, 12)", (f, lines[f])
        assert float(s) == pytest.approx(total, rel=1e-5)


def test_plain_torch_refuses_a_plain_save_naming_scorch(tmp_path):
    """What the docs tell apart: ``torch.save`` of a SparseTensor needs scorch to load (the error names it)."""
    path = tmp_path / "plain.pt"
    torch.save({"w": scorch.asformat(_matrix(), "csr")}, path)
    r = subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(path)!r})"], capture_output=True,
                       text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode != 0 and "scorch.sparse_tensor._rebuild" in r.stderr


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_round_trip_keeps_format_index_dtype_and_values(fmt, dtype):
    s = scorch.asformat(_matrix(1).to(dtype), fmt)
    buf = io.BytesIO()
    scorch.save_portable({"w": s}, buf)
    buf.seek(0)
    back = scorch.load_portable(buf)["w"]
    assert isinstance(back, scorch.SparseTensor)
    assert back.format == s.format and back._index_dtype == s._index_dtype and back.dtype == dtype
    assert torch.equal(back.to_dense(), s.to_dense())
    if LAYOUT[fmt] is not torch.sparse_coo or fmt == "coo":  # the torch layout's arrays: the very same entries
        for a, b in zip(back.levels, s.levels):
            for x, y in ((a.pos, b.pos), (a.crd, b.crd)):
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y))


@pytest.mark.parametrize("fmt,shape", [("bsr(3, 5)", (8, 12)), ("csf", (3, 4, 5))])
def test_formats_torch_cannot_hold_go_through_coo(fmt, shape):
    """Blocks the shape does not divide (torch's BSR refuses them) and a 3-d CSF: saved as COO, restored."""
    s = scorch.asformat(_matrix(4, shape), fmt)
    portable = scorch.to_portable(s)
    assert portable.layout == torch.sparse_coo and not isinstance(portable, scorch.SparseTensor)
    back = scorch.from_portable(portable)
    assert back.format == s.format and torch.equal(back.to_dense(), s.to_dense())


def test_model_state_dict_round_trip(tmp_path):
    """A model with sparse weights: its state dict saved portably, loaded into a fresh model, same outputs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(scorch.nn.SparseLinear(12, 8, format="csr", density=0.3), torch.nn.ReLU(),
                                scorch.nn.SparseLinear(8, 4, format="bsr(2, 4)", density=0.5))
    path = tmp_path / "model.pt"
    scorch.save_portable(model.state_dict(), path)
    sd = scorch.load_portable(path)
    assert isinstance(sd, OrderedDict) and sd._metadata == model.state_dict()._metadata
    fresh = torch.nn.Sequential(scorch.nn.SparseLinear(12, 8, format="csr", density=0.3), torch.nn.ReLU(),
                                scorch.nn.SparseLinear(8, 4, format="bsr(2, 4)", density=0.5))
    fresh.load_state_dict(sd)
    x = torch.randn(5, 12)
    torch.testing.assert_close(fresh(x), model(x))
    for (k, a), b in zip(model.state_dict().items(), sd.values()):
        assert type(a) is type(b), k
        if isinstance(a, scorch.SparseTensor):
            assert a.format == b.format, k


def test_nested_containers_and_parameters():
    w = torch.nn.Parameter(scorch.asformat(_matrix(2), "csr"))
    obj = {"layers": [w, (torch.ones(2), scorch.asformat(_matrix(3), "dcsr"))], "step": 7, "name": "run"}
    portable = scorch.to_portable(obj)
    assert portable["step"] == 7 and portable["name"] == "run"
    assert portable["layers"][0].layout == torch.sparse_csr and not portable["layers"][0].requires_grad
    assert portable["layers"][1][1].layout == torch.sparse_coo
    back = scorch.from_portable(portable)
    assert back["layers"][0].requires_grad and back["layers"][0].format.name == "csr"
    assert back["layers"][1][1].format.name == "dcsr" and torch.equal(back["layers"][1][0], torch.ones(2))
    assert torch.equal(back["layers"][1][1].to_dense(), _matrix(3))
    assert obj["layers"][0] is w  # the object saved is left as it was


def test_a_tampered_mark_is_refused():
    t = torch.eye(3).to_sparse()
    t._scorch_portable = {"format": "csr", "index_dtype": "int128"}
    with pytest.raises(ValueError, match="unknown index dtype"):
        scorch.from_portable({"w": t})
    t._scorch_portable = {"format": "csr", "index_dtype": "float32"}
    with pytest.raises(ValueError, match="index_dtype must be"):
        scorch.from_portable({"w": t})
    t._scorch_portable = "csr"
    with pytest.raises(ValueError, match="not what save_portable writes"):
        scorch.from_portable({"w": t})
