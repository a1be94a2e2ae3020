"""The direct convolution's one-kernel form (``compiler.conv_direct.banded``, ``engine.conv_direct._banded``): the
pack, kernel and unpack of a band of output rows of one image in one work item, each thread's buffer and grid its
own. Against dense torch over strides, padding, dilation, kernel sizes, planes, batch sizes, NCHW and channels_last,
bias, and bands of any rows (the engine takes whole images; smaller bands are forced here, so that the kernel's
band offsets are checked too); the policy (``_band_rows``); a kept call replayed; the input gradient, which runs
the forward kernel on the flipped weight."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from conftest import conv_input
from scorch.engine import conv_direct

F = torch.nn.functional


@pytest.fixture(autouse=True)
def _direct(monkeypatch):
    """The direct kernel whatever the CPU (n:4 weights take ``engine.conv_picks`` on AMD CPUs with AVX2)."""
    from scorch.ops import conv
    monkeypatch.setattr(conv, "_picks", lambda *a, **k: None)


def _nm_conv(cin, out, seed):
    """An eval ``Conv2d`` (3 x 3, padding 1, bias) whose weight ``scorch.schedule`` made 2:4."""
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d(cin, out, 3, padding=1).eval()
    s = scorch.schedule(conv)
    s["weight"].sparsify(scorch.nn.NM(2, 4))
    s.apply()
    return conv


def _weight(shape, density, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < density)


@settings(max_examples=40, deadline=None)
@given(out=st.integers(1, 20), cin=st.integers(1, 12), kh=st.integers(1, 5), kw=st.integers(1, 5),
       stride=st.tuples(st.integers(1, 3), st.integers(1, 3)), dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       padding=st.tuples(st.integers(0, 2), st.integers(0, 2)), batch=st.integers(1, 4),
       extra=st.tuples(st.integers(0, 20), st.integers(0, 20)), bias=st.booleans(), cl=st.booleans(),
       density=st.sampled_from([0.0, 0.1, 0.3, 0.6, 1.0]), band=st.integers(1, 30), seed=st.integers(0, 999))
def test_bands_of_any_rows_equal_dense(out, cin, kh, kw, stride, dilation, padding, batch, extra, bias, cl, density,
                                       band, seed):
    w = _weight((out, cin, kh, kw), density, seed)
    x = conv_input(batch, cin, (kh, kw), dilation, padding, extra, cl, seed + 1)
    b = torch.randn(out) if bias else None
    ran = []
    real = conv_direct._banded
    with pytest.MonkeyPatch.context() as mp:
        # (bands of ``band`` rows at most, whatever the policy says: the rows past the image's last are computed on
        #  zeros and not stored)
        mp.setattr(conv_direct, "_band_rows", lambda geometry, *a: min(band, geometry[3]))
        mp.setattr(conv_direct, "_banded", lambda *a, **k: ran.append(1) or real(*a, **k))
        with torch.no_grad():
            y = F.conv2d(x, scorch.asformat(w, "coo"), b, stride, padding, dilation)
    ref = F.conv2d(x, w, b, stride, padding, dilation)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert y.is_contiguous(memory_format=torch.channels_last) == ref.is_contiguous(memory_format=torch.channels_last)
    # (every weight takes the banded form here, unless the planes are joined side by side: weights dense enough
    #  for the shifted planes, on rows too short for them)
    assert ran or int((w != 0).sum()) >= conv_direct.SHIFT_DENSITY * w.numel() and conv_direct._side_by_side_count(
        (out, cin, kh, kw), tuple(x.shape), stride, dilation, ((padding[0],) * 2, (padding[1],) * 2),
        conv_direct._lanes(), conv_direct.SHIFT_SLACK) > 1


def test_whole_images_where_they_fit_and_the_batch_fills_the_threads():
    geometry = conv_direct._geometry((64, 64, 3, 3), (8, 64, 56, 56), (1, 1), (1, 1), ((1, 1), (1, 1)), 16)
    threads = 2
    enough = conv_direct.ITEMS_PER_THREAD * threads
    assert conv_direct._band_rows(geometry, 64, 64, enough, threads, 64) == 56
    assert conv_direct._band_rows(geometry, 64, 64, enough - 1, threads, 64) == 0  # (a thread would idle)
    big = conv_direct._geometry((64, 512, 3, 3), (8, 512, 56, 56), (1, 1), (1, 1), ((1, 1), (1, 1)), 16)
    assert conv_direct._band_rows(big, 512, 64, enough, threads, 64) == 0  # (an image's buffer past BAND_BYTES)


def test_a_batch_layer_runs_banded_kept_and_right(monkeypatch):
    """A 2:4 layer at a batch of ``ITEMS_PER_THREAD`` images a thread: one banded call, kept and replayed on new
    inputs, equal to dense torch; a batch of one takes the three kernels."""
    conv = _nm_conv(16, 24, 0)
    n = conv_direct.ITEMS_PER_THREAD * torch.get_num_threads()
    ran, real = [], conv_direct._banded
    monkeypatch.setattr(conv_direct, "_banded", lambda *a, **k: ran.append(1) or real(*a, **k))
    conv_direct._KEPT.clear()
    dense = conv.weight.to_dense()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(n, 16, 20, 40).contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(conv(x), F.conv2d(x, dense, conv.bias, padding=1), rtol=1e-4, atol=1e-4)
        assert ran == [1] and len(conv_direct._KEPT) == 1
        x = torch.randn(1, 16, 20, 40)
        torch.testing.assert_close(conv(x), F.conv2d(x, dense, conv.bias, padding=1), rtol=1e-4, atol=1e-4)
    assert ran == [1]


@pytest.mark.parametrize("stride", [1, 2])
def test_gradients_through_the_banded_forward(stride, monkeypatch):
    """The input gradient runs the forward kernel on the flipped weight (``engine.conv_grad``): banded too where the
    batch qualifies; the gradients equal dense torch's on the masked weight."""
    monkeypatch.setattr(conv_direct, "ITEMS_PER_THREAD", 0)
    w = _weight((12, 8, 3, 3), 0.5, 3)
    x = torch.randn(3, 8, 15, 13).contiguous(memory_format=torch.channels_last).requires_grad_()
    vals = scorch.asformat(w, "coo").values().detach().clone().requires_grad_()
    s = scorch.asformat(w, "coo").with_values(vals)
    y = F.conv2d(x, s, None, stride, 1)
    xd, wd = x.detach().clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.conv2d(xd, wd, None, stride, 1)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    g = torch.randn(ref.shape)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, xd.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(scorch.asformat(w, "coo").with_values(vals.grad).to_dense(), wd.grad * (w != 0),
                               rtol=1e-4, atol=1e-4)


def test_an_input_copied_first_is_not_kept(monkeypatch):
    """An NCHW input whose rows are not contiguous is copied before the pack: the call is right and not kept (a
    replay would read the caller's tensor with the copy's strides)."""
    monkeypatch.setattr(conv_direct, "ITEMS_PER_THREAD", 0)
    conv = _nm_conv(8, 12, 1)
    conv_direct._KEPT.clear()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8, 10, 60)[..., ::2]
            torch.testing.assert_close(conv(x), F.conv2d(x, conv.weight.to_dense(), conv.bias, padding=1),
                                       rtol=1e-4, atol=1e-4)
    assert not conv_direct._KEPT
