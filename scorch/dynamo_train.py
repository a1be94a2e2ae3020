"""``F.dropout(F.relu(h))`` in a compiled training graph as one scorch op that keeps no mask (issue 46).

Inductor's CPU code stores and loads bool tensors with a scalar byte loop, and draws dropout's random numbers one
element at a time (``normalized_rand_cpu``, a Philox call per element): in a GCN trained under ``torch.compile``
(``apps/gnn``), ``dropout(relu(A @ (X W) + b))`` of 20000 x 16 floats took about 16 ms of a 20 ms compiled epoch,
where the eager epoch is 13 ms (1 thread, AMD Zen 4). The forward kept two bool masks for the backward (ReLU's
``h <= 0`` and dropout's draw), each written and read by those loops.

``TrainingPass`` is an Inductor pre-grad pass (put beside ``dynamo_fuse``'s in
``torch._inductor.config.pre_grad_custom_pass``): in a graph with a SparseTensor in it, it replaces each
``F.dropout(F.relu(h), p, training=True)`` (the ReLU read by nothing else; ``torch.relu``, ``F.relu`` or
``h.relu()``, not in place) by ``relu_dropout(h, p)``, which while traced (AOTAutograd) is

- for a float32 or float64 CPU tensor: a seed drawn in the graph (``torch.randint``: Inductor's own random
  stream, seeded from torch's generator, so ``torch.manual_seed`` repeats a run) and one ``scorch::relu_dropout``
  op: a generated loop that hashes each element's index with the seed (SplitMix64's finalizer, a counter-based
  generator: vectorized, and the same draws whatever the thread count) and writes
  ``relu(h) * (scale if kept else 0)``, ``scale = 1 / (1 - p)`` as torch's dropout. Its backward
  (``scorch::relu_dropout_backward``, one loop) is ``grad * scale`` where the output is positive, else 0: an
  element of the output is positive exactly where ``h`` was and the element was kept, so the float output, which
  the graph keeps anyway where the next product's weight gradient reads it, is all the backward needs. (Written
  with torch ops, that backward let the partitioner compute ``out > 0`` in the forward and keep the bool mask.)
- anything else: ``F.dropout(F.relu(h), p, True)`` as before the pass.

The mask differs from eager dropout's (as Inductor's own does: a compiled dropout draws from its own stream); the
values kept, the scale and the gradients are eager's. An ``h`` with a NaN gives a 0 gradient there (eager gives
``grad * scale`` where kept); its loss is NaN anyway. Other backends (``aot_eager``) run no pre-grad pass.
"""
from __future__ import annotations

import ctypes
import sys

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_custom_graph_passes, get_hash_for_files

from . import _compile_ready
from .compiler import runtime
from .sparse_tensor import SparseTensor

F = torch.nn.functional

_SOURCE = r"""
#include <cstdint>
template <typename T>
static void relu_dropout(const T* __restrict__ x, T* __restrict__ out, int64_t n, uint64_t seed,
                         uint32_t threshold, T scale, int64_t nthreads) {
  #pragma omp parallel for simd num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    // SplitMix64's output function of seed + i * golden ratio: element i's draw, whatever the threads
    uint64_t z = seed + (uint64_t)i * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    T v = x[i];
    T r = v > T(0) || v != v ? v : T(0);                     // torch's relu (NaN stays NaN)
    out[i] = r * ((uint32_t)(z >> 32) >= threshold ? scale : T(0));  // torch's dropout: inf * 0 is NaN
  }
}
template <typename T>
static void backward(const T* __restrict__ grad, const T* __restrict__ out, T* __restrict__ gx, int64_t n, T scale,
                     int64_t nthreads) {
  #pragma omp parallel for simd num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < n; ++i) gx[i] = out[i] > T(0) ? grad[i] * scale : T(0);
}
extern "C" void scorch_relu_dropout_backward(const void* grad, const void* out, void* gx, int64_t n, double scale,
                                             int64_t itemsize, int64_t nthreads) {
  if (itemsize == 8) backward((const double*)grad, (const double*)out, (double*)gx, n, scale, nthreads);
  else backward((const float*)grad, (const float*)out, (float*)gx, n, (float)scale, nthreads);
}
extern "C" void scorch_relu_dropout(const void* x, void* out, int64_t n, uint64_t seed, uint32_t threshold,
                                    double scale, int64_t itemsize, int64_t nthreads) {
  if (itemsize == 8) relu_dropout((const double*)x, (double*)out, n, seed, threshold, scale, nthreads);
  else relu_dropout((const float*)x, (float*)out, n, seed, threshold, (float)scale, nthreads);
}
"""
_kernels = {}
_DTYPES = (torch.float32, torch.float64)


def _scale(p: float) -> float:
    """torch's dropout scale: ``1 / (1 - p)``, 0 for ``p == 1`` (everything dropped)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


@torch.library.custom_op("scorch::relu_dropout", mutates_args=())
def relu_dropout_op(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """``F.dropout(F.relu(x), p, training=True)`` of a float32/float64 CPU ``x``, its mask drawn from ``seed`` (a
    0-d int64 tensor): each element kept with probability ``1 - p``."""
    _check(x, p)
    x = x.contiguous()
    out = torch.empty_like(x)
    threshold = min(int(p * 2.0 ** 32), 2 ** 32 - 1)  # a draw (32 bits) below it is dropped
    _kernel("scorch_relu_dropout", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64,
            ctypes.c_uint32, ctypes.c_double)(x.data_ptr(), out.data_ptr(), x.numel(), int(seed) & (2 ** 64 - 1),
                                              threshold, _scale(p), *_tail(x))
    return out


def _check(x: torch.Tensor, p: float) -> None:
    if x.device.type != "cpu" or x.dtype not in _DTYPES:
        raise ValueError(f"scorch::relu_dropout takes a float32 or float64 CPU tensor, not {x.dtype} on {x.device}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def _kernel(symbol: str, *argtypes):
    """The loaded function ``symbol`` of ``_SOURCE``, whose arguments end with the item size and the threads."""
    k = _kernels.get(symbol)
    if k is None:
        k = _kernels[symbol] = runtime.load(_SOURCE, symbol, [*argtypes, ctypes.c_int64, ctypes.c_int64])
    return k


def _tail(x: torch.Tensor) -> tuple:
    """The kernels' last arguments for ``x``: its item size and the threads (one below 64k elements)."""
    return x.element_size(), torch.get_num_threads() if x.numel() >= 1 << 16 else 1


@torch.library.custom_op("scorch::relu_dropout_backward", mutates_args=())
def relu_dropout_backward(grad: torch.Tensor, out: torch.Tensor, p: float) -> torch.Tensor:
    """The gradient of ``relu_dropout``'s input from its output ``out`` and the output's gradient ``grad``:
    ``grad / (1 - p)`` where ``out`` is positive, else 0."""
    _check(out, p)
    if grad.shape != out.shape or grad.device != out.device:
        raise ValueError(f"scorch::relu_dropout_backward: a gradient of shape {tuple(grad.shape)} on {grad.device} "
                         f"for an output of shape {tuple(out.shape)} on {out.device}")
    grad, out = grad.to(out.dtype).contiguous(), out.contiguous()
    gx = torch.empty_like(out)
    _kernel("scorch_relu_dropout_backward", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_double)(grad.data_ptr(), out.data_ptr(), gx.data_ptr(), out.numel(), _scale(p), *_tail(out))
    return gx


@relu_dropout_backward.register_fake
def _relu_dropout_backward_fake(grad, out, p):
    return torch.empty_like(out)


@relu_dropout_op.register_fake
def _relu_dropout_fake(x, p, seed):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    ctx.p = inputs[1]
    ctx.save_for_backward(output)


def _backward(ctx, grad):
    # torch's dropout backward is grad * mask * scale, ReLU's passes it where its output is positive. An opaque op:
    # written with torch ops, the partitioner computed ``out > 0`` in the forward and kept that bool mask instead
    (out,) = ctx.saved_tensors
    return relu_dropout_backward(grad, out, ctx.p), None, None


relu_dropout_op.register_autograd(_backward, setup_context=_setup_context)


def relu_dropout(h, p: float):
    """``F.dropout(F.relu(h), p, training=True)``, the call ``TrainingPass`` puts in a graph (see the module's
    text)."""
    if not isinstance(h, torch.Tensor) or isinstance(h, SparseTensor) or h.device.type != "cpu" or \
            h.dtype not in _DTYPES:
        return F.dropout(F.relu(h), p, True)
    seed = torch.randint(0, 2 ** 62, (), dtype=torch.int64, device=h.device)
    return relu_dropout_op(h, p, seed)


def _arg(node, k: int, name: str, default=None):
    return node.args[k] if len(node.args) > k else node.kwargs.get(name, default)


def _relu_of(node):
    """The operand of ``node`` where it is an out-of-place ReLU of one tensor, else None."""
    if node.op == "call_method" and node.target == "relu" and len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    if node.op == "call_function" and node.target in (torch.relu, F.relu) and len(node.args) == 1 and \
            set(node.kwargs) <= {"inplace"} and not node.kwargs.get("inplace", False):
        return node.args[0]
    return None


def _has_sparse(graph: torch.fx.Graph) -> bool:
    return any(type(n.meta.get("example_value")) is SparseTensor for n in graph.nodes)


def rewrite(graph: torch.fx.Graph) -> int:
    """Replace ``graph``'s ``F.dropout(F.relu(h), p, training=True)`` by ``relu_dropout(h, p)`` calls (see the
    module's text); the number replaced."""
    if not _has_sparse(graph):
        return 0
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not F.dropout or len(node.args) > 4 or \
                not set(node.kwargs) <= {"input", "p", "training", "inplace"}:
            continue
        source, p = _arg(node, 0, "input"), _arg(node, 1, "p", 0.5)
        if _arg(node, 2, "training", True) is not True or _arg(node, 3, "inplace", False) is not False or \
                type(p) not in (float, int) or not 0 <= p <= 1 or not isinstance(source, torch.fx.Node) or \
                len(source.users) != 1:
            continue
        h = _relu_of(source)
        if not isinstance(h, torch.fx.Node):
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(relu_dropout, (h, float(p)))
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        graph.erase_node(source)
        count += 1
    return count


class TrainingPass(CustomGraphPass):
    """``rewrite`` as an Inductor pre-grad pass; its ``uuid`` (part of Inductor's cache keys) is this module's
    text."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        rewrite(graph)

    def uuid(self):
        return get_hash_for_files((__file__,))


PASS = TrainingPass()


def install() -> None:
    """Put ``PASS`` after the pre-grad passes already set (once), before ``dynamo_fuse``'s: that pass takes a ReLU
    after a sparse-weight linear into its ``fused_linear`` call, which with a gradient is the unfused graph again."""
    passes = list(get_custom_graph_passes(inductor_config.pre_grad_custom_pass))
    if not any(isinstance(p, TrainingPass) for p in passes):
        fuse = sys.modules.get("scorch.dynamo_fuse")  # (mid-import where it brought torch._dynamo in: its pass
        epilogue = getattr(fuse, "EpiloguePass", ())  # is not set yet, and its install() appends it after this)
        at = next((k for k, p in enumerate(passes) if isinstance(p, epilogue)), len(passes))
        passes.insert(at, PASS)
        inductor_config.pre_grad_custom_pass = passes if len(passes) > 1 else PASS


install()

_compile_ready.ready(__name__)  # (last: the ops above exist now)
