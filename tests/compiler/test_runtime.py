"""scorch.compiler.runtime: compile once, cache in memory and on disk, call through ctypes.

Every test gets a fresh ``SCORCH_CACHE_DIR``. Subprocesses load ``runtime.py`` by file path (it imports nothing
from scorch or torch), so each costs ~50 ms instead of a 2 s torch import.
"""
import ast
import concurrent.futures
import ctypes
import os
import pathlib
import struct
import statistics
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from scorch.compiler import runtime
from scorch.compiler.runtime import CompileError

RUNTIME = pathlib.Path(runtime.__file__).resolve()

ADD = r"""
extern "C" void add(const float* a, const float* b, float* out, long n) {
    #pragma omp parallel for
    for (long i = 0; i < n; ++i) out[i] = a[i] + b[i];
}
"""
ADD_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

# The overflow reads one element past a buffer the kernel mallocs itself, so ASan owns its redzone.
OOB = r"""
#include <cstdlib>
extern "C" long oob(long n) {
    long* p = static_cast<long*>(std::malloc(n * sizeof(long)));
    for (long i = 0; i < n; ++i) p[i] = i;
    long s = 0;
    for (long i = 0; i <= n; ++i) s += p[i];
    std::free(p);
    return s;
}
"""

NOOP = r"""extern "C" void noop(void* p, long n) {}"""

# Prelude of every subprocess: the runtime module on its own, and a check of the add kernel on ctypes arrays.
PRELUDE = f"""
import ctypes, importlib.util, json, os, sys, time
spec = importlib.util.spec_from_file_location("scorch_runtime", {str(RUNTIME)!r})
rt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rt)
ADD, ADD_ARGS = {ADD!r}, [ctypes.c_void_p] * 3 + [ctypes.c_int64]

def check_add(kernel, n=1001):
    a = (ctypes.c_float * n)(*range(n))
    b = (ctypes.c_float * n)(*(2 * i for i in range(n)))
    out = (ctypes.c_float * n)()
    kernel(ctypes.addressof(a), ctypes.addressof(b), ctypes.addressof(out), n)
    assert list(out) == [3.0 * i for i in range(n)], "wrong result"
"""


def run_python(body, env=None, timeout=120):
    """Run ``body`` after PRELUDE in a fresh interpreter (inheriting the monkeypatched environment)."""
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True,
                          text=True, env=env, timeout=timeout)


def parse_last_line(proc):
    assert proc.returncode == 0, proc.stderr
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])  # a literal the subprocess printed


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A fresh cache per test; the module reads the variables at call time."""
    monkeypatch.setenv("SCORCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SCORCH_SANITIZE", raising=False)
    return tmp_path / "cache" / runtime.CACHE_VERSION


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_environment_is_read_at_call_time(tmp_path, monkeypatch, cache):
    assert runtime.cache_dir() == cache
    monkeypatch.setenv("SCORCH_CACHE_DIR", str(tmp_path / "other"))
    assert runtime.cache_dir() == tmp_path / "other" / runtime.CACHE_VERSION

    plain = runtime.flags()
    assert "-O3" in plain and {"-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"} <= set(plain)
    monkeypatch.setenv("SCORCH_SANITIZE", "1")
    sanitized = runtime.flags()
    assert "-O3" not in sanitized
    assert {"-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all", "-fopenmp", "-shared"} <= set(sanitized)
    # This process has no ASan runtime: loading a sanitized build would abort it, so load refuses instead.
    with pytest.raises(RuntimeError, match="sanitizer_env"):
        runtime.load(NOOP, "noop", [ctypes.c_void_p, ctypes.c_int64])

    monkeypatch.delenv("SCORCH_SANITIZE")
    assert os.path.isabs(runtime.compiler())
    monkeypatch.setenv("CXX", "/nonexistent/scorch-c++")
    with pytest.raises(RuntimeError, match="scorch-c\\+\\+"):
        runtime.compiler()


def test_compile_and_call_on_torch_tensors(cache):
    kernel = runtime.load(ADD, "add", ADD_ARGS)
    assert kernel.origin == "compiled" and kernel.compile_seconds > 0 and kernel.name == "add"
    assert kernel.path.parent == cache and kernel.path.suffix == ".so" and kernel.path.exists()
    assert kernel.source_path == kernel.path.with_suffix(".cpp")
    assert kernel.source_path.read_text() == ADD + runtime.stamp_source(kernel.path.stem)
    assert leftovers(cache) == []
    print(f"\ncompile time of a small OpenMP kernel (-O3): {kernel.compile_seconds * 1e3:.0f} ms")

    a, b = torch.randn(100_003), torch.randn(100_003)
    out = torch.empty_like(a)
    assert kernel(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel()) is None
    assert torch.equal(out, a + b)


def test_memory_cache(cache):
    first = runtime.load(ADD, "add", ADD_ARGS)
    start = time.perf_counter()
    second = runtime.load(ADD, "add", ADD_ARGS)
    seconds = time.perf_counter() - start
    print(f"\nmemory-cache load: {seconds * 1e6:.1f} us")
    assert (second.origin, second.compile_seconds, second.path) == ("memory", 0.0, first.path)
    assert seconds < 0.005
    # Each load gets its own function object, so argtypes/restype of one never change another.
    other = runtime.load(ADD, "add", [ctypes.c_void_p] * 4, ctypes.c_int)
    assert other.fn is not first.fn and first.fn.argtypes == ADD_ARGS and first.fn.restype is None
    a = torch.arange(10, dtype=torch.float32)
    out = torch.empty_like(a)
    second(a.data_ptr(), a.data_ptr(), out.data_ptr(), 10)
    assert torch.equal(out, 2 * a)


def test_threads_compile_once(cache):
    source = ADD.replace("add(", "add_threads(")
    barrier = threading.Barrier(4)

    def worker(_):
        barrier.wait()
        return runtime.load(source, "add_threads", ADD_ARGS).origin

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        origins = sorted(pool.map(worker, range(4)))
    assert origins == ["compiled", "memory", "memory", "memory"]


def test_a_fork_during_a_build_compiles_in_the_child(cache):
    """A library being built on another thread at a fork: the child's load of it does not wait on the lock that
    thread held (it has no such thread to release it), it builds the library itself, and the parent's build ends
    as before."""
    proc = run_python("""
        import threading
        t = rt._target(ADD, "cxx", "")
        with rt._lock:
            held = rt._key_locks.setdefault(t[0], threading.Lock())
        held.acquire()  # (as a thread compiling the library holds it)
        pid = os.fork()
        if pid == 0:
            k = rt.load(ADD, "add", ADD_ARGS)
            check_add(k)
            os._exit(0 if k.origin in ("compiled", "disk") else 3)
        held.release()
        _, status = os.waitpid(pid, 0)
        k = rt.load(ADD, "add", ADD_ARGS)
        check_add(k)
        print((os.waitstatus_to_exitcode(status), k.origin in ("compiled", "disk")))
    """, timeout=60)
    assert parse_last_line(proc) == (0, True)


def test_disk_cache_in_new_process(cache):
    compiled = runtime.load(ADD, "add", ADD_ARGS)
    before = os.stat(compiled.path)
    proc = run_python("""
        k = rt.load(ADD, "add", ADD_ARGS)
        check_add(k)
        print(dict(origin=k.origin, seconds=k.compile_seconds, path=str(k.path)))
    """)
    got = parse_last_line(proc)
    assert got == dict(origin="disk", seconds=0.0, path=str(compiled.path))
    after = os.stat(compiled.path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rebuilt
    assert len(list(cache.glob("*.so"))) == 1


def test_corrupt_so_is_rebuilt(tmp_path, cache):
    good = runtime.load(ADD, "add", ADD_ARGS).path.read_bytes()
    # dlopen of a truncated library dies with SIGBUS rather than failing, so load the damaged files in a
    # subprocess (a regression fails this test instead of killing pytest), each case in its own cache folder
    # (a path this process has dlopen'ed is never overwritten in place).
    cases = {"empty": b"", "header": good[:100], "half": good[:len(good) // 2], "one-short": good[:-1],
             "garbage": os.urandom(len(good)), "not-elf": b"#!" + good[2:]}
    name = add_entry_name()
    got = load_each_case(tmp_path, name, cases)
    assert got == {case: ("compiled", "memory", name, len(good)) for case in cases}, got


def add_entry_name():
    """The ``add`` kernel's cache entry (``<key>.so``) under this process's compiler, flags and cache folder."""
    return runtime.load(ADD, "add", ADD_ARGS).path.name


def load_each_case(tmp_path, name, cases):
    """Put each case's bytes in its own cache folder as the ``add`` kernel's entry ``name``; load it twice in a
    subprocess (where a crash fails the test instead of killing pytest) and check it adds: per case, the two
    loads' origins, the entry's name and its size afterwards. (A path this process has dlopen'ed is never
    overwritten in place, hence one folder per case.)"""
    for case, data in cases.items():
        (_case_folder(tmp_path, case) / name).write_bytes(data)
    proc = run_python(f"""
        result = {{}}
        for case in {list(cases)!r}:
            os.environ["SCORCH_CACHE_DIR"] = os.path.join({str(tmp_path)!r}, case)
            k = rt.load(ADD, "add", ADD_ARGS)
            check_add(k)
            again = rt.load(ADD, "add", ADD_ARGS)
            result[case] = (k.origin, again.origin, k.path.name, os.path.getsize(k.path))
        print(result)
    """)
    return parse_last_line(proc)


def _case_folder(tmp_path, case):
    """The cache folder (made) of one case of ``load_each_case``."""
    folder = tmp_path / case / runtime.CACHE_VERSION
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _zero_body(data: bytes) -> bytes:
    """``data`` (an ELF64 library) with everything between its program headers and its section headers zeroed:
    the headers intact, the code and data gone."""
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    start = phoff + phentsize * phnum
    return data[:start] + bytes(shoff - start) + data[shoff:]


def test_damaged_or_foreign_cache_entries_are_rebuilt(tmp_path, cache):
    """A cached library with intact headers and a zeroed body segfaulted the next process; another kernel's
    valid library copied over an entry loaded and ran. Each is now detected (the trailer's hash before dlopen,
    the stamp after) and rebuilt; checked in a subprocess, where a regression crashes only the subprocess."""
    good = runtime.load(ADD, "add", ADD_ARGS).path.read_bytes()
    other = runtime.load(NOOP, "noop", [ctypes.c_void_p, ctypes.c_int64])
    foreign = other.path.read_bytes()
    name = add_entry_name()
    body = foreign[:-runtime.TRAILER_SIZE]
    cases = {
        "zeroed-body": _zero_body(good),
        "zeroed-body-no-trailer": _zero_body(good[:-runtime.TRAILER_SIZE]),
        "foreign": foreign,
        # a forged trailer: the other kernel's library MAC'd under this key (and the case folder's secret) passes
        # the MAC, fails the stamp
        "forged-trailer": body + runtime.TRAILER_MARK + runtime.digest(name[:-3], body, runtime.cache_secret(
            _case_folder(tmp_path, "forged-trailer"))),
        "no-trailer": good[:-runtime.TRAILER_SIZE],
    }
    got = load_each_case(tmp_path, name, cases)
    assert got == {case: ("compiled", "memory", name, len(good)) for case in cases}, got
    # the rebuilt entries verify: a new process loads them from disk
    for case in cases:
        assert runtime.trailer_damage(str(tmp_path / case / runtime.CACHE_VERSION / name), name[:-3]) is None


def test_read_only_cache_falls_back_with_one_warning(tmp_path, monkeypatch):
    """A cache folder that cannot be written gave a raw PermissionError; now kernels are built in a private
    temporary folder, with one warning naming SCORCH_CACHE_DIR."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        root = locked / "cache"
    else:  # root writes through permission bits: use a file system that refuses everyone
        root = pathlib.Path("/sys/scorch-test-cache")
        if os.access("/sys", os.W_OK) and not _refuses(root):
            pytest.skip("no unwritable folder available")
    monkeypatch.setenv("SCORCH_CACHE_DIR", str(root))
    proc = run_python("""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            k = rt.load(ADD, "add", ADD_ARGS)
            check_add(k)
            n = rt.load(NOOP, "noop", [ctypes.c_void_p, ctypes.c_int64])
            p = rt.load(NOOP.replace("noop", "noop2"), "noop2", [ctypes.c_void_p, ctypes.c_int64])
        print(([str(w.message) for w in caught], str(k.path), k.origin))
    """.replace("NOOP", repr(NOOP)))
    messages, path, origin = parse_last_line(proc)
    assert len(messages) == 1 and "SCORCH_CACHE_DIR" in messages[0] and str(root) in messages[0], messages
    assert origin == "compiled" and not path.startswith(str(root))
    assert not os.path.exists(path)  # the private cache is removed when the process exits


def _refuses(path) -> bool:
    try:
        os.makedirs(path)
    except OSError:
        return True
    os.rmdir(path)
    return False


def test_compile_error_names_source_and_compiler_message(cache):
    source = 'extern "C" void bad(float* x) { x[0] = scorch_undeclared_name; }\n'
    with pytest.raises(CompileError) as info:
        runtime.load(source, "bad", [ctypes.c_void_p])
    message = str(info.value)
    assert str(info.value.source_path) in message and info.value.source_path.read_text().startswith(source)
    assert "scorch_undeclared_name" in message and "not declared" in message
    assert isinstance(info.value, RuntimeError)
    assert list(cache.glob("*.so")) == [] and leftovers(cache) == []

    with pytest.raises(CompileError, match="'missing'"):  # compiles, but the symbol is not there
        runtime.load(ADD, "missing", ADD_ARGS)


def test_concurrent_processes_compile_same_source(cache):
    source = ADD.replace("add(", "add_concurrent(")
    start_at = time.time() + 0.5  # both start compiling at the same moment
    body = f"""
        time.sleep(max(0.0, {start_at!r} - time.time()))
        k = rt.load({source!r}, "add_concurrent", ADD_ARGS)
        check_add(k)
        print(dict(origin=k.origin, seconds=k.compile_seconds))
    """
    procs = [subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(ast.literal_eval(out.strip().splitlines()[-1]))
    print(f"\nconcurrent processes: {results}")
    assert all(r["origin"] in ("compiled", "disk") for r in results)
    assert len(list(cache.glob("*.so"))) == 1 and len(list(cache.glob("*.cpp"))) == 1
    assert leftovers(cache) == []
    assert runtime.load(source, "add_concurrent", ADD_ARGS).origin == "disk"


def sanitized_env():
    env = runtime.sanitizer_env()
    env["SCORCH_SANITIZE"] = "1"
    return env


def test_sanitizer_env():
    env = runtime.sanitizer_env()
    preload = env["LD_PRELOAD"].split(":")
    assert "libasan" in os.path.basename(preload[0]) and any("libubsan" in p for p in preload)
    assert all(os.path.isabs(p) and os.path.exists(p) for p in preload[:2])
    assert env["ASAN_OPTIONS"] == "detect_leaks=0:abort_on_error=0"
    assert env["SCORCH_CACHE_DIR"] == os.environ["SCORCH_CACHE_DIR"]


def test_sanitizer_catches_heap_overflow(cache):
    proc = run_python(f"""
        k = rt.load({OOB!r}, "oob", [ctypes.c_long], ctypes.c_long)
        print("loaded", k.origin, flush=True)
        print(k(1000))
    """, env=sanitized_env())
    assert proc.returncode != 0
    assert "loaded compiled" in proc.stdout, proc.stderr  # it got as far as the call: the call is what failed
    assert "AddressSanitizer" in proc.stderr and "heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]


def test_sanitizer_runs_correct_kernel_cleanly(cache):
    plain = runtime.load(ADD, "add", ADD_ARGS)
    proc = run_python("""
        k = rt.load(ADD, "add", ADD_ARGS)
        check_add(k, n=100_003)
        print(dict(origin=k.origin, path=str(k.path)))
    """, env=sanitized_env())
    got = parse_last_line(proc)
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
    assert got["origin"] == "compiled" and got["path"] != str(plain.path)  # flags differ, so does the key
    assert len(list(cache.glob("*.so"))) == 2


def test_call_overhead(cache):
    kernel = runtime.load(NOOP, "noop", [ctypes.c_void_p, ctypes.c_int64])
    x = torch.zeros(4)
    ptr, n = x.data_ptr(), x.numel()
    clock = time.perf_counter_ns

    def per_call_ns(fn, calls=10_000):
        samples = []
        for _ in range(calls):
            t0 = clock()
            fn(ptr, n)
            samples.append(clock() - t0)
        return statistics.median(samples)

    per_call_ns(kernel)  # warm up
    through_kernel, bare_fn = per_call_ns(kernel), per_call_ns(kernel.fn)
    print(f"\nno-op kernel, median per call: Kernel.__call__ {through_kernel / 1e3:.2f} us, "
          f"ctypes fn {bare_fn / 1e3:.2f} us")
    assert through_kernel < 50_000
