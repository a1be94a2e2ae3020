import pickle

import pytest
import torch

import scorch
from scorch import SparseTensor
from scorch.formats import LevelStorage

X = torch.tensor([[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 3.0, 4.0]])


def csr_parts():
    return [LevelStorage(), LevelStorage(pos=torch.tensor([0, 1, 1, 4]), crd=torch.tensor([1, 0, 2, 3]))], \
        torch.tensor([2.0, 1.0, 3.0, 4.0])


def test_is_a_tensor_with_metadata():
    s = scorch.asformat(X, "csr")
    assert isinstance(s, torch.Tensor) and isinstance(s, SparseTensor)
    assert s.shape == (3, 4) and s.dtype == torch.float32 and s.device == torch.device("cpu")
    assert s.dim() == 2 and s.ndim == 2 and s.size(1) == 4 and s.numel() == 12
    assert s.format == scorch.formats.csr and s.nnz == 4 and s.index_dtype == torch.int32
    assert s.values().tolist() == [2.0, 1.0, 3.0, 4.0]
    assert s.levels[1].pos.tolist() == [0, 1, 1, 4] and s.levels[1].crd.tolist() == [1, 0, 2, 3]
    assert s.levels[0].pos is None and s.levels[0].crd is None
    assert s.density == pytest.approx(4 / 12)
    assert torch.equal(s.to_dense(), X) and type(s.to_dense()) is torch.Tensor


def test_wraps_arrays_without_copying():
    levels, vals = csr_parts()
    s = SparseTensor("csr", (3, 4), levels, vals)
    assert s.values().data_ptr() == vals.data_ptr()
    assert s.levels[1].crd.data_ptr() == levels[1].crd.data_ptr()
    assert torch.equal(s.to_dense(), X)
    s2 = SparseTensor("csr", (3, 4), [{}, {"pos": levels[1].pos, "crd": levels[1].crd}], vals)
    assert torch.equal(s2.to_dense(), X)


def test_to_dtype_and_device():
    s = scorch.asformat(X, "coo")
    d = s.to(torch.float64)
    assert d.dtype == torch.float64 and d.values().dtype == torch.float64 and torch.equal(d.to_dense(), X.double())
    assert d.levels[0].crd.data_ptr() == s.levels[0].crd.data_ptr()  # only the values change
    assert s.to("cpu") is s and s.to(torch.float32) is s
    assert s.to(torch.float32, copy=True).values().data_ptr() != s.values().data_ptr()
    assert s.double().dtype == torch.float64 and s.double().float().dtype == torch.float32
    assert s.to(torch.zeros(1, dtype=torch.int64)).dtype == torch.int64


def test_clone_is_independent():
    s = scorch.asformat(X, "csr")
    c = s.clone()
    assert c.values().data_ptr() != s.values().data_ptr()
    assert c.levels[1].crd.data_ptr() != s.levels[1].crd.data_ptr()
    c.values()[0] = 100.0
    assert s.values()[0] == 2.0 and torch.equal(torch.clone(s).to_dense(), X)


def test_requires_grad_and_detach():
    s = scorch.asformat(X, "csr").requires_grad_()
    assert s.requires_grad and s.is_leaf and s.grad is None
    d = s.detach()
    assert not d.requires_grad and d.values().data_ptr() == s.values().data_ptr()
    assert "requires_grad=True" in repr(s)


def test_repr_shows_format_shape_dtype_nnz_density_and_picture():
    s = scorch.asformat(X, "csr")
    assert repr(s).splitlines() == [
        "SparseTensor(format=csr, shape=(3, 4), dtype=torch.float32, nnz=4, density=0.333)",
        "  .#..", "  ....", "  #.##"]
    b = scorch.asformat(X, "bsr(2, 2)")  # stored zeros inside blocks show as '0'
    assert repr(b).splitlines()[1:] == ["  0#..", "  00..", "  #0##"]
    big = scorch.asformat(torch.eye(100), "csr")
    assert "\n" not in repr(big) and "nnz=100" in repr(big) and "density=0.01" in repr(big)
    assert str(s) == repr(s)
    coo = scorch.sparse_coo_tensor([[0, 0], [1, 1]], [1.0, 2.0], (2, 2))
    assert "format=coo (uncoalesced)" in repr(coo)
    dsl = scorch.asformat(X, "(i, j) -> (i + j : compressed, i : dense)")
    assert "format=(i, j) -> (i + j : compressed, i : dense)" in repr(dsl)


def test_pickle_and_torch_save_round_trip(tmp_path):
    s = scorch.asformat(X, "bsr(2, 2)")
    r = pickle.loads(pickle.dumps(s))
    assert r.format == s.format and torch.equal(r.to_dense(), X)
    torch.save(s, tmp_path / "s.pt")
    r = torch.load(tmp_path / "s.pt", weights_only=False)
    assert isinstance(r, SparseTensor) and torch.equal(r.to_dense(), X)


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell", "bsr(2, 2)"])
def test_legacy_torch_save_format_and_meta_loads(fmt, tmp_path):
    """A legacy-format file reads its arrays after rebuilding the objects: the rebuild validated arrays that
    held no data yet (a ValueError on a good file); they are validated at the load's end now, so a bad file
    still raises. ``map_location="meta"`` (no data to check) loads too."""
    s = scorch.asformat(X, fmt)
    state = {"w": s, "p": torch.nn.Parameter(s)}
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    r = torch.load(tmp_path / "old.pt", weights_only=False)
    assert torch.equal(r["w"].to_dense(), X) and torch.equal(r["p"].to_dense(), X)
    assert type(r["p"]) is type(state["p"])
    m = torch.load(tmp_path / "old.pt", weights_only=False, map_location="meta")["w"]
    assert m.device.type == "meta" and m.shape == X.shape and m.format == s.format
    if fmt == "csr":
        crd = s.levels[1].crd + 100
        bad = SparseTensor(s.format, s.shape, [s.levels[0], {"pos": s.levels[1].pos, "crd": crd}], s.values(),
                           check=False)
        for legacy in (False, True):
            torch.save(bad, tmp_path / "bad.pt", _use_new_zipfile_serialization=not legacy)
            with pytest.raises(ValueError, match="out of range"):
                torch.load(tmp_path / "bad.pt", weights_only=False)


def test_strict_mode_names_the_unimplemented_op_and_format():
    s = scorch.asformat(X, "csr")
    with scorch.strict():
        with pytest.raises(scorch.DensifyError, match=r"torch\.cumprod has no sparse rule for these operands"
                                                      r" \(format csr \(3, 4\)\)"):
            torch.cumprod(s, 0)
        with pytest.raises(NotImplementedError, match=r"Tensor\.cumsum has no sparse rule.*format csr"):
            s.cumsum(0)
        with pytest.raises(NotImplementedError, match="format dia"):
            torch.sort(scorch.asformat(X, "dia"))


def test_construction_validates_by_default():
    levels, vals = csr_parts()
    bad = [LevelStorage(), LevelStorage(pos=levels[1].pos, crd=torch.tensor([1, 2, 0, 3]))]
    with pytest.raises(ValueError, match=r"level 1 \(j : compressed\): coordinates not strictly increasing"
                                         r" at stored entry 2 \(0 after 2\)"):
        SparseTensor("csr", (3, 4), bad, vals)
    s = SparseTensor("csr", (3, 4), bad, vals, check=False)  # trusted: no check
    with pytest.raises(ValueError, match="level 1"):
        s.check_invariants()
    with pytest.raises(ValueError, match="not strictly increasing"):
        scorch.asformat(s, "coo", check=True)
    with pytest.raises(ValueError, match="not strictly increasing"):
        with scorch.sparse.check_invariants():
            SparseTensor("csr", (3, 4), bad, vals, check=False)
    with pytest.raises(ValueError, match=r"values has shape \(3,\), expected \(4,\)"):
        SparseTensor("csr", (3, 4), levels, vals[:3])
    with pytest.raises(ValueError, match="has 2 levels, storage has 1"):
        SparseTensor("csr", (3, 4), levels[:1], vals)
    with pytest.raises(ValueError, match="for 2-d tensors"):
        SparseTensor("csr", (3, 4, 1), levels, vals)
    with pytest.raises(ValueError, match="negative dimension"):
        SparseTensor("csr", (3, -4), levels, vals)
    with pytest.raises(TypeError, match="values must be a torch.Tensor"):
        SparseTensor("csr", (3, 4), levels, [1.0, 2.0])


def test_out_of_range_coordinates_name_level_and_position():
    levels, vals = csr_parts()
    bad = [LevelStorage(), LevelStorage(pos=levels[1].pos, crd=torch.tensor([1, 0, 2, 4]))]
    with pytest.raises(ValueError, match=r"level 1 \(j : compressed\): crd\[3\] = 4 is out of range \[0, 4\)"):
        SparseTensor("csr", (3, 4), bad, vals)
    coo_bad = [LevelStorage(pos=torch.tensor([0, 2]), crd=torch.tensor([0, 0])),
               LevelStorage(crd=torch.tensor([3, 1]))]
    with pytest.raises(ValueError, match=r"level 1 \(j : singleton\): coordinates not strictly increasing"):
        SparseTensor("coo", (3, 4), coo_bad, torch.ones(2))


def test_asformat_errors():
    with pytest.raises(ValueError, match="unknown format 'crs'"):
        scorch.asformat(X, "crs")
    with pytest.raises(ValueError, match="0-d"):
        scorch.asformat(torch.tensor(1.0), "coo")
    with pytest.raises(ValueError, match="index_dtype"):
        scorch.asformat(X, "csr", index_dtype=torch.uint8)
    with pytest.raises(ValueError, match="cannot hold"):
        scorch.asformat(torch.ones(200, 200), "csr", index_dtype=torch.int16)
    with pytest.raises(ValueError, match="is for 2-d tensors, but the tensor is 1-d"):
        scorch.asformat(torch.ones(3), "csr")


def test_asformat_returns_the_same_tensor_when_nothing_changes():
    s = scorch.asformat(X, "csr")
    assert scorch.asformat(s, "csr") is s
    assert scorch.asformat(s, scorch.formats.csr, index_dtype=torch.int32) is s
    assert scorch.asformat(s, "csr", index_dtype=torch.int64).index_dtype == torch.int64
    assert torch.equal(s.asformat("csc").to_dense(), X)


def test_scorch_sparse_calls_go_straight_to_scorch_unless_a_torch_function_mode_is_active():
    """``scorch.sparse.mm`` on a SparseTensor calls scorch's implementation directly; under a TorchFunctionMode the
    call goes through torch's operator, so the mode sees it."""
    from torch.overrides import TorchFunctionMode
    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    s = scorch.asformat(torch.eye(3), "csr")
    torch.testing.assert_close(scorch.sparse.mm(s, torch.ones(3, 2)), torch.ones(3, 2))
    with Spy():
        r = scorch.sparse.mm(s, torch.ones(3, 2))
    assert torch.sparse.mm in seen
    torch.testing.assert_close(r, torch.ones(3, 2))


def test_deepcopy_of_a_sparse_parameter_leaves_its_grad_behind():
    """As torch's ``Parameter.__deepcopy__``: the copy's first backward must not add onto the original's grad."""
    import copy
    w = torch.nn.Parameter(scorch.asformat(X, "csr"))
    (w @ torch.ones(4, 2)).sum().backward()
    c = copy.deepcopy(w)
    assert w.grad is not None and c.grad is None and isinstance(c, torch.nn.Parameter)
    t = scorch.asformat(X, "csr").requires_grad_()
    (t @ torch.ones(4, 2)).sum().backward()
    assert copy.deepcopy(t).grad is not None  # (a plain tensor's deepcopy keeps it, as torch's)
