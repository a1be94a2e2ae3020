"""An eager sparse-weight ``F.conv2d`` without gradients makes its pack, kernel and unpack calls again from the calls
the first one kept (``engine.conv_direct.kept_key`` / ``run_kept``): later calls skip the geometry, the plan, the
memos and the arguments' binding, read the new input, see the weight and the bias changed in place, take a new
entry for a new input shape, layout, thread count or module setting, and a call that needs gradients, splits its
batch into groups or joins images side by side is not kept (and is right)."""
import threading

import pytest
import torch

import scorch
from scorch.engine import conv_direct

F = torch.nn.functional


@pytest.fixture(autouse=True, params=["banded", "three calls"])
def _direct(monkeypatch, request):
    """Every convolution here on the direct kernel, whatever the CPU (n:4 weights take ``engine.conv_picks`` where
    the CPU takes its rows-in-lanes kernel: AMD with AVX2), whose calls are the ones kept: a dense enough weight's
    one banded call (every batch in bands here) or its pack, kernel and unpack."""
    from scorch.ops import conv
    monkeypatch.setattr(conv, "_picks", lambda *a, **k: None)
    if request.param == "banded":  # (any batch: its images a thread at least 0)
        monkeypatch.setattr(conv_direct, "ITEMS_PER_THREAD", 0)
    else:
        monkeypatch.setattr(conv_direct, "BAND_BYTES", 0)


def _conv(sparsifier, cin=8, out=12, k=3, stride=1, padding=1, bias=True, seed=0):
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d(cin, out, k, stride=stride, padding=padding, bias=bias).eval()
    s = scorch.schedule(conv)
    s.regex("weight").sparsify(sparsifier)
    s.apply()
    return conv


def _dense(conv, x):
    return F.conv2d(x, conv.weight.to_dense(), conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)


def _packs(monkeypatch):
    """A list that records each input buffer packed the long way (``_buffer``, ``_banded``: a call not made from a
    kept one)."""
    packs = []
    for name in ("_buffer", "_banded"):
        real = getattr(conv_direct, name)
        monkeypatch.setattr(conv_direct, name, lambda *a, real=real, **k: packs.append(1) or real(*a, **k))
    return packs


SPARSIFIERS = [scorch.nn.NM(2, 4), scorch.nn.ScalarFraction(0.8)]


@pytest.mark.parametrize("sparsifier", SPARSIFIERS, ids=["2:4", "80%"])
@pytest.mark.parametrize("stride, cl", [(1, True), (1, False), (2, True)])
def test_later_calls_replay_the_kept_calls_on_the_new_input(sparsifier, stride, cl, monkeypatch):
    conv = _conv(sparsifier, stride=stride)
    conv_direct._KEPT.clear()
    packs = _packs(monkeypatch)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 8, 11, 13)
            x = x.contiguous(memory_format=torch.channels_last) if cl else x
            y = conv(x)
            torch.testing.assert_close(y, _dense(conv, x), rtol=1e-4, atol=1e-5)
            assert y.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
    assert len(conv_direct._KEPT) == 1 and len(packs) == 1


def test_a_weight_or_bias_changed_in_place_is_seen():
    conv = _conv(scorch.nn.NM(2, 4))
    x = torch.randn(2, 8, 9, 9)
    with torch.no_grad():
        conv(x)
        conv.weight._vals.mul_(-2.0)
        torch.testing.assert_close(conv(x), _dense(conv, x), rtol=1e-4, atol=1e-5)
        conv.bias.add_(1.0)
        torch.testing.assert_close(conv(x), _dense(conv, x), rtol=1e-4, atol=1e-5)
        conv.weight = torch.nn.Parameter(scorch.asformat(torch.randn(12, 8, 3, 3) * (torch.rand(12, 8, 3, 3) < 0.3),
                                                         "coo"), requires_grad=False)
        torch.testing.assert_close(conv(x), _dense(conv, x), rtol=1e-4, atol=1e-5)


def test_a_new_shape_layout_thread_count_or_setting_is_its_own_entry(monkeypatch):
    conv = _conv(scorch.nn.NM(2, 4))
    conv_direct._KEPT.clear()
    threads = torch.get_num_threads()
    x = torch.randn(1, 8, 10, 10)  # (one image: several may be joined side by side, which is not kept)
    inputs = [x, torch.randn(1, 8, 7, 10), x.contiguous(memory_format=torch.channels_last), x[:, :, :, 1:]]
    try:
        with torch.no_grad():
            for t in (1, 2):
                torch.set_num_threads(t)
                for x in inputs + inputs:
                    torch.testing.assert_close(conv(x), _dense(conv, x), rtol=1e-4, atol=1e-5)
            monkeypatch.setattr(conv_direct, "CHUNK_BYTES", 64)  # (the kernels' channel chunks: new offsets)
            packs = _packs(monkeypatch)
            torch.testing.assert_close(conv(inputs[0]), _dense(conv, inputs[0]), rtol=1e-4, atol=1e-5)
            assert packs == [1]
    finally:
        torch.set_num_threads(threads)
    assert len(conv_direct._KEPT) == 9


def test_calls_that_need_gradients_or_are_several_are_not_kept(monkeypatch):
    conv = _conv(scorch.nn.NM(2, 4))
    conv_direct._KEPT.clear()
    x = torch.randn(2, 8, 9, 9, requires_grad=True)
    for _ in range(2):
        conv(x).sum().backward()
    assert not conv_direct._KEPT
    xd = x.detach().clone().requires_grad_()
    _dense(conv, xd).sum().backward()
    torch.testing.assert_close(x.grad, 2 * xd.grad, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(conv_direct, "BUFFER_BYTES", 1)  # (one image a group: a call per image)
    monkeypatch.setattr(conv_direct, "PARALLEL_BUFFER_BYTES", 1)
    monkeypatch.setattr(conv_direct, "BAND_BYTES", 0)  # (the three kernels' groups: one banded call is kept)
    x = torch.randn(3, 8, 9, 9)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(conv(x), _dense(conv, x), rtol=1e-4, atol=1e-5)
    assert not conv_direct._KEPT


def test_images_side_by_side_are_right_and_not_kept():
    conv = _conv(scorch.nn.NM(2, 4), cin=16, out=16)
    conv_direct._KEPT.clear()
    x = torch.randn(4, 16, 3, 3).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(conv(x), _dense(conv, x), rtol=1e-4, atol=1e-5)
    joined = conv_direct._side_by_side_count((16, 16, 3, 3), (4, 16, 3, 3), (1, 1), (1, 1), ((1, 1), (1, 1)),
                                             conv_direct._lanes(), conv_direct.SHIFT_SLACK) > 1
    assert len(conv_direct._KEPT) == (0 if joined else 1)


def test_arrays_made_in_inference_mode_are_not_kept():
    w = torch.randn(12, 8, 3, 3) * (torch.rand(12, 8, 3, 3) < 0.5)
    with torch.inference_mode():
        S = scorch.asformat(w, "coo")
        conv_direct._KEPT.clear()
        x = torch.randn(1, 8, 6, 6)
        for _ in range(2):
            torch.testing.assert_close(F.conv2d(x, S, None, 1, 1), F.conv2d(x, w, None, 1, 1), rtol=1e-4,
                                       atol=1e-5)
    assert not conv_direct._KEPT


def test_threads_share_a_kept_call_with_their_own_workspaces():
    """Two Python threads running the same layer at once: each call packs into its own thread's buffer."""
    conv = _conv(scorch.nn.NM(2, 4), cin=16, out=16)
    conv_direct._KEPT.clear()
    inputs = [torch.randn(1, 16, 20, 20) for _ in range(4)]
    want = [_dense(conv, x) for x in inputs]
    errors = []

    def work(k):
        try:
            with torch.no_grad():
                for _ in range(20):
                    torch.testing.assert_close(conv(inputs[k]), want[k], rtol=1e-4, atol=1e-5)
        except AssertionError as e:
            errors.append(e)
    with torch.no_grad():
        conv(inputs[0])
    assert len(conv_direct._KEPT) == 1
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_weight_changing_between_calls_is_kept_again_once_it_stops(monkeypatch):
    """Calls without gradients between which the weight changes in place (a compiled training step's forward) stop
    keeping their calls after ``CHANGES`` stale entries, and keep them again once two calls in a row see the same
    weight; every result right."""
    conv = _conv(scorch.nn.NM(2, 4))
    conv_direct._KEPT.clear()
    packs = _packs(monkeypatch)
    x = torch.randn(1, 8, 9, 9)
    kept = []
    with torch.no_grad():
        for step in range(8):
            torch.testing.assert_close(conv(x), _dense(conv, x), rtol=1e-4, atol=1e-5)
            kept.append(len(conv_direct._KEPT))
            if step < 5:
                conv.weight._vals.mul_(0.9)
    assert kept == [1, 1, 0, 0, 0, 0, 1, 1]  # (kept, stale and kept again, then skipped; stable again: kept)
    assert len(packs) == 7
