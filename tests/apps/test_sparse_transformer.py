"""The sparse transformer app (apps/sparse_transformer): the pattern builder, the task, the three backends agreeing
on one attention layer and on training steps, scorch really running the sparse ops, training learning, and the
command line. Tiny sizes (sequences of 64-128 tokens)."""
from __future__ import annotations

import math
import os
import pathlib

import pytest
import torch

import scorch
from conftest import import_app, record_sparse_ops, run_app

ROOT = pathlib.Path(__file__).resolve().parents[2]


st = import_app("sparse_transformer")
st_pattern = import_app("sparse_transformer.pattern")
st_task = import_app("sparse_transformer.task")

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled"),
]

TINY = dict(seq_len=64, window=16, n_globals=2, random_blocks=1, block=16)


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    """The app sets torch's and OpenMP's thread count (``threads=1`` here: tiny sizes); put them back after."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    yield
    torch.set_num_threads(threads)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


# --- the pattern --------------------------------------------------------------------------------------------------

def _check_csr(crow, col, n):
    assert crow.dtype == col.dtype == torch.int64
    assert crow.shape == (n + 1,) and crow[0] == 0 and int(crow[-1]) == col.numel()
    assert (crow[1:] >= crow[:-1]).all()
    assert ((col >= 0) & (col < n)).all()
    for i in range(n):  # columns strictly increasing within each row: sorted, no duplicates
        c = col[crow[i]:crow[i + 1]]
        assert (c[1:] > c[:-1]).all(), i


def test_pattern_window_and_globals():
    n, window, g = 50, 10, 3
    crow, col = st_pattern.build_pattern(n, window, n_globals=g, random_blocks=0)
    _check_csr(crow, col, n)
    mask = st_pattern.dense_mask(crow, col)
    i = torch.arange(n)
    expected = ((i[:, None] - i[None, :]).abs() <= window // 2) | (i[:, None] < g) | (i[None, :] < g)
    assert torch.equal(mask, expected)
    assert torch.equal(mask, mask.t())                       # window and globals are symmetric
    assert st_pattern.density(crow) == pytest.approx(expected.sum().item() / n ** 2)
    assert torch.equal(st_pattern.rows_of(crow), mask.nonzero()[:, 0])


def test_pattern_random_blocks_deterministic():
    n, window, block, r = 128, 8, 16, 2
    crow, col = st_pattern.build_pattern(n, window, n_globals=0, random_blocks=r, block=block, seed=5)
    _check_csr(crow, col, n)
    again = st_pattern.build_pattern(n, window, n_globals=0, random_blocks=r, block=block, seed=5)
    other = st_pattern.build_pattern(n, window, n_globals=0, random_blocks=r, block=block, seed=6)
    assert torch.equal(crow, again[0]) and torch.equal(col, again[1])
    assert not (torch.equal(crow, other[0]) and torch.equal(col, other[1]))
    mask = st_pattern.dense_mask(crow, col)
    i = torch.arange(n)
    band = (i[:, None] - i[None, :]).abs() <= window // 2
    assert (mask & band).sum() == band.sum()                 # the whole window is there
    extra = (mask & ~band).reshape(n // block, block, n // block, block)
    full = extra.all(dim=(1, 3))                             # key blocks every query of a block-row sees
    assert (full.sum(1) == r).all()                          # r random blocks per block-row...
    assert torch.equal(extra.any(dim=(1, 3)), full)          # ...and nothing else outside the window
    assert not torch.equal(mask, mask.t())                   # random blocks are not symmetric


def test_pattern_edge_cases():
    crow, col = st_pattern.build_pattern(8, 0)               # window 0: the diagonal
    assert torch.equal(st_pattern.dense_mask(crow, col), torch.eye(8, dtype=torch.bool))
    crow, col = st_pattern.build_pattern(8, 100, n_globals=20, random_blocks=3, block=4)
    assert torch.equal(st_pattern.dense_mask(crow, col), torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError):
        st_pattern.build_pattern(8, -1)


# --- the task -------------------------------------------------------------------------------------------------------

def test_task_labels():
    tokens, labels = st_task.make_task(64, 200, vocab=5, seed=3)
    assert tokens.shape == labels.shape == (64, 200)
    assert (labels[:, 0] == st_task.IGNORE).all()
    assert torch.equal(labels[:, 1:], (tokens[:, 1:] == tokens[:, :1]).long())
    assert 0.45 < labels[:, 1:].float().mean() < 0.55        # balanced: chance accuracy is 0.5
    again = st_task.make_task(64, 200, vocab=5, seed=3)
    assert torch.equal(tokens, again[0])


# --- backends agree -----------------------------------------------------------------------------------------------



def _layer_result(backend):
    torch_mod, _, layer, x, grad, mask = st.attention_setup(backend, d_model=32, heads=2, batch=2, seed=0, **TINY)
    out = layer(x, mask)
    out.backward(grad)
    return mask, {"out": out.detach(), "grad_x": x.grad,
                  **{f"grad_{k}": p.grad for k, p in layer.named_parameters()}}


def test_attention_layer_backends_agree_and_scorch_runs_the_sparse_ops():
    _, want = _layer_result("dense")
    _, sparse = _layer_result("sparse")
    with record_sparse_ops() as seen:
        mask, got = _layer_result("scorch")
    assert isinstance(mask, scorch.SparseTensor) and mask.layout == torch.sparse_csr
    for fn in (torch.sparse.sampled_addmm, torch.sparse.softmax, torch.sparse.mm):
        assert seen[fn] == 1, (fn, seen)                     # batch 2 x 2 heads, all in one call through scorch
    for key, value in want.items():
        for name, result in (("scorch", got), ("sparse", sparse)):
            assert type(result[key]) is torch.Tensor, (name, key)
            torch.testing.assert_close(result[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {key}: {m}")


@pytest.mark.parametrize("heads_a_call", [1, 2])
def test_heads_in_groups_agree_with_dense(monkeypatch, heads_a_call):
    """Where all the heads' scores would hold over ``GROUP_ENTRIES`` entries, the heads attend a group a call (the
    largest divisor of batch x heads that keeps within it): the same values and gradients as dense attention, one
    call per group."""
    M = import_app("sparse_transformer.model")
    _, want = _layer_result("dense")
    nnz = st.attention_setup("scorch", d_model=32, heads=2, batch=2, seed=0, **TINY)[-1]._nnz()
    assert [M.group_size(8, e) for e in (100_000, 200_000, 543_194, 2 << 20)] == [8, 4, 1, 1]
    monkeypatch.setattr(M, "GROUP_ENTRIES", nnz * heads_a_call + 1)
    assert M.group_size(4, nnz) == heads_a_call and M.group_size(3, nnz) == 1
    with record_sparse_ops() as seen:
        _, got = _layer_result("scorch")
    for fn in (torch.sparse.sampled_addmm, torch.sparse.softmax, torch.sparse.mm):
        assert seen[fn] == 4 // heads_a_call, (fn, seen)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_training_steps_agree_across_backends():
    """The same model code under each backend: equal losses step by step, and a second backend in the same
    process after scorch (no global state left behind)."""
    opts = dict(epochs=1, threads=1, seed=1, train_size=12, test_size=4, batch=4, d_model=32, heads=2, layers=1,
                **TINY)
    results = {b: st.run(b, **opts) for b in ("scorch", "dense", "sparse")}
    ref = results["dense"]["losses"]
    assert len(ref) == 3
    for b, r in results.items():
        assert r["backend"] == b and r["nnz"] == results["dense"]["nnz"]
        assert r["losses"] == pytest.approx(ref, rel=1e-4), b
        assert r["accuracy"] == pytest.approx(results["dense"]["accuracy"], abs=1e-6), b
        for key in ("epoch_s", "step_s", "infer_s", "loss"):
            assert r[key] > 0 and math.isfinite(r[key]), (b, key)


def test_interleaved_trainings_train_as_they_do_alone():
    """``training`` steps interleaved across backends (the benchmarks' tables) give each the losses of its run alone,
    with one backend's inference batches between another's training steps (no grad mode left behind)."""
    from apps import common
    opts = dict(threads=1, seed=1, train_size=12, test_size=8, batch=4, d_model=32, heads=2, layers=1, **TINY)
    alone = {b: st.run(b, epochs=e, **opts) for b, e in (("scorch", 1), ("dense", 2))}
    together = common.interleave({b: st.training(b, epochs=e, **opts) for b, e in (("scorch", 1), ("dense", 2))},
                                 block=1)
    for b, r in together.items():
        assert not isinstance(r, BaseException), r
        assert r["losses"] == pytest.approx(alone[b]["losses"], rel=1e-4), b
        assert r["accuracy"] == pytest.approx(alone[b]["accuracy"], abs=1e-6), b
        assert len(r["epoch_times"]) == 1 and r["epoch_s"] == r["epoch_times"][0] > 0


def test_fused_attention_trains_as_the_unfused(monkeypatch):
    """``fuse=True`` (scorch.compile around the attention of all heads): the fused kernel runs, and training gives the unfused
    losses step by step; other backends refuse it."""
    from scorch import fusion
    calls = []
    kernel = fusion.attention
    monkeypatch.setattr(fusion, "attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    opts = dict(epochs=1, threads=1, seed=1, train_size=8, test_size=4, batch=4, d_model=32, heads=2, layers=1,
                **TINY)
    fused, plain = st.run("scorch", fuse=True, **opts), st.run("scorch", **opts)
    assert len(calls) >= 2 + 1  # every training step and the test batch (all heads in one call)
    assert fused["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    assert fused["accuracy"] == pytest.approx(plain["accuracy"], abs=1e-6)
    with pytest.raises(ValueError, match="needs scorch"):
        st.run("sparse", fuse=True, **opts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here (torch.cuda.is_available() is False)")
def test_scorch_trains_on_the_gpu_as_on_the_cpu():
    """--device cuda: SDDMM, sparse softmax and SpMM of the attention on the GPU take the CPU's steps."""
    opts = dict(epochs=1, threads=1, seed=1, train_size=12, test_size=4, batch=4, d_model=32, heads=2, layers=1,
                **TINY)
    cpu, gpu = st.run("scorch", **opts), st.run("scorch", device="cuda", **opts)
    assert gpu["device"] == "cuda"
    assert gpu["losses"] == pytest.approx(cpu["losses"], rel=1e-3)
    assert gpu["accuracy"] == pytest.approx(cpu["accuracy"], abs=1e-6)


def test_training_learns():
    """Dense is the fastest backend at this size; the others take the same steps (the test above)."""
    r = st.run("dense", epochs=10, threads=1, seed=0, train_size=64, test_size=16, batch=8, d_model=32, heads=2,
               layers=2, vocab=8, lr=5e-3, **TINY)
    assert r["accuracy"] > 0.9, r["accuracy"]                # chance is 0.5
    assert r["losses"][-1] < 0.5 * r["losses"][0]


def test_scorch_training_lowers_the_loss():
    r = st.run("scorch", epochs=2, threads=1, seed=0, train_size=16, test_size=4, batch=4, d_model=32, heads=2,
               layers=1, vocab=4, lr=1e-2, **TINY)
    first, last = r["losses"][:2], r["losses"][-2:]
    assert sum(last) < sum(first), r["losses"]


def test_run_rejects_unknown_options():
    with pytest.raises(TypeError):
        st.run("dense", epochs=1, sequence_length=64)
    with pytest.raises(ValueError):
        st.run("cuda", epochs=1, **TINY)


# --- routing attention: the pattern computed from the data -----------------------------------------------------

st_routing = import_app("sparse_transformer.routing")
ROUTED = dict(d_model=32, heads=2, batch=2, seed=0, pattern="routing", clusters=3, **TINY)


def _same_cluster_mask(q, k, centroids, n_globals):
    """The routing pattern by its definition, densely: ``(B, H, n, n)`` bool."""
    cq, ck = st_routing.assign(q, centroids), st_routing.assign(k, centroids)
    i = torch.arange(q.shape[2])
    extra = (i[:, None] == i[None, :]) | (i[:, None] < n_globals) | (i[None, :] < n_globals)
    return (cq[..., :, None] == ck[..., None, :]) | extra


def test_routing_pattern_is_the_same_cluster_pairs():
    gen = torch.Generator().manual_seed(0)
    for problems, n, clusters, g in ((3, 10, 3, 0), (4, 17, 5, 2), (2, 8, 1, 0), (1, 1, 1, 1)):
        cq = torch.randint(clusters, (problems, n), generator=gen)
        ck = torch.randint(clusters, (problems, n), generator=gen)
        crow, col = st_routing.pattern(cq, ck, g)
        _check_csr(crow, col, problems * n)
        rows = st_pattern.rows_of(crow)
        assert torch.equal(rows // n, col // n)                  # block-diagonal: problems never mix
        i = torch.arange(n)
        want = (cq[:, :, None] == ck[:, None, :]) | (i[:, None] == i[None, :]) | (i[:, None] < g) | (i[None, :] < g)
        assert torch.equal(st_routing.dense_blocks(crow, col, problems), want)


def test_routing_attention_equals_dense_attention_with_the_same_mask():
    """The scorch layer (its mask a scorch CSR SparseTensor built in the forward) against plain torch SDPA with the
    routing pattern written out densely from its definition: values and every gradient."""
    import torch.nn.functional as F
    with record_sparse_ops() as seen:
        _, crow, layer, x, grad, mask = st.attention_setup("scorch", **ROUTED)
        assert crow is None and mask is None
        layer.eval()  # (the centroids stay: the reference below reads the same ones)
        out = layer(x, None)
        out.backward(grad)
    for fn in (torch.sparse.sampled_addmm, torch.sparse.softmax, torch.sparse.mm):
        assert seen[fn] == 1, (fn, seen)                         # scorch ran the attention, all heads in one call
    _, _, ref, x_ref, _, _ = st.attention_setup("dense", **ROUTED)
    B, n, d = x_ref.shape
    H, dh = 2, d // 2
    qkv = ref.qkv(x_ref).reshape(B, n, 3, H, dh).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    allowed = _same_cluster_mask(q.detach(), k.detach(), ref.centroids, TINY["n_globals"])
    assert layer.last_nnz == allowed.sum().item() / (B * H)
    assert 0.2 < allowed.float().mean() < 0.9                    # neither empty nor dense at 3 clusters
    want = ref.out(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(B, n, d))
    want.backward(grad)
    torch.testing.assert_close(out.detach(), want.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for (name, p), (_, p_ref) in zip(layer.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_routing_pattern_follows_the_data_and_the_centroids_learn():
    _, _, layer, x, _, _ = st.attention_setup("scorch", **ROUTED)
    layer.eval()

    def routed(inputs):
        layer(inputs, None)
        return layer.last_pattern

    def same(a, b):
        return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with torch.no_grad():
        first = routed(x)
        before = layer.centroids.clone()
        assert same(routed(x), first) and torch.equal(layer.centroids, before)  # eval: the same pattern again
        assert not same(routed(torch.randn_like(x)), first)       # other inputs, another pattern
        layer.train()
        layer(x, None)
        assert not torch.allclose(layer.centroids, before)        # training: the centroids move (EMA)...
        torch.testing.assert_close(layer.centroids.norm(dim=-1), torch.ones(2, 3))  # ...and stay unit vectors
        layer.eval()
        assert not same(routed(x), first)                         # so the same input is routed anew


def test_routing_training_steps_agree_across_backends():
    opts = dict(epochs=1, threads=1, seed=1, train_size=8, test_size=4, batch=4, d_model=32, heads=2, layers=2,
                pattern="routing", clusters=3, **TINY)
    results = {b: st.run(b, **opts) for b in ("scorch", "dense")}
    ref = results["dense"]["losses"]
    assert len(ref) == 2 and all(math.isfinite(v) for v in ref)
    assert results["scorch"]["losses"] == pytest.approx(ref, rel=1e-4)
    for r in results.values():
        assert r["pattern"] == "routing" and 0 < r["density"] < 1 and r["nnz"] > 0


def test_routing_options_are_checked():
    with pytest.raises(ValueError, match="unknown pattern"):
        st.run("scorch", epochs=1, pattern="lsh", **TINY)
    with pytest.raises(ValueError, match="clusters"):
        st.run("scorch", epochs=1, pattern="routing", clusters=0, **TINY)
    with pytest.raises(ValueError, match="compile"):
        st.run("scorch", epochs=1, pattern="routing", compile=True, **TINY)


# --- timing and memory helpers ------------------------------------------------------------------------------------

def test_time_attention_tiny():
    r = st.time_attention("scorch", 64, window=16, block=16, d_model=32, heads=2, repeats=2, threads=1)
    assert r["nnz"] > 0 and 0 < r["density"] < 1
    assert r["fwd_s"] > 0 and r["fwd_bwd_s"] > 0


def test_measure_memory_in_a_fresh_process():
    r = st.measure_memory("dense", 128, mode="fwd_bwd", window=16, block=16, d_model=32, heads=2, threads=1)
    assert r["backend"] == "dense" and r["finite"]
    assert r["peak_delta"] >= 0 and r["peak"] >= r["rss_before"] > 0


# --- the command line ---------------------------------------------------------------------------------------------

def _cli(*args, timeout=120):
    return run_app("sparse_transformer", *args, timeout=timeout)


def test_cli_help():
    p = _cli("--help")
    assert p.returncode == 0, p.stderr
    for option in ("--backend", "--data", "--epochs", "--threads", "--seq-len", "--window", "--globals",
                   "--random-blocks", "--block", "--d-model", "--heads", "--layers", "--batch", "--time-attention",
                   "--measure-memory", "--pattern", "--clusters"):
        assert option in p.stdout, option
    assert "scorch" in p.stdout and "dense" in p.stdout and "sparse" in p.stdout


def test_cli_tiny_run():
    p = _cli("--backend", "scorch", "--epochs", "1", "--seq-len", "64", "--window", "16", "--block", "16",
             "--train-size", "4", "--test-size", "4", "--batch", "2", "--d-model", "32", "--layers", "1", "--quiet",
             "--threads", "1")
    assert p.returncode == 0, p.stderr
    for key in ("backend                scorch", "accuracy", "epoch_s", "infer_s", "nnz", "density"):
        assert key in p.stdout, (key, p.stdout)


def test_cli_tiny_routing_run():
    p = _cli("--backend", "scorch", "--pattern", "routing", "--clusters", "3", "--epochs", "1", "--seq-len", "64",
             "--train-size", "4", "--test-size", "4", "--batch", "2", "--d-model", "32", "--layers", "1", "--quiet",
             "--threads", "1")
    assert p.returncode == 0, p.stderr
    for key in ("pattern                routing", "clusters               3", "accuracy", "density"):
        assert key in p.stdout, (key, p.stdout)


@pytest.mark.slow
def test_compiled_training_matches_eager(monkeypatch):
    """``compile=True`` (the encoder under ``torch.compile``): the attention is scorch's fused kernel inside the graph,
    and training gives eager's losses step by step."""
    from scorch import fusion
    calls = []
    kernel = fusion.attention
    monkeypatch.setattr(fusion, "attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    opts = dict(epochs=1, threads=1, seed=1, train_size=8, test_size=4, batch=4, d_model=32, heads=2, layers=1,
                **TINY)
    compiled, plain = st.run("scorch", compile=True, **opts), st.run("scorch", **opts)
    assert calls, "the compiled graph runs the fused attention kernel"
    # one call per forward of the layer (3 batches) and its backward, every (sequence, head) in it: not one per
    # (sequence, head) (4 x 2 a batch), as when the graph was given the n x n mask
    assert len(calls) <= 6, len(calls)
    assert compiled["compiled"] and compiled["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    assert compiled["accuracy"] == pytest.approx(plain["accuracy"], abs=1e-6)


def test_compiled_steps_reuse_the_pattern_work(monkeypatch):
    """The index arrays a compiled backward gets are the forward's (``scorch.dynamo._canonical``), not other objects
    over the same memory (as AOTAutograd hands saved arrays back): the attention's sparse products weigh and make
    their pattern's transposition once, not every step."""
    import sys
    from apps.sparse_transformer import model as M
    from apps.sparse_transformer.task import CLASSES
    engine_run = sys.modules["scorch.engine.run"]  # (the module: ``scorch.engine.run`` is also its function)
    decided = []
    decide = engine_run._decide
    monkeypatch.setattr(engine_run, "_decide", lambda *a, **kw: decided.append(1) or decide(*a, **kw))
    _, _, mask = st.pattern_and_mask("scorch", 64, 16, 2, 1, 16, 0)
    net = M.build_encoder(scorch, 8, 32, 2, 1, CLASSES, 0)
    step = torch.compile(net, fullgraph=True)
    x, big = torch.randint(0, 8, (2, 64)), M.block_diagonal(scorch, mask, 4, {})
    counts = []
    for _ in range(5):
        step(x, big).sum().backward()
        counts.append(len(decided))
    assert counts[-1] == counts[0], f"the compiled steps planned their products again: {counts}"
