"""Plans kept on disk (``compiler/pipeline.py``, "plans kept on disk"): a new process loads the plan the last one
made and goes straight to the library, without lowering or rendering; a damaged, foreign or stale entry is a
miss, never a wrong kernel."""
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, torch, scorch
    from scorch.compiler import pipeline
    g = torch.Generator().manual_seed(0)
    d = torch.randn(24, 24, generator=g) * (torch.rand(24, 24, generator=g) < 0.2)
    x = torch.randn(24, int(sys.argv[2]), generator=g)
    s = scorch.asformat(d, sys.argv[3])  # (a conversion: its kernels are not kept as plans)
    if sys.argv[1] == "no-lowering":
        def refuse(*a, **k):
            raise AssertionError("lowered again: the stored plan was not used")
        pipeline.lower = refuse
    torch.testing.assert_close(scorch.einsum("ij,jk->ik", s, x), d @ x, rtol=1e-5, atol=1e-5)
    print("ok")
""")


def _run(cache, mode, k=8, fmt="csr"):
    env = dict(os.environ, SCORCH_CACHE_DIR=str(cache))
    env.pop("SCORCH_DEFER", None)
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(k), fmt], env=env, capture_output=True, text=True,
                       timeout=600)
    return r


def _plans(cache):
    return sorted(pathlib.Path(cache).glob("**/plans/*.pkl"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache holding two kernels' libraries and plans (CSR with 8 columns, BSR with 16): the tests below work on
    copies, so g++ runs only here."""
    cache = tmp_path_factory.mktemp("plan-cache")
    for k, fmt in ((8, "csr"), (16, "bsr(2, 2)")):
        r = _run(cache, "compile", k=k, fmt=fmt)
        assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    assert len(_plans(cache)) == 2
    return cache


def _copy(cache, tmp_path):
    shutil.copytree(cache, tmp_path / "cache")
    return tmp_path / "cache"


def _which(cache, k):
    """The plan file of the kernel with ``k`` columns (an entry is its MAC, then ``(fingerprint, key, fields)``,
    pickled; the key ends with the compiled-in column count and the target)."""
    from scorch.compiler import runtime
    (plan,) = [p for p in _plans(cache) if pickle.loads(p.read_bytes()[runtime.MAC_SIZE:])[1][-2] == k]
    return plan


def test_a_new_process_uses_the_stored_plan(cache):
    for k, fmt in ((8, "csr"), (16, "bsr(2, 2)")):
        r = _run(cache, "no-lowering", k=k, fmt=fmt)
        assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_a_damaged_entry_is_lowered_again(cache, tmp_path):
    cache = _copy(cache, tmp_path)
    plan = _which(cache, 8)
    plan.write_bytes(b"\0" * 64)
    assert "lowered again" in _run(cache, "no-lowering").stderr  # a miss: it lowers again (refused here) ...
    r = _run(cache, "compile")  # ... and a normal run is right, and writes the entry anew
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    assert _run(cache, "no-lowering").returncode == 0


def test_another_keys_entry_under_this_name_is_a_miss(cache, tmp_path):
    """An entry holds its own key: the BSR kernel's plan copied over the CSR kernel's file is not used for CSR."""
    cache = _copy(cache, tmp_path)
    mine, other = _which(cache, 8), _which(cache, 16)
    mine.write_bytes(other.read_bytes())
    assert "lowered again" in _run(cache, "no-lowering").stderr
    r = _run(cache, "compile")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# --- calls kept on disk (``engine/run.py``, "calls kept on disk") ------------------------------------------------
# A call that went straight to one kernel is kept under its signature: a new process with the same signature
# prepares the call from the kept plan without planning at all (``scorch.cache_info()["planned"]`` stays 0).

CALL = textwrap.dedent("""
    import json, sys, torch, scorch
    torch.set_num_threads(int(sys.argv[1]))
    g = torch.Generator().manual_seed(0)
    d = torch.randn(20, 20, generator=g) * (torch.rand(20, 20, generator=g) < 0.2)
    s = scorch.sparse_csr_tensor(d.to_sparse_csr().crow_indices(), d.to_sparse_csr().col_indices(),
                                 d.to_sparse_csr().values(), (20, 20))
    x = torch.randn(20, int(sys.argv[2]), generator=g)
    torch.testing.assert_close(scorch.einsum("ij,jk->ik", s, x), d @ x, rtol=1e-5, atol=1e-5)
    # a second tensor of the same signature (another pattern): the prepared call serves it too, rightly
    d2 = torch.randn(20, 20, generator=g) * (torch.rand(20, 20, generator=g) < 0.5)
    s2 = scorch.sparse_csr_tensor(d2.to_sparse_csr().crow_indices(), d2.to_sparse_csr().col_indices(),
                                  d2.to_sparse_csr().values(), (20, 20))
    torch.testing.assert_close(scorch.einsum("ij,jk->ik", s2, x), d2 @ x, rtol=1e-5, atol=1e-5)
    print(json.dumps({k: n for k, (n, _) in scorch.cache_info().items()}))
""")


def _call(cache, threads=1, k=8):
    env = dict(os.environ, SCORCH_CACHE_DIR=str(cache))
    env.pop("SCORCH_DEFER", None)
    r = subprocess.run([sys.executable, "-c", CALL, str(threads), str(k)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    import json
    return json.loads(r.stdout.strip().splitlines()[-1])


def _calls(cache):
    return sorted(pathlib.Path(cache).glob("**/calls/*.pkl"))


@pytest.fixture(scope="module")
def call_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("call-cache")
    first = _call(cache)
    assert first["planned"] >= 1 and len(_calls(cache)) == 1
    return cache


def test_a_new_process_prepares_a_kept_call_without_planning(call_cache, tmp_path):
    cache = _copy(call_cache, tmp_path)
    info = _call(cache)
    assert info["planned"] == 0 and info["compiled"] == 1 and info["prepared-by-equation"] == 1


def test_a_damaged_or_foreign_call_entry_is_planned_again(call_cache, tmp_path):
    cache = _copy(call_cache, tmp_path)
    (entry,) = _calls(cache)
    entry.write_bytes(b"\0" * 64)
    assert _call(cache)["planned"] >= 1  # a miss: planned again, right, and kept anew
    assert _call(cache)["planned"] == 0
    (entry,) = _calls(cache)
    _call(cache, k=5)  # another signature's entry ...
    other = [p for p in _calls(cache) if p != entry][0]
    entry.write_bytes(other.read_bytes())  # ... under this one's name
    assert _call(cache)["planned"] >= 1


@pytest.mark.slow
def test_a_kept_call_is_per_thread_count(call_cache, tmp_path):
    """The decisions before the kernel depend on the thread count (a transposition for a parallel loop)."""
    cache = _copy(call_cache, tmp_path)
    assert _call(cache, threads=2)["planned"] >= 1
    assert _call(cache, threads=2)["planned"] == 0


def test_a_kept_call_whose_plan_is_gone_is_planned_again(call_cache, tmp_path):
    cache = _copy(call_cache, tmp_path)
    for p in _plans(cache):
        p.unlink()
    assert _call(cache)["planned"] >= 1


def test_a_call_never_kept_looks_on_disk_once(monkeypatch):
    """A call that is not kept under its equation (here the dense operand is relaid before the kernel) looks for a
    kept call once per signature, not on every call (a file name hashed and a file opened each time)."""
    import torch
    import scorch
    from scorch.engine import prepared
    looked = []
    real = prepared.kept_call
    monkeypatch.setattr(prepared, "kept_call", lambda sig: looked.append(sig) or real(sig))
    scorch.clear_caches()
    s = scorch.asformat(torch.randn(30, 40) * (torch.rand(30, 40) < 0.2), "csr")
    w = torch.randn(16, 40)
    for _ in range(3):
        torch.testing.assert_close(scorch.einsum("ij,oj->io", s, w), s.to_dense() @ w.T)
    assert len(looked) == 1, looked
