"""Row-by-row assembly of sparse outputs: rows with many entries (the radix sort of the touched list), keys
above 2**32, and both widths of output coordinates, checked against dense torch."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch.engine import bind


def _random_csr(m, n, per_row, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(m).repeat_interleave(per_row)
    cols = torch.randint(0, n, (m * per_row,), generator=g)
    vals = torch.randn(m * per_row, generator=g, dtype=torch.float64)
    dense = torch.zeros(m, n, dtype=torch.float64).index_put_((rows, cols), vals, accumulate=True)
    return dense, scorch.asformat(dense, "csr")


@pytest.mark.parametrize("narrow", [True, False])
def test_spgemm_with_long_rows(monkeypatch, narrow):
    if not narrow:
        monkeypatch.setattr(bind, "NARROW_COORDINATES", 0)
    da, a = _random_csr(40, 3000, 30, 1)   # about 900 touched entries per row: the radix path
    db, b = _random_csr(3000, 3000, 30, 2)
    r = a @ b
    assert isinstance(r, scorch.SparseTensor) and r.format == scorch.asformat(da[:1, :1], "csr").format
    torch.testing.assert_close(r.to_dense(), da @ db)
    assert r._levels[1].crd.dtype == torch.int32  # the output's index width, whichever the kernel wrote
    _assert_rows_strictly_increasing(r)


def _assert_rows_strictly_increasing(r):
    pos, crd = r._levels[1].pos.long(), r._levels[1].crd.long()
    assert pos[-1] == crd.numel()
    step = crd[1:] > crd[:-1]
    row_start = torch.zeros(crd.numel(), dtype=torch.bool)
    row_start[pos[1:-1][pos[1:-1] < crd.numel()]] = True
    assert bool((step | row_start[1:]).all())


@pytest.mark.parametrize("width, per_row", [(300, 60), (3000, 12), (20000, 40)])
def test_spgemm_rows_sorted_through_the_bitmap(width, per_row):
    """Rows of more than 32 entries that fill at least a 64th of their width are sorted through a bitmap (its
    words read 4 keys at a time, then the rest, then the row's last keys one by one): words holding 0 to 64 keys,
    checked against dense torch."""
    da, a = _random_csr(24, 200, per_row // 4 + 1, 3)
    db, b = _random_csr(200, width, per_row, 4)
    r = a @ b
    assert r.format.name == "csr"
    torch.testing.assert_close(r.to_dense(), da @ db)
    rows = r.to_torch()
    for i in range(24):  # each row's columns strictly increasing
        c = rows.col_indices()[rows.crow_indices()[i]:rows.crow_indices()[i + 1]]
        assert bool((c[1:] > c[:-1]).all())


def test_rows_output_with_a_two_dimensional_workspace():
    # rows i of a CSF output, assembled over (j, k): keys up to 2000 * 1500, three radix passes
    g = torch.Generator().manual_seed(3)
    da = (torch.rand(6, 2000, generator=g) < 0.02) * torch.randn(6, 2000, generator=g)
    db = (torch.rand(6, 1500, generator=g) < 0.03) * torch.randn(6, 1500, generator=g)
    a, b = scorch.asformat(da, "csr"), scorch.asformat(db, "csr")
    r = scorch.einsum("ij,ik->ijk", a, b, format="csf")
    torch.testing.assert_close(r.to_dense(), torch.einsum("ij,ik->ijk", da, db))


@pytest.mark.parametrize("fmt", ["csr", "dcsr", "csc", "coo", "csf"])
def test_merges_are_written_directly(fmt):
    """Sums and elementwise products of sparse operands meet each entry of a row once, in order: written straight
    from the merge (no workspace, no sort), empty rows and 3-d outputs included, equal to dense torch."""
    g = torch.Generator().manual_seed(7)
    shape = (7, 9, 5) if fmt == "csf" else (40, 300)
    da = (torch.rand(shape, generator=g) < 0.1) * torch.randn(shape, generator=g, dtype=torch.float64)
    db = (torch.rand(shape, generator=g) < 0.1) * torch.randn(shape, generator=g, dtype=torch.float64)
    da[3], db[3] = 0, 0  # an empty row in both
    a, b = scorch.asformat(da, fmt), scorch.asformat(db, fmt)
    torch.testing.assert_close((a + b).to_dense(), da + db)
    torch.testing.assert_close((a - b).to_dense(), da - db)
    torch.testing.assert_close((a * b).to_dense(), da * db)
    letters = "ijk"[:len(shape)]
    text = scorch.explain(f"{letters},{letters}->{letters}", a, b, file=__import__("io").StringIO())
    assert "written straight from the loops" in text


def _rows_of_sizes(sizes, width, g):
    """``(A, B)`` whose product's row ``r`` is the sum of two rows of B of ``sizes[r]`` random columns each (the
    second overlapping the first's), in float64."""
    db = torch.zeros(2 * len(sizes), width, dtype=torch.float64)
    for r, c in enumerate(sizes):
        for half in (0, 1):
            cols = torch.randperm(width, generator=g)[:min(c, width)]
            db[2 * r + half, cols] = torch.randn(cols.numel(), generator=g, dtype=torch.float64)
    da = torch.zeros(len(sizes), 2 * len(sizes), dtype=torch.float64)
    for r in range(len(sizes)):
        da[r, 2 * r], da[r, 2 * r + 1] = 1.5, -0.5
    return da, db


@pytest.mark.parametrize("width", [64, 650, 2100])
@pytest.mark.parametrize("dtype, index, backend", [
    (torch.float32, torch.int32, "cpp"), (torch.float64, torch.int64, "cpp"), (torch.bfloat16, torch.int32, "cpp"),
    (torch.float64, torch.int32, "interp")])  # (the interpreter, NumPy, has no bfloat16)
def test_spgemm_fill_marks_long_rows_in_a_bitmap(width, dtype, index, backend):
    """A fill's row with more than 32 entries and at least one per 2 words of columns (``BITMAP_ROW_SPREAD``) is
    marked in a bitmap and read in order (no touched list, no sort); other rows keep the touched list. Rows of
    exactly 0, 1, 32, 33, one short of a word's worth, a word's worth, a full word's 64 columns and the whole
    width, in widths that end inside a word; each output row the sum of two rows of B (overlapping columns
    added), against dense torch."""
    g = torch.Generator().manual_seed(width)
    words = -(-width // 64)
    sizes = [0, 1, 32, 33, max(words - 1, 0), words, 64, width]
    da, db = _rows_of_sizes(sizes, width, g)
    a = scorch.asformat(da.to(dtype), "csr", index_dtype=index)
    b = scorch.asformat(db.to(dtype), "csr", index_dtype=index)
    with scorch.engine.cpu_backend(backend):
        r = a @ b
    expected = da.to(dtype).to(torch.float32) @ db.to(dtype).to(torch.float32)
    torch.testing.assert_close(r.to_dense().to(torch.float32), expected,
                               **({"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}))
    _assert_rows_strictly_increasing(r)


@pytest.mark.parametrize("backend", ["cpp", "interp"])
def test_spgemm_count_pass_guesses_bitmap_rows_from_the_last_row(backend):
    """The count pass marks a row in a bitmap (and counts its bits) where the thread's last row was dense in the
    workspace, else with marks and a touched list: both give the exact count, so rows alternating between dense
    and sparse (each taking the other's path), empty rows, rows at the threshold (32, 33 entries), a dense row
    after an empty one and the last row, give the dense product; the source has both paths and prefetches the
    rows of B it will walk."""
    width = 1000  # 16 words: a row is dense from 33 entries
    sizes = [400, 0, 500, 1, 33, 32, 33, 900, 2, 34, 0, 0, 700, 999, 5, 1000]
    g = torch.Generator().manual_seed(11)
    da, db = _rows_of_sizes(sizes, width, g)
    a, b = scorch.asformat(da, "csr"), scorch.asformat(db, "csr")
    with scorch.engine.cpu_backend(backend):
        r = a @ b
    torch.testing.assert_close(r.to_dense(), da @ db)
    _assert_rows_strictly_increasing(r)
    if backend == "cpp":
        text = scorch.explain("ij,jk->ik", a, b, source=True)
        count = text.split("kernel count")[1].split("kernel fill")[0]
        assert "scorch_bit_count(" in count and "nt_last" in count and "__builtin_prefetch" in count


@settings(max_examples=30, deadline=None)
@given(widths=st.lists(st.integers(0, 60), min_size=0, max_size=10), n=st.integers(1, 400),
       fmt=st.sampled_from(["csr", "dcsr"]), dtype=st.sampled_from([torch.float32, torch.float64]),
       index=st.sampled_from([torch.int32, torch.int64]), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_spgemm_rows_of_any_mix_of_sizes_match_dense(widths, n, fmt, dtype, index, threads, seed):
    """Output rows of random sizes in a random order (each row of A picks ``w`` rows of B of random densities),
    so the count pass's guess from the last row is wrong in both directions and rows fall on both sides of the
    bitmap rule, in widths around a word's multiple, on one thread and two: equal to dense torch."""
    g = torch.Generator().manual_seed(seed)
    k = max(widths, default=0) + 1
    db = (torch.rand(k, n, generator=g) < torch.rand(k, 1, generator=g)) * torch.randn(k, n, generator=g)
    da = torch.zeros(len(widths), k)
    for r, w in enumerate(widths):
        cols = torch.randperm(k, generator=g)[:w]
        da[r, cols] = torch.randn(cols.numel(), generator=g)
    da, db = da.to(dtype), db.to(dtype)
    a, b = scorch.asformat(da, fmt, index_dtype=index), scorch.asformat(db, fmt, index_dtype=index)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        r = scorch.einsum("ij,jk->ik", a, b)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(r.to_dense(), da @ db)


def test_interpreter_refuses_16_bit_operands_by_name():
    """The loop-IR interpreter (NumPy) has no bfloat16: a 16-bit operand is refused with the reason, not a NumPy
    conversion error."""
    a = scorch.asformat(torch.eye(40, dtype=torch.bfloat16), "csr")
    with scorch.engine.cpu_backend("interp"), pytest.raises(NotImplementedError, match="interpreter takes no"):
        a @ a
