"""``F.embedding`` / ``F.embedding_bag`` with a sparse weight (``scorch/ops/embedding.py``): the looked-up rows
gathered sparse, never the table densified; values and gradients as torch's on the dense weight."""
import contextlib
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F

import scorch

EXACT = ["csr", "coo", "csc", "dcsr", "ell"]  # formats storing exactly the nonzeros: the gradient is dense's there
ALL = EXACT + ["bsr(2, 2)", "dia"]
V, D = 8, 6


def _table(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    d = (torch.randn(V, D, generator=g) * (torch.rand(V, D, generator=g) < 0.5)).to(dtype)
    d[3] = 0  # an empty row
    return d, g


@contextlib.contextmanager
def _no_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)
        yield


@pytest.mark.parametrize("fmt", EXACT)
@pytest.mark.parametrize("kw", [{}, {"padding_idx": 2}, {"padding_idx": -1}, {"scale_grad_by_freq": True},
                                {"max_norm": 1.0}, {"max_norm": 0.5, "norm_type": 1.0}, {"sparse": True},
                                {"padding_idx": 3, "scale_grad_by_freq": True}])
def test_embedding_matches_dense(fmt, kw):
    d, g = _table(len(fmt) + len(kw))
    idx = torch.randint(0, V, (3, 4), generator=g)
    idx[0, 0], idx[1, 1] = 3, idx[1, 2]  # the empty row; a repeated index
    w, ref = torch.nn.Parameter(scorch.asformat(d, fmt)), torch.nn.Parameter(d.clone())
    grad = torch.randn(3, 4, D, generator=g, dtype=d.dtype)
    with _no_fallback():
        out = F.embedding(idx, w, **kw)
        (out * grad).sum().backward()
    want = F.embedding(idx, ref, **kw)
    (want * grad).sum().backward()
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(w.grad.to_dense(), ref.grad.to_dense() * (d != 0))
    if "max_norm" in kw:  # the looked-up rows renormed in place, as torch renorms its weight
        torch.testing.assert_close(w.detach().to_dense(), ref.detach())


@pytest.mark.parametrize("fmt", ALL)
def test_embedding_equals_the_dense_form_in_every_format(fmt):
    # the reference is the same weight's dense form (differentiable): formats storing zeros (blocks, diagonals)
    # have their gradient on every stored position
    d, g = _table(5)
    idx = torch.randint(0, V, (2, 5), generator=g)
    w1, w2 = torch.nn.Parameter(scorch.asformat(d, fmt)), torch.nn.Parameter(scorch.asformat(d, fmt))
    grad = torch.randn(2, 5, D, generator=g, dtype=d.dtype)
    with _no_fallback():
        out = F.embedding(idx, w1, padding_idx=1)
    (out * grad).sum().backward()
    want = F.embedding(idx, w2.to_dense(), padding_idx=1)
    (want * grad).sum().backward()
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(w1.grad.to_dense(), w2.grad.to_dense())


def _bag_reference(flat, ref, offsets, mode, n_bags):
    """A bag of ``F.embedding(scale_grad_by_freq=True)`` rows: the documented gradient (torch 2.13's CPU bag
    divides some rows by another row's count, pytorch#190063)."""
    e = F.embedding(flat, ref, scale_grad_by_freq=True)
    bags = torch.bucketize(torch.arange(flat.numel()), offsets, right=True) - 1
    out = torch.zeros(n_bags, ref.shape[1], dtype=ref.dtype).index_add(0, bags, e)
    if mode == "mean":
        out = out / torch.bincount(bags, minlength=n_bags).clamp(min=1).unsqueeze(1).to(ref.dtype)
    return out


@pytest.mark.parametrize("fmt", EXACT)
@pytest.mark.parametrize("mode, kw", list(itertools.product(["sum", "mean", "max"], [
    {}, {"padding_idx": 1}, {"include_last_offset": True}, {"max_norm": 1.0}, {"scale_grad_by_freq": True}])))
def test_embedding_bag_matches_dense(fmt, mode, kw):
    if mode == "max" and kw.get("scale_grad_by_freq"):
        pytest.skip("torch: max mode takes no scale_grad_by_freq")
    d, g = _table(len(mode) + 3 * len(kw))
    flat = torch.randint(0, V, (9,), generator=g)
    flat[0] = flat[1] = 1  # a padding index (where padding_idx=1) and a repeat
    offsets = torch.tensor([0, 2, 2, 9]) if kw.get("include_last_offset") else torch.tensor([0, 2, 2, 6])
    w, ref = torch.nn.Parameter(scorch.asformat(d, fmt)), torch.nn.Parameter(d.clone())
    with _no_fallback():
        out = F.embedding_bag(flat, w, offsets, mode=mode, **kw)
    if kw.get("scale_grad_by_freq"):
        want = _bag_reference(flat, ref, offsets, mode, 4)
    else:
        want = F.embedding_bag(flat, ref, offsets, mode=mode, **kw)
    torch.testing.assert_close(out, want)
    grad = torch.randn(out.shape, generator=g, dtype=d.dtype)
    (out * grad).sum().backward()
    (want * grad).sum().backward()
    torch.testing.assert_close(w.grad.to_dense(), ref.grad * (d != 0))


@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_embedding_bag_2d_input_and_per_sample_weights(fmt):
    d, g = _table(11)
    w = scorch.asformat(d, fmt)
    idx = torch.randint(0, V, (3, 4), generator=g)
    flat, offsets = idx.reshape(-1), torch.tensor([0, 5, 5])
    psw = torch.randn(12, generator=g, dtype=d.dtype)
    with _no_fallback():
        got = [F.embedding_bag(idx, w, mode="mean"), F.embedding_bag(idx, w, mode="max"),
               F.embedding_bag(flat, w, offsets, mode="sum", per_sample_weights=psw)]
    want = [F.embedding_bag(idx, d, mode="mean"), F.embedding_bag(idx, d, mode="max"),
            F.embedding_bag(flat, d, offsets, mode="sum", per_sample_weights=psw)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_embedding_bag_indices_past_the_last_offset_are_in_no_bag():
    # torch 2.13 on CPU lets them into max (and a mean's count) and gives their rows a gradient read from an
    # uninitialized bag; documented, they belong to no bag: the same as leaving them out
    d, g = _table(2)
    flat = torch.tensor([0, 1, 2, 4, 5])
    offsets = torch.tensor([0, 2, 3])
    for mode in ("sum", "mean", "max"):
        w = torch.nn.Parameter(scorch.asformat(d, "csr"))
        out = F.embedding_bag(flat, w, offsets, mode=mode, include_last_offset=True)
        torch.testing.assert_close(out, F.embedding_bag(flat[:3], d, offsets, mode=mode, include_last_offset=True))
        out.sum().backward()
        g = w.grad.to_dense()
        assert g[4].eq(0).all() and g[5].eq(0).all()


def test_embedding_reads_only_the_looked_up_rows():
    d, _ = _table(3, torch.float32)
    w = scorch.asformat(d, "csr")
    before = scorch.stats()
    F.embedding(torch.tensor([[1, 2]]), w)
    F.embedding_bag(torch.tensor([1, 2, 5]), w, torch.tensor([0, 1]))
    after = scorch.stats()
    assert after["fallback"] == before["fallback"] and after["densified"] == before["densified"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_embedding_dtypes_and_empty_input(dtype):
    d, _ = _table(4, dtype)
    w = scorch.asformat(d, "csr")
    for idx in (torch.zeros(0, 3, dtype=torch.long), torch.tensor([[1, 7], [0, 0]], dtype=torch.int32)):
        out = F.embedding(idx, w)
        assert out.dtype == dtype and out.shape == (*idx.shape, D)
        torch.testing.assert_close(out, F.embedding(idx, d))


def test_embedding_bad_input():
    d, _ = _table(1)
    w = scorch.asformat(d, "csr")
    for idx in (torch.tensor([V]), torch.tensor([-1])):
        with pytest.raises(IndexError, match="out of range"):
            F.embedding(idx, w)
    with pytest.raises(RuntimeError, match="int32 or int64"):
        F.embedding(torch.tensor([1.0]), w)
    with pytest.raises(RuntimeError, match="int32 or int64"):
        F.embedding_bag(torch.tensor([1.0]), w, torch.tensor([0]))


def test_sparsified_embedding_module_trains():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, D)
    ref = torch.nn.Embedding(V, D)
    s = scorch.schedule(emb)
    s["weight"].sparsify(scorch.nn.ScalarFraction(0.5)).set_format("csr")
    s.apply()
    ref.weight.data = emb.weight.detach().to_dense().clone()
    mask = ref.weight.detach() != 0
    opt, opt_ref = torch.optim.AdamW(emb.parameters(), lr=0.1), torch.optim.AdamW(ref.parameters(), lr=0.1)
    idx = torch.tensor([[1, 2, 2], [7, 0, 5]])
    for _ in range(3):
        with _no_fallback():
            emb(idx).pow(2).sum().backward()
        ref(idx).pow(2).sum().backward()
        ref.weight.grad *= mask  # the dense reference trains the same pattern
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    torch.testing.assert_close(emb.weight.detach().to_dense(), ref.weight.detach() * mask)
