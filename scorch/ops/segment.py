"""Softmax over the segments of a compressed level: the softmax of a CSR matrix along its rows (of CSC along
its columns, of any format whose last level is compressed and stores the softmax dimension). A segment is one
``[pos[s], pos[s + 1])`` range of the values array, so the kernel walks the values in place: no coordinates,
no sort, one pass for the maximum, one for the sum, one to normalize, parallel over segments.

The backward pass is a kernel too: ``dx = y * (dy - sum(dy * y))`` (softmax) or ``dx = dy - exp(y) * sum(dy)``
(log-softmax), per segment.
"""
from __future__ import annotations

import ctypes

import torch

from ..compiler import runtime
from ..compiler.codegen.cpp import EXPF

_SOURCE = r"""
#include <cstdint>
#include <cmath>
#include <limits>
""" + EXPF + r"""
static inline float scorch_exp(float x) { return scorch_expf(x); }
static inline double scorch_exp(double x) { return std::exp(x); }
template <typename T, typename I>
static void forward(const I* __restrict__ pos, const T* __restrict__ x, T* __restrict__ y, int64_t segments,
                    int64_t log_space, int64_t nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 64)
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t lo = pos[s], hi = pos[s + 1];
    if (lo >= hi) continue;
    T peak = -std::numeric_limits<T>::infinity();
    #pragma omp simd reduction(max:peak)
    for (int64_t p = lo; p < hi; ++p) peak = x[p] > peak ? x[p] : peak;
    if (!(peak > -std::numeric_limits<T>::infinity())) peak = 0;  // all -inf (or NaN): as torch, NaN out
    T total = 0;
    #pragma omp simd reduction(+:total)
    for (int64_t p = lo; p < hi; ++p) { const T e = scorch_exp(x[p] - peak); y[p] = e; total += e; }
    if (log_space) {
      const T shift = peak + std::log(total);
      for (int64_t p = lo; p < hi; ++p) y[p] = x[p] - shift;
    } else {
      const T inv = T(1) / total;
      for (int64_t p = lo; p < hi; ++p) y[p] *= inv;
    }
  }
}
template <typename T, typename I>
static void backward(const I* __restrict__ pos, const T* __restrict__ y, const T* __restrict__ dy,
                     T* __restrict__ dx, int64_t segments, int64_t log_space, int64_t nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 64)
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t lo = pos[s], hi = pos[s + 1];
    T acc = 0;
    if (log_space) {
      for (int64_t p = lo; p < hi; ++p) acc += dy[p];
      for (int64_t p = lo; p < hi; ++p) dx[p] = dy[p] - std::exp(y[p]) * acc;
    } else {
      for (int64_t p = lo; p < hi; ++p) acc += dy[p] * y[p];
      for (int64_t p = lo; p < hi; ++p) dx[p] = y[p] * (dy[p] - acc);
    }
  }
}
extern "C" void scorch_segment_softmax(const void* pos, const void* x, void* y, int64_t segments, int64_t log_space,
                                       int64_t dbl, int64_t wide, int64_t nthreads) {
  if (dbl) {
    if (wide) forward((const int64_t*)pos, (const double*)x, (double*)y, segments, log_space, nthreads);
    else forward((const int32_t*)pos, (const double*)x, (double*)y, segments, log_space, nthreads);
  } else {
    if (wide) forward((const int64_t*)pos, (const float*)x, (float*)y, segments, log_space, nthreads);
    else forward((const int32_t*)pos, (const float*)x, (float*)y, segments, log_space, nthreads);
  }
}
extern "C" void scorch_segment_softmax_backward(const void* pos, const void* y, const void* dy, void* dx,
                                                int64_t segments, int64_t log_space, int64_t dbl, int64_t wide,
                                                int64_t nthreads) {
  if (dbl) {
    if (wide) backward((const int64_t*)pos, (const double*)y, (const double*)dy, (double*)dx, segments, log_space, nthreads);
    else backward((const int32_t*)pos, (const double*)y, (const double*)dy, (double*)dx, segments, log_space, nthreads);
  } else {
    if (wide) backward((const int64_t*)pos, (const float*)y, (const float*)dy, (float*)dx, segments, log_space, nthreads);
    else backward((const int32_t*)pos, (const float*)y, (const float*)dy, (float*)dx, segments, log_space, nthreads);
  }
}
"""
_kernels: dict = {}
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _kernel(name):
    k = _kernels.get(name)
    if k is None:
        args = [_P] * (3 if name == "scorch_segment_softmax" else 4) + [_I] * 5
        k = _kernels[name] = runtime.load(_SOURCE, name, args)
    return k


SUPPORTED = (torch.float32, torch.float64)


def _check(pos, values):
    if values.dtype not in SUPPORTED or pos.dtype not in (torch.int32, torch.int64) or values.device.type != "cpu":
        raise TypeError("segment softmax: float32/float64 values and int32/int64 positions on the CPU")


class SegmentSoftmax(torch.autograd.Function):
    """``softmax`` (or ``log_softmax``) of ``values`` within each segment ``[pos[s], pos[s + 1])``."""

    @staticmethod
    def forward(ctx, values, pos, log_space):
        values = values.contiguous()
        ctx.log_space = log_space
        if values.device.type != "cpu":  # on a GPU: torch's segment reductions
            y = _forward_ops(values, pos, log_space)
            ctx.save_for_backward(y, pos)
            return y
        _check(pos, values)
        y = torch.empty_like(values)
        _kernel("scorch_segment_softmax")(pos.data_ptr(), values.data_ptr(), y.data_ptr(), pos.numel() - 1,
                                          int(log_space), int(values.dtype == torch.float64),
                                          int(pos.dtype == torch.int64), torch.get_num_threads())
        ctx.save_for_backward(y, pos)
        ctx.log_space = log_space
        return y

    @staticmethod
    def backward(ctx, dy):
        y, pos = ctx.saved_tensors
        return softmax_backward(y, dy, pos, ctx.log_space), None, None


def softmax_backward(y, dy, pos, log_space=False):
    """The gradient of the segment softmax's input from its output ``y`` and the output's gradient ``dy``."""
    if torch.is_grad_enabled() or y.device.type != "cpu":  # double backward, or a GPU: torch ops, differentiable
        return _backward_ops(y, dy, pos, log_space)
    dy = dy.contiguous()
    dx = torch.empty_like(y)
    _kernel("scorch_segment_softmax_backward")(pos.data_ptr(), y.data_ptr(), dy.data_ptr(), dx.data_ptr(),
                                               pos.numel() - 1, int(log_space), int(y.dtype == torch.float64),
                                               int(pos.dtype == torch.int64), torch.get_num_threads())
    return dx


def _forward_ops(x, pos, log_space):
    """The forward pass in torch ops (any device): per segment, subtract the maximum, exponentiate, normalize."""
    seg = _segment_of_each(pos)
    if x.numel() == 0:
        return x.clone()
    peak = torch.full((pos.numel() - 1,), float("-inf"), dtype=x.dtype, device=x.device)
    peak = peak.scatter_reduce(0, seg, x, "amax")
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # an all -inf segment: NaN out
    shifted = x - peak[seg]
    total = torch.zeros_like(peak).index_add(0, seg, shifted.exp())
    if log_space:
        return shifted - total.log()[seg]
    return shifted.exp() / total[seg]


def _segment_of_each(pos):
    """The segment index of every value: ``s`` repeated ``pos[s + 1] - pos[s]`` times."""
    return torch.repeat_interleave(torch.arange(pos.numel() - 1, device=pos.device), pos.diff())


def _backward_ops(y, dy, pos, log_space):
    seg = _segment_of_each(pos)
    total = torch.zeros(pos.numel() - 1, dtype=y.dtype, device=y.device)
    if log_space:
        return dy - y.exp() * total.index_add(0, seg, dy)[seg]
    return y * (dy - total.index_add(0, seg, dy * y)[seg])


def softmax(values: torch.Tensor, pos: torch.Tensor, log_space: bool = False) -> torch.Tensor:
    """Softmax of ``values`` within each segment of ``pos`` (differentiable)."""
    return SegmentSoftmax.apply(values, pos, log_space)
