"""SciPy interop: ``scorch.from_scipy``, ``SparseTensor.to_scipy`` / ``scorch.to_scipy`` and ``scorch.asformat`` of
a SciPy array. Every result is checked against SciPy's own ``toarray()``; sharing is checked by writing through
one side and reading the other (and by ``np.shares_memory``)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch.formats import named

np = pytest.importorskip("numpy")
sp = pytest.importorskip("scipy.sparse")

pytestmark = [pytest.mark.filterwarnings("ignore:.*Sparse invariant checks are implicitly disabled"),
              pytest.mark.filterwarnings("ignore:.*support is in beta state")]

NEAREST = {"csr": named.csr, "csc": named.csc, "coo": named.coo}


def _dense(shape=(6, 8), seed=0, density=0.4, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 10, shape).astype(dtype)
    x[rng.random(shape) >= density] = 0
    assert (x != 0).any()
    return x


def _equal(got, expected):
    got = got.to_dense() if isinstance(got, torch.Tensor) else got
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


# --- from_scipy ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["csr", "csc", "coo"])
@pytest.mark.parametrize("matrix", [False, True], ids=["array", "matrix"])
def test_from_scipy_shares_arrays_and_writes_are_seen(kind, matrix):
    a = sp.coo_array(_dense()).asformat(kind)
    if matrix:
        a = sp.csr_matrix(a).asformat(kind)
    a.sum_duplicates()  # (canonical: COO made by SciPy's conversions is marked so)
    s = scorch.from_scipy(a)
    assert isinstance(s, scorch.SparseTensor) and s.format == NEAREST[kind]
    _equal(s, a.toarray())
    assert np.shares_memory(s.values().numpy(), a.data)
    a.data[0] = 100.0  # written through SciPy, read by scorch
    assert float(s.values()[0]) == 100.0
    _equal(s, a.toarray())
    s.values()[-1] = -7.0  # and the other way
    assert a.data[-1] == -7.0
    arrays = [st.crd for st in s.levels if st.crd is not None]
    indices = [a.indices] if kind != "coo" else list(a.coords)
    for t, n in zip(arrays, indices):
        assert t.data_ptr() == n.__array_interface__["data"][0]


def test_from_scipy_bsr_keeps_blocks():
    d = _dense((6, 9))
    a = sp.bsr_array(d, blocksize=(2, 3))
    s = scorch.from_scipy(a)
    assert s.format == named.bsr(2, 3)
    _equal(s, d)
    assert np.shares_memory(s.values().numpy(), a.data) and np.shares_memory(s.levels[1].crd.numpy(), a.indices)
    back = s.to_scipy()
    assert back.format == "bsr" and back.blocksize == (2, 3) and np.shares_memory(back.data, a.data)


@pytest.mark.parametrize("kind", ["dia", "lil", "dok"])
def test_other_scipy_formats_arrive_as_csr(kind):
    d = _dense()
    a = sp.csr_array(d).asformat(kind)
    s = scorch.from_scipy(a)
    assert s.format == named.csr
    _equal(s, d)


@pytest.mark.parametrize("index", [np.int32, np.int64])
def test_index_dtype_is_kept(index):
    d = _dense()
    a = sp.csr_array(d)
    a.indices, a.indptr = a.indices.astype(index), a.indptr.astype(index)
    s = scorch.from_scipy(a)
    assert s.index_dtype == torch.from_numpy(np.zeros(1, index)).dtype
    assert np.shares_memory(s.levels[1].pos.numpy(), a.indptr)
    _equal(s, d)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
                                   np.uint8, np.bool_])
def test_value_dtypes_are_shared(dtype):
    d = _dense(dtype=dtype)
    a = sp.csr_array(d)
    s = scorch.from_scipy(a)
    assert s.dtype == torch.from_numpy(np.zeros(1, dtype)).dtype
    assert np.shares_memory(s.values().numpy(), a.data)
    _equal(s, d)
    back = s.to_scipy()
    assert back.dtype == a.dtype and np.shares_memory(back.data, a.data)


def test_float16_values_are_shared_one_way():
    """SciPy stores float16 values (its constructors take them) but computes nothing with them (``toarray``
    refuses): scorch shares them, and ``to_scipy`` of a float16 tensor asks for a conversion."""
    a = sp.csr_array((np.array([1.5, 2.0], np.float16), np.array([0, 2]), np.array([0, 1, 2])), shape=(2, 3))
    s = scorch.from_scipy(a)
    assert s.dtype == torch.float16 and np.shares_memory(s.values().numpy(), a.data)
    _equal(s, [[1.5, 0, 0], [0, 0, 2.0]])
    with pytest.raises(TypeError, match="float16"):
        s.to_scipy()
    _equal(s.float().to_scipy().toarray(), s.to_dense().float())


@pytest.mark.parametrize("kind", ["csr", "csc", "bsr"])
def test_unsorted_and_repeated_compressed_indices_are_summed_as_scipy_does(kind):
    # row 0 holds column 2 twice and column 0 after them; row 1 an explicit zero
    indptr, indices = np.array([0, 3, 4]), np.array([2, 2, 0, 1])
    data = np.array([1.0, 2.0, 5.0, 0.0])
    if kind == "bsr":
        a = sp.bsr_array((data.reshape(-1, 1, 1), indices, indptr), shape=(2, 3))
    else:
        a = (sp.csr_array if kind == "csr" else sp.csc_array)((data, indices, indptr), shape=(2, 3) if kind == "csr"
                                                             else (3, 2))
    before = a.toarray()
    s = scorch.from_scipy(a)
    _equal(s, before)
    assert s.values().numel() == 3 and (s.values() == 0).sum() == 1  # summed; the explicit zero kept
    np.testing.assert_array_equal(a.indices, indices)  # the caller's array is left as it was
    assert not np.shares_memory(s.values().numpy(), a.data)


def test_unsorted_repeated_coo_with_explicit_zero():
    row, col = np.array([2, 0, 2, 1]), np.array([1, 3, 1, 0])
    a = sp.coo_array((np.array([1.0, 4.0, 2.0, 0.0]), (row, col)), shape=(3, 4))
    s = scorch.from_scipy(a)
    assert s.format == named.coo
    _equal(s, a.toarray())
    assert s.values().numel() == 3 and (s.values() == 0).sum() == 1


def test_sorted_coo_not_marked_canonical_is_shared():
    """SciPy marks a COO it did not sort as non-canonical; sorted, unique entries are shared anyway."""
    a = sp.coo_array((np.array([1.0, 2.0, 3.0]), (np.array([0, 0, 2]), np.array([1, 3, 0]))), shape=(3, 4))
    s = scorch.from_scipy(a)
    assert np.shares_memory(s.values().numpy(), a.data)
    _equal(s, a.toarray())


def test_read_only_and_big_endian_arrays_are_copied_quietly():
    a = sp.csr_array(_dense())
    a.data.setflags(write=False)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = scorch.from_scipy(a)
    assert not np.shares_memory(s.values().numpy(), a.data)
    _equal(s, a.toarray())
    b = sp.csr_array(_dense())
    b.data = b.data.astype(">f8")
    _equal(scorch.from_scipy(b), b.toarray())


def test_out_of_range_indices_raise_instead_of_crashing():
    a = sp.csr_array((np.ones(2), np.array([0, 9]), np.array([0, 1, 2])), shape=(2, 3))
    with pytest.raises(ValueError):
        scorch.from_scipy(a)


def test_from_scipy_with_a_format_and_asformat_accept_scipy():
    d = _dense()
    a = sp.csr_array(d)
    for fmt in ["csc", "coo", "dcsr", "ell", "bsr(2, 2)"]:
        _equal(scorch.from_scipy(a, format=fmt), d)
        _equal(scorch.asformat(a, fmt), d)
    s = scorch.asformat(a, "csr")
    assert np.shares_memory(s.values().numpy(), a.data)


def test_from_scipy_errors():
    with pytest.raises(TypeError, match="scipy.sparse"):
        scorch.from_scipy(np.eye(3))
    z = sp.csr_array(np.eye(3) * (1 + 2j))
    for call in (scorch.from_scipy, lambda a: scorch.asformat(a, "csr")):
        with pytest.raises(TypeError, match="complex"):
            call(z)


def test_products_with_a_scipy_matrix():
    d = _dense((7, 5))
    a = sp.csr_array(d)
    x = np.random.default_rng(1).standard_normal((5, 3))
    got = scorch.from_scipy(a) @ torch.from_numpy(x)
    np.testing.assert_allclose(got.numpy(), a @ x)


# --- to_scipy --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,kind", [("csr", "csr"), ("csc", "csc"), ("coo", "coo"), ("bsr(2, 2)", "bsr"),
                                      ("bsc(2, 2)", "bsr"), ("dcsr", "csr"), ("dcsc", "csc"), ("ell", "csr"),
                                      ("dia", "csr"), ("csf", "csr")])
def test_to_scipy_nearest_format(fmt, kind):
    x = torch.from_numpy(_dense((6, 8)))
    s = scorch.asformat(x, fmt)
    a = s.to_scipy()
    assert isinstance(a, sp.sparray) and a.format == kind
    _equal(a.toarray(), x.numpy())
    assert scorch.to_scipy(s).format == kind
    if fmt in ("csr", "csc", "coo", "bsr(2, 2)"):  # shared: a write through SciPy is seen by scorch
        assert np.shares_memory(a.data, s.values().numpy())
        a.data[0] = 123.0
        assert float(s.values()[0]) == 123.0
        _equal(s, a.toarray())


@pytest.mark.parametrize("fmt", ["bsr(2, 2)", "bsc(2, 3)"])
def test_to_scipy_of_blocks_that_do_not_tile_the_shape_is_csr(fmt):
    x = torch.from_numpy(_dense((5, 7)))
    a = scorch.asformat(x, fmt).to_scipy()
    assert a.format == "csr"
    _equal(a.toarray(), x.numpy())


def test_to_scipy_uncoalesced_coo_sums_as_scorch_does():
    t = torch.sparse_coo_tensor(torch.tensor([[1, 0, 1], [2, 0, 2]]), torch.tensor([1.0, 2.0, 3.0]), (2, 3))
    s = scorch.from_torch(t)
    a = s.to_scipy()
    assert a.format == "coo" and not a.has_canonical_format
    _equal(a.toarray(), t.to_dense().numpy())


def test_to_scipy_of_a_torch_sparse_tensor_and_narrow_indices():
    x = torch.from_numpy(_dense())
    _equal(scorch.to_scipy(x.to_sparse_csr()).toarray(), x.numpy())
    s = scorch.asformat(x, "csr", index_dtype=torch.int16)
    a = s.to_scipy()
    assert a.indices.dtype == np.int32
    _equal(a.toarray(), x.numpy())


def test_to_scipy_errors():
    x = torch.from_numpy(_dense())
    with pytest.raises(ValueError, match="2-d"):
        scorch.asformat(x.reshape(2, 3, 8), "coo").to_scipy()
    with pytest.raises(RuntimeError, match="detach"):
        scorch.asformat(x, "csr").requires_grad_().to_scipy()
    with pytest.raises(TypeError, match="bfloat16"):
        scorch.asformat(x, "csr").bfloat16().to_scipy()
    with pytest.raises(TypeError, match="asformat"):
        scorch.to_scipy(x)
    s = scorch.asformat(x, "csr").requires_grad_()
    _equal(s.detach().to_scipy().toarray(), x.numpy())


def test_scipy_is_not_imported_by_scorch():
    code = "import sys, scorch; assert not any(m.startswith('scipy') for m in sys.modules), 'scipy imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# --- against SciPy, generated ----------------------------------------------------------------------------------

@settings(max_examples=40)
@given(rows=st.integers(1, 9), cols=st.integers(1, 9), density=st.floats(0.0, 1.0), seed=st.integers(0, 2 ** 16),
       kind=st.sampled_from(["csr", "csc", "coo", "bsr"]), dtype=st.sampled_from([np.float32, np.float64, np.int64]),
       repeat=st.booleans())
def test_round_trips_against_scipy(rows, cols, density, seed, kind, dtype, repeat):
    rng = np.random.default_rng(seed)
    d = rng.integers(-5, 5, (rows, cols)).astype(dtype)
    d[rng.random((rows, cols)) >= density] = 0
    if kind == "bsr":
        a = sp.bsr_array(np.kron(d, np.ones((1, 2), dtype)), blocksize=(1, 2))
    else:
        a = sp.coo_array(d)
        if repeat:  # every entry twice, reversed: unsorted, repeated
            r, c = a.coords
            a = sp.coo_array((np.concatenate([a.data, a.data])[::-1], (np.concatenate([r, r])[::-1],
                                                                       np.concatenate([c, c])[::-1])), shape=a.shape)
        a = a.asformat(kind) if kind != "coo" else a
    s = scorch.from_scipy(a)
    _equal(s, a.toarray())
    _equal(s.to_scipy().toarray(), a.toarray())
    x = rng.standard_normal((a.shape[1], 2)).astype(np.float64)
    np.testing.assert_allclose((s.double() @ torch.from_numpy(x)).numpy(), a.astype(np.float64) @ x, rtol=1e-9,
                               atol=1e-9)
