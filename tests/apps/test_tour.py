"""The main job's tour (``apps.tour``): its pruned encoder equals the masked dense one, and the table names
every case and the CPU."""
from __future__ import annotations

import torch

import scorch
from apps import tour


def test_pruned_encoder_equals_its_masked_dense_self():
    dense = tour.encoder(1, width=64, hidden=128, heads=4)
    x = torch.randn(2, 16, 64)
    for _, fmt, sparsifier in tour.VARIANTS:
        m = tour.pruned(dense, fmt, sparsifier())
        linears = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]
        assert linears and all(isinstance(mod.weight, scorch.SparseTensor) for mod in linears)
        with torch.no_grad():
            torch.testing.assert_close(m(x), tour.masked_dense(m)(x), rtol=1e-4, atol=1e-4)
        assert tour.weight_bytes(m) < tour.weight_bytes(dense)


def test_table_and_plot(tmp_path):
    rows = [("dense", 0.010, 1.0, 1.0), ("scorch csr", 0.004, 2.5, 0.2)]
    text = tour.table(rows, "some CPU")
    assert "some CPU" in text and "| scorch csr | 4.0 ms | 2.50x | 0.20x |" in text
    tour.plot(rows, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0
