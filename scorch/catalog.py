"""What every torch function and Tensor method does with a sparse operand, read from the code itself.

``python -m scorch.catalog`` prints ``docs/sparse-api.md``: first the sparse rules (each torch name routed to a
scorch implementation by ``SparseTensor.__torch_function__``, with the first line of that implementation's
documentation), then one row for every overridable torch function and Tensor method
(``torch.overrides.get_testing_overrides()``, plus the ones scorch implements beyond it) saying what happens to a
SparseTensor operand:

- **sparse rule**: scorch's implementation (which may still run some arguments on the dense form: its summary
  says which);
- **dense fallback**: torch's own result computed on the dense form of the sparse operands, with a
  ``DensifyWarning`` once per op, a count in ``scorch.stats()["fallback"]``, ``DensifyError`` in strict mode;
- **error**: an in-place op without a sparse rule on a sparse ``self`` (a sparse tensor cannot become dense in
  place; with a dense ``self`` the op falls back), or an op about dense storage (``data_ptr``...);
- **metadata**: answered by the wrapper itself (shape, dtype, device, flags).

Attributes (``Tensor.T``, ``Tensor.real``...) are classified by reading them on a small sparse tensor.
"""
from __future__ import annotations

import inspect
import warnings

import torch

import scorch  # noqa: F401  (registers the implementations)
from . import _stats
from ._versions import release
from .sparse_tensor import _INPLACE_DUNDERS, _METADATA, _NO_FALLBACK, IMPLEMENTATIONS, SparseTensor, _op_name

# namespaces whose names spell the functions in the table, first one wins
_NAMESPACES = (("torch", torch), ("Tensor", torch.Tensor), ("torch.nn.functional", torch.nn.functional),
               ("torch.linalg", torch.linalg), ("torch.special", torch.special), ("torch.fft", torch.fft),
               ("torch.sparse", torch.sparse), ("torch.nested", torch.nested))


def public_names() -> dict:
    """``id(function) -> "namespace.name"`` for every public callable (and attribute getter) of the namespaces
    (the lookup ``public_name`` takes). Public for tests, which spell torch's functions as the table does."""
    names: dict = {}
    for prefix, ns in _NAMESPACES:
        for attr in sorted(dir(ns)):
            try:
                obj = inspect.getattr_static(ns, attr) if ns is torch.Tensor else getattr(ns, attr)
            except AttributeError:
                continue
            key = obj if not hasattr(obj, "__func__") else obj.__func__
            names.setdefault(id(key), f"{prefix}.{attr}")
            names.setdefault(id(obj), f"{prefix}.{attr}")
    return names


def public_name(func, names: dict) -> str:
    """The public spelling of ``func``, as the table's rows name it (``names``: ``public_names()``; the op name
    of ``SparseTensor``'s messages where no namespace holds it: attribute getters...). Public for tests, which check
    that every overridable function has a row."""
    return names.get(id(func)) or _op_name(func)


def _functions() -> list:
    """Every overridable torch function and Tensor method, and every one scorch implements."""
    funcs = list(torch.overrides.get_testing_overrides())
    seen = {id(f) for f in funcs}
    return funcs + [f for f in IMPLEMENTATIONS if id(f) not in seen]


def _attribute_behaviour(func) -> str:
    """Read an attribute on a small sparse tensor: ``metadata``, ``dense fallback`` or ``error``."""
    x = scorch.asformat(torch.eye(2), "csr")
    _stats.reset_stats()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            func(x)
    except Exception:  # noqa: BLE001  (whatever it raises, it is an error for a sparse operand)
        return "error"
    finally:
        fell_back = bool(_stats.stats()["fallback"])
        _stats.reset_stats()
    return "dense fallback" if fell_back else "metadata"


def behaviour(func) -> tuple[str, str]:
    """``(kind, note)`` for ``func`` given a SparseTensor operand (kinds as in the module text)."""
    impl = IMPLEMENTATIONS.get(func)
    if impl is not None:
        return "sparse rule", f"`{impl.__module__.replace('scorch.', '')}.{impl.__name__}`"
    name = getattr(func, "__name__", "")
    if func in _METADATA:
        return "metadata", ""
    if name == "__get__":
        return _attribute_behaviour(func), ""
    if name in ("__set__", "__delete__"):
        return "metadata", "set on the wrapper"
    if func in _NO_FALLBACK:
        return "error", "about dense storage: a SparseTensor's arrays are `values()` and `levels`"
    if getattr(SparseTensor, name, None) is not None and getattr(SparseTensor, name) is not \
            getattr(torch.Tensor, name, None) and any(name in c.__dict__ for c in SparseTensor.__mro__
                                                      if not issubclass(torch.Tensor, c)):  # (its mixin's too)
        return "sparse rule", f"`SparseTensor.{name}`"
    if (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS:
        return "error", "in place on a sparse tensor (with a dense `self`: dense fallback)"
    return "dense fallback", ""


def entries():
    """``[(torch names, implementation name, summary)]`` of the sparse rules, grouped by implementation."""
    groups: dict = {}
    names = public_names()
    for func, impl in IMPLEMENTATIONS.items():
        groups.setdefault(inspect.unwrap(impl), []).append(public_name(func, names))
    rows = []
    for impl, spelled in groups.items():
        doc = inspect.getdoc(impl) or ""
        summary = " ".join(doc.split("\n\n")[0].split()) if doc else ""
        where = f"{impl.__module__.replace('scorch.', '')}.{impl.__name__}"
        rows.append((", ".join(sorted(set(spelled))), where, summary))
    return sorted(rows, key=lambda r: (r[1], r[0]))


def surface():
    """``[(torch name, kind, note)]`` for every overridable torch function and Tensor method, sorted by name."""
    names = public_names()
    rows = {}
    for func in _functions():
        name = public_name(func, names)
        if name.startswith(("torch._", "Tensor._")) and not name.startswith(("Tensor.__", "Tensor._values",
                                                                             "Tensor._indices", "Tensor._nnz")):
            continue  # private functions, except the accessors and dunders that user code calls
        rows.setdefault(name, (name,) + behaviour(func))
    return sorted(rows.values())


def torch_minor() -> str:
    """The running torch's release, major.minor (``2.13``): the names this page lists are that release's."""
    return ".".join(map(str, release(torch.__version__)))


HEADER = """# Torch functions on sparse operands

Generated by `python -m scorch.catalog` from scorch's registry on torch TORCH_MINOR (a test keeps this file in sync;
another torch release lists the torch names it has).

No op on a `scorch.SparseTensor` stops a program. An op with a **sparse rule** runs scorch's implementation
(below: what it does with the format; autograd differentiates through the stored values, `scorch/_autograd.py`).
Any other op runs as a **dense fallback**: torch's own function on the dense form of every sparse argument
(`to_dense()`, differentiable, so gradients reach the stored values) with torch's result, a
`scorch.DensifyWarning` once per op name, a count in `scorch.stats()["fallback"]`; `scorch.strict()` (a call, or
`with scorch.strict():`) and `SCORCH_STRICT=1` raise `scorch.DensifyError` instead, and a fallback whose dense
operands would take more than `scorch.fallback_limit()` bytes (a quarter of physical memory, or
`scorch.set_fallback_limit(n)` / `SCORCH_FALLBACK_LIMIT=8G`) raises `MemoryError` naming the op and the size.
An implementation can itself fall back for arguments its rule does not cover (its summary says so). An
in-place op without a sparse rule raises on a sparse `self` (**error**: a sparse tensor cannot become dense in
place), as do the ops about dense storage (`data_ptr`, `storage`...). **Metadata** reads are answered by the
wrapper.

**Checkpoints.** `torch.save` of a SparseTensor (a state dict with sparse weights) pickles scorch's rebuild
function, so it loads where scorch is imported (`torch.load` then takes it with `weights_only=True`, validating
the arrays). In a process without scorch, `torch.load` fails with `Weights only load failed ... Unsupported global:
GLOBAL scorch.sparse_tensor._rebuild was not an allowed global by default`: `import scorch` before `torch.load`
(do not pass `weights_only=False`: the file would still need scorch). For a checkpoint plain torch loads, write
it with `scorch.save_portable(obj, f)`: each SparseTensor is saved as torch's sparse tensor (CSR, CSC, COO, BSR,
BSC; COO for a format torch lacks, never densified; a dense format dense) with its scorch format beside it;
`scorch.load_portable(f)` gives the SparseTensors back in their formats and index dtypes (`scorch.to_portable` /
`scorch.from_portable` do the same in memory).

**Where scorch differs from torch on purpose.** Products with a sparse operand (`@`, `mm`, `mv`, `addmm`,
`einsum`, `F.linear`, `sampled_addmm`...) of operands of different dtypes compute in and return the promoted dtype
(`torch.promote_types`: a bfloat16 SparseTensor times a float32 matrix is float32; an int64 one-hot gate times
float32 experts is float32), where torch raises `RuntimeError: expected ... same dtype` for dense and sparse
operands alike; torch code casts first and gets the same values. SparseTensors hold real values (bool, integers,
float16, bfloat16, float32, float64): complex values are refused where a SparseTensor would be made (`TypeError`).

**Sparse attention** is written as in torch: `F.scaled_dot_product_attention(q, k, v, attn_mask=S)` with a sparse
mask `S` computes the scores only at the mask's allowed entries (a bool mask's stored True entries; an additive
float mask's stored entries, their values added to the scores, an unstored position meaning `-inf`), for every
batch and head at once, by the fused kernels (SDDMM, row softmax and SpMM in one pass per row), forward and
backward. Its row below says the rest (`is_causal`, dropout, shapes, formats).

**Sparsified ops** (STen's operator model): `scorch.sparsified_op(op, out_fmt=..., grad_out_fmt=...,
grad_inp_fmt=...)` makes any function of tensors into one whose outputs, the gradients with respect to them, and
the gradients its arguments receive are sparsified and stored in formats: each through a spec `(inline sparsifier,
temporary format, external sparsifier, final format)` or `(sparsifier, format)`, with scorch's sparsifiers
(`KeepAll`, `ScalarThreshold`, `ScalarFraction`, `RandomFraction`, `BlockFraction`, `NM`, or a subclass of
`scorch.nn.Sparsifier`): `sparsified_op(torch.add, out_fmt=[(NM(2, 4), "nm(2, 4)")])` is an add whose result is
a 2:4 SparseTensor; `sparsified_op(F.linear, grad_inp_fmt=[None, (ScalarFraction(0.9), "coo")])` a linear whose
dense weight receives the top 10% of its gradient as torch's sparse COO `.grad` (applied by `torch.optim.SGD` and
`SparseAdam`). The op itself runs as called (through scorch on sparse operands). Examples and semantics:
`docs/training.md`, `scorch/nn/sparsified.py`.

"""


def markdown() -> str:
    lines = [HEADER.replace("TORCH_MINOR", torch_minor()) + "## Sparse rules\n",
             "| torch function / method | scorch implementation | what it does with the format |",
             "| --- | --- | --- |"]
    for spelled, where, summary in entries():
        lines.append(f"| `{spelled.replace(', ', '`, `')}` | `{where}` | {summary.replace('|', '/')} |")
    rows = surface()
    counts: dict = {}
    for _, kind, _ in rows:
        counts[kind] = counts.get(kind, 0) + 1
    lines += ["", "## Every torch function and Tensor method", "",
              f"{len(rows)} names (`torch.overrides.get_testing_overrides()` and scorch's registry; private"
              " `torch._*` names left out): " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + ".", "",
              "| torch name | with a sparse operand | note |", "| --- | --- | --- |"]
    for name, kind, note in rows:
        lines.append(f"| `{name}` | {kind} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
