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
    """The plan file of the kernel with ``k`` columns (an entry is ``(fingerprint, key, fields)``, pickled; the key
    ends with the compiled-in column count and the target)."""
    (plan,) = [p for p in _plans(cache) if pickle.loads(p.read_bytes())[1][-2] == k]
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
