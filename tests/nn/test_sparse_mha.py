"""nn.MultiheadAttention and nn.TransformerEncoder with sparse attention weights (``scorch.schedule``), against
the same modules holding the masked dense weights: values, input gradients, weight gradients on the pattern,
optimizer steps, state_dict, eval mode; and a sparse ``attn_mask`` against its dense equivalent."""
import copy
import io

import pytest
import torch

import scorch

F64 = torch.float64
FORMATS = ["csr", "bsr", "nm"]


def _schedule(model, names, fmt, sparsity=0.6):
    s = scorch.schedule(model)
    for name in names:
        sel = s[name]
        if fmt == "nm":
            sel.sparsify(scorch.nn.NM(2, 4))
        elif fmt == "bsr":
            sel.sparsify(scorch.nn.ScalarFraction(sparsity)).block(16, 16)
        else:
            sel.sparsify(scorch.nn.ScalarFraction(sparsity)).set_format("csr")
    s.apply()
    return s


def _pattern(w):
    """Where the sparse weight ``w`` stores an entry (a block format's zeros inside a block included)."""
    return w.detach().with_values(torch.ones_like(w.detach().values())).to_dense() != 0


def _sparse_pair(make, names, fmt):
    """``(sparse, dense)``: a module from ``make`` scheduled sparse on ``names``, and a copy holding the masked
    dense weights."""
    torch.manual_seed(0)
    sparse = make().to(F64)
    dense = copy.deepcopy(sparse)
    _schedule(sparse, names, fmt)
    with torch.no_grad():
        for name in names:
            w = sparse.get_parameter(name)
            assert isinstance(w, scorch.SparseTensor)
            dense.get_parameter(name).copy_(w.detach().to_dense())
    return sparse, dense


def _check_grads(sparse, dense, names):
    for name in names:
        ws, wd = sparse.get_parameter(name), dense.get_parameter(name)
        assert isinstance(ws.grad, scorch.SparseTensor), name
        torch.testing.assert_close(ws.grad.to_dense(), wd.grad * _pattern(ws), msg=name)
    for (name, p), q in zip(sparse.named_parameters(), dense.parameters()):
        if name not in names and p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


CASES = {
    "self": dict(),
    "self-no-weights": dict(call=dict(need_weights=False)),
    "per-head-weights": dict(call=dict(average_attn_weights=False)),
    "cross": dict(cross=True),
    "cross-kv-differ": dict(cross=True, kv_differ=True, call=dict(need_weights=False)),
    "separate-qkv": dict(module=dict(kdim=24, vdim=40), cross=True),
    "no-bias": dict(module=dict(bias=False)),
    "bias-kv-zero-attn": dict(module=dict(add_bias_kv=True, add_zero_attn=True), call=dict(need_weights=False)),
    "bias-kv-weights": dict(module=dict(add_bias_kv=True, add_zero_attn=True)),
    "key-padding": dict(kpm=True),
    "key-padding-no-weights": dict(kpm=True, call=dict(need_weights=False)),
    "bool-mask": dict(mask="bool"),
    "float-mask-3d": dict(mask="float3d", call=dict(need_weights=False)),
    "causal": dict(mask="causal", call=dict(need_weights=False, is_causal=True)),
    "seq-first": dict(module=dict(batch_first=False)),
    "dropout": dict(module=dict(dropout=0.3), train=True),
    "unbatched": dict(unbatched=True),
}

E, H, B, L, S = 32, 4, 2, 5, 7


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_multihead_attention_matches_masked_dense(fmt, case):
    c = CASES[case]
    kw = {"batch_first": True, **c.get("module", {})}
    separate = "kdim" in kw
    names = (["q_proj_weight", "k_proj_weight", "v_proj_weight"] if separate else ["in_proj_weight"]) + \
        ["out_proj.weight"]
    if fmt == "bsr" and separate:
        names = ["q_proj_weight", "out_proj.weight"]  # (k and v: 32 x 24 and 32 x 40, not 16 x 16 blocks)
    sparse, dense = _sparse_pair(lambda: torch.nn.MultiheadAttention(E, H, **kw), names, fmt)
    sparse.train(c.get("train", False))
    dense.train(c.get("train", False))
    g = torch.Generator().manual_seed(1)
    first = kw["batch_first"]
    shape = (lambda n: (n, E)) if c.get("unbatched") else (lambda n: (B, n, E) if first else (n, B, E))
    src = S if c.get("cross") else L
    q = torch.randn(shape(L), dtype=F64, generator=g, requires_grad=True)
    if c.get("cross"):
        kshape, vshape = list(shape(src)), list(shape(src))
        kshape[-1], vshape[-1] = kw.get("kdim", E), kw.get("vdim", E)
        k = torch.randn(kshape, dtype=F64, generator=g, requires_grad=True)
        v = torch.randn(vshape, dtype=F64, generator=g, requires_grad=True) if c.get("kv_differ") or separate \
            else k
    else:
        k = v = q
    call = dict(c.get("call", {}))
    if c.get("kpm"):
        kpm = torch.zeros(B, src, dtype=torch.bool)
        kpm[0, -2:] = True
        call["key_padding_mask"] = kpm
    mask = c.get("mask")
    if mask == "bool":
        call["attn_mask"] = torch.rand(L, src, generator=g) < 0.3
        call["attn_mask"][:, 0] = False  # (every query attends a key: no NaN row)
    elif mask == "float3d":
        call["attn_mask"] = torch.randn(B * H, L, src, dtype=F64, generator=g)
    elif mask == "causal":
        call["attn_mask"] = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    outs = []
    for m in (sparse, dense):
        torch.manual_seed(7)  # (dropout: the same draws; the sparse projections draw nothing)
        outs.append(m(q, k, v, **call))
    (o1, w1), (o2, w2) = outs
    torch.testing.assert_close(o1, o2)
    assert (w1 is None) == (w2 is None)
    if w1 is not None:
        torch.testing.assert_close(w1, w2)
    inputs = list({id(t): t for t in (q, k, v)}.values())
    gout = torch.randn(o1.shape, dtype=F64, generator=g)
    loss1, loss2 = ((o * gout).sum() + (0 if w is None else (w ** 2).sum()) for o, w in ((o1, w1), (o2, w2)))
    for a, b in zip(torch.autograd.grad(loss1, inputs, retain_graph=True),
                    torch.autograd.grad(loss2, inputs, retain_graph=True)):
        torch.testing.assert_close(a, b)
    loss1.backward()
    loss2.backward()
    _check_grads(sparse, dense, names)


def _dense_equivalent(mask):
    """The dense additive mask meaning what the sparse ``mask`` means: 0 (or the value) at its allowed entries,
    -inf elsewhere."""
    d = mask.to_dense()
    allowed = d if mask.dtype == torch.bool else _pattern(mask)
    vals = torch.zeros(d.shape, dtype=F64) if mask.dtype == torch.bool else d.to(F64)
    return torch.where(allowed, vals, float("-inf"))


def _mha(m, x, **kw):
    """``F.multi_head_attention_forward`` with ``m``'s parameters on the sequence-first ``x`` (the module's own
    forward canonicalizes a bool mask in place first, which a sparse tensor cannot take)."""
    return torch.nn.functional.multi_head_attention_forward(
        x, x, x, E, H, m.in_proj_weight, m.in_proj_bias, m.bias_k, m.bias_v, m.add_zero_attn, 0.0,
        m.out_proj.weight, m.out_proj.bias, training=False, **kw)


@pytest.mark.parametrize("dtype", ["bool", "float"])
@pytest.mark.parametrize("extra", ["plain", "no-weights", "per-head", "key-padding", "zero-attn", "3d", "causal"])
def test_sparse_attn_mask_lists_the_attended_pairs(dtype, extra):
    kw = dict(add_bias_kv=True, add_zero_attn=True) if extra == "zero-attn" else {}
    m, _ = _sparse_pair(lambda: torch.nn.MultiheadAttention(E, H, **kw), ["in_proj_weight"], "csr")
    g = torch.Generator().manual_seed(3)
    shape = (B * H, L, L) if extra == "3d" else (L, L)
    keep = torch.rand(shape, generator=g) < 0.4
    keep[..., torch.arange(L), torch.arange(L)] = True  # (each query attends itself: no empty row)
    vals = torch.randn(shape, dtype=F64, generator=g)
    if extra == "causal":  # (the dense reference takes is_causal for its mask: the mask must be the causal one,
        keep = torch.ones(L, L, dtype=torch.bool).tril()  # its values one shift of every score)
        vals = torch.ones(shape, dtype=F64)
    mask = scorch.asformat(keep if dtype == "bool" else torch.where(keep, vals, 0), "csr" if len(shape) == 2
                           else "coo")
    dense_mask = _dense_equivalent(mask)
    x = torch.randn(L, B, E, dtype=F64, generator=g, requires_grad=True)
    call = dict(need_weights=extra not in ("no-weights", "causal"), average_attn_weights=extra != "per-head",
                is_causal=extra == "causal")
    if extra == "key-padding":
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[1, [0, 2]] = True
        call["key_padding_mask"] = kpm
        allowed = (dense_mask > float("-inf")) & ~kpm.repeat_interleave(H, 0)[:, None, :]
        assert bool(allowed.any(-1).all())  # (no query left with no key)
    o1, w1 = _mha(m, x, attn_mask=mask, **call)
    o2, w2 = _mha(m, x, attn_mask=dense_mask, **call)
    torch.testing.assert_close(o1, o2)
    assert (w1 is None) == (w2 is None)
    if w1 is not None:
        torch.testing.assert_close(w1, w2)
    gout = torch.randn(o1.shape, dtype=F64, generator=g)
    (ga,) = torch.autograd.grad((o1 * gout).sum() + (0 if w1 is None else (w1 ** 2).sum()), [x])
    (gb,) = torch.autograd.grad((o2 * gout).sum() + (0 if w2 is None else (w2 ** 2).sum()), [x])
    torch.testing.assert_close(ga, gb)


def test_float_sparse_mask_through_the_module():
    """nn.MultiheadAttention with a sparse weight and a float sparse mask (a bool pattern as 1.0 everywhere: the
    same shift of every allowed score, which the softmax ignores)."""
    m, _ = _sparse_pair(lambda: torch.nn.MultiheadAttention(E, H, batch_first=True), ["out_proj.weight"], "csr")
    keep = torch.rand(L, L, generator=torch.Generator().manual_seed(4)) < 0.5
    keep.fill_diagonal_(True)
    mask = scorch.asformat(keep, "csr").to(F64)
    x = torch.randn(B, L, E, dtype=F64)
    o1, w1 = m(x, x, x, attn_mask=mask)
    o2, w2 = m(x, x, x, attn_mask=torch.where(keep, 0.0, float("-inf")).to(F64))
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(w1, w2)


def test_schedule_accepted_the_attention_weights_it_refused():
    """The issue's example, as a user writes it (nested tensors on): eval with a padding mask; torch's dense model
    takes its nested-tensor fast path (zeros at the padded positions), the sparse one the slow path."""
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2)
    ref = copy.deepcopy(model)
    s = scorch.schedule(model)
    s.glob("*self_attn.in_proj_weight").sparsify(scorch.nn.ScalarFraction(0.5))
    s.apply()
    assert all(isinstance(layer.self_attn.in_proj_weight, scorch.SparseTensor) for layer in model.layers)
    with torch.no_grad():
        for layer, other in zip(model.layers, ref.layers):
            other.self_attn.in_proj_weight.copy_(layer.self_attn.in_proj_weight.to_dense())
    model.eval()
    ref.eval()
    x = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(1))
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1, -2:] = True
    with torch.no_grad():
        torch.testing.assert_close(model(x, src_key_padding_mask=kpm)[~kpm], ref(x, src_key_padding_mask=kpm)[~kpm],
                                   rtol=1e-5, atol=1e-5)


ENCODER_WEIGHTS = ["self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight"]


def _encoder(batch_first):
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=batch_first)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_transformer_encoder_every_weight_sparse(fmt, batch_first):
    names = [f"layers.{i}.{w}" for i in range(2) for w in ENCODER_WEIGHTS]
    sparse, dense = _sparse_pair(lambda: _encoder(batch_first), names, fmt)
    g = torch.Generator().manual_seed(2)
    x = torch.randn((3, 6, 64) if batch_first else (6, 3, 64), dtype=F64, generator=g)
    y = torch.randn(x.shape, dtype=F64, generator=g)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[2, -1] = True
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (sparse, dense)]
    for step in range(3):
        losses = []
        for m, opt in zip((sparse, dense), opts):
            opt.zero_grad()
            loss = ((m(x, src_key_padding_mask=kpm) - y) ** 2).mean()
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1])
        if step == 0:
            _check_grads(sparse, dense, names)
        for name in names:  # the dense model trained on the same pattern
            dense.get_parameter(name).grad *= _pattern(sparse.get_parameter(name))
        for opt in opts:
            opt.step()
        for name in names:
            w = sparse.get_parameter(name)
            torch.testing.assert_close(w.detach().to_dense(), dense.get_parameter(name).detach() * _pattern(w))
    # eval mode, inference (torch's fast path is not taken: a sparse weight has __torch_function__)
    for m in (sparse, dense):
        m.eval()
    with torch.no_grad():
        torch.testing.assert_close(sparse(x, src_key_padding_mask=kpm), dense(x, src_key_padding_mask=kpm))
    with torch.inference_mode():
        torch.testing.assert_close(sparse(x), dense(x))
    # state_dict round trip: into a fresh model scheduled the same way
    buf = io.BytesIO()
    torch.save(sparse.state_dict(), buf)
    buf.seek(0)
    other, _ = _sparse_pair(lambda: _encoder(batch_first), names, fmt)
    other.load_state_dict(torch.load(buf))
    other.eval()
    with torch.no_grad():
        torch.testing.assert_close(other(x), sparse(x))
        for name in names:
            torch.testing.assert_close(other.get_parameter(name).detach().to_dense(),
                                       sparse.get_parameter(name).detach().to_dense())


def test_bad_arguments_raise_as_torch():
    sparse, dense = _sparse_pair(lambda: torch.nn.MultiheadAttention(E, H), ["in_proj_weight"], "csr")
    x = torch.randn(L, B, E, dtype=F64)
    for m in (sparse, dense):
        with pytest.raises(RuntimeError, match="2D attn_mask"):
            m(x, x, x, attn_mask=torch.zeros(L, L + 1, dtype=F64))
        with pytest.raises(RuntimeError, match="is_causal"):
            m(x, x, x, is_causal=True)
        with pytest.raises(AssertionError, match="key_padded_mask"):
            m(x, x, x, key_padding_mask=torch.zeros(B + 1, L, dtype=torch.bool))
