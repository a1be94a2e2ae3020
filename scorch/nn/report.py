"""The report of a ``scorch.schedule``: ``Summary`` (``Schedule.summary()``'s rows and table) and
``storage_bytes``."""
from __future__ import annotations

from ..sparse_tensor import SparseTensor


def storage_bytes(t) -> int:
    """Bytes a tensor's storage takes: a SparseTensor's values and index arrays, a dense tensor's elements."""
    if isinstance(t, SparseTensor):
        arrays = [a for st in t.levels for a in st.arrays().values()] + [t.values()]
        return sum(a.numel() * a.element_size() for a in arrays)
    return t.numel() * t.element_size()


class Summary(list):
    """Rows (dicts: ``kind, name, shape, format, density, dense_bytes, bytes, schedule``) for the scheduled
    parameters, then one row per selected module (``format`` None where its output is not sparsified; ``schedule``
    the directives as text, or None); ``str()`` is the table."""

    def __str__(self):
        head = ("parameter", "shape", "format", "density", "dense bytes", "bytes")
        rows = [(r["name"], "x".join(map(str, r["shape"])), r["format"], f"{r['density']:.3f}",
                 str(r["dense_bytes"]), str(r["bytes"])) for r in self if r["kind"] == "param"]
        if rows:
            total = sum(r["dense_bytes"] for r in self if r["kind"] == "param")
            after = sum(r["bytes"] for r in self if r["kind"] == "param")
            rows.append(("total", "", "", "", str(total), f"{after} ({after / max(total, 1):.1%})"))
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in [head, *rows]]
        lines += [f"output of {r['name']}: {r['format']}, {r['sparsifier']}, mask computed per forward"
                  for r in self if r["kind"] == "output" and r["format"] is not None]
        lines += [f"schedule of {r['name']}{'' if r['kind'] == 'param' else ' (module)'}: {r['schedule']}"
                  for r in self if r.get("schedule")]
        return "\n".join(lines)
