"""What the kernel cache trusts, and why: the checks ``runtime`` makes before it reads a cache file.

A cached library is ``dlopen``ed and a kept plan is unpickled, so both run code taken from the cache folder, and a
cache folder may sit on a shared disk or in ``/tmp``. scorch therefore reads nothing that another account could
have written:

* a cache folder is trusted when it is a real directory (not a symbolic link) owned by this process's effective
  user and writable by no one else (no group or other write bit), and every folder above it is owned by this user
  or by root and, where every user may write it, sticky (``/tmp``): no other account can replace or rename it;
* a cache file is read only through a descriptor opened with ``O_NOFOLLOW`` (a symbolic link is never followed),
  whose ``fstat`` shows a regular file owned by this user and writable by no one else: the bytes checked are the
  bytes used, whatever happens to the name meanwhile;
* every entry is authenticated with an HMAC-SHA256 under a per-user secret (32 random bytes in the file
  ``secret`` of the cache folder, mode 0600, written under a unique name opened with ``O_EXCL`` and linked into
  place, so no process ever reads it half written). A forged entry (a sha256 anyone can compute, another
  entry's file) is a miss: rebuilt, never loaded.

The folder used is chosen once per process (``usable``): the configured one where it is trusted; else, with one
``CacheTrustWarning`` naming it and ``SCORCH_CACHE_DIR``, the private cache ``$XDG_CACHE_HOME`` (or ``~/.cache``)
``/scorch-<uid>``, made 0700 and checked the same way (a temporary 0700 folder for the process where that fails
too). Nothing is read from an untrusted folder, and no cache file is written there.

This module imports nothing from scorch (``runtime`` loads it beside itself when it is loaded by file path).
"""
from __future__ import annotations

import atexit
import hashlib
import hmac
import os
import pathlib
import secrets
import shutil
import stat
import struct
import sys
import tempfile
import threading
import warnings

#: the per-user secret's file name in a cache folder, and its size in bytes
SECRET_NAME = "secret"
SECRET_SIZE = 32
#: the size of a MAC (HMAC-SHA256)
MAC_SIZE = 32

_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class CacheTrustWarning(UserWarning):
    """The configured kernel cache (``SCORCH_CACHE_DIR``) is owned by another user or writable by others: scorch
    loads nothing from it and uses a private cache instead."""


class Untrusted(OSError):
    """A cache file or folder that another account could have written: it is never read."""


_lock = threading.Lock()  # one choice (and one warning) per configured folder, whichever thread asks first
_chosen: dict[pathlib.Path, pathlib.Path] = {}  # configured cache folder -> the folder used (itself or a fallback)
_secrets: dict[str, bytes] = {}  # cache folder -> its per-user secret (read or made once per process)
_subfolders: dict[str, bool] = {}  # a cache's subfolder (plans, calls, ptx) -> trusted


def usable(folder: pathlib.Path) -> pathlib.Path:
    """The cache folder to use for the configured ``folder`` (``$SCORCH_CACHE_DIR/<version>``), chosen once per
    process: ``folder`` (its real path), made 0700 where missing, where it is trusted and this process can write
    there. Else, with one warning naming ``SCORCH_CACHE_DIR``: for a folder another user owns or can write
    (``CacheTrustWarning``), the private cache; for one that cannot be written (a read-only home must not stop
    the program; ``RuntimeWarning``), a private temporary folder for the process."""
    used = _chosen.get(folder)
    if used is None:
        with _lock:
            used = _chosen.get(folder)
            if used is None:
                used = _chosen[folder] = _choose(folder)
    return used


def _choose(folder: pathlib.Path) -> pathlib.Path:
    try:
        used, reason = _prepare(folder)
    except OSError as e:
        used = _temporary(folder.name)
        warnings.warn(f"scorch: the kernel cache {folder} is not writable ({e.strerror or e}); compiled kernels"
                      f" are kept in {used} for this process only. Set SCORCH_CACHE_DIR to a writable folder to"
                      " keep them across runs", RuntimeWarning, stacklevel=5)
        return used
    if reason is None:
        return used
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    private = pathlib.Path(os.path.abspath(os.path.expanduser(base))) / f"scorch-{os.geteuid()}" / folder.name
    try:
        used, why = _prepare(private)
    except OSError:
        why = "unusable"
    if why is not None:
        used = _temporary(folder.name)
    warnings.warn(CacheTrustWarning(
        f"scorch: the kernel cache {folder.parent} (SCORCH_CACHE_DIR) is not used: {reason}. scorch loads compiled"
        " kernels and kept plans only from a folder that this user owns and no other user can write; they are kept"
        f" in the private cache {used} instead. Set SCORCH_CACHE_DIR to a folder of your own (chmod 700)"),
        stacklevel=5)
    return used


def _prepare(folder: pathlib.Path) -> tuple[pathlib.Path | None, str | None]:
    """(the real path of ``folder``, None) where it is trusted, made (0700) where missing, and holds its secret;
    (None, why) where it is not trusted (nothing is made in an untrusted root); ``OSError`` where it cannot be
    made or written."""
    os.makedirs(folder.parent, mode=0o700, exist_ok=True)
    root = os.path.realpath(folder.parent)
    reason = folder_distrust(root) or ancestors_distrust(root)
    if reason is not None:
        return None, reason
    real = os.path.join(root, folder.name)
    try:
        os.mkdir(real, 0o700)
    except FileExistsError:
        pass
    reason = folder_distrust(real)
    if reason is not None:
        return None, reason
    cache_secret(real)
    probe = _tmp_name(os.path.join(real, "probe"))  # (the secret may exist already) can this process write here?
    os.close(os.open(probe, _CREATE_FLAGS, 0o600))
    os.unlink(probe)
    return pathlib.Path(real), None


def _temporary(version: str) -> pathlib.Path:
    """A new private (0700) temporary cache folder for this process, removed at exit."""
    private = tempfile.mkdtemp(prefix="scorch-cache-")
    atexit.register(shutil.rmtree, private, ignore_errors=True)  # (loaded libraries stay mapped)
    used = pathlib.Path(private) / version
    os.mkdir(used, 0o700)
    return used


def subfolder(path: pathlib.Path) -> bool:
    """Whether the cache's subfolder ``path`` (plans, calls, ptx) is trusted, made 0700 where missing; checked
    once per process."""
    ok = _subfolders.get(str(path))
    if ok is None:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return False
        ok = _subfolders[str(path)] = folder_distrust(path) is None
    return ok


def cache_secret(folder) -> bytes:
    """The per-user secret of the cache ``folder`` (made on first use), read once per process; ``Untrusted`` where
    the folder is not trusted."""
    folder = os.fspath(folder)
    secret = _secrets.get(folder)
    if secret is None:
        reason = folder_distrust(folder)
        if reason is not None:
            raise Untrusted(reason)
        secret = _secrets[folder] = _secret_file(folder)
    return secret


def _tmp_name(path: str) -> str:
    return f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _alone(path, st, private: bool = False) -> str | None:
    """Why ``st`` (of ``path``) is not this user's alone, or None. ``private``: nobody else may read it either."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    mask = 0o077 if private else 0o022
    if st.st_mode & mask:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: " + (
            "others may read it" if private and not st.st_mode & 0o022 else "other users may write it")
    return None


def folder_distrust(path) -> str | None:
    """Why the existing cache folder ``path`` is not trusted (a symbolic link, not a directory, another user's, or
    writable by others), or None."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    return _alone(path, st)


def ancestors_distrust(path) -> str | None:
    """Why a folder above ``path`` (a real path: no symbolic links) lets another account replace it, or None: one
    owned by another user (not root), or writable by every user without the sticky bit. (A group-writable folder
    above the cache is allowed: a ``~/.cache`` made under umask 002 is, with the user's own group.)"""
    uid, head = os.geteuid(), os.path.dirname(os.path.abspath(path))
    while True:
        st = os.stat(head)
        if st.st_uid not in (uid, 0):
            return f"{head}, above it, is owned by uid {st.st_uid}"
        if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            return f"{head}, above it, is writable by every user and not sticky"
        parent = os.path.dirname(head)
        if parent == head:
            return None
        head = parent


def read(path, private: bool = False) -> bytes:
    """The bytes of the cache file ``path``. ``FileNotFoundError`` where there is none; ``Untrusted`` where it is a
    symbolic link, not a regular file, or not this user's alone (``private``: readable by others too)."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise
    except OSError:  # O_NOFOLLOW on a link: ELOOP on Linux, EMLINK on BSD
        if os.path.islink(path):
            raise Untrusted(f"{path} is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        reason = f"{path} is not a regular file" if not stat.S_ISREG(st.st_mode) else _alone(path, st, private)
        if reason is not None:
            raise Untrusted(reason)
        return f.read()


def _secret_file(folder) -> bytes:
    """The secret in the trusted cache ``folder``, made where there is none. One that is not this user's alone,
    or not 32 bytes, is replaced (what was authenticated under it becomes a miss). ``OSError`` where none can be
    made."""
    path = os.path.join(folder, SECRET_NAME)
    for _ in range(3):
        try:
            data = read(path, private=True)
            if len(data) == SECRET_SIZE:
                return data
        except FileNotFoundError:
            data = None
        except Untrusted:
            data = b""
        if data is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        _create_secret(path)
    raise Untrusted(f"scorch: cannot make the kernel cache's secret {path}")


def _create_secret(path: str) -> None:
    tmp = _tmp_name(path)
    fd = os.open(tmp, _CREATE_FLAGS, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_SIZE))
        try:
            os.link(tmp, path)  # never over an existing secret: a process that made one first wins
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: the last writer wins (the others' entries miss)
            os.replace(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 under ``key`` of ``parts``, each length-prefixed (no two splits of the same bytes agree)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def elf_damage(data: bytes) -> str | None:
    """Why the ELF library ``data`` cannot be loaded safely, or None. dlopen of a truncated library maps segments
    past the end of the file and dies with SIGBUS instead of failing, so check every loaded range lies in it."""
    size, head = len(data), data[:64]
    if not sys.platform.startswith("linux"):
        return None if size else "empty file"
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
        return "not an ELF file"
    end = "<" if head[5] == 1 else ">"
    if head[4] == 2:  # ELF64
        if len(head) < 64:
            return "truncated ELF header"
        phoff, shoff = struct.unpack_from(end + "QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", head, 54)
        ph_fmt, ph_fields = end + "IIQQQQ", (0, 2, 5)  # p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz
    else:  # ELF32
        phoff, shoff = struct.unpack_from(end + "II", head, 28)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", head, 42)
        ph_fmt, ph_fields = end + "IIIII", (0, 1, 4)  # p_type, p_offset, p_vaddr, p_paddr, p_filesz
    if shoff + shentsize * shnum > size:
        return "section headers past end of file"
    if phnum == 0 or phoff + phentsize * phnum > size or phentsize < struct.calcsize(ph_fmt):
        return "program headers missing or past end of file"
    for i in range(phnum):
        fields = struct.unpack_from(ph_fmt, data, phoff + i * phentsize)
        p_type, p_offset, p_filesz = (fields[j] for j in ph_fields)
        if p_type == 1 and p_offset + p_filesz > size:  # PT_LOAD
            return "loadable segment past end of file"
    return None
