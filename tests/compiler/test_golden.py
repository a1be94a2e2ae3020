"""Golden files: the generated source of canonical kernels, pinned byte for byte in ``tests/compiler/golden``.

Each case computes something through the public API (``scorch.einsum``, ``+``, ``.sum``, ``scorch.asformat``,
``scorch.compile``) on fixed small operands (fixed shapes, value and index dtypes, sparsity patterns from
arithmetic, no random numbers), and every kernel source the compiler generates for it is compared with the
golden file: ``<case>.cpp`` (C++, the CPU backend) and ``<case>.cu`` (CUDA, rendered only: no GPU, no nvcc),
or ``<case>.<n>.<symbol>.cpp`` / ``.cu`` where a case generates several kernels (``n``: the order in which the
compiler generated them). A case without a ``.cu`` file has no CUDA kernel: conversions and the fused attention
kernel run on the CPU only. Nothing is compiled and no kernel runs: the adapter ``_sources`` records each source
where it is handed to the compiler and hands back a kernel that does nothing (no case reads a kernel's result).

Every case and target is generated in a fresh process (one child process, forked per case and target after
``import scorch``): the compiler's caches start empty, so every kernel of a case is generated again, whatever ran
before, and nothing generated here is left in the test process's caches. The environment is fixed there: no
``SCORCH_*`` variables but ``SCORCH_VECTOR_BYTES=64`` (the register tiles are sized in AVX-512 vectors, whatever the
machine's) and ``SCORCH_LEAD_GATHERS=1`` (lead vectors that gather, whatever the CPU's maker),
``torch.set_num_threads(THREADS)`` (thread counts enter the schedule's choices).

Refresh (after an intended change to the generated code; review the diff of ``tests/compiler/golden`` before
committing it)::

    python tests/compiler/test_golden.py --refresh

The golden files were first generated at commit 14ba01c8ba60b97aae53edc36d91402043befa27 (before the split of
``compiler/dispatch.py`` into a pipeline and an execution layer), from a pristine checkout of it.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import traceback
import warnings
from typing import Callable

import pytest
import torch

GOLDEN = pathlib.Path(__file__).resolve().with_name("golden")
ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGETS = {"cpp": ".cpp", "cuda": ".cu"}
THREADS = 4
REFRESH = "python tests/compiler/test_golden.py --refresh"


# --- the one adapter onto compiler internals --------------------------------------------------------------------

def _sources(case: Case, target: str) -> list[tuple[str, str]]:
    """``[(symbol, source), ...]``: the distinct kernel sources the compiler generates for ``target`` (``"cpp"``
    or ``"cuda"``) while ``case`` runs, in the order it generates them. Call it in a fresh process (``_emit``
    forks one per call): a kernel already in a cache of this process is not generated again.

    The only place in this module that touches compiler internals. It uses exactly these names:

    * ``scorch.compiler.runtime.load(source, symbol, argtypes, restype=None, toolchain="cxx", arch="")``, the
      one function through which every generated source reaches the compiler (``dispatch._build``,
      ``codegen.cpp.load``). It is replaced by a recorder that compiles nothing; ``toolchain`` ``"cxx"`` marks
      C++ source, ``"emulate"`` and ``"nvcc"`` CUDA source. (A CUDA source is loaded twice, once for the
      launcher and once for its ``<symbol>_error`` function: repeats of a text are dropped.)
    * ``scorch.compiler.runtime.Kernel(name, path, source_path, origin, compile_seconds, fn)``: what the recorder
      returns, with an ``fn`` that does nothing and returns 0 (a CUDA launcher's "no error").
    * ``scorch.compiler.relayout.fingerprint(tensor)``: a fixed helper (not generated), loaded once per process
      by whichever call is first to check a kept copy or a deferred operand; it is loaded before recording, so
      that no case's files depend on what ran before it in the process.
    * ``scorch.engine.direct.function()``: the fixed helper a kept product's repeated call runs (not generated),
      loaded once per process by the first prepared call that can use it; loaded before recording likewise.
    * ``scorch.engine.cpu_backend("cuda-emulate")`` (documented): for ``"cuda"`` the case runs in this block, where
      the calls that would give CPU tensors the ``"cpp"`` backend give ``"cuda-emulate"`` (as CUDA tensors get
      ``"cuda"``): every kernel of the execution layer is then lowered for and rendered as CUDA, from CPU tensors.
      (Made before the split of ``compiler/dispatch.py``, this adapter wrapped ``dispatch._backend`` instead.)

    After a refactor, point these at their new places (the function that turns a source into a loaded kernel;
    the way to run CPU tensors' kernels as CUDA) and leave the rest of the module alone.
    """
    import contextlib
    from scorch import engine
    from scorch.compiler import relayout, runtime
    torch.set_num_threads(THREADS)
    relayout.fingerprint(torch.zeros(1))
    from scorch.engine import direct
    direct.function(wait=True)
    seen: list[tuple[str, str, str]] = []  # (toolchain, symbol, source) as loaded

    def record(source, symbol, argtypes, restype=None, toolchain="cxx", arch=""):
        seen.append((toolchain, symbol, source))
        return runtime.Kernel(symbol, None, None, "golden", 0.0, lambda *args: 0)

    runtime.load = record
    ops = case.operands()
    if seen:
        raise AssertionError(f"golden case {case.name}: building the operands generated kernels ({seen[0][1]}):"
                             " build them without generated conversions (from index arrays)")
    with engine.cpu_backend("cuda-emulate") if target == "cuda" else contextlib.nullcontext():
        case.run(*ops)
    wanted = ("cxx",) if target == "cpp" else ("emulate", "nvcc")
    out, texts = [], set()
    for toolchain, symbol, source in seen:
        if toolchain in wanted and source not in texts:
            texts.add(source)
            out.append((symbol, source))
    return out


# --- the cases: public API only -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    operands: Callable[[], tuple]  # builds the operands (must not generate kernels)
    run: Callable                  # computes the case from them


def _matrix(m, n, every=3, shift=0, dtype=torch.float32):
    """An ``m x n`` matrix with a fixed pattern (entries where ``(3i + 5j + shift) % every == 0``; ``every=1``:
    dense) of nonzero multiples of 1/4."""
    i, j = torch.arange(m).unsqueeze(1), torch.arange(n).unsqueeze(0)
    vals = ((i + 2 * j + shift) % 7 + 1).to(dtype) / 4
    return torch.where((3 * i + 5 * j + shift) % every == 0, vals, torch.zeros((), dtype=dtype))


def _csr(dense, index_dtype=torch.int32):
    """``dense`` as a scorch CSR tensor built from its index arrays (torch's own conversion, no kernel)."""
    import scorch
    t = dense.to_sparse_csr()
    return scorch.sparse_csr_tensor(t.crow_indices().to(index_dtype), t.col_indices().to(index_dtype),
                                    t.values(), tuple(dense.shape))


def _as(fmt, dense, index_dtype=torch.int32):
    """``dense`` in a format whose conversion from a dense tensor needs no kernel (COO, BSR, DIA)."""
    import scorch
    return scorch.asformat(dense, fmt, index_dtype=index_dtype)


def _einsum(equation):
    def run(*ops):
        import scorch
        return scorch.einsum(equation, *ops)
    return run


def _attention(q, k, v, mask):
    s = torch.sparse.sampled_addmm(mask, q, k.transpose(0, 1), beta=0.0, alpha=q.shape[1] ** -0.5)
    return torch.sparse.mm(torch.sparse.softmax(s, dim=1), v)


def _compiled_attention(*ops):
    import scorch
    return scorch.compile(_attention)(*ops)


def _to(fmt):
    def run(x):
        import scorch
        return scorch.asformat(x, fmt)
    return run


CASES = {c.name: c for c in [
    Case("spmm_csr", lambda: (_csr(_matrix(8, 6)), _matrix(6, 4, 1)), _einsum("ij,jk->ik")),
    Case("spmv_csr", lambda: (_csr(_matrix(8, 6)), _matrix(6, 1, 1)[:, 0]), _einsum("ij,j->i")),
    Case("spmm_csr_f64_i64", lambda: (_csr(_matrix(8, 6, dtype=torch.float64), torch.int64),
                                      _matrix(6, 4, 1, dtype=torch.float64)), _einsum("ij,jk->ik")),
    Case("sddmm_csr", lambda: (_csr(_matrix(8, 6)), _matrix(8, 4, 1), _matrix(6, 4, 1)), _einsum("ij,ik,jk->ij")),
    Case("spgemm_csr_csr", lambda: (_csr(_matrix(8, 6)), _csr(_matrix(6, 5, 4, 1))), _einsum("ij,jk->ik")),
    Case("add_csr_csr", lambda: (_csr(_matrix(8, 6)), _csr(_matrix(8, 6, 4, 1))), lambda a, b: a + b),
    Case("spmm_bsr22", lambda: (_as("bsr(2, 2)", _matrix(8, 6)), _matrix(6, 4, 1)), _einsum("ij,jk->ik")),
    Case("spmv_dia", lambda: (_as("dia", _matrix(8, 8, 4)), _matrix(8, 1, 1)[:, 0]), _einsum("ij,j->i")),
    Case("sum_coo", lambda: (_as("coo", _matrix(8, 6)),), lambda x: x.sum(dim=1)),
    Case("attention_csr", lambda: (_matrix(8, 4, 1), _matrix(6, 4, 1, 1), _matrix(6, 4, 1, 2), _csr(_matrix(8, 6))),
         _compiled_attention),
    Case("einsum3_scale_csr", lambda: (_csr(_matrix(8, 6)), _matrix(8, 1, 1)[:, 0], _matrix(6, 1, 1, 1)[:, 0]),
         _einsum("ij,i,j->ij")),
    Case("einsum3_chain_csr", lambda: (_csr(_matrix(8, 6)), _matrix(6, 5, 1), _matrix(5, 3, 1)),
         _einsum("ij,jk,kl->il")),
    Case("convert_csr_csc", lambda: (_csr(_matrix(8, 6)),), _to("csc")),
    Case("convert_dense_csr", lambda: (_matrix(8, 6),), _to("csr")),
]}


# --- generating, naming, comparing --------------------------------------------------------------------------------

def _files(kernels: list[tuple[str, str]], name: str, suffix: str) -> dict[str, str]:
    """Golden file names for one case's kernels of one target: ``<case><suffix>`` for one kernel, else
    ``<case>.<n>.<symbol><suffix>`` in the order generated."""
    if len(kernels) == 1:
        return {name + suffix: kernels[0][1]}
    return {f"{name}.{n}.{symbol}{suffix}": source for n, (symbol, source) in enumerate(kernels, 1)}


def _in_child(fn):
    """``fn()``'s result (JSON data), computed in a forked child process; an exception there is raised here with
    the child's traceback."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                payload = {"ok": fn()}
        except BaseException:  # noqa: BLE001  (reported by the parent)
            payload = {"error": traceback.format_exc()}
        with os.fdopen(write, "w") as f:
            json.dump(payload, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    payload = json.loads(text) if text else {"error": "the child process died without an answer"}
    if "error" in payload:
        raise RuntimeError(payload["error"])
    return payload["ok"]


def _emit(names) -> dict:
    """``{case: {file name: source}}`` (or ``{case: {"error": traceback}}``), each case and target generated in
    a child forked from this process after ``import scorch``, before anything else ran here."""
    for variable in [v for v in os.environ if v.startswith("SCORCH_")]:  # (SCORCH_DEFER=all: no kernel would run)
        del os.environ[variable]
    os.environ["SCORCH_VECTOR_BYTES"] = "64"  # (the files do not depend on the machine's vector width)
    os.environ["SCORCH_LEAD_GATHERS"] = "1"  # (nor on whether its row sums' lead vectors gather: off on AMD)
    import scorch  # noqa: F401  (imported once, before forking: each child starts from here)
    result = {}
    for name in names:
        files = {}
        try:
            for target, suffix in TARGETS.items():
                files.update(_files(_in_child(lambda: _sources(CASES[name], target)), name, suffix))
        except RuntimeError as e:
            files = {"error": str(e)}
        result[name] = files
    return result


def generate(names=None) -> dict:
    """``{case: {file name: source}}`` for ``names`` (default: every case), from a fresh Python process on this
    checkout's ``scorch``; a case that failed to generate has ``{"error": traceback}`` instead."""
    names = list(CASES) if names is None else list(names)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "sources.json"
        proc = subprocess.run([sys.executable, __file__, "--emit", str(out), *names], env=env, cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"generating golden sources failed:\n{proc.stdout}\n{proc.stderr}")
        return json.loads(out.read_text())


def _golden_files(name: str) -> dict[str, str]:
    """The golden files of one case on disk."""
    return {p.name: p.read_bytes().decode("utf-8") for p in sorted(GOLDEN.glob(f"{name}.*"))
            if p.name.split(".")[0] == name}  # (bytes: no newline translation)


def refresh() -> None:
    """Rewrite every golden file from the current code (and remove the files of kernels no longer generated)."""
    generated = generate()
    errors = {n: f["error"] for n, f in generated.items() if "error" in f}
    if errors:
        sys.exit("\n".join(f"golden case {n} failed (nothing rewritten):\n{e}" for n, e in errors.items()))
    GOLDEN.mkdir(exist_ok=True)
    for name, files in generated.items():
        for stale in set(_golden_files(name)) - set(files):
            (GOLDEN / stale).unlink()
        for file, source in files.items():
            with open(GOLDEN / file, "w", encoding="utf-8", newline="") as f:
                f.write(source)
        print(f"{name}: {', '.join(files)}")


@pytest.fixture(scope="module")
def generated():
    return generate()


@pytest.mark.parametrize("name", list(CASES))
def test_generated_source_equals_golden(name, generated):
    want, got = _golden_files(name), generated[name]
    if "error" in got:
        pytest.fail(f"golden case {name}: generating its kernel sources failed:\n{got['error']}", pytrace=False)
    problems = []
    for file in sorted(set(want) | set(got)):
        if file not in got:
            problems.append(f"{file}: golden file, but the compiler no longer generates this kernel")
        elif file not in want:
            problems.append(f"{file}: generated, but there is no golden file for it")
        elif got[file] != want[file]:
            diff = difflib.unified_diff(want[file].splitlines(keepends=True), got[file].splitlines(keepends=True),
                                        f"golden/{file}", f"generated/{file}")
            problems.append(f"{file}: differs from the golden file:\n{''.join(diff)}")
    if problems:
        pytest.fail(f"golden case {name}: the generated kernel source changed.\n" + "\n".join(problems) +
                    f"\nIf the change is intended, refresh the golden files ({REFRESH}) and review their diff.",
                    pytrace=False)


def test_every_golden_file_belongs_to_a_case():
    stray = [p.name for p in GOLDEN.iterdir() if p.name.split(".")[0] not in CASES]
    assert not stray, f"golden files of no case: {stray} (remove them, or run {REFRESH})"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--emit"]:
        pathlib.Path(sys.argv[2]).write_text(json.dumps(_emit(sys.argv[3:] or list(CASES))))
    elif sys.argv[1:] == ["--refresh"]:
        refresh()
    else:
        sys.exit(f"usage: {REFRESH}")
