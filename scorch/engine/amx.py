"""Whether bfloat16 BSR products run on the CPU's matrix tiles (Intel AMX: ``compiler.weights._tile_rows``).

``mode()`` gives the ``Target.amx`` of such products: "tiles" where all of these hold, else "" (the vector kernels):

- the CPU lists ``amx_tile`` and ``amx_bf16``;
- Linux lets this process use the tile state: it is asked for once, ``arch_prctl(ARCH_REQ_XCOMP_PERM,
  XFEATURE_XTILEDATA)`` (a tile instruction without it is a fault that ends the process);
- the tile kernels passed their first-use check on this CPU: a child process (a fault there ends only the child)
  runs bfloat16 BSR products of a few shapes on tiles and compares them with torch's float32 product. The
  verdict is kept in the kernel cache, authenticated as its entries are (``compiler.cachetrust``), by the CPU's
  model, the compiler and the tile code; a failed check warns once, naming what failed, and keeps the vector
  kernels.

``$SCORCH_AMX`` overrides: "0" never, "1" without the first-use check (still only on a CPU with AMX, allowed by
the kernel: else a ``RuntimeError`` naming what is missing), "model" the scalar model of the instructions
(``codegen.amx.MODEL``: any CPU, slow; tests). ``FORCE`` does the same from Python (tests).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import sys
import warnings

from ..compiler import runtime
from ..compiler.codegen import amx as tiles_code
from ..compiler.target import _cpuinfo, _forced, cpu_flags

#: None lets ``$SCORCH_AMX`` and the CPU decide; "", "tiles" or "model" forces the mode (tests)
FORCE = None
#: the first-use check's time limit in seconds (a child process that compiles two kernels)
CHECK_SECONDS = 300
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158
_OK = "scorch-amx-ok"


def mode() -> str:
    """The ``Target.amx`` of bfloat16 BSR products in this process (see the module's doc)."""
    if FORCE is not None:
        return FORCE
    forced = _forced("SCORCH_AMX", ("0", "1", "model"))
    if forced == "0":
        return ""
    if forced == "model":
        return "model"
    if forced == "1":
        missing = _missing()
        if missing:
            raise RuntimeError(f"scorch: SCORCH_AMX=1, but {missing}")
        return "tiles"
    return "tiles" if not _missing() and _trusted() else ""


def has_tiles() -> bool:
    """Whether the CPU lists AMX tiles with bfloat16 products."""
    return {"amx_tile", "amx_bf16"} <= (cpu_flags() or frozenset())


@functools.lru_cache(maxsize=None)
def _missing() -> str:
    """What keeps this process from the tiles ("" where nothing does), asked of the kernel once."""
    if not has_tiles():
        return "this CPU has no AMX tiles with bfloat16 products (amx_tile, amx_bf16)"
    if not sys.platform.startswith("linux"):
        return "AMX tiles are used on Linux only"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                    ctypes.c_long(_XFEATURE_XTILEDATA)) != 0:
        return f"Linux refused this process the AMX tile state (arch_prctl: {os.strerror(ctypes.get_errno())})"
    return ""


def _verdict_key() -> bytes:
    """What a first-use verdict depends on: the CPU's model, the compiler, the tile code and the kernel family."""
    import inspect

    from ..compiler import weights, weights_amx
    parts = [_cpuinfo().get(k, "") for k in ("vendor_id", "cpu family", "model", "model name", "microcode")]
    source = tiles_code.TILES + inspect.getsource(tiles_code.row) + inspect.getsource(weights_amx) + \
        str(weights.AMX_TOKENS)
    parts += [runtime.compiler(), " ".join(runtime.flags()), source]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest().encode()


@functools.lru_cache(maxsize=None)
def _trusted() -> bool:
    """Whether the tile kernels passed their first-use check on this CPU (run once, the verdict kept on disk)."""
    key = _verdict_key()
    folder = runtime._usable(runtime.cache_dir())
    path = folder / f"amx-{key[:24].decode()}.verdict"
    secret = runtime.cache_secret(folder)
    try:
        data = runtime.trust.read(path)
        verdict, tag = data[:1], data[1:]
        if tag == runtime.trust.mac(secret, key, verdict):
            return verdict == b"1"
    except (FileNotFoundError, runtime.trust.Untrusted):
        pass
    passed, why = check()
    if not passed:
        warnings.warn(f"scorch: the AMX tile kernels failed their first-use check on this CPU ({why}); bfloat16 "
                      "BSR products run on vector kernels. SCORCH_AMX=0 skips the check.", RuntimeWarning,
                      stacklevel=3)
    verdict = b"1" if passed else b"0"
    try:  # (a cache that cannot be written: checked again by a later process)
        runtime.write_atomic(path, verdict + runtime.trust.mac(secret, key, verdict))
    except OSError:
        pass
    return passed


def check(env_mode: str = "1") -> tuple[bool, str]:
    """The first-use check in a child process with ``$SCORCH_AMX`` = ``env_mode``: ``(passed, why not)``."""
    env = dict(os.environ, SCORCH_AMX=env_mode)
    try:
        done = subprocess.run([sys.executable, "-c", "import scorch; from scorch.engine import amx, weights; "
                               "amx._check_here(scorch.asformat, weights.linear)"],
                              env=env, capture_output=True, text=True, timeout=CHECK_SECONDS)
    except subprocess.TimeoutExpired:
        return False, f"no answer in {CHECK_SECONDS} s"
    if done.returncode == 0 and _OK in done.stdout:
        return True, ""
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return False, f"exit status {done.returncode}: {' / '.join(tail) or 'no output'}"


#: the check's products: (out, in, block, tokens): square and tall blocks, a partial tile, one block column
CHECKED = ((64, 96, (16, 16), 40), (48, 64, (16, 32), 32), (32, 48, (8, 2), 7), (128, 32, (16, 16), 97))


def _check_here(asformat, linear) -> None:
    """The child's side of ``check``: each product of ``CHECKED`` on tiles (``linear``: ``engine.weights.linear``;
    ``asformat``: ``scorch.asformat``) against torch's float32 product."""
    import torch
    if mode() not in ("tiles", "model"):
        raise SystemExit("scorch: the AMX check runs with SCORCH_AMX=1 or model")
    gen = torch.Generator().manual_seed(0)
    for n_out, n_in, block, tokens in CHECKED:
        keep = torch.rand(n_out // block[0], n_in // block[1], generator=gen) < 0.4
        keep[0, 0] = True
        mask = keep.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        dense = (torch.randn(n_out, n_in, generator=gen) * mask).to(torch.bfloat16)
        w = asformat(dense, f"bsr{block}")
        x = torch.randn(tokens, n_in, generator=gen).to(torch.bfloat16)
        bias = torch.randn(n_out, generator=gen).to(torch.bfloat16)
        got = linear(w, x, bias).float()
        want = x.float() @ dense.float().T + bias.float()
        err = ((got - want).abs() / (want.abs() + 1)).max().item()
        if not err < 0.02:
            raise SystemExit(f"scorch: AMX check: {n_out} x {n_in} bsr{block} at {tokens} tokens off by {err:.3g}")
    print(_OK)
