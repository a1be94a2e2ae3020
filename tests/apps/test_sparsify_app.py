"""The sparsifying example (apps/sparsify): the schedule turns the MLP's wide weights into SparseTensors of the
requested format and sparsity, the pruned model computes exactly what the dense model does with the same mask,
fine-tuning keeps the pattern, and the command line runs."""
from __future__ import annotations

import copy
import re

import pytest
import torch

import scorch
from conftest import import_app, run_app

app = import_app("sparsify")

pytestmark = [pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")]

CASES = [("csr", 0.9, "csr"), ("bsr16", 0.75, "bsr(16, 16)"), ("bsr32", 0.5, "bsr(32, 32)"), ("nm24", 0.5, "nm(2, 4)")]


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
        stored = p.detach()
        mask = stored.with_values(torch.ones_like(stored.values())).to_dense() != 0
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


def test_nm24_needs_half():
    with pytest.raises(ValueError, match="50%"):
        app.sparsify(app.mlp(torch, 8, 16, 2), "nm24", 0.75)


def test_command_line_runs():
    out = run_app("sparsify", "--epochs", "2", "--finetune-epochs", "1", "--hidden", "64", "--repeats", "2",
                  "--sparsities", "0.5,0.9", "--format", "csr", "--threads", "1", "--quiet", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("dense ") for line in lines)
    assert any(line.startswith("csr 50%") for line in lines) and any(line.startswith("csr 90%") for line in lines)
    assert "bytes_ratio" in out.stdout
