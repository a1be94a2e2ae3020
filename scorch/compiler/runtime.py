"""Compile generated C++ into shared libraries once, cache them, and call them through ctypes.

``load(source, symbol, argtypes, restype)`` returns a :class:`Kernel` whose ``fn`` is a plain ctypes function:
callers pass raw pointers (``t.data_ptr()`` for a ``c_void_p``) and scalars; per call there is nothing but
ctypes' own argument conversion.

Caches, fastest first:

* memory: ``.so`` path -> loaded ``ctypes.CDLL`` (per process, guarded by a lock);
* disk: ``<cache_dir()>/<key>.so`` beside ``<key>.cpp``, where ``key`` is a sha256 of the source, the compiler
  (path and ``--version``), the flags and the CPU (``-march=native`` code is only valid on the CPU it was built
  for). Files are written to a unique temporary name and ``os.replace``d into place, so concurrent processes
  never see a half-written file, and a cached ``.so`` that is damaged is deleted and rebuilt, never loaded.

Nothing is read from a cache folder or file that another account owns or can write (``cachetrust``: the
folder, those above it, and each file, opened without following a symbolic link); a configured cache that is
not trusted is not read at all: one ``CacheTrustWarning`` naming it and ``SCORCH_CACHE_DIR``, and a private cache
(``$XDG_CACHE_HOME`` or ``~/.cache``, ``scorch-<uid>``, made 0700) serves instead. Every cached library is
verified before it is used, and rebuilt otherwise: its file ends with a trailer holding an HMAC, under the
cache's per-user secret, of the key and the library's bytes (written at build time: a zeroed, altered or planted
body, or another entry's library copied over this one, fails the check before ``dlopen``), and it exports
``scorch_kernel_stamp()``, which returns the key it was built for (checked after ``dlopen``, before any kernel
runs). A cache directory that cannot be written falls back to a private temporary one for the process, with one
warning naming ``SCORCH_CACHE_DIR``.

Toolchains (``load(..., toolchain=)``): ``"cxx"`` builds C++ with the host compiler; ``"nvcc"`` builds CUDA source
(``codegen.cuda``) for one GPU architecture (``arch="sm_90"``); ``"emulate"`` builds the same CUDA source with the
host compiler and ``-DSCORCH_EMULATE``, so that it runs on the CPU (tests without a GPU). :func:`ptx` compiles CUDA
source to PTX for an architecture without loading it (the compile check that runs without a GPU).

Environment, read at call time: ``CXX`` (compiler, default ``g++``), ``NVCC`` (default ``nvcc``),
``SCORCH_CACHE_DIR`` (default ``~/.cache/scorch``), ``XDG_CACHE_HOME`` (where the private cache goes),
``SCORCH_SANITIZE=1`` (ASan + UBSan build of host-compiled kernels; load it only in a process started with
:func:`sanitizer_env`).

This module imports nothing from scorch or torch (only its sibling ``cachetrust``, which imports nothing either),
so it can be loaded on its own (tests do, in subprocesses).
"""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import os
import pathlib
import platform
import secrets
import shutil
import subprocess
import threading
import time

try:
    from . import cachetrust as trust
except ImportError:  # loaded by file path, outside the package (tests' subprocesses): its sibling, the same way
    import importlib.util
    _spec = importlib.util.spec_from_file_location(
        "scorch_cachetrust", os.path.join(os.path.dirname(os.path.abspath(__file__)), "cachetrust.py"))
    trust = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(trust)

__all__ = ["CacheTrustWarning", "CompileError", "Kernel", "cache_dir", "compiler", "flags", "load", "nvcc", "ptx",
           "sanitizer_env"]

# Bump when the layout of the cache or the meaning of a key changes: old entries are then simply ignored.
CACHE_VERSION = "v3"  # v2: entries carry a verified trailer and a key stamp; v3: trailers and entries are HMACs
CacheTrustWarning = trust.CacheTrustWarning
#: the per-user secret of a trusted cache folder (``cachetrust.cache_secret``). Public for tests, which forge entries
cache_secret = trust.cache_secret
_usable, _subfolder = trust.usable, trust.subfolder

_BASE_FLAGS = ("-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# -fno-loop-unroll-and-jam: GCC 12 jams two iterations of a sparse loop around a dense inner loop and then
# loads the second one's dense row with gathers (measured 4-5x slower SpMM, benchmarks/RESULTS.md);
# -mprefer-vector-width=512: use the full AVX-512 width where the CPU has it (GCC prefers 256 otherwise);
# -fno-trapping-math: floating-point selects (clamps, max) may be if-converted, so loops over them vectorize (the
# exp of softmax: 10x); values are unchanged, only floating-point exception flags are not kept.
_OPT_FLAGS = ("-O3", "-fno-loop-unroll-and-jam", "-mprefer-vector-width=512", "-fno-trapping-math")
_SANITIZE_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                   "-fno-sanitize-recover=all")
#: nvcc: C++17, host code position-independent; ``-lineinfo`` keeps source lines for profilers at no run-time cost
_NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")
_EMULATE_FLAGS = ("-x", "c++", "-DSCORCH_EMULATE")
_MAX_MESSAGE = 8000  # characters of compiler output kept in a CompileError; the first errors matter most

_lock = threading.Lock()            # guards _libs and _key_locks; the memo dicts after them are filled without
                                    # it, since a race there only computes the same value twice
_libs: dict[str, ctypes.CDLL] = {}  # memory cache: .so path -> loaded library
_key_locks: dict[str, threading.Lock] = {}  # one per .so path: a compile happens once per process
_targets: dict[tuple, tuple] = {}          # (source, environment) -> what _target computes
_which: dict[tuple[str, str], str] = {}     # ($CXX, $PATH) -> resolved compiler path
_versions: dict[str, str] = {}               # compiler path -> `--version` output
_cpu: str | None = None


def _forked() -> None:
    """In a fork's child the locks other threads held at the fork stay held, with no thread to release them (a
    kernel compiling on another thread then: a child wanting that library would wait forever). The child starts
    with fresh ones; a build the parent had under way is the child's to make again (both write atomically)."""
    global _lock
    _lock = threading.Lock()
    _key_locks.clear()


os.register_at_fork(after_in_child=_forked)

#: the function every library exports, returning the key it was built for
STAMP_SYMBOL = "scorch_kernel_stamp"
#: the trailer appended to every cached library: this marker, then ``digest(key, body, secret)`` (32 bytes). Public,
#: with ``TRAILER_SIZE``, for tests that damage and forge cache entries
TRAILER_MARK = b"\0scorch-kernel-cache-trailer\0"
#: the trailer's length in bytes: the marker and the hash
TRAILER_SIZE = len(TRAILER_MARK) + 32
_asan_loaded: bool | None = None


class CompileError(RuntimeError):
    """The compiler rejected a source: the message names the ``.cpp`` file and carries the compiler's output.

    Attributes: ``source_path`` (the ``.cpp``), ``command`` (the argv run), ``stderr`` (full compiler output).
    """

    def __init__(self, message: str, source_path: pathlib.Path | None = None,
                 command: tuple[str, ...] = (), stderr: str = ""):
        super().__init__(message)
        self.source_path = source_path
        self.command = command
        self.stderr = stderr


def compiler() -> str:
    """The C++ compiler: ``$CXX`` or ``g++``, resolved to an absolute path; ``RuntimeError`` if not found."""
    return _resolve("CXX", "g++", "C++ compiler", "install g++ or set CXX to a C++17 compiler with OpenMP support")


def _resolve(variable, default, what, hint, fallback=None) -> str:
    """The program named by ``$variable`` (or ``default``) on the ``PATH`` (else in ``fallback``), absolute."""
    name = os.environ.get(variable) or default
    path_env = os.environ.get("PATH", "")
    resolved = _which.get((name, path_env))
    if resolved is None:
        resolved = shutil.which(name) or (shutil.which(name, path=fallback) if fallback else None)
        if resolved is None:
            raise RuntimeError(f"scorch: {what} {name!r} not found (from ${variable} or the default {default!r}); "
                               f"{hint}")
        resolved = os.path.abspath(resolved)
        _which[(name, path_env)] = resolved
    return resolved


def _sanitize() -> bool:
    return os.environ.get("SCORCH_SANITIZE", "") not in ("", "0")


def flags() -> tuple[str, ...]:
    """Compiler flags: ``-O3`` plus the base flags, or the ASan/UBSan set instead of ``-O3`` under
    ``SCORCH_SANITIZE=1``."""
    return (_SANITIZE_FLAGS if _sanitize() else _OPT_FLAGS) + _BASE_FLAGS


def nvcc() -> str:
    """The CUDA compiler: ``$NVCC`` or ``nvcc`` on the ``PATH`` (else under ``/usr/local/cuda/bin``), as an
    absolute path; ``RuntimeError`` if there is none."""
    return _resolve("NVCC", "nvcc", "CUDA compiler", "install the CUDA toolkit or set NVCC", "/usr/local/cuda/bin")


def _arch_number(arch: str) -> str:
    """``"90"`` for ``"sm_90"``; ``ValueError`` for anything else."""
    if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
        raise ValueError(f"scorch: a CUDA architecture is written like 'sm_90', got {arch!r}")
    return arch[3:]


def _arch_flags(arch: str) -> tuple[str, ...]:
    n = _arch_number(arch)
    # the machine code for this GPU, and its PTX (which a newer GPU's driver compiles)
    return ("-gencode", f"arch=compute_{n},code=sm_{n}", "-gencode", f"arch=compute_{n},code=compute_{n}")


def cache_dir() -> pathlib.Path:
    """``$SCORCH_CACHE_DIR`` (or ``~/.cache/scorch``) / ``CACHE_VERSION``. Not created here; ``load`` does."""
    root = os.environ.get("SCORCH_CACHE_DIR") or os.path.join("~", ".cache", "scorch")
    return pathlib.Path(os.path.expanduser(root)) / CACHE_VERSION


class Kernel:
    """One loaded function. ``origin`` is ``"compiled"`` (built by this call), ``"disk"`` (an existing ``.so``)
    or ``"memory"`` (already loaded in this process); ``compile_seconds`` is 0.0 unless compiled now."""

    __slots__ = ("name", "path", "source_path", "origin", "compile_seconds", "fn", "packed")

    def __init__(self, name: str, path: pathlib.Path, source_path: pathlib.Path, origin: str,
                 compile_seconds: float, fn, packed=None):
        self.name = name
        self.path = path
        self.source_path = source_path
        self.origin = origin
        self.compile_seconds = compile_seconds
        self.fn = fn
        #: ``<name>_packed`` where the library exports it (generated C++ kernels): the same function taking all
        #: its arguments as one buffer of 8-byte words (``bytes``), one ctypes conversion instead of one per
        #: argument (13 arguments: 6.3 -> 2.1 us a call)
        self.packed = packed

    def __call__(self, *args):
        # Nothing but the ctypes call: hot loops may call ``kernel.fn`` directly to skip even this frame.
        return self.fn(*args)

    def __repr__(self):
        return f"Kernel({self.name!r}, origin={self.origin!r}, path='{self.path}')"


def load(source: str, symbol: str, argtypes: list, restype=None, toolchain: str = "cxx", arch: str = "",
         build: bool = True) -> Kernel | None:
    """Compile ``source`` (or reuse a cached build) and return its ``extern "C"`` function ``symbol`` with the
    given ctypes ``argtypes``/``restype``. Raises ``CompileError`` if the source does not compile or does not
    export ``symbol``. ``toolchain`` and ``arch``: see the module's docstring. ``build=False``: None where the
    library is neither loaded nor on disk (verified), instead of compiling it."""
    # Everything the target depends on, as raw strings: a memory hit then costs a few dict lookups, not a
    # sha256, a PATH search and pathlib parsing (the variables are still read on every call).
    env = os.environ
    inputs = (source, env.get("CXX"), env.get("PATH"), env.get("SCORCH_SANITIZE"), env.get("SCORCH_CACHE_DIR"),
              env.get("HOME"), toolchain, arch, env.get("NVCC"))
    target = _targets.get(inputs)
    if target is None:
        target = _targets[inputs] = _target(source, toolchain, arch)
    so_path, path, cpp_path, cxx, flag_set = target

    with _lock:
        lib = _libs.get(so_path)
        if lib is None:
            key_lock = _key_locks.setdefault(so_path, threading.Lock())
    if lib is not None:
        return _kernel(lib, symbol, argtypes, restype, path, cpp_path, "memory", 0.0)

    with key_lock:  # other threads wanting the same library wait here; different libraries build in parallel
        with _lock:
            lib = _libs.get(so_path)
        if lib is not None:
            return _kernel(lib, symbol, argtypes, restype, path, cpp_path, "memory", 0.0)
        if "-fsanitize=address,undefined" in flag_set:
            _require_asan_runtime()
        os.makedirs(path.parent, mode=0o700, exist_ok=True)

        origin, seconds = "disk", 0.0
        key = path.stem
        stamped = source + stamp_source(key)
        lib = _load_cached(so_path, key)
        if lib is None and not build:
            return None
        if lib is None:
            if not cpp_path.exists() or cpp_path.read_text(encoding="utf-8") != stamped:
                write_atomic(cpp_path, stamped)
            seconds = _compile(cxx, flag_set, cpp_path, so_path, key)
            origin = "compiled"
            try:
                lib = _open_verified(so_path, key, fresh=so_path in _opened)
            except OSError as e:
                raise CompileError(f"scorch: compiled {cpp_path} but cannot load {so_path}: {e}", cpp_path) from e
            if lib is None:
                raise CompileError(f"scorch: compiled {cpp_path} but {so_path} does not verify (another process"
                                   " replaced it?)", cpp_path)
        elif not cpp_path.exists():  # keep the source beside the binary for debugging
            write_atomic(cpp_path, stamped)
        with _lock:
            _libs[so_path] = lib
        return _kernel(lib, symbol, argtypes, restype, path, cpp_path, origin, seconds)


def sanitizer_env() -> dict:
    """``os.environ`` plus ``LD_PRELOAD`` (the compiler's libasan and libubsan, ASan first) and
    ``ASAN_OPTIONS=detect_leaks=0:abort_on_error=0``: the environment for a subprocess that loads
    ``SCORCH_SANITIZE=1`` kernels (an ASan library cannot be dlopen'ed into a process started without it).
    Leak detection is off because the Python interpreter's own leaks are not ours."""
    cxx = compiler()
    preload = []
    for name in ("libasan.so", "libubsan.so"):
        out = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not os.path.isabs(out) or not os.path.exists(out):  # the compiler echoes the bare name if missing
            raise RuntimeError(f"scorch: {cxx} has no {name} (install the compiler's sanitizer runtime)")
        preload.append(os.path.realpath(out))
    env = dict(os.environ)
    if env.get("LD_PRELOAD"):
        preload.append(env["LD_PRELOAD"])
    env["LD_PRELOAD"] = ":".join(preload)
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0"
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1")
    return env


# --- internals -----------------------------------------------------------------------------------------------

def _target(source: str, toolchain: str = "cxx", arch: str = "") \
        -> tuple[str, pathlib.Path, pathlib.Path, str, tuple[str, ...]]:
    """(.so path as str and Path, source path, compiler, flags) for ``source`` under the current environment."""
    if toolchain == "cxx":
        cxx, flag_set, suffix = compiler(), flags(), ".cpp"
    elif toolchain == "emulate":
        cxx, flag_set, suffix = compiler(), flags() + _EMULATE_FLAGS, ".cu"
    elif toolchain == "nvcc":
        cxx, flag_set, suffix = nvcc(), _NVCC_FLAGS + _arch_flags(arch), ".cu"
    else:
        raise ValueError(f"scorch: unknown toolchain {toolchain!r} (cxx, nvcc, emulate)")
    path = _usable(cache_dir()) / (_key(source, cxx, flag_set) + ".so")
    return str(path), path, path.with_suffix(suffix), cxx, flag_set


def ptx(source: str, arch: str) -> str:
    """``source`` (CUDA) compiled by nvcc to PTX for ``arch`` (``"sm_80"``...), without a GPU: the PTX text.
    Raises ``CompileError`` with nvcc's messages if it does not compile."""
    cc = nvcc()
    flag_set = ("-std=c++17", "--ptx", f"-arch=compute_{_arch_number(arch)}")
    path = _usable(cache_dir()) / "ptx" / (_key(source, cc, flag_set) + ".ptx")
    if _subfolder(path.parent):
        try:
            return trust.read(path).decode("utf-8")
        except (FileNotFoundError, trust.Untrusted, UnicodeDecodeError):
            pass
    os.makedirs(path.parent, mode=0o700, exist_ok=True)
    cu = path.with_suffix(".cu")
    write_atomic(cu, source)
    _compile(cc, flag_set, cu, str(path))
    return path.read_text(encoding="utf-8")


def _key(source: str, cxx: str, flag_set: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (CACHE_VERSION, source, cxx, _compiler_version(cxx), "\0".join(flag_set), _cpu_id()):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed: no two field splits hash alike
        h.update(data)
    return h.hexdigest()


def _compiler_version(cxx: str) -> str:
    version = _versions.get(cxx)
    if version is None:
        try:
            run = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
        except OSError as e:
            raise RuntimeError(f"scorch: cannot run C++ compiler {cxx!r}: {e}") from e
        version = run.stdout + run.stderr
        _versions[cxx] = version
    return version


def _cpu_id() -> str:
    global _cpu
    if _cpu is None:
        model = ""
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        model = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        _cpu = f"{platform.machine()}|{model}"
    return _cpu


def _require_asan_runtime() -> None:
    # Loading an ASan library into a process without the ASan runtime kills the process outright (ASan's
    # "runtime does not come first" check calls Die()), so refuse with an exception instead.
    global _asan_loaded
    if _asan_loaded is None:
        try:
            with open("/proc/self/maps") as f:
                _asan_loaded = "libasan" in f.read()
        except OSError:
            _asan_loaded = "libasan" in os.environ.get("LD_PRELOAD", "")
    if not _asan_loaded:
        raise RuntimeError("scorch: SCORCH_SANITIZE=1 kernels need the ASan runtime preloaded; run this "
                           "process with scorch.compiler.runtime.sanitizer_env() as its environment")


def _tmp_name(path: str | os.PathLike) -> str:
    # Same folder (os.replace must not cross filesystems), unique per process and call, hidden, ignorable.
    head, tail = os.path.split(os.fspath(path))
    return os.path.join(head, f".{tail}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def write_atomic(path: pathlib.Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` through a unique temporary name and ``os.replace``:
    readers, in this process or another, see the old file or the whole new one, never a part."""
    tmp = _tmp_name(path)
    try:
        # this user's alone whatever the umask (cachetrust reads no file that others may write)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


# --- decisions kept on disk -------------------------------------------------------------------------------------
# Beside the compiled libraries (keyed by their source), the cache keeps what was decided on the way to them, so a
# new process need not decide it again: plans (``pipeline``) and prepared calls (``engine.run``). An entry is a
# pickle of (fingerprint, key, value) in ``cache_dir() / kind``, named by a digest of both; it is used only where
# both equal the ones asked for (a shared file name is a miss, never another key's value), so the fingerprint
# names the code that made the decision: ``source_fingerprint``. The file is the pickle after its MAC (``MAC_SIZE``
# bytes: an HMAC under the cache's secret of the kind, the file name and the pickle), and is unpickled only once
# the MAC verifies: a pickle can run code as it loads, so only one this user's scorch wrote is ever loaded.

#: the bytes of a kept entry's MAC, before its pickle
MAC_SIZE = trust.MAC_SIZE

_SOURCES: dict = {}


def source_fingerprint(*parts: str) -> str:
    """A digest of scorch's source files under ``parts`` (paths relative to the package: folders, all their ``.py``
    files, or files), names and contents, with torch's version and ``CACHE_VERSION``; once per process."""
    fp = _SOURCES.get(parts)
    if fp is None:
        import torch
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        files = []

        def walk(path, rel):
            if os.path.isdir(path):
                for entry in os.scandir(path):
                    if entry.is_dir() and entry.name != "__pycache__":
                        walk(entry.path, rel + "/" + entry.name)
                    elif entry.name.endswith(".py"):
                        files.append((rel + "/" + entry.name, entry.path))
            else:
                files.append((rel, path))
        for part in parts:
            walk(os.path.join(root, part), part)
        h = hashlib.sha256(f"{CACHE_VERSION}|{torch.__version__}".encode())
        for rel, path in sorted(files):
            with open(path, "rb") as f:
                h.update(rel.encode() + b"\0" + f.read() + b"\0")
        fp = _SOURCES[parts] = h.hexdigest()
    return fp


def _entry_path(kind: str, fingerprint: str, key):
    import pickle
    buf = __import__("io").BytesIO()
    p = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    p.fast = True  # no memo: equal keys pickle alike whether or not they share objects
    try:
        p.dump(key)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError):
        return None  # (a key that does not pickle is not kept)
    name = hashlib.sha256(fingerprint.encode() + b"|" + buf.getvalue()).hexdigest()
    return _usable(cache_dir()) / kind / f"{name}.pkl"


def entry_mac(path: pathlib.Path, payload: bytes) -> bytes:
    """The MAC of a kept entry at ``path`` holding ``payload`` (its pickle), under its cache's secret. Public for
    tests, which forge entries."""
    return trust.mac(cache_secret(path.parent.parent), b"scorch-entry", path.parent.name.encode(),
                     path.name.encode(), payload)


def kept(kind: str, fingerprint: str, key):
    """The value ``keep`` kept under ``key`` and ``fingerprint``, or None (none, damaged, forged, another key's
    or another code's)."""
    import pickle
    path = _entry_path(kind, fingerprint, key)
    if path is None or not _subfolder(path.parent):
        return None
    try:
        data = trust.read(path)
        if not hmac.compare_digest(data[:MAC_SIZE], entry_mac(path, data[MAC_SIZE:])):
            return None  # not written by this user's scorch: never unpickled
        fp, k, value = pickle.loads(data[MAC_SIZE:])
        return value if fp == fingerprint and k == key else None
    except Exception:  # noqa: BLE001  (none yet, damaged, a link, or foreign)
        return None


def keep(kind: str, fingerprint: str, key, value) -> None:
    """Keep ``value`` (picklable) under ``key`` and ``fingerprint`` (written atomically: ``write_atomic``); a
    cache that cannot be written keeps nothing."""
    import pickle
    path = _entry_path(kind, fingerprint, key)
    if path is None or not _subfolder(path.parent):
        return
    try:
        payload = pickle.dumps((fingerprint, key, value), protocol=pickle.HIGHEST_PROTOCOL)
        write_atomic(path, entry_mac(path, payload) + payload)
    except (OSError, pickle.PicklingError, TypeError, AttributeError, ValueError):
        pass


def _unlink(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _compile(cxx: str, flag_set: tuple[str, ...], cpp_path: pathlib.Path, so_path: str, key: str | None = None) \
        -> float:
    """Build ``cpp_path`` into ``so_path``; with a ``key``, the library gets the verified cache trailer."""
    tmp = _tmp_name(so_path)
    command = (cxx, *flag_set, "-o", tmp, str(cpp_path))
    start = time.perf_counter()
    try:
        run = subprocess.run(command, capture_output=True, text=True, errors="replace")
        seconds = time.perf_counter() - start
        if run.returncode != 0:
            output = (run.stderr + run.stdout).strip()
            shown = output if len(output) <= _MAX_MESSAGE else (
                output[:_MAX_MESSAGE] + f"\n... ({len(output) - _MAX_MESSAGE} more characters)")
            raise CompileError(f"scorch: failed to compile {cpp_path} (exit {run.returncode}):\n"
                               f"$ {' '.join(command)}\n{shown}", cpp_path, command, output)
        if key is not None:
            os.chmod(tmp, 0o700)  # this user's alone whatever the umask: cachetrust loads no library others may write
            with open(tmp, "rb") as f:
                body = f.read()
            with open(tmp, "ab") as f:
                f.write(TRAILER_MARK + digest(key, body, cache_secret(os.path.dirname(so_path))))
        os.replace(tmp, so_path)  # atomic: other processes see the old file, none, or the whole new one
    finally:
        _unlink(tmp)
    return seconds


def _load_cached(so_path: str, key: str) -> ctypes.CDLL | None:
    """The cached library at ``so_path`` built for ``key``, or None if absent; a file that is damaged or was not
    built for ``key`` (or a link, or not this user's alone: ``cachetrust``) is deleted (and None returned), never
    run. The bytes checked are read through one descriptor; the name then loaded is in a folder only this user
    can write, so it still names them."""
    try:
        data = trust.read(so_path)
        reason = _trailer_damage(data, key, os.path.dirname(so_path)) or trust.elf_damage(data)
    except FileNotFoundError:
        return None
    except trust.Untrusted as e:
        reason = str(e)
    if reason is None:
        try:
            lib = _open_verified(so_path, key, fresh=False)
            if lib is not None:
                return lib
        except OSError:
            pass
    # Never trust it; the caller rebuilds. Deleting (not truncating) leaves any process that mapped it intact.
    _unlink(so_path)
    return None


_opened: set = set()  # paths dlopen'ed by this process whose library failed its stamp check


def _open_verified(so_path: str, key: str, fresh: bool) -> ctypes.CDLL | None:
    """``dlopen`` the library and check its stamp is ``key``; None (the library closed) if it is not.
    ``fresh``: load through a new file name, since the dynamic loader would hand back a library already loaded
    under this path (one that failed its check, and that it may be unable to unload)."""
    path, copy = so_path, None
    if fresh:
        copy = _tmp_name(so_path)
        shutil.copyfile(so_path, copy)
        path = copy
    try:
        lib = ctypes.CDLL(path)
    finally:
        if copy is not None:
            _unlink(copy)  # the mapping stays valid
    try:
        stamp = lib[STAMP_SYMBOL]
        stamp.restype = ctypes.c_char_p
        stamp.argtypes = []
        ok = stamp() == key.encode()
    except AttributeError:
        ok = False
    if not ok:
        _opened.add(so_path)
        _dlclose(lib)
        return None
    return lib


def _dlclose(lib) -> None:
    try:
        import _ctypes
        _ctypes.dlclose(lib._handle)
    except (ImportError, AttributeError, OSError):
        pass


def stamp_source(key: str) -> str:
    """The C++ appended to every cached kernel's source: a function (``STAMP_SYMBOL``) returning the kernel's key.
    Public for tests, which check the source kept beside a library."""
    return f'\nextern "C" const char* {STAMP_SYMBOL}(void) {{ return "{key}"; }}\n'


def digest(key: str, body: bytes, secret: bytes) -> bytes:
    """The trailer's MAC: of the key and the library under the cache's ``secret`` (``cache_secret``), so another
    entry's library (and trailer) fails, and so does a planted one. Public for tests, which forge a trailer."""
    return trust.mac(secret, b"scorch-library", key.encode(), body)


def trailer_damage(path: str, key: str) -> str | None:
    """Why the file at ``path`` is not the library built for ``key`` (its trailer's MAC under its folder's
    secret), or None. Public for tests, which check that rebuilt entries verify."""
    return _trailer_damage(trust.read(path), key, os.path.dirname(path))


def _trailer_damage(data: bytes, key: str, folder) -> str | None:
    if len(data) < TRAILER_SIZE or data[-TRAILER_SIZE:-32] != TRAILER_MARK:
        return "no cache trailer"
    if not hmac.compare_digest(data[-32:], digest(key, data[:-TRAILER_SIZE], cache_secret(folder))):
        return "content does not match its MAC"
    return None


def _kernel(lib, symbol, argtypes, restype, path, source_path, origin, seconds) -> Kernel:
    try:
        fn = lib[symbol]  # __getitem__ makes a fresh function object: argtypes set here never leak to others
    except AttributeError:
        raise CompileError(f"scorch: {path} (from {source_path}) does not export {symbol!r}; "
                           "is it declared extern \"C\"?", source_path) from None
    fn.argtypes = list(argtypes)
    fn.restype = restype
    try:
        packed = lib[symbol + "_packed"]
        packed.argtypes, packed.restype = [ctypes.c_char_p], None
    except AttributeError:
        packed = None
    return Kernel(symbol, path, source_path, origin, seconds, fn, packed)
