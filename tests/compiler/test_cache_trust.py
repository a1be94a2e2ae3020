"""A kernel cache that another account can write never runs its code (issue 42, ``compiler/cachetrust.py``).

Reproduced before: with ``SCORCH_CACHE_DIR`` a world-writable folder, a kept plan replaced by a pickle whose
``__reduce__`` calls ``os.system`` ran that command in the next process's first ``S @ X``; a planted library with a
sha256 trailer (which anyone can compute) was ``dlopen``ed, running its constructor. Each attack below plants an
entry that creates a marker file when loaded (the fixtures check that it does, loaded directly), then checks that
the next process never creates the marker and computes the right result. Each "next process" is a subprocess: the
runtime alone, loaded by file path (fast), or scorch with torch for ``S @ X``.
"""
import hashlib
import json
import os
import pathlib
import pickle
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from scorch.compiler import runtime
from test_runtime import ADD, ADD_ARGS, parse_last_line, run_python

V = runtime.CACHE_VERSION
UID = os.geteuid()

# The next process: load the add kernel twice, check it adds, report the warnings, where it came from.
LOAD = """
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        k = rt.load(ADD, "add", ADD_ARGS)
        check_add(k)
        again = rt.load(ADD, "add", ADD_ARGS)
        check_add(again)
    print(([(type(w.message).__name__, issubclass(w.category, UserWarning), str(w.message)) for w in caught],
           str(k.path), k.origin, again.origin))
"""


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def files(folder):
    return {p: p.read_bytes() for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A fresh cache and a fresh private-cache home per test (the runtime reads both at call time)."""
    monkeypatch.setenv("SCORCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SCORCH_SANITIZE", raising=False)
    return tmp_path / "cache" / V


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A library an attacker would plant as the add kernel's entry: it exports ``add`` (computing a wrong sum) and
    the stamp of the add kernel's key, and its constructor creates ``marker`` as it is loaded. Returns
    ``(key, body, marker)``: the entry is ``body`` plus some trailer."""
    folder = tmp_path_factory.mktemp("planted")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SCORCH_CACHE_DIR", str(folder / "cache"))
        key = runtime.load(ADD, "add", ADD_ARGS).path.stem
    marker = folder / "marker"
    source = folder / "planted.cpp"
    source.write_text(textwrap.dedent(f"""
        #include <fcntl.h>
        #include <unistd.h>
        __attribute__((constructor)) static void scorch_planted(void) {{
            int fd = open({json.dumps(str(marker))}, O_CREAT | O_WRONLY, 0644);
            if (fd >= 0) close(fd);
        }}
        extern "C" void add(const float* a, const float* b, float* out, long n) {{
            for (long i = 0; i < n; ++i) out[i] = -1.0f;
        }}
    """) + runtime.stamp_source(key))
    subprocess.run([runtime.compiler(), "-shared", "-fPIC", "-o", str(folder / "planted.so"), str(source)],
                   check=True)
    body = (folder / "planted.so").read_bytes()
    # the attack is real: loaded, the library runs its constructor and claims the add kernel's key
    check = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import ctypes
        lib = ctypes.CDLL({str(folder / 'planted.so')!r})
        lib.{runtime.STAMP_SYMBOL}.restype = ctypes.c_char_p
        print(lib.{runtime.STAMP_SYMBOL}().decode())
    """)], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.strip() == key and marker.exists(), check.stderr
    marker.unlink()
    return key, body, marker


def sha256_trailer(key, body):
    """The trailer before issue 42: a plain sha256 of the key and the body, which anyone can compute."""
    return runtime.TRAILER_MARK + hashlib.sha256(key.encode() + b"\0" + body).digest()


def mac_trailer(key, body, folder):
    """A trailer that verifies under ``folder``'s own secret (as if the attacker could read or replace it)."""
    return runtime.TRAILER_MARK + runtime.digest(key, body, runtime.cache_secret(folder))


# --- a cache another account owns or can write is not read at all -------------------------------------------

def _untrusted(case, tmp_path, folder):
    """Make the cache ``folder`` (``<root>/<version>``) untrusted as ``case`` says; returns the configured root."""
    root = folder.parent
    if case == "world-writable":
        root.chmod(0o777)
    elif case == "group-writable":
        root.chmod(0o775)
    elif case == "version-folder-world-writable":
        folder.chmod(0o777)
    elif case == "version-folder-a-symlink":
        real = tmp_path / "elsewhere"
        folder.rename(real)
        folder.symlink_to(real, target_is_directory=True)
    elif case == "parent-world-writable-not-sticky":
        parent = tmp_path / "open"
        parent.mkdir()
        root.rename(parent / "cache")
        parent.chmod(0o777)
        root = parent / "cache"
    elif case == "another-uid":
        if UID != 0:
            pytest.skip("only root can give a folder to another uid (os.chown)")
        os.chown(root, 12345, 12345)
    return root


@pytest.mark.parametrize("case", ["world-writable", "group-writable", "version-folder-world-writable",
                                  "version-folder-a-symlink", "parent-world-writable-not-sticky", "another-uid"])
def test_an_untrusted_cache_is_not_read(case, planted, tmp_path, cache, monkeypatch):
    """The add kernel's entry holds the planted library with a trailer that verifies under the folder's own
    secret: only the folder's trust check stands between it and dlopen. The next process warns once (naming the
    folder and SCORCH_CACHE_DIR), builds in the private cache (made 0700) and never touches the planted one."""
    key, body, marker = planted
    runtime.load(ADD, "add", ADD_ARGS)  # a cache made by this user ...
    (cache / f"{key}.so").write_bytes(body + mac_trailer(key, body, cache))  # ... with the attacker's library
    root = _untrusted(case, tmp_path, cache)
    monkeypatch.setenv("SCORCH_CACHE_DIR", str(root))
    before = files(tmp_path / "elsewhere" if case == "version-folder-a-symlink" else root)
    messages, path, origin, again = parse_last_line(run_python(LOAD))
    assert not marker.exists()
    assert len(messages) == 1, messages
    name, is_user_warning, message = messages[0]
    assert name == "CacheTrustWarning" and is_user_warning
    assert str(root) in message and "SCORCH_CACHE_DIR" in message, message
    private = tmp_path / "xdg" / f"scorch-{UID}" / V
    assert pathlib.Path(path).parent == private and (origin, again) == ("compiled", "memory")
    assert mode(private) == mode(private.parent) == 0o700 and mode(private / "secret") == 0o600
    assert files(tmp_path / "elsewhere" if case == "version-folder-a-symlink" else root) == before  # untouched
    # the private cache serves the next process from disk, without a second warning about it
    messages, path, origin, _ = parse_last_line(run_python(LOAD))
    assert origin == "disk" and pathlib.Path(path).parent == private and len(messages) == 1


def test_a_cache_made_under_umask_002_is_trusted(tmp_path, cache):
    """Folders and files scorch makes are this user's alone whatever the umask (a group-writable umask is common
    with per-user groups), so its own cache passes its own checks: the next process loads from disk, no warning."""
    body = "os.umask(0o002)\n" + textwrap.dedent(LOAD)
    messages, path, origin, _ = parse_last_line(run_python(body))
    assert messages == [] and origin == "compiled" and pathlib.Path(path).parent == cache
    for p in [cache.parent, cache, *cache.rglob("*")]:
        assert mode(p) & 0o022 == 0, (p, oct(mode(p)))
    assert mode(cache.parent) == mode(cache) == 0o700 and mode(cache / "secret") == 0o600
    messages, _, origin, _ = parse_last_line(run_python(body))
    assert messages == [] and origin == "disk"


# --- in a trusted cache, entries are authenticated, and links are not followed ------------------------------

@pytest.mark.parametrize("trailer", ["sha256", "none", "another-secret"])
def test_a_planted_library_is_never_loaded(trailer, planted, cache):
    """The planted library under the add kernel's name, in this user's cache: its trailer is the old sha256 (which
    anyone can compute), missing, or an HMAC under another secret. The MAC fails before dlopen: the entry is
    deleted and rebuilt, the constructor never runs, the sum is right."""
    key, body, marker = planted
    runtime.load(ADD, "add", ADD_ARGS)
    entry = cache / f"{key}.so"
    entry.write_bytes(body + {"sha256": sha256_trailer(key, body), "none": b"",
                              "another-secret": runtime.TRAILER_MARK + runtime.digest(key, body, os.urandom(32))}[
                                  trailer])
    messages, path, origin, again = parse_last_line(run_python(LOAD))
    assert not marker.exists()
    assert messages == [] and (origin, again) == ("compiled", "memory") and pathlib.Path(path) == entry
    assert runtime.trailer_damage(str(entry), key) is None  # rebuilt: this user's library again


def test_a_symlink_swapped_in_for_a_library_is_not_followed(tmp_path, cache):
    """The add kernel's entry moved out of the cache (where another account might change it) and a symbolic link
    put in its place: the link is not followed (even to a library that would verify), but removed and the entry
    rebuilt; what it pointed to is left alone."""
    first = runtime.load(ADD, "add", ADD_ARGS).path
    outside = tmp_path / "outside.so"
    shutil.move(first, outside)
    first.symlink_to(outside)
    data = outside.read_bytes()
    messages, path, origin, _ = parse_last_line(run_python(LOAD))
    assert messages == [] and origin == "compiled" and pathlib.Path(path) == first
    assert not first.is_symlink() and outside.read_bytes() == data
    assert runtime.trailer_damage(str(first), first.stem) is None


class Marker:
    """A pickle that runs a shell command as it loads (the issue's reproduction): it creates ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch '{self.path}'",)


def _planted_pickle(marker, form):
    payload = pickle.dumps(Marker(marker))
    return {"raw": payload, "zero-mac": bytes(runtime.MAC_SIZE) + payload,
            "sha256-mac": hashlib.sha256(payload).digest() + payload}[form]


def test_the_marker_pickle_runs_code_when_loaded(tmp_path):
    """The planted pickles below are real attacks: unpickled, each runs its command."""
    marker = tmp_path / "marker"
    pickle.loads(_planted_pickle(marker, "raw"))
    assert marker.exists()


KEPT = """
    print(repr(rt.kept("plans", "fingerprint", ("key", 1))))
"""


@pytest.mark.parametrize("attack", ["raw", "zero-mac", "sha256-mac", "another-entry", "writable-by-others",
                                    "symlink", "symlinked-folder"])
def test_a_kept_entry_is_unpickled_only_when_authentic(attack, tmp_path, cache):
    """A kept entry (a plan or a prepared call) replaced by a pickle that runs a command (with no MAC, a zero one,
    or a sha256 anyone can compute), by another entry's file, made writable by others, swapped for a symbolic link
    to the real entry moved out of the cache, or its folder swapped for a link: the next process gets a miss (the
    caller plans again), never runs the command."""
    marker = tmp_path / "marker"
    runtime.keep("plans", "fingerprint", ("key", 1), {"value": 1})
    runtime.keep("plans", "fingerprint", ("other", 2), {"value": 2})
    assert parse_last_line(run_python(KEPT)) == {"value": 1}  # kept, and read by the next process
    entry = runtime._entry_path("plans", "fingerprint", ("key", 1))
    other = runtime._entry_path("plans", "fingerprint", ("other", 2))
    if attack in ("raw", "zero-mac", "sha256-mac"):
        entry.write_bytes(_planted_pickle(marker, attack))
    elif attack == "another-entry":
        entry.write_bytes(other.read_bytes())
    elif attack == "writable-by-others":
        entry.chmod(0o666)
    elif attack == "symlink":
        shutil.move(entry, tmp_path / "outside.pkl")
        entry.symlink_to(tmp_path / "outside.pkl")
    else:
        shutil.move(entry.parent, tmp_path / "outside")
        entry.parent.symlink_to(tmp_path / "outside", target_is_directory=True)
    assert parse_last_line(run_python(KEPT)) is None
    assert not marker.exists()


# --- the reproduction: S @ X in a new process --------------------------------------------------------

SPMM = textwrap.dedent("""
    import json, warnings, torch, scorch
    from scorch.compiler import pipeline
    g = torch.Generator().manual_seed(0)
    d = torch.randn(24, 24, generator=g) * (torch.rand(24, 24, generator=g) < 0.2)
    x = torch.randn(24, 8, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = scorch.asformat(d, "csr")  # (a conversion: its kernels are lowered each time, not kept as plans)
        lowered = []
        real = pipeline.lower
        pipeline.lower = lambda *a, **k: lowered.append(1) or real(*a, **k)
        y = s @ x
    assert torch.allclose(y, d @ x, rtol=1e-5, atol=1e-5), "wrong result"
    print(json.dumps({"lowered": len(lowered), "planned": scorch.cache_info()["planned"][0],
                      "warnings": [str(w.message) for w in caught if type(w.message).__name__ == "CacheTrustWarning"]}))
""")


def _spmm(root, xdg):
    env = dict(os.environ, SCORCH_CACHE_DIR=str(root), XDG_CACHE_HOME=str(xdg))
    env.pop("SCORCH_DEFER", None)
    r = subprocess.run([sys.executable, "-c", SPMM], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def spmm_cache(tmp_path_factory):
    """A cache holding the libraries, the plan and the prepared call of one S @ X (the tests work on copies)."""
    root = tmp_path_factory.mktemp("spmm")
    info = _spmm(root / "cache", root / "xdg")
    assert info["lowered"] >= 1 and info["warnings"] == []
    assert list((root / "cache").rglob("plans/*.pkl")) and list((root / "cache").rglob("calls/*.pkl"))
    return root / "cache"


def test_planted_pickles_in_a_world_writable_cache_never_run(spmm_cache, tmp_path):
    """The issue's reproduction: a world-writable SCORCH_CACHE_DIR whose kept plan and call are replaced by pickles
    that run a command, even MAC'd under the folder's own secret. The next S @ X warns, uses the private cache
    (here already holding this user's plan: nothing is lowered) and never runs the command."""
    marker = tmp_path / "marker"
    shared = tmp_path / "shared"
    shutil.copytree(spmm_cache, shared)
    shutil.copytree(spmm_cache, tmp_path / "xdg" / f"scorch-{UID}")
    for entry in shared.rglob("*.pkl"):
        payload = pickle.dumps(Marker(marker))
        entry.write_bytes(runtime.entry_mac(entry, payload) + payload)
    shared.chmod(0o777)
    info = _spmm(shared, tmp_path / "xdg")
    assert not marker.exists()
    assert len(info["warnings"]) == 1 and str(shared) in info["warnings"][0], info
    assert info["lowered"] == 0


def test_planted_pickles_and_a_symlinked_plan_in_a_trusted_cache(spmm_cache, tmp_path):
    """In this user's own cache: the kept call replaced by a pickle that runs a command (sha256 "MAC"), the kept
    plan moved out and a symbolic link put in its place. Neither is loaded: S @ X plans and lowers again, rightly,
    and the link's target is left alone."""
    marker = tmp_path / "marker"
    cache = tmp_path / "cache"
    shutil.copytree(spmm_cache, cache)
    for entry in cache.rglob("calls/*.pkl"):
        entry.write_bytes(_planted_pickle(marker, "sha256-mac"))
    (plan,) = cache.rglob("plans/*.pkl")
    shutil.move(plan, tmp_path / "outside.pkl")
    plan.symlink_to(tmp_path / "outside.pkl")
    data = (tmp_path / "outside.pkl").read_bytes()
    info = _spmm(cache, tmp_path / "xdg")
    assert not marker.exists()
    assert info["warnings"] == [] and info["planned"] >= 1 and info["lowered"] >= 1, info
    assert not plan.is_symlink() and (tmp_path / "outside.pkl").read_bytes() == data
