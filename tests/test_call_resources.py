"""What a kernel call takes from the machine: output buffers with huge-page advice (``scorch.engine.memory``) and
the thread count (``engine.bind.call_threads``)."""
from __future__ import annotations

import os

import pytest
import torch

import scorch
from scorch.engine import memory


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _huge_kib(t):
    """AnonHugePages (KiB) of the mappings that hold ``t``'s memory."""
    lo, hi, total, inside = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@pytest.mark.parametrize("make", [memory.empty, memory.zeros])
@pytest.mark.parametrize("shape", [(0,), (3, 5), (1024, 2048)])
def test_buffers_are_plain_tensors(make, shape):
    t = make(shape, torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    if make is memory.zeros:
        assert not t.any()


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always") or not os.path.exists("/proc/self/smaps"),
                    reason="transparent huge pages are off here")
def test_large_outputs_get_huge_pages():
    """A large SpMM output is faulted in 2 MiB pages (checked in /proc/self/smaps), and its values are right."""
    s = scorch.asformat(torch.eye(4096)[:, :2048].contiguous(), "csr")
    x = torch.randn(2048, 1024)
    y = s @ x                            # 16 MiB of float32
    assert torch.equal(y[:2048], x) and not y[2048:].any()
    assert _huge_kib(y) >= 2048, _huge_kib(y)


def test_small_calls_run_on_one_thread(monkeypatch):
    """A prepared call below ``SMALL_WORK`` multiply-adds passes one thread to its kernel; a larger one torch's
    thread count; both give the dense result."""
    from scorch.engine import bind
    assert bind.call_threads(bind.SMALL_WORK - 1) == 1
    assert bind.call_threads(bind.SMALL_WORK) == torch.get_num_threads()
    seen = []
    real = bind.call_threads
    monkeypatch.setattr(bind, "call_threads", lambda work: seen.append(work) or real(work))
    a = torch.randn(300, 200) * (torch.rand(300, 200) < 0.1)
    s = scorch.asformat(a, "csr")
    for k in (4, 4096):
        x = torch.randn(200, k)
        for _ in range(2):  # (a signature's first call may plan instead)
            torch.testing.assert_close(s @ x, a @ x)
    assert s.nnz * 4 in seen and s.nnz * 4096 in seen, seen
