"""Convolutions with a sparse weight (``scorch.ops.conv``) and conv weights in ``scorch.schedule``: values, input
gradients and weight gradients (on the pattern) against dense torch on the masked weight, for conv1d/2d/3d in
CSR, BSR and n:m; a small CNN trained 3 steps; state_dict round trips; ResNet-18 at 90% CSR."""
import copy
import io

import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch.nn import NM, BlockFraction, ScalarFraction

CONVS = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}
FUNCS = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}


def _schedule(model, names, kind):
    """Schedule the weights ``names`` of ``model`` in the format ``kind`` (csr, bsr, nm) and apply."""
    s = scorch.schedule(model)
    for name in names:
        if kind == "csr":
            s[name].sparsify(ScalarFraction(0.6)).set_format("csr")
        elif kind == "bsr":
            s[name].sparsify(BlockFraction(0.5, block=(2, 2))).block(2, 2)
        else:
            s[name].sparsify(NM(2, 4))
    return s.apply()


def _mask(p):
    """The stored positions of a sparse parameter, as a dense bool tensor of its shape."""
    return p.detach().with_values(torch.ones_like(p.detach().values())).to_dense() != 0


@settings(max_examples=40, deadline=None)
@given(d=st.sampled_from([1, 2, 3]), kind=st.sampled_from(["csr", "bsr", "nm"]), groups=st.sampled_from([1, 2]),
       og=st.integers(1, 3), cg=st.integers(1, 3), k=st.integers(1, 3), stride=st.integers(1, 2),
       dilation=st.integers(1, 2), padding=st.sampled_from([0, 1, 2, "same", "valid"]), batch=st.integers(1, 2),
       bias=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_conv_matches_dense(d, kind, groups, og, cg, k, stride, dilation, padding, batch, bias, seed):
    if padding == "same":
        stride = 1
    if kind == "nm":
        cg = 4  # (the matrix view's rows need a multiple of 4 entries)
    if kind == "bsr":
        og = 2  # (block rows inside one group)
    torch.manual_seed(seed)
    conv = CONVS[d](cg * groups, og * groups, k, stride=stride, padding=padding, dilation=dilation, groups=groups,
                    bias=bias)
    dense = copy.deepcopy(conv)
    _schedule(conv, ["weight"], kind)
    w = conv.weight
    assert isinstance(w, scorch.SparseTensor) and tuple(w.shape) == tuple(dense.weight.shape)
    mask = _mask(w)
    with torch.no_grad():
        dense.weight.copy_(w.to_dense())
    assert torch.equal(dense.weight * mask, dense.weight)
    size = dilation * (k - 1) + 1 + 2
    x = torch.randn(batch, cg * groups, *(size + i for i in range(d)), requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with scorch.strict():
        y = conv(x)
    yr = dense(xr)
    assert y.shape == yr.shape
    torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-5)
    gy = torch.randn_like(yr)
    (y * gy).sum().backward()
    (yr * gy).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    g = w.grad
    assert isinstance(g, scorch.SparseTensor)
    torch.testing.assert_close(g.to_dense(), dense.weight.grad * mask, rtol=1e-4, atol=1e-5)
    if bias:
        torch.testing.assert_close(conv.bias.grad, dense.bias.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["csr", "bsr", "nm"])
def test_functional_conv_unbatched_and_channels_last(kind):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 6, 3, padding=1)
    _schedule(conv, ["weight"], kind)
    w, b = conv.weight, conv.bias
    # the matrix view is (out, kh * kw * in), channels innermost, and runs in the scheduled format
    view = scorch.ops.conv.matrix_view(w)
    assert scorch.nn.schedule.named.name_of(view.format) == {"csr": "csr", "bsr": "bsr(2, 2)", "nm": "nm(2, 4)"}[kind]
    torch.testing.assert_close(view.to_dense(), w.detach().to_dense().movedim(1, -1).reshape(6, 72))
    if kind == "nm":  # 2 of every 4 input channels at each kernel position
        assert torch.equal(_mask(w).movedim(1, -1).reshape(6, 18, 4).sum(-1), torch.full((6, 18), 2))
    x = torch.randn(2, 8, 9, 7)
    ref = torch.nn.functional.conv2d(x, w.detach().to_dense(), b, padding=1)
    torch.testing.assert_close(torch.conv2d(x, w, b, 1, 1), ref, rtol=1e-4, atol=1e-5)
    cl = x.to(memory_format=torch.channels_last)
    torch.testing.assert_close(torch.nn.functional.conv2d(cl, w, b, padding=1), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.nn.functional.conv2d(x[0], w, b, padding=1), ref[0], rtol=1e-4, atol=1e-5)


def test_depthwise_and_float64():
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(6, 12, 3, padding="same", groups=6).double()
    dense = copy.deepcopy(conv)
    _schedule(conv, ["weight"], "csr")
    with torch.no_grad():
        dense.weight.copy_(conv.weight.to_dense())
    x = torch.randn(2, 6, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(conv(x), dense(x))


def test_bad_arguments_raise():
    conv = torch.nn.Conv2d(4, 6, 3)
    _schedule(conv, ["weight"], "csr")
    w = conv.weight
    F = torch.nn.functional
    with pytest.raises(ValueError, match="channels"):
        F.conv2d(torch.randn(1, 5, 8, 8), w)
    with pytest.raises(ValueError, match="groups"):
        F.conv2d(torch.randn(1, 4, 8, 8), w, groups=4)
    with pytest.raises(ValueError, match="strided"):
        F.conv2d(torch.randn(1, 4, 8, 8), w, stride=2, padding="same")
    with pytest.raises(ValueError, match="smaller than"):
        F.conv2d(torch.randn(1, 4, 2, 2), w)
    with pytest.raises(ValueError, match="4-d"):
        F.conv2d(torch.randn(1, 4, 8, 8), scorch.asformat(torch.randn(6, 36), "csr"))


def test_schedule_formats_and_refusals():
    conv = torch.nn.Conv2d(3, 4, 3)  # the matrix view is 4 x 27
    s = scorch.schedule(conv)
    assert scorch.nn.schedule.named.name_of(s["weight"].set_format("csr").formats["weight"]) == "csr"
    with pytest.raises(ValueError, match="2-d"):  # a transposed conv has no matrix view: its weight is 4-d
        scorch.schedule(torch.nn.ConvTranspose2d(4, 4, 3))["weight"].set_format("csr")
    s = scorch.schedule(conv)
    s["weight"].sparsify(NM(2, 4))  # 27 columns: not a multiple of 4
    with pytest.raises(ValueError, match="27"):
        s.apply()
    assert type(conv.weight) is torch.nn.Parameter
    s = scorch.schedule(conv)
    s["weight"].sparsify(ScalarFraction(0.5)).set_format("coo")  # any 2-d format: COO runs through einsum
    s.apply()
    x = torch.randn(1, 3, 6, 6)
    torch.testing.assert_close(conv(x), torch.nn.functional.conv2d(x, conv.weight.to_dense(), conv.bias))
    conv = torch.nn.Conv2d(4, 4, 3)
    s = scorch.schedule(conv)
    s["weight"].sparsify(ScalarFraction(0.7)).set_format("bsr(2, 4)")  # elementwise mask, stored in blocks
    s.apply()
    view = scorch.ops.conv.matrix_view(conv.weight)
    assert scorch.nn.schedule.named.name_of(view.format) == "bsr(2, 4)"
    assert conv.weight.nnz == view.nnz  # (the blocks' zeros stay stored: the gradient covers whole blocks)
    x = torch.randn(2, 4, 6, 6)
    torch.testing.assert_close(conv(x), torch.nn.functional.conv2d(x, conv.weight.to_dense(), conv.bias),
                               rtol=1e-4, atol=1e-5)


def _steps(pairs, masks, batches):
    """An optimizer step of each ``(model, optimizer)`` pair per batch ``(x, target)``, the second pair's model (the
    dense reference) with its gradients masked by ``masks`` (by parameter name)."""
    for x, t in batches:
        for m, op in pairs:
            op.zero_grad()
            torch.nn.functional.cross_entropy(m(x), t).backward()
        for n, mask in masks.items():
            pairs[1][0].get_parameter(n).grad *= mask
        for _, op in pairs:
            op.step()


def small_cnn(seed=0):
    # (no conv bias before a BatchNorm: its gradient is ~0, rounding noise that Adam's normalization magnifies)
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 5))


@pytest.mark.parametrize("kind,opt", [("csr", "adam"), ("bsr", "sgd"), ("nm", "adam")])
def test_small_cnn_training_matches_masked_dense(kind, opt):
    model = small_cnn()
    names = ["0.weight", "3.weight"] if kind != "nm" else ["3.weight"]
    ref = copy.deepcopy(model)
    _schedule(model, names, kind)
    masks = {n: _mask(p) for n, p in model.named_parameters() if isinstance(p, scorch.SparseTensor)}
    assert set(masks) == set(names)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n in masks:
                p.copy_(dict(model.named_parameters())[n].to_dense())

    def make(m):
        return torch.optim.Adam(m.parameters(), lr=1e-2) if opt == "adam" else \
            torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)
    gen = torch.Generator().manual_seed(3)
    _steps(((model, make(model)), (ref, make(ref))), masks,
           [(torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen)) for _ in range(3)])
    params = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        q = params[n]
        got = q.detach().to_dense() if isinstance(q, scorch.SparseTensor) else q.detach()
        torch.testing.assert_close(got, p.detach(), rtol=1e-4, atol=1e-5)
        if n in masks:
            assert isinstance(q, scorch.SparseTensor) and torch.equal(_mask(q), masks[n])


def test_state_dict_round_trip():
    model = small_cnn()
    _schedule(model, ["0.weight", "3.weight"], "csr")
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    y = model(x)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    other = small_cnn(seed=5)
    _schedule(other, ["0.weight", "3.weight"], "csr")
    other.load_state_dict(sd)
    other.eval()
    torch.testing.assert_close(other(x), y)
    dense = small_cnn(seed=7)
    dense.load_state_dict({k: v.to_dense() if isinstance(v, scorch.SparseTensor) else v for k, v in sd.items()})
    dense.eval()
    torch.testing.assert_close(dense(x), y, rtol=1e-4, atol=1e-5)
    assert tuple(sd["0.weight"].to_dense().shape) == (8, 3, 3, 3)


def test_summary_names_the_matrix_view_format():
    model = small_cnn()
    s = scorch.schedule(model)
    s["3.weight"].sparsify(BlockFraction(0.5, block=(2, 2))).block(2, 2)
    s.apply()
    row = [r for r in s.summary(print_it=False) if r["name"] == "3.weight"][0]
    assert row["shape"] == (8, 8, 3, 3) and "matrix view" in row["format"] and "bsr" in row["format"]


def test_resnet18_every_conv_csr_90_matches_masked_dense():
    from benchmarks.resnet import resnet18
    torch.manual_seed(0)
    model = resnet18(num_classes=10).eval()
    ref = copy.deepcopy(model)
    convs = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 20
    s = scorch.schedule(model)
    for n in convs:
        s[f"{n}.weight"].sparsify(ScalarFraction(0.9)).set_format("csr")
    s.apply()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in convs:
            w = params[f"{n}.weight"]
            assert isinstance(w, scorch.SparseTensor) and w.density <= 0.11
            ref.get_parameter(f"{n}.weight").copy_(w.to_dense())
    x = torch.randn(1, 3, 32, 32)
    with scorch.strict():
        y = model(x)
    yr = ref(x)
    torch.testing.assert_close(y, yr, rtol=1e-3, atol=1e-4)
    y.square().sum().backward()
    yr.square().sum().backward()
    for n in convs[:3] + convs[-3:]:
        w = params[f"{n}.weight"]
        r = ref.get_parameter(f"{n}.weight")
        torch.testing.assert_close(w.grad.to_dense(), r.grad * _mask(w), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(model.fc.weight.grad, ref.fc.weight.grad, rtol=1e-3, atol=1e-4)


def test_dynamic_pattern_follows_the_steps():
    from scorch.nn import RandomFraction
    torch.manual_seed(2)
    conv = torch.nn.Conv2d(4, 8, 3, padding=1)
    s = scorch.schedule(conv)
    s["weight"].sparsify(RandomFraction(0.5, seed=0), dynamic=True).set_format("csr")
    s.apply()
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    s.attach(opt)
    x = torch.randn(2, 4, 6, 6)
    masks = [_mask(conv.weight)]
    for _ in range(2):
        opt.zero_grad()
        conv(x).square().sum().backward()
        opt.step()
        masks.append(_mask(conv.weight))
        # the convolution reads the new pattern (its matrix view is rebuilt), values as the dense weight's
        torch.testing.assert_close(conv(x), torch.nn.functional.conv2d(x, conv.weight.detach().to_dense(), conv.bias,
                                                                       padding=1), rtol=1e-4, atol=1e-5)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    assert all(int(m.sum()) == 144 for m in masks)
    assert scorch.nn.schedule.named.name_of(conv.weight.__dict__["_view_format"]) == "csr"


def test_inference_sees_values_changed_in_place():
    torch.manual_seed(4)
    conv = torch.nn.Conv1d(4, 4, 3, bias=False)
    _schedule(conv, ["weight"], "csr")
    x = torch.randn(2, 4, 9)
    with torch.no_grad():
        y1 = conv(x)
        torch.testing.assert_close(conv(x), y1)  # (the view's values kept)
        conv.weight.values().mul_(2)  # (a new version of the same values tensor)
        torch.testing.assert_close(conv(x), 2 * y1)
        conv.weight.copy_(conv.weight.detach().with_values(torch.ones(conv.weight.nnz)))
        torch.testing.assert_close(conv(x), torch.nn.functional.conv1d(x, _mask(conv.weight).float()))


def test_any_sparse_weight_runs_as_csr_view():
    # a 4-d weight made by scorch.asformat (no schedule, no recorded view format): its view is CSR
    torch.manual_seed(5)
    w = torch.randn(6, 2, 3, 3) * (torch.rand(6, 2, 3, 3) > 0.7)
    S = scorch.asformat(w, "csf").requires_grad_()
    x = torch.randn(1, 4, 7, 7, requires_grad=True)
    with scorch.strict():
        y = torch.nn.functional.conv2d(x, S, None, 1, 1, 1, 2)
    xr, wr = x.detach().requires_grad_(), w.clone().requires_grad_()
    yr = torch.nn.functional.conv2d(xr, wr, None, 1, 1, 1, 2)
    torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-5)
    assert scorch.nn.schedule.named.name_of(scorch.ops.conv.matrix_view(S, 2).format) == "csr"
    y.sum().backward()
    yr.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S.grad.to_dense(), wr.grad * (w != 0), rtol=1e-4, atol=1e-5)


def test_a_view_that_does_not_fit_its_format_runs_as_csr():
    w = torch.zeros(2, 4, 1, 1)
    w[0, :3] = 1.0  # 3 of 4 input channels: not 2:4
    w[1, 1] = 2.0
    S = scorch.asformat(w, "coo")
    S.__dict__["_view_format"] = scorch.nn.schedule.named.nm(2, 4)
    assert scorch.nn.schedule.named.name_of(scorch.ops.conv.matrix_view(S).format) == "csr"
    x = torch.randn(1, 4, 3, 3)
    torch.testing.assert_close(torch.nn.functional.conv2d(x, S), torch.nn.functional.conv2d(x, w))


@pytest.mark.parametrize("kind", ["bsr", "nm"])
def test_resnet18_every_conv_trains_as_the_masked_dense_model(kind):
    """ResNet-18 with every conv weight bsr(16, 16) at 75% (the 7 x 7 stem's view, 147 columns, runs as CSR) or 2:4
    (the stem refused: 147 is not a multiple of 4): three SGD steps equal the masked dense model's, and the state
    dict loads into a dense ResNet-18 giving the same outputs. (BatchNorm in eval mode: batch statistics of 2
    samples at the last stage's 1 x 1 maps turn rounding differences into 4% gradient differences.)"""
    from benchmarks.resnet import resnet18
    torch.manual_seed(1)
    model = resnet18(num_classes=10).eval()
    ref = copy.deepcopy(model)
    convs = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    if kind == "nm":
        stem = scorch.schedule(copy.deepcopy(model))
        stem["conv1.weight"].sparsify(NM(2, 4))
        with pytest.raises(ValueError, match="147, not a multiple of 4"):
            stem.apply()
        convs.remove("conv1")
    s = scorch.schedule(model)
    for n in convs:
        if kind == "bsr":
            s[f"{n}.weight"].sparsify(BlockFraction(0.75, block=(16, 16))).block(16, 16)
        else:
            s[f"{n}.weight"].sparsify(NM(2, 4))
    s.apply()
    params = dict(model.named_parameters())
    masks = {f"{n}.weight": _mask(params[f"{n}.weight"]) for n in convs}
    with torch.no_grad():
        for n in masks:
            ref.get_parameter(n).copy_(params[n].to_dense())
    gen = torch.Generator().manual_seed(2)
    _steps([(m, torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)) for m in (model, ref)], masks,
           [(torch.randn(2, 3, 32, 32, generator=gen), torch.randint(0, 10, (2,), generator=gen)) for _ in range(3)])
    for n, p in ref.named_parameters():
        q = params[n].detach()
        torch.testing.assert_close(q.to_dense() if n in masks else q, p.detach(), rtol=1e-3, atol=1e-4)
    dense = resnet18(num_classes=10)
    dense.load_state_dict({k: v.to_dense() if isinstance(v, scorch.SparseTensor) else v
                           for k, v in model.state_dict().items()})
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(dense.eval()(x), model(x), rtol=1e-3, atol=1e-4)
