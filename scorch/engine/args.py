"""Kernel arguments from tensors: a plan's parameters are known by kind (``pos``/``crd`` of an operand's level,
its values, a dense operand, a size, a level's bounds, the output, the thread count); ``argument`` finds one's
value on the operands. Also the operand types the compiler plans for (``tensor_type``)."""
from __future__ import annotations

import torch

from .. import loopir as L
from ..compiler.ir import TensorType
from ..compiler.pipeline import Plan, target_of
from ..sparse_tensor import SparseTensor, shape_of


#: the value dtypes kernels take (bfloat16 and float16 stored as such, computed in float32)
SUPPORTED = (torch.float32, torch.float64, torch.int32, torch.int64) + L.HALF_DTYPES


def tensor_type(x) -> TensorType:
    if type(x) is SparseTensor:
        return TensorType(len(x._shape), x._vals.dtype, x._format, x.index_dtype, x._vals.device.type)
    return TensorType(x.dim(), x.dtype, None, None, x.device.type)


def level_info(x: SparseTensor):
    """Per level: ``(lo, extent, width)`` and the number of positions, from the storage."""
    fmt = x.format
    count, info, counts = 1, [], []
    for (lo, hi), lvl, st in zip(fmt.level_bounds(x._shape), fmt.level_types, x._levels):
        width = lvl.width(st, count) if lvl.padded else 0
        info.append((lo, hi - lo, width))
        count = lvl.num_positions(st, count, lo, hi)
        counts.append(count)
    return info, counts


def mean_length(x: SparseTensor, level: int) -> int:
    """The positions of ``x``'s level ``level`` per position of its parent, rounded up (0 where the parent has
    none): a row's expected length, for a kernel's ``For.lead``. Kept on the level's storage with the arrays it
    was read from (compared by identity), so a repeated call costs a dict lookup (level_info: ~2.6 us). (The
    levels are read from ``x.__dict__``: a tensor subclass's attribute is looked up through ``torch.Tensor``'s
    type first, microseconds with the caches cold; see ``prepared.stands``.)"""
    st = x.__dict__["_levels"][level]
    arrays = (getattr(st, "pos", None), getattr(st, "crd", None))
    kept = st.__dict__.get("_mean")
    if kept is not None and kept[0] is arrays[0] and kept[1] is arrays[1]:
        return kept[2]
    _, counts = level_info(x)
    parents = counts[level - 1] if level else 1
    mean = -(-counts[level] // parents) if parents else 0
    st.__dict__["_mean"] = arrays + (mean,)
    return mean


def worker_count(backend) -> int:
    """How many workers a parallel loop gets, for the schedule's cost estimates: on a GPU, many."""
    return 1 << 14 if target_of(backend) == "cuda" else torch.get_num_threads()


def argument(a, ops, info, sizes, scalars, out_arr, backend="cpp"):
    """The value of one kernel argument: a tensor (passed by pointer) or a number."""
    k = a.kind
    if k in ("pos", "crd"):
        return getattr(ops[a.operand]._levels[a.level], k)
    if k == "values":
        return ops[a.operand]._vals
    if k == "dense":
        return ops[a.operand]
    if k in ("lo", "extent", "width"):
        return info[a.level][("lo", "extent", "width").index(k)]
    if k == "dim":
        return shape_of(ops[a.operand])[a.level]
    if k == "mean":
        return mean_length(ops[a.operand], a.level)
    if k == "size":
        return sizes[a.var]
    if k == "scalar":
        return scalars[a.var]
    if k == "out":
        return out_arr
    if k == "threads":
        return worker_count(backend)
    raise AssertionError(f"unknown argument kind {k!r}")


def arguments(plan: Plan, ops, sizes, out_arr, backend="cpp") -> dict:
    """The kernel parameters' values of ``plan`` on ``ops``, by parameter name (``out_arr`` the output array)."""
    info, _ = level_info(ops[plan.schedule.driver.operand])
    return {a.param.name: argument(a, ops, info, sizes, {}, out_arr, backend) for a in plan.lowered.args}
