"""One owner for the memo tables (``scorch.cache_info``, ``scorch.clear_caches``) and the CPU backend block
(``scorch.engine.cpu_backend``)."""
import pytest
import torch

import scorch
from scorch import engine
from scorch.compiler import caches
from scorch.engine import evaluate


def _spmm():
    d = torch.arange(36.).reshape(6, 6) * (torch.arange(36).reshape(6, 6) % 4 == 0)
    s = scorch.asformat(d, "csr")
    x = torch.arange(12.).reshape(6, 2)
    return s, x, d @ x


def test_cache_info_lists_every_cache_and_clear_empties_them():
    s, x, want = _spmm()
    torch.testing.assert_close(scorch.einsum("ij,jk->ik", s, x), want)
    info = scorch.cache_info()
    for name in ("planned", "compiled", "prepared", "prepared-by-equation", "paths", "converters"):
        assert name in info, name
        entries, what = info[name]
        assert isinstance(entries, int) and what
    # (its prepared call: made here, or kept on disk by an earlier process and found by the equation)
    assert info["compiled"][0] >= 1 and info["prepared"][0] + info["prepared-by-equation"][0] >= 1
    scorch.clear_caches()
    assert all(entries == 0 for entries, _ in scorch.cache_info().values())
    torch.testing.assert_close(scorch.einsum("ij,jk->ik", s, x), want)  # planned and prepared again
    assert scorch.cache_info()["compiled"][0] >= 1


def test_cpu_backend_runs_every_op_on_the_chosen_backend():
    s, x, want = _spmm()
    scorch.einsum("ij,jk->ik", s, x)  # a prepared C++ call exists now
    with engine.cpu_backend("interp"):
        torch.testing.assert_close(scorch.einsum("ij,jk->ik", s, x), want)
        torch.testing.assert_close((s + s).to_dense(), 2 * s.to_dense())
        assert scorch.cache_info()["prepared"][0] == 0  # (the interpreter is never prepared)
    with pytest.raises(ValueError, match="cpu_backend"):
        with engine.cpu_backend("cuda"):
            pass


def test_a_full_cache_evicts_its_oldest_entry():
    c = caches.Cache("t", "test", limit=3)
    for k in range(5):
        c[k] = k * 10
    assert list(c.items()) == [(2, 20), (3, 30), (4, 40)] and c.evicted == 2
    c[3] = 31  # (a key it holds: replaced, nothing evicted)
    assert list(c) == [2, 3, 4] and c.evicted == 2
    c.clear()
    assert len(c) == 0 and c.generation == 1


@pytest.fixture
def small_caches(monkeypatch):
    """The caches of prepared calls made small, so that a few signatures fill them."""
    scorch.clear_caches()
    for name in ("prepared", "prepared-by-equation", "not-kept-calls", "paths", "planned", "compiled"):
        monkeypatch.setattr(caches.cache(name, ""), "limit", 3)
    yield
    scorch.clear_caches()


@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_new_signatures_keep_their_calls_after_the_caches_filled(small_caches, fmt):
    """More signatures (shapes) than the caches hold: every one still gets a prepared call, so a product
    repeated on a new shape takes the kept path (a cache that stopped taking entries when full lost that for
    the rest of the process), and every result is right."""
    g = torch.Generator().manual_seed(3)
    with scorch.deferred.deferral("auto"):
        for n in range(4, 14):
            d = torch.randn(n, 5, generator=g) * (torch.rand(n, 5, generator=g) < 0.5)
            s, x = scorch.asformat(d, fmt), torch.randn(5, 3, generator=g)
            for _ in range(3):
                torch.testing.assert_close(s @ x, d @ x)
            assert evaluate.kept_product(s, x, True) is not None, n
            assert len(caches.cache("prepared", "")) <= 3 and len(evaluate._FAST_EQ) <= 3
    assert evaluate._FAST_EQ.evicted > 0  # (every signature's call is kept there, made here or found on disk)


def _patterns(count: int):
    g = torch.Generator().manual_seed(5)
    return [scorch.asformat(torch.randn(4, 6, generator=g) * (torch.rand(4, 6, generator=g) < 0.5), "csr")
            for _ in range(count)]


def test_a_pattern_memo_cycled_past_its_limit_keeps_its_recent_entries():
    """A model cycling through more patterns than a memo holds (the 72 weights of BERT-base through a memo of 64)
    hit on none of them while a full memo emptied itself; now the least recently used entry leaves."""
    from scorch.formats.storage import PatternMemo
    memo, made = PatternMemo(3), []
    tensors = _patterns(4)

    def look(t):
        got = memo.get("k", t._levels)
        if got is None:
            made.append(t)
            got = object()
            memo.put("k", t._levels, got)
        return got

    for t in tensors[:3]:
        look(t)
    look(tensors[0])  # (a hit: tensors[0] is now the most recent)
    look(tensors[3])  # evicts tensors[1], the least recently used
    assert len(memo) == 3 and len(made) == 4
    look(tensors[0]), look(tensors[2]), look(tensors[3])
    assert len(made) == 4
    look(tensors[1])
    assert len(made) == 5


def test_a_pattern_memo_drops_the_entry_of_an_array_that_died():
    from scorch.formats.storage import PatternMemo
    memo = PatternMemo(8)
    tensors = _patterns(2)
    for t in tensors:
        memo.put("k", t._levels, 1)
    assert len(memo) == 2
    del t, tensors[0]
    import gc
    gc.collect()
    assert len(memo) == 1


def test_a_values_memo_follows_the_values_version_and_what_it_depends_on():
    """One entry per values tensor: served while unmodified, remade (replacing, not beside) when the values change
    or the layout it depends on is another object, dropped when the values die."""
    import gc
    from scorch.formats.storage import ValuesMemo
    memo, made = ValuesMemo(8), []
    v, layout = torch.arange(4.0), torch.zeros(2)

    def make():
        made.append(1)
        return v * 2
    assert torch.equal(memo.lookup("k", v, make, (layout,)), v * 2)
    memo.lookup("k", v, make, (layout,))
    assert len(made) == 1
    v.add_(1)
    assert torch.equal(memo.lookup("k", v, make, (layout,)), v * 2) and len(made) == 2 and len(memo) == 1
    memo.lookup("k", v, make, (torch.zeros(2),))
    assert len(made) == 3 and len(memo) == 1
    with torch.inference_mode():
        w = torch.ones(3)
    memo.lookup("k", w, lambda: w)
    assert len(memo) == 1  # (inference tensors have no version: never kept)
    del v
    gc.collect()
    assert len(memo) == 0
