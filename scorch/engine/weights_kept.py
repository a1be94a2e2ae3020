"""A sparse-weight product's one kernel call kept, to be made again on the next input without the Python between.

Under ``torch.compile`` each of a pruned model's sparse linears is a custom op (``scorch/dynamo_fuse.py``) that,
every call, wraps the weights' arrays into SparseTensors again (``dynamo._rebuild``), picks the plan, looks up the
kernel, narrows the coordinates and stacks the weights through their memos, and binds about twenty arguments:
about 0.3-0.5 ms of Python an op at 1024 tokens (AMD Zen 4, 1 thread), 12 ops a pass of a 4-layer BERT, where the
products themselves take 2-20 ms. The result depends on the input and on the weights' arrays and biases only,
so ``kept`` records the first call's one kernel call (``call`` below, which ``engine.weights`` makes its calls
through) and later calls with the same arrays (the same objects, unmodified: ``_version``), input shape, dtype and
thread count run that kernel on a new output with the same arguments, the input's and output's pointers replaced.

A call is kept only where it is certainly that: exactly one kernel call, reading the input object itself
(``x`` as given, contiguous: not a converted copy) and writing the returned tensor (``y``, its only output), no
other argument over their memory. Any other path (the general product, two calls, a result converted after the
kernel) runs as it did, every time. The tensors the kernel reads besides the input (index arrays, values, a
stacked copy of them, a bias in the values' type) are held by the entry; an entry goes when one of the arrays it
guards dies, and arrays without a version counter (made under ``torch.inference_mode``) are never kept.
"""
from __future__ import annotations

import threading
import weakref

import torch

from ..compiler.caches import register
from ..compiler.codegen import cpp

_RECORDING = threading.local()
#: the kept calls by ``kept``'s key: ``(guard references, guard versions, kernel function, arguments, the input's
#: and output's argument places, the output's shape and dtype, the tensors the arguments point into)``
_KEPT: dict = {}
#: entries at most (the oldest dropped first): a model's sparse products, one entry each
LIMIT = 1024
register("kept weight calls", "sparse-weight products' kernel calls with their arguments bound, by the weights' "
         "arrays, the input's shape and the thread count (the compiled graph's ops)", _KEPT.__len__, _KEPT.clear)


def call(kernel, loaded, values: dict) -> None:
    """``cpp.call``, seen by ``kept`` while it records."""
    calls = getattr(_RECORDING, "calls", None)
    if calls is not None:
        calls.append((kernel, loaded, values))
    cpp.call(kernel, loaded, values)


def guards(weight, *others) -> list:
    """The tensors a kept call on the sparse ``weight`` depends on besides its input: the weight's index arrays, its
    values, then ``others`` that are not None (a bias)."""
    out = [a for level in weight._levels for a in level.arrays().values()]
    out.append(weight._vals)
    out.extend(t for t in others if t is not None)
    return out


def kept(tag: tuple, guards, x: torch.Tensor, compute) -> torch.Tensor:
    """``compute(x)``, whose result depends only on ``x`` and the tensors ``guards`` (and ``tag``, constants), made
    through its kernel call kept from an earlier call where there is one (see the module's text)."""
    guards = [g for g in guards if g is not None]
    key = (tag, tuple(map(id, guards)), tuple(x.shape), x.dtype, x.device, torch.get_num_threads())
    entry = _KEPT.get(key)
    if entry is not None and x.is_contiguous():
        refs, versions, fn, args, x_at, y_at, shape, dtype, _ = entry
        if all(r() is g for r, g in zip(refs, guards)) and all(g._version == v for g, v in zip(guards, versions)):
            y = torch.empty(shape, dtype=dtype)
            args = list(args)
            args[x_at], args[y_at] = x.data_ptr(), y.data_ptr()
            fn(*args)
            if getattr(_RECORDING, "calls", None) is not None:  # (an outer recorder: a call it cannot repeat)
                _RECORDING.calls.append(None)
            return y
    outer = getattr(_RECORDING, "calls", None)  # (a kept call inside another's compute: the outer sees its calls)
    _RECORDING.calls = calls = []
    try:
        y = compute(x)
    finally:
        _RECORDING.calls = outer
        if outer is not None:
            outer.extend(calls)
    if len(calls) == 1 and calls[0] is not None and not any(g.is_inference() for g in guards):
        _keep(key, guards, x, y, *calls[0])
    return y


def _keep(key, guards, x, y, kernel, loaded, values) -> None:
    """Keep the one call ``kernel(values)`` that made ``y`` from ``x``, where it is certainly that."""
    names = [p.name for p in kernel.params]
    outputs = [p.name for p in kernel.params if p.kind == "array" and p.output]
    if values.get("x") is not x or values.get("y") is not y or outputs != ["y"] or not x.is_contiguous() or \
            not y.is_contiguous() or getattr(loaded, "fn", None) is None:
        return
    mine = {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
    held = [values[n] for n in names if n not in ("x", "y") and isinstance(values[n], torch.Tensor)]
    if any(t.untyped_storage().data_ptr() in mine for t in held):
        return
    args = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in (values[n] for n in names)]
    while len(_KEPT) >= LIMIT:
        del _KEPT[next(iter(_KEPT))]

    def drop(_ref, key=key, entries=_KEPT):  # (an array died: its id may be reused)
        entries.pop(key, None)
    _KEPT[key] = ([weakref.ref(g, drop) for g in guards], [g._version for g in guards], loaded.fn, tuple(args),
                  names.index("x"), names.index("y"), tuple(y.shape), y.dtype, held)
