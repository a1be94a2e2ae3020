"""The recommender app (apps/recsys): both backends learn on a tiny generated ratings matrix and agree with each
other, the scorch backend's SDDMM and SpMM really run through scorch, ML-100k loads, and the command line works."""
from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import pathlib

import pytest
import torch

import scorch
from conftest import import_app, record_sparse_ops, run_app

ROOT = pathlib.Path(__file__).resolve().parents[2]




recsys = import_app("recsys")
recsys_data = importlib.import_module(recsys.__name__ + ".data")
recsys_model = importlib.import_module(recsys.__name__ + ".model")
TINY = dict(generated=True, users=60, items=80, ratings=2000, rank=8, lr=0.05, weight_decay=3e-3)

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
]




@functools.cache
def tiny(backend, dtype="float64", epochs=20):
    return recsys.run(backend, epochs=epochs, threads=1, seed=0, dtype=dtype, **TINY)


@pytest.mark.parametrize("backend", recsys.BACKENDS)
def test_learns(backend):
    r = tiny(backend, "float32")
    assert r["backend"] == backend and r["data"].startswith("generated")
    assert (r["users"], r["items"], r["train_ratings"] + r["test_ratings"]) == (60, 80, 2000)
    assert r["losses"][-1] < 0.3 * r["losses"][0]
    # well below a constant predictor (the training mean) on held-out ratings
    assert r["test_rmse"] < 0.85 * r["baseline_rmse"], (r["test_rmse"], r["baseline_rmse"])
    assert r["train_rmse"] < r["test_rmse"]
    for key in ("epoch_s", "infer_s", "batch_s"):
        assert r[key] > 0 and math.isfinite(r[key]), key


def test_backends_agree():
    """Same seed, same math: the SDDMM/SpMM path and the gather/EmbeddingBag path give the same training curve
    and RMSEs (float64 here: equal to rounding; float32 to a looser tolerance)."""
    s, t = tiny("scorch"), tiny("torch")
    assert s["losses"] == pytest.approx(t["losses"], rel=1e-9, abs=1e-12)
    for key in ("train_rmse", "test_rmse", "baseline_rmse"):
        assert s[key] == pytest.approx(t[key], rel=1e-9), key
    s32, t32 = tiny("scorch", "float32"), tiny("torch", "float32")
    assert s32["losses"] == pytest.approx(t32["losses"], rel=1e-4)
    assert s32["test_rmse"] == pytest.approx(t32["test_rmse"], rel=1e-4)


def test_batches():
    """A few batches per epoch (fixed chunks of the ratings, each its own pattern): the backends still agree."""
    opts = dict(TINY, batches=3)
    s = recsys.run("scorch", epochs=4, threads=1, dtype="float64", **opts)
    t = recsys.run("torch", epochs=4, threads=1, dtype="float64", **opts)
    assert s["batches"] == 3
    assert s["losses"] == pytest.approx(t["losses"], rel=1e-9)
    assert s["test_rmse"] == pytest.approx(t["test_rmse"], rel=1e-9)


def test_scorch_runs_sparse_ops():
    """Under scorch the model's inputs are scorch.SparseTensors and its SDDMM and SpMMs reach scorch (no silent
    torch-sparse or dense path)."""
    ds = recsys_data.load(None, generated=True, users=30, items=40, ratings=300)
    batch_obs, _, _, _, test_obs, _, user_feat, item_feat = recsys.operands(
        scorch, "scorch", ds, 1, 0, torch.float32)
    for x in (batch_obs[0], test_obs, user_feat, item_feat):
        assert type(x) is scorch.SparseTensor and x.format.name == "csr"
    scorch.manual_seed(0)
    model = recsys_model.build(scorch, ds.n_users, ds.n_items, user_feat.shape[1], item_feat.shape[1], 4, 3.5)
    with record_sparse_ops() as seen:
        pred = model(batch_obs[0], user_feat, item_feat)
        pred.sum().backward()
    assert seen[torch.sparse.sampled_addmm] == 1
    assert seen[torch.sparse.mm] == 2
    assert type(pred) is torch.Tensor and pred.shape == (len(ds.train),)
    assert model.user_feature_bag.weight.grad is not None and model.item_factors.weight.grad is not None

    # and the same numbers as the gather / EmbeddingBag spelling, with the same parameters
    _, _, _, _, _, _, uf_idx, if_idx = recsys.operands(torch, "torch", ds, 1, 0, torch.float32)
    with torch.no_grad():
        want = model((ds.train.users, ds.train.items), uf_idx, if_idx)
        got = model(batch_obs[0], user_feat, item_feat)
    torch.testing.assert_close(got, want)


def test_generated_shape_and_ratings():
    ds = recsys_data.load(None, generated=True, users=50, items=70, ratings=900, seed=3)
    assert ds.n_users == 50 and ds.n_items == 70 and len(ds.train) + len(ds.test) == 900
    assert len(ds.test) == 90
    r = torch.cat([ds.train.ratings, ds.test.ratings])
    assert r.min() >= 1 and r.max() <= 5 and torch.equal(r, r.round())
    # distinct pairs, sorted row-major; train and test disjoint
    for part in (ds.train, ds.test):
        key = part.users * ds.n_items + part.items
        assert torch.all(key[1:] > key[:-1])
    both = torch.cat([ds.train.users * 70 + ds.train.items, ds.test.users * 70 + ds.test.items])
    assert both.unique().numel() == 900
    # the split is a function of the seed
    again = recsys_data.load(None, generated=True, users=50, items=70, ratings=900, seed=3)
    assert torch.equal(again.test.users, ds.test.users) and torch.equal(again.test.items, ds.test.items)


def _ml100k_or_skip():
    path = recsys_data.recbole_dir()
    if path is None:
        pytest.skip("recbole is not installed: its bundled dataset_example/ml-100k is the default ML-100k copy")
    return path


def test_ml100k_loads():
    path = _ml100k_or_skip()
    ds = recsys_data.load(None, seed=0)
    assert ds.source.startswith("ml-100k")
    assert (ds.n_users, ds.n_items) == (943, 1682)
    assert len(ds.train) + len(ds.test) == 100_000 and len(ds.test) == 10_000
    assert set(torch.cat([ds.train.ratings, ds.test.ratings]).unique().tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}
    uf, itf = ds.user_features, ds.item_features
    assert uf.shape == (943, 30)             # 7 age groups, 2 genders, 21 occupations
    assert torch.equal(uf.crow.diff(), torch.full((943,), 3))
    assert "gender:F" in uf.names and "occupation:technician" in uf.names
    assert "genre:Drama" in itf.names and "decade:1990s" in itf.names and "decade:unknown" in itf.names
    assert itf.shape[0] == 1682 and int(itf.crow.diff().min()) >= 2   # at least one genre and a decade
    # user 1 (row 0): 24 years old, M, technician
    row0 = {uf.names[k] for k in uf.col[: int(uf.crow[1])].tolist()}
    assert row0 == {"age:18-24", "gender:M", "occupation:technician"}


def test_data_folder(tmp_path):
    """``--data DIR`` reads DIR/ml-100k/ (or DIR itself); a folder without the files is an error."""
    path = _ml100k_or_skip()
    (tmp_path / "ml-100k").mkdir()
    for name in recsys_data.FILES:
        (tmp_path / "ml-100k" / name).symlink_to(path / name)
    ds = recsys_data.load(str(tmp_path))
    assert ds.source.startswith("ml-100k") and str(tmp_path) in ds.source and ds.n_users == 943
    assert recsys_data.load(str(tmp_path / "ml-100k")).n_items == 1682
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="ML-100k"):
        recsys_data.load(str(empty))


def test_compare_interleaved():
    """apps.recsys.compare: both backends, epochs interleaved in one process, the same RMSE."""
    compare = importlib.import_module(recsys.__name__ + ".compare")
    r = compare.compare(epochs=3, threads=1, dtype="float64", **TINY)
    assert r["scorch_test_rmse"] == pytest.approx(r["torch_test_rmse"], rel=1e-9)
    assert r["scorch_epoch_s"] > 0 and r["torch_infer_s"] > 0 and r["speedup"] > 0


def test_quick_and_step_times():
    """``quick=True`` (the benchmark suite's quick runs) caps the epochs; the timed steps come back too."""
    r = recsys.run("torch", epochs=50, threads=1, quick=True, **TINY)
    assert r["epochs"] == recsys.QUICK_EPOCHS == len(r["losses"])
    assert len(r["epoch_times"]) == len(r["infer_times"]) == recsys.QUICK_EPOCHS - 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        recsys.run("jax", epochs=1, **TINY)
    with pytest.raises(TypeError, match="unknown options"):
        recsys.run("torch", epochs=1, hidden=3, **TINY)


def _cli(*args, timeout=120):
    return run_app("recsys", *args, timeout=timeout)


def test_cli_help():
    out = _cli("--help")
    assert out.returncode == 0, out.stderr
    for option in ("--backend", "--data", "--epochs", "--threads", "--rank", "--batches", "--generated"):
        assert option in out.stdout
    assert "scorch" in out.stdout and "torch" in out.stdout


def test_cli_tiny_run():
    out = _cli("--backend", "scorch", "--generated", "--users", "40", "--items", "50", "--ratings", "600",
               "--rank", "4", "--epochs", "3", "--threads", "1")
    assert out.returncode == 0, out.stderr
    assert "recsys (scorch)" in out.stdout
    for key in ("test_rmse", "train_rmse", "epoch_s", "infer_s"):
        assert key in out.stdout
