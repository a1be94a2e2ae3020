"""Training across processes with ``torch.distributed`` (issue 21): sparse parameters under torch's own
``DistributedDataParallel``, and the one collective with a gradient the apps exchange rows with.

**DDP with SparseTensor parameters.** A SparseTensor parameter's trainable state is its values array (its pattern
is fixed while it trains), and scorch's autograd graph lives on those values: they are an ordinary leaf tensor whose
``.grad`` is the parameter's gradient on its pattern. So DDP is given the values: torch's reducer buckets them, hooks
their gradient accumulators, all-reduces ``nnz`` numbers per sparse parameter (never the dense shape) and runs comm
hooks and ``no_sync`` as for any dense parameter, while ``model.weight`` stays the SparseTensor and every
``torch.optim`` optimizer steps it as before (it reads ``p.grad``: the values' gradient). Importing scorch installs
this into torch's ``DistributedDataParallel`` class at three seams (``install``; the constructor is wrapped only to
read its ``init_sync``):

- ``_build_params_for_reducer``: the reducer's parameter list holds each sparse parameter's values. Before, when
  the constructor synchronizes (``init_sync``, the default), rank 0's sparse parameters, pattern and values, are
  broadcast (``broadcast_sparse``), so ranks may start with different patterns (a random sparsifier) and even a
  different number of stored entries: DDP's shape check then compares equal values arrays;
- the module-state broadcast (``_sync_module_states``, at construction and in ``join``): sparse parameters go
  through ``broadcast_sparse``, everything else through torch's own function;
- ``_build_debug_param_to_name_mapping``: values are named as their parameter.

A forward pre-hook checks that each sparse parameter still holds the values array DDP was given (a dynamic
sparsity step that changes a pattern replaces it: build DDP again after one).

**Exchanging rows** (``exchange_rows``): ``all_to_all_single`` with split sizes as an autograd function (the
gradient goes back along the reversed splits), with the bytes each process sends and receives counted in
``traffic``; the GNN's halo exchange and the MoE's token dispatch are both one.
"""
from __future__ import annotations

import math

import dataclasses
import functools
import inspect
import threading

import torch

from ..sparse_tensor import SparseTensor

__all__ = ["broadcast_sparse", "exchange_rows", "install", "sparse_parameters", "traffic", "Traffic"]


def sparse_parameters(module: torch.nn.Module, ignore=()) -> list:
    """``(name, parameter)`` for each SparseTensor parameter of ``module`` (shared ones once), except the names in
    ``ignore``."""
    return [(n, p) for n, p in module.named_parameters() if type(p) is SparseTensor and n not in ignore]


def broadcast_sparse(params, src: int = 0, group=None) -> None:
    """Make every process's SparseTensor ``params`` (a list, in the same order everywhere) equal to those of rank
    ``src`` of ``group`` (its rank in the group, as DDP counts): format, index arrays and values. A process whose
    parameter has ``src``'s number of stored entries keeps its values array (updated in place: an optimizer or a
    reducer holding it sees the new values); otherwise the parameter takes a new one. Shapes and dtypes must agree
    (``ValueError`` naming the parameter)."""
    import torch.distributed as dist
    params = list(params)
    for p in params:
        if type(p) is not SparseTensor:
            raise TypeError(f"broadcast_sparse takes SparseTensors, got {type(p).__name__}")
    mine = [_describe(p) for p in params]
    meta = [mine]
    dist.broadcast_object_list(meta, group=group, device=_object_device(params, group), group_src=src)
    theirs = meta[0]
    if len(theirs) != len(params):
        raise ValueError(f"broadcast_sparse: rank {src} has {len(theirs)} sparse parameters, this rank "
                         f"{len(params)}")
    rank = dist.get_rank(group)
    for k, (p, want) in enumerate(zip(params, theirs)):
        if (want["shape"], want["dtype"]) != (mine[k]["shape"], mine[k]["dtype"]):
            raise ValueError(f"broadcast_sparse: sparse parameter {k} is {want['shape']} {want['dtype']} on rank "
                             f"{src} but {mine[k]['shape']} {mine[k]['dtype']} here: the model differs")
        if rank == src:
            for a in _arrays(p):
                dist.broadcast(_on_wire(a), group=group, group_src=src)
            continue
        dev = p._vals.device
        levels = [{name: None if got is None else torch.empty(got[0], dtype=getattr(torch, got[1]), device=dev)
                   for name, got in lv.items()} for lv in want["levels"]]
        same_nnz = want["nnz"] == p._vals.numel()
        values = p._vals.detach() if same_nnz else torch.empty(want["nnz"], dtype=p._vals.dtype, device=dev)
        for a in [a for lv in levels for a in (lv["pos"], lv["crd"]) if a is not None] + [values]:
            dist.broadcast(_on_wire(a), group=group, group_src=src)
        _adopt(p, want["format"], levels, values, same_nnz)


def _describe(p: SparseTensor) -> dict:
    def arr(a):
        return None if a is None else (a.numel(), str(a.dtype).removeprefix("torch."))
    return {"format": str(p._format), "shape": tuple(p._shape), "dtype": str(p.dtype), "nnz": p._vals.numel(),
            "levels": [{"pos": arr(st.pos), "crd": arr(st.stored_crd)} for st in p._levels]}


def _arrays(p: SparseTensor) -> list:
    """The index arrays as held (level by level, pos before crd: a packed level's narrow coordinates) then the values,
    in the order ``broadcast_sparse`` sends."""
    return [a for st in p._levels for a in (st.pos, st.stored_crd) if a is not None] + [p._vals.detach()]


def _on_wire(a: torch.Tensor) -> torch.Tensor:
    """``a`` as the collectives send it: a packed level's int16 coordinates as their bytes (gloo and NCCL have no
    16-bit integers), written through into the receiver's int16 array."""
    return a.view(torch.uint8) if a.dtype == torch.int16 else a


def _adopt(p: SparseTensor, fmt: str, levels, values, in_place: bool) -> None:
    """``p`` takes the received format, index arrays and values (already written into its own values array when
    ``in_place``)."""
    from ..formats import Format, LevelStorage, packed_level
    # (coordinates narrower than their positions came from a packed level: packed again, not widened)
    stored = [packed_level(lv["pos"], lv["crd"]) if lv["pos"] is not None and lv["crd"] is not None else
              LevelStorage(lv["pos"], lv["crd"]) for lv in levels]
    new = SparseTensor(Format(fmt), p._shape, stored, values, check=True)
    if in_place:  # the values array (a reducer's or optimizer's reference to it) stays
        p._format, p._levels, p._index_dtype = new._format, new._levels, new._index_dtype
    else:
        p.data = new
    p.__dict__.pop("_conversions", None)  # conversions kept for the old pattern (engine.convert)


def _object_device(params, group):
    """The device ``broadcast_object_list`` stages through: the current CUDA device under NCCL, else the CPU."""
    import torch.distributed as dist
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --- torch's DistributedDataParallel ------------------------------------------------------------------------------

class _Constructing(threading.local):
    def __init__(self):
        self.init_sync = []      # init_sync of each DDP constructor running on this thread (innermost last)
        self.synced = None       # the module whose sparse parameters _build_params_for_reducer just broadcast


_constructing = _Constructing()


def install() -> bool:
    """Teach torch's ``DistributedDataParallel`` to train SparseTensor parameters (the module docstring); once per
    process, a no-op where torch has no ``torch.distributed``. Returns whether it is installed."""
    if not torch.distributed.is_available():
        return False
    import torch.nn.parallel.distributed as ddp_module
    ddp = ddp_module.DistributedDataParallel
    if getattr(ddp, "_scorch_sparse", False):
        return True
    signature = inspect.signature(ddp.__init__)
    init, build, debug_names = ddp.__init__, ddp._build_params_for_reducer, ddp._build_debug_param_to_name_mapping
    sync_states = ddp_module._sync_module_states

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init_sync = signature.bind(self, *args, **kwargs).arguments.get("init_sync", True)
        _constructing.init_sync.append(init_sync)
        try:
            init(self, *args, **kwargs)
        finally:
            _constructing.init_sync.pop()
            _constructing.synced = None

    @functools.wraps(build)
    def _build_params_for_reducer(self):
        sparse = [p for _, p in sparse_parameters(self.module, self.parameters_to_ignore)]
        syncing = _constructing.init_sync[-1] if _constructing.init_sync else True
        # sparse buffers (a graph's adjacency): broadcast here once, as the parameters, and kept out of DDP's own
        # buffer broadcasts, which copy into them in place
        buffers = [(n, b) for n, b in self.module.named_buffers() if type(b) is SparseTensor
                   and n not in self.parameters_to_ignore]
        if buffers:
            self.parameters_to_ignore = set(self.parameters_to_ignore) | {n for n, _ in buffers}
        if sparse and syncing:
            broadcast_sparse(sparse, src=0, group=self.process_group)  # (all of them, as DDP broadcasts every one)
            _constructing.synced = self.module
        if buffers and syncing and getattr(self, "broadcast_buffers", True):
            broadcast_sparse([b for _, b in buffers], src=0, group=self.process_group)
        sparse = [p for p in sparse if p.requires_grad]
        parameters, expect_sparse_gradient = build(self)
        given = {id(p): p._vals for p in sparse}
        parameters = [given.get(id(p), p) for p in parameters]
        if sparse:
            self.register_forward_pre_hook(functools.partial(_check_values, list(zip(sparse, given.values()))))
        return parameters, expect_sparse_gradient

    @functools.wraps(debug_names)
    def _build_debug_param_to_name_mapping(self, parameters):
        owner = {id(p._vals): p for _, p in sparse_parameters(self.module)}
        return debug_names(self, [owner.get(id(p), p) for p in parameters])

    @functools.wraps(sync_states)
    def _sync_module_states(module, process_group, broadcast_bucket_size, src, params_and_buffers_to_ignore,
                            broadcast_buffers=True):
        sparse = sparse_parameters(module, params_and_buffers_to_ignore)
        if sparse and _constructing.synced is not module:  # (at construction, _build_params_for_reducer did it)
            broadcast_sparse([p for _, p in sparse], src=src, group=process_group)
        _constructing.synced = None
        sync_states(module, process_group, broadcast_bucket_size, src,
                    set(params_and_buffers_to_ignore) | {n for n, _ in sparse}, broadcast_buffers)

    ddp.__init__ = __init__
    ddp._build_params_for_reducer = _build_params_for_reducer
    ddp._build_debug_param_to_name_mapping = _build_debug_param_to_name_mapping
    ddp_module._sync_module_states = _sync_module_states
    ddp._scorch_sparse = True
    return True


def _check_values(given, module, args):
    for p, vals in given:
        if p._vals is not vals:
            raise RuntimeError("scorch: a sparse parameter of this DistributedDataParallel model holds another values"
                               " array than DDP was built with (its pattern changed, e.g. by a dynamic sparsity"
                               " step): build DistributedDataParallel again after changing a pattern")


# --- rows exchanged, with a gradient ---------------------------------------------------------------------------

@dataclasses.dataclass
class Traffic:
    """Bytes this process sent to and received from other processes through ``exchange_rows`` (its own rows, which
    stay local, are not counted), forward and backward, and the number of exchanges."""
    sent: int = 0
    received: int = 0
    calls: int = 0

    def reset(self) -> "Traffic":
        """A copy of the counts so far; the counts restart at 0."""
        old = dataclasses.replace(self)
        self.sent = self.received = self.calls = 0
        return old


#: this process's counts (``traffic.reset()`` reads and restarts them, e.g. once an epoch)
traffic = Traffic()


def _count(send_splits, recv_splits, row_bytes):
    import torch.distributed as dist
    me = dist.get_rank()
    traffic.sent += sum(n for r, n in enumerate(send_splits) if r != me) * row_bytes
    traffic.received += sum(n for r, n in enumerate(recv_splits) if r != me) * row_bytes
    traffic.calls += 1


def _all_to_all(x, send_splits, recv_splits, group):
    import torch.distributed as dist
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits),
                           group=group)
    _count(send_splits, recv_splits, math.prod(x.shape[1:]) * x.element_size())  # (x may have no rows to send)
    return out


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _all_to_all(grad, recv_splits, send_splits, ctx.group), None, None, None


def exchange_rows(x: torch.Tensor, send_splits, recv_splits, group=None) -> torch.Tensor:
    """``torch.distributed.all_to_all_single`` of ``x``'s rows, differentiable: the first ``send_splits[0]`` rows go
    to rank 0, the next ``send_splits[1]`` to rank 1...; the result stacks the ``recv_splits[r]`` rows from each rank
    ``r`` in rank order. The gradient of the result goes back to the rows' owners along the reversed splits. Counts
    bytes in ``traffic``."""
    send_splits, recv_splits = [int(n) for n in send_splits], [int(n) for n in recv_splits]
    if x.dim() == 0 or x.shape[0] != sum(send_splits):
        raise ValueError(f"exchange_rows: x has {x.shape[0] if x.dim() else 0} rows, send_splits add up to "
                         f"{sum(send_splits)}")
    if any(n < 0 for n in send_splits + recv_splits):
        raise ValueError("exchange_rows: split sizes must be non-negative")
    return _ExchangeRows.apply(x, send_splits, recv_splits, group)
