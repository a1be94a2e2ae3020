"""The sparsifying example (apps/sparsify): the schedule turns the MLP's wide weights (and the transformer's
feed-forward weights) into SparseTensors of the requested format and sparsity, the pruned model computes exactly
what the dense model does with the same mask, fine-tuning keeps the pattern, and the command line runs."""
from __future__ import annotations

import copy
import re

import pytest
import torch

import scorch
from conftest import import_app, run_app

app = import_app("sparsify")

pytestmark = [pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is fastest, and it keeps these tests quick when other work shares the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CASES = [("csr", 0.9, "csr"), ("bsr16", 0.75, "bsr(16, 16)"), ("bsr32", 0.5, "bsr(32, 32)"), ("nm24", 0.5, "nm(2, 4)")]


def stored_pattern(p):
    """Where ``p`` stores an entry (a block format stores the zeros of its kept blocks too)."""
    stored = p.detach()
    return stored.with_values(torch.ones_like(stored.values())).to_dense() != 0


def sparse_weights(model):
    return {n: p for n, p in model.named_parameters() if re.fullmatch(app.SPARSE_WEIGHTS, n)}


@pytest.mark.parametrize("fmt, sparsity, name", CASES)
def test_pruned_model_is_the_dense_model_with_the_mask(fmt, sparsity, name):
    torch.manual_seed(0)
    dense = app.mlp(torch, 64, 128, 5)
    model = copy.deepcopy(dense)
    app.sparsify(model, fmt, sparsity)
    weights = sparse_weights(model)
    assert set(weights) == {"0.weight", "3.weight"}
    masked = copy.deepcopy(dense)
    for n, p in weights.items():
        assert isinstance(p, scorch.SparseTensor) and isinstance(p, torch.nn.Parameter) and p.requires_grad
        assert scorch.formats.named.short_name(p.format) == name
        mask = stored_pattern(p)
        kept = mask.float().mean().item()
        assert kept == pytest.approx(1 - sparsity, abs=1e-3), (n, kept)
        dict(masked.named_parameters())[n].data.mul_(mask)  # the dense weight with the same mask
        assert torch.equal(p.to_dense(), dict(masked.named_parameters())[n].detach())
    x = torch.randn(33, 64)
    model.eval()
    masked.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), masked(x), rtol=1e-5, atol=1e-5)


def test_finetuning_keeps_the_pattern_and_learns():
    torch.manual_seed(0)
    model = app.mlp(torch, 40, 64, 5)
    app.sparsify(model, "bsr16", 0.75)
    before = {n: (p.format, p.nnz) for n, p in sparse_weights(model).items()}
    x, y = torch.randn(200, 40), torch.randint(0, 5, (200,))
    idx = torch.arange(200)
    first = torch.nn.functional.cross_entropy(model(x), y).item()
    times = app.train(model, x, y, idx, epochs=15, lr=1e-2, batch=64, seed=0, desc="", quiet=True)
    assert len(times) == 15
    model.eval()
    assert torch.nn.functional.cross_entropy(model(x), y).item() < first
    assert {n: (p.format, p.nnz) for n, p in sparse_weights(model).items()} == before
    assert all(isinstance(p, scorch.SparseTensor) for p in sparse_weights(model).values())


def test_nm24_finetuning_keeps_the_format_and_the_pattern():
    """An nm(2, 4) weight is fine-tuned through CSR (scorch cannot update a padded format in place yet) and
    stored as nm(2, 4) again, with the same kept entries."""
    torch.manual_seed(0)
    model = app.mlp(torch, 40, 64, 5)
    app.sparsify(model, "nm24", 0.5)
    before = {n: p.detach().to_dense() != 0 for n, p in sparse_weights(model).items()}
    x, y = torch.randn(200, 40), torch.randint(0, 5, (200,))
    first = torch.nn.functional.cross_entropy(model(x), y).item()
    app.finetune(model, "nm24", x, y, torch.arange(200), epochs=5, lr=1e-2, batch=64, seed=0, desc="", quiet=True)
    model.eval()
    assert torch.nn.functional.cross_entropy(model(x), y).item() < first
    for n, p in sparse_weights(model).items():
        assert isinstance(p, scorch.SparseTensor) and isinstance(p, torch.nn.Parameter) and p.requires_grad
        assert scorch.formats.named.short_name(p.format) == "nm(2, 4)"
        assert torch.equal(p.detach().to_dense() != 0, before[n])


def test_features_are_padded_to_a_multiple_of_4():
    g, x, y, tr, va, te = app.features("sbm-like-cora", None, 0)  # (Cora's sizes, generated: no data needed)
    assert x.shape[1] % 4 == 0 and x.shape[1] - g.num_features < 4
    assert not x[:, g.num_features:].any()
    assert len(set(tr.tolist()) | set(va.tolist()) | set(te.tolist())) == tr.numel() + va.numel() + te.numel()


TRANSFORMER_WEIGHTS = {f"encoder.layers.{i}.linear{j}.weight" for i in range(2) for j in (1, 2)}


def small_transformer():
    return app.transformer(torch, vocab=10, seq_len=8, d_model=32, heads=2, hidden=64, layers=2, classes=3)


@pytest.mark.parametrize("fmt, sparsity, name", CASES)
def test_transformer_pruned_is_the_dense_model_with_the_mask(fmt, sparsity, name):
    """The feed-forward weights of nn.TransformerEncoder's layers become SparseTensors; the attention's stay dense."""
    torch.manual_seed(0)
    dense = small_transformer()
    model = copy.deepcopy(dense)
    app.sparsify(model, fmt, sparsity, app.TRANSFORMER_WEIGHTS)
    masked = copy.deepcopy(dense)
    params = dict(model.named_parameters())
    assert {n for n, p in params.items() if isinstance(p, scorch.SparseTensor)} == TRANSFORMER_WEIGHTS
    for n in TRANSFORMER_WEIGHTS:
        p = params[n]
        assert scorch.formats.named.short_name(p.format) == name and p.requires_grad
        mask = stored_pattern(p)
        assert mask.float().mean().item() == pytest.approx(1 - sparsity, abs=1e-3), n
        dict(masked.named_parameters())[n].data.mul_(mask)
    x = torch.randint(10, (5, 8))
    model.eval()
    masked.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), masked(x), rtol=1e-4, atol=1e-4)


def test_transformer_finetuning_keeps_the_pattern_and_learns():
    torch.manual_seed(0)
    model = small_transformer()
    app.sparsify(model, "bsr16", 0.75, app.TRANSFORMER_WEIGHTS)
    before = {n: p.detach().to_dense() != 0 for n, p in model.named_parameters() if n in TRANSFORMER_WEIGHTS}
    x, y = app.lookup_task(64, 8, 10, 3, seed=0)
    idx = torch.arange(64)
    first = app.loss_fn(model(x), y).item()
    app.train(model, x, y, idx, epochs=6, lr=3e-3, batch=16, seed=0, desc="", quiet=True)
    model.eval()
    assert app.loss_fn(model(x), y).item() < first
    for n, p in model.named_parameters():
        if n in TRANSFORMER_WEIGHTS:
            assert isinstance(p, scorch.SparseTensor) and torch.equal(p.detach().to_dense() != 0, before[n])
    assert 0.0 <= app.accuracy(model, x, y, idx) <= 1.0


def test_lookup_task():
    x, y = app.lookup_task(50, 8, 10, 3, seed=1)
    x2, y2 = app.lookup_task(50, 8, 10, 3, seed=2)
    assert x.shape == y.shape == (50, 8) and (y[:, 0] == app.IGNORE).all()
    assert y[:, 1:].min() >= 0 and y[:, 1:].max() < 3
    table = {}
    for xs, ys in ((x, y), (x2, y2)):  # one table for every seed: a token and the first token fix the class
        for s in range(50):
            for i in range(1, 8):
                assert table.setdefault((int(xs[s, i]), int(xs[s, 0])), int(ys[s, i])) == int(ys[s, i])


def test_transformer_run():
    r = app.run("scorch", model="transformer", hidden=32, sequences=80, epochs=2, finetune_epochs=1, batch=16,
                repeats=1, sparsities=(0.5,), format="csr", quiet=True)
    assert [row["model"] for row in r["rows"]] == ["dense", "csr 50%"] and r["rows"][1]["format"] == "csr"
    assert r["model"] == "transformer" and 0.0 <= r["test_acc"] <= 1.0


def test_nm24_needs_half():
    with pytest.raises(ValueError, match="50%"):
        app.sparsify(app.mlp(torch, 8, 16, 2), "nm24", 0.75)


def test_command_line_runs():
    # (the generated graph by its name: a checkout without ../shared/data has no Cora, and a missing named data set
    # is an error)
    out = run_app("sparsify", "--dataset", "sbm-like-cora", "--epochs", "2", "--finetune-epochs", "1", "--hidden", "64",
                  "--repeats", "2", "--sparsities", "0.5,0.9", "--format", "csr", "--threads", "1", "--quiet",
                  timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("dense ") for line in lines)
    assert any(line.startswith("csr 50%") for line in lines) and any(line.startswith("csr 90%") for line in lines)
    assert "bytes_ratio" in out.stdout
