"""``scorch.schedule``: selecting parameters and module outputs, composing formats, applying to real torch.nn
models (outputs, gradients and training steps match the dense model with the same masks), dynamic patterns,
activations, summary and undo."""
import copy
import re

import pytest
import torch

import scorch
from scorch.nn import NM, BlockFraction, RandomFraction, ScalarFraction, ScalarThreshold

F64 = torch.float64


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 8)).double()


def encoder_layer(seed=0):
    torch.manual_seed(seed)
    return torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True).double()


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def masked_copy(model, masks):
    """The dense reference: a copy of ``model`` (before apply) with ``w * mask`` for each masked parameter."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in masks.items():
            ref.get_parameter(name).mul_(m)
    return ref


# --- selection ------------------------------------------------------------------------------------------------

def test_select_by_name_regex_glob_and_module_output():
    s = scorch.schedule(mlp())
    assert s["0.weight"].names == ("0.weight",)
    assert s[re.compile(r"\d\.bias")].names == ("0.bias", "2.bias", "4.bias")
    assert s.regex(r"[02]\.weight").names == ("0.weight", "2.weight")
    with pytest.raises(KeyError):  # a regex matches whole names
        s.regex("weight")
    assert s.glob("*.weight").names == ("0.weight", "2.weight", "4.weight")
    out = s["2"]
    assert isinstance(out, scorch.nn.schedule.OutputSelection) and out.names == ("2",)
    assert s.output(re.compile(r"[13]")).names == ("1", "3")


def test_selecting_nothing_raises_key_error_with_names():
    s = scorch.schedule(mlp())
    with pytest.raises(KeyError, match=r"0\.weigth.*close matches: 0\.weight"):
        s["0.weigth"]
    with pytest.raises(KeyError, match="available: 0.weight"):
        s.glob("encoder.*")
    with pytest.raises(KeyError, match="no module matches 'nope'"):
        s.output("nope")
    with pytest.raises(TypeError):
        s[3]
    with pytest.raises(TypeError, match="Sparsifier"):
        s["0.weight"].sparsify(0.5)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        scorch.schedule(torch.zeros(3))


# --- formats --------------------------------------------------------------------------------------------------

def _composed(selection_calls, shape=(32, 32)):
    model = torch.nn.Linear(shape[1], shape[0])
    s = scorch.schedule(model)
    selection_calls(s["weight"])
    return s["weight"].formats["weight"]


def test_hybrid_format_from_block_axes():
    fmt = _composed(lambda w: w.block(16, 16).set_format("ell", axes=[0, 1]).set_format("coo", axes=[2, 3]))
    assert fmt == scorch.Format("(i, j) -> (i / 16 : dense, j / 16 : fixed, i % 16 : compressed(nonunique),"
                                " j % 16 : singleton)")


def test_a_named_format_on_axes_keeps_its_level_order():
    fmt = _composed(lambda w: w.block(4, 8).set_format("csc", axes=[0, 1]).set_format("csr", axes=[2, 3]))
    assert fmt == scorch.Format("(i, j) -> (j / 8 : dense, i / 4 : compressed, i % 4 : dense, j % 8 : compressed)")
    assert _composed(lambda w: w.set_format("csr", axes=[1, 0])) == scorch.formats.csc


def test_block_with_a_plain_format_is_block_sparse_with_dense_blocks():
    assert _composed(lambda w: w.block(16, 8).set_format("csr")) == scorch.formats.bsr(16, 8)
    assert _composed(lambda w: w.block(16, 8).set_format("csc")) == scorch.formats.bsc(16, 8)
    assert _composed(lambda w: w.block(16, 8)) == scorch.formats.bsr(16, 8)  # the default after block
    assert _composed(lambda w: w.block(4, 4).set_format("ell", axes=[0, 1])) == scorch.Format(
        "(i, j) -> (i / 4 : dense, j / 4 : fixed, i % 4 : dense, j % 4 : dense)")
    assert _composed(lambda w: w.block(16, 16).set_format("bsr(8, 8)")) == scorch.formats.bsr(8, 8)  # as it is
    assert _composed(lambda w: None) == scorch.formats.csr  # the default


def test_bad_formats_are_refused_at_the_call():
    s = scorch.schedule(torch.nn.Linear(32, 32))
    w = s["weight"]
    with pytest.raises(ValueError, match="plain dimensions"):
        w.block(16, 16).set_format("dia", axes=[0, 1])
    with pytest.raises(ValueError, match=r"parameter 'weight'.*4 axes \(0\.\.3\)"):
        w.set_format("csr", axes=[3, 4])
    with pytest.raises(ValueError, match="call .block"):
        scorch.schedule(torch.nn.Linear(8, 8))["weight"].set_format("csr", axes=[2, 3])
    with pytest.raises(ValueError, match="singleton level must follow"):  # the parser's error surfaces
        w.set_format("(i, j) -> (j : singleton, i : dense)")
    with pytest.raises(ValueError, match="unknown format"):
        w.set_format("blocked")
    with pytest.raises(ValueError, match=r"parameter 'bias' \(32,\).*2-d"):
        s["bias"].block(2, 2)
    with pytest.raises(TypeError):
        w.set_format(3)
    # a failed call changes nothing: the plan is still the hybrid-free bsr(16, 16)
    assert s["weight"].formats == {"weight": scorch.formats.bsr(16, 16)}


@pytest.mark.skipif("nm" not in scorch.formats.named.NAMES, reason="the nm(n, m) format is not in this scorch yet")
def test_nm_format_with_the_nm_sparsifier():
    model = mlp()
    w = model[0].weight.detach().clone()
    s = scorch.schedule(model)
    s["0.weight"].sparsify(NM(2, 4)).set_format("nm(2, 4)")
    s.apply()
    assert model[0].weight.format == scorch.formats.resolve("nm(2, 4)", 2)
    assert torch.equal(model[0].weight.detach().to_dense(), NM(2, 4)(w))
    ref = mlp()
    with torch.no_grad():
        ref[0].weight.copy_(NM(2, 4)(w))
    x = _x(4, 16)
    torch.testing.assert_close(model(x), ref(x))
    model(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad.to_dense(), ref[0].weight.grad * NM(2, 4).mask(w))


# --- applying to models ---------------------------------------------------------------------------------------

RULES = {"0.weight": ScalarFraction(0.75), "2.weight": NM(2, 4), "4.weight": BlockFraction(0.5, (4, 8))}


def _apply_mlp(formats=("csr", "coo", "bsr(4, 8)")):
    model = mlp()
    masks = {n: sp.mask(model.get_parameter(n).detach()) for n, sp in RULES.items()}
    ref = masked_copy(model, masks)
    s = scorch.schedule(model)
    for (name, sp), fmt in zip(RULES.items(), formats):
        s[name].sparsify(sp).set_format(fmt)
    assert s.apply() is model
    return model, ref, masks, s


def test_apply_replaces_parameters_and_matches_the_masked_dense_model():
    model, ref, masks, _ = _apply_mlp()
    for name, fmt in zip(RULES, ("csr", "coo", "bsr(4, 8)")):
        p = model.get_parameter(name)
        assert isinstance(p, scorch.SparseTensor) and isinstance(p, torch.nn.Parameter) and p.requires_grad
        assert p.format == scorch.formats.resolve(fmt, 2)
        assert torch.equal(p.detach().to_dense(), ref.get_parameter(name).detach())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert type(model[0].bias) is torch.nn.Parameter  # not selected: untouched
    x = _x(5, 16)
    y, y_ref = model(x), ref(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    for name, p in model.named_parameters():
        g_ref = ref.get_parameter(name).grad
        if name in masks:  # the sparse gradient is the dense one restricted to the pattern
            assert isinstance(p.grad, scorch.SparseTensor)
            torch.testing.assert_close(p.grad.to_dense(), g_ref * masks[name])
        else:
            torch.testing.assert_close(p.grad, g_ref)


@pytest.mark.parametrize("fmt", ["csc", "dcsr", "ell", "dia", "dense", "bsr(4, 4)"])
def test_apply_in_other_formats(fmt):
    model = torch.nn.Linear(16, 24).double()
    m = ScalarFraction(0.6).mask(model.weight.detach())
    ref = masked_copy(model, {"weight": m})
    s = scorch.schedule(model)
    s["weight"].sparsify(ScalarFraction(0.6)).set_format(fmt)
    s.apply()
    assert model.weight.format == scorch.formats.resolve(fmt, 2)
    x = _x(3, 16)
    torch.testing.assert_close(model(x), ref(x))
    model(x).sum().backward()
    ref(x).sum().backward()
    cells = model.weight.detach().to_dense() != 0  # the gradient lives on the stored (nonzero) cells
    torch.testing.assert_close(model.weight.grad.to_dense() * cells, ref.weight.grad * cells)


def test_hybrid_format_applied():
    model = torch.nn.Linear(32, 32).double()
    m = BlockFraction(0.5, (16, 16)).mask(model.weight.detach()) & ScalarFraction(0.5).mask(model.weight.detach())
    ref = masked_copy(model, {"weight": m})

    class Both(scorch.nn.Sparsifier):
        def mask(self, w):
            return BlockFraction(0.5, (16, 16)).mask(w) & ScalarFraction(0.5).mask(w)

    s = scorch.schedule(model)
    s["weight"].sparsify(Both()).block(16, 16).set_format("ell", axes=[0, 1]).set_format("coo", axes=[2, 3])
    s.apply()
    assert model.weight.format.name is None and str(model.weight.format).startswith("(i, j) -> (i / 16 : dense")
    x = _x(4, 32)
    torch.testing.assert_close(model(x), ref(x))


def test_requires_grad_and_shared_parameters_are_kept():
    model = mlp()
    model[4].weight.requires_grad_(False)
    tied = torch.nn.Linear(16, 32).double()
    tied.weight = model[0].weight  # one Parameter in two modules
    holder = torch.nn.ModuleDict({"mlp": model, "tied": tied})
    s = scorch.schedule(holder)
    s.glob("mlp.*.weight").sparsify(ScalarFraction(0.5))
    s.apply()
    assert holder.tied.weight is model[0].weight and isinstance(model[0].weight, scorch.SparseTensor)
    assert not model[4].weight.requires_grad and model[2].weight.requires_grad


def test_failed_apply_leaves_the_model_untouched():
    model = torch.nn.Linear(8, 8)
    before = model.weight
    s = scorch.schedule(model)
    s["bias"].sparsify(ScalarFraction(0.5))
    s["weight"].set_format("(i, j) -> (i : dense, j : singleton)")  # one entry per row only
    with pytest.raises(ValueError, match="parameter 'weight'.*singleton"):
        s.apply()
    assert model.weight is before and type(model.bias) is torch.nn.Parameter


# --- torch.nn.TransformerEncoderLayer and nn.MultiheadAttention -----------------------------------------------

def test_transformer_encoder_layer_linear_layers_forward_backward_and_adam():
    layer = encoder_layer()
    masks = {n: ScalarFraction(0.8).mask(layer.get_parameter(n).detach()) for n in ("linear1.weight",
                                                                                     "linear2.weight")}
    ref = masked_copy(layer, masks)
    s = scorch.schedule(layer)
    s.regex(r"linear[12]\.weight").sparsify(ScalarFraction(0.8)).set_format("csr")
    s.apply()
    x = _x(2, 5, 16)
    torch.testing.assert_close(layer(x), ref(x), rtol=1e-5, atol=1e-5)
    opt, opt_ref = torch.optim.Adam(layer.parameters(), lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)
    for _ in range(3):
        for net, o in ((layer, opt), (ref, opt_ref)):
            o.zero_grad()
            net(x).pow(2).mean().backward()
            if net is ref:
                for n, m in masks.items():
                    net.get_parameter(n).grad.mul_(m)
            o.step()
    for n in masks:
        torch.testing.assert_close(layer.get_parameter(n).detach().to_dense(), ref.get_parameter(n).detach())
    torch.testing.assert_close(layer(x), ref(x), rtol=1e-5, atol=1e-5)
    layer.eval()
    ref.eval()
    with torch.no_grad():  # torch's fast path is skipped for sparse weights: the same result
        torch.testing.assert_close(layer(x), ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["self_attn.in_proj_weight", "self_attn.out_proj.weight"])
def test_multihead_attention_parameters_are_applied(name):
    """(Refused at apply before F.multi_head_attention_forward had a sparse rule: tests/nn/test_sparse_mha.py.)"""
    layer = encoder_layer()
    ref = masked_copy(layer, {name: ScalarFraction(0.5).mask(layer.get_parameter(name).detach())})
    s = scorch.schedule(layer)
    s[name].sparsify(ScalarFraction(0.5))
    s.apply()
    assert isinstance(layer.get_parameter(name), scorch.SparseTensor)
    x = _x(2, 5, 16)
    torch.testing.assert_close(layer(x), ref(x), rtol=1e-5, atol=1e-5)


def test_transposed_convolution_weights_are_refused_at_apply():
    # (Conv1d/2d/3d weights are sparse in their matrix view: tests/nn/test_sparse_conv.py)
    s = scorch.schedule(torch.nn.Sequential(torch.nn.ConvTranspose2d(3, 4, 3)))
    s["0.weight"].sparsify(ScalarFraction(0.5)).set_format("coo")
    with pytest.raises(NotImplementedError, match="'0.weight'.*conv_transpose2d"):
        s.apply()


# --- training -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                      lambda p: torch.optim.Adam(p, lr=0.01)], ids=["sgd", "adam"])
def test_static_training_matches_masked_dense_training(make_opt):
    model, ref, masks, _ = _apply_mlp()
    opt, opt_ref = make_opt(model.parameters()), make_opt(ref.parameters())
    x, y = _x(6, 16), _x(6, 8, seed=2)
    levels = model[0].weight.levels
    for _ in range(3):
        for net, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            (net(x) - y).pow(2).mean().backward()
            if net is ref:
                for n, m in masks.items():
                    net.get_parameter(n).grad.mul_(m)
            o.step()
        for n in masks:
            torch.testing.assert_close(model.get_parameter(n).detach().to_dense(), ref.get_parameter(n).detach())
    assert model[0].weight.levels is levels  # static: the pattern never changed


def _dynamic_run(make_opt, sparsifiers, steps=4, attach=True):
    """A model with a dynamic first weight trained next to the dense reference that re-masks the weight (and
    the optimizer state) after each step."""
    model, ref = mlp(), mlp()
    sp, sp_ref = sparsifiers
    with torch.no_grad():
        mask = sp_ref.mask(ref[0].weight)
        ref[0].weight.mul_(mask)
    s = scorch.schedule(model)
    s["0.weight"].sparsify(sp, dynamic=True).set_format("csr")
    s.apply()
    param = model[0].weight
    opt, opt_ref = make_opt(model.parameters()), make_opt(ref.parameters())
    if attach:
        s.attach(opt)
    x, y = _x(6, 16), _x(6, 8, seed=2)
    patterns = []
    for _ in range(steps):
        for net, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            (net(x) - y).pow(2).mean().backward()
            if net is ref:
                net[0].weight.grad.mul_(mask)
            o.step()
        if not attach:
            s.step(opt)
        with torch.no_grad():
            w = ref[0].weight
            mask = sp_ref.mask(w)
            w.mul_(mask)
            for v in opt_ref.state[w].values():
                if v.shape == w.shape:
                    v.mul_(mask)  # the reference of the re-projected state: dropped entries forget theirs
        assert model[0].weight is param  # the same Parameter object, whatever its pattern
        torch.testing.assert_close(param.detach().to_dense(), ref[0].weight.detach())
        torch.testing.assert_close(param.detach().to_dense() != 0, mask & (ref[0].weight != 0))
        patterns.append(param.levels[1].crd.clone())
    torch.testing.assert_close(model(x), ref(x))
    return patterns, s, model


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                      lambda p: torch.optim.Adam(p, lr=0.05)], ids=["sgd", "adam"])
@pytest.mark.parametrize("attach", [True, False], ids=["attach", "step"])
def test_dynamic_random_pattern_matches_masked_dense_training(make_opt, attach):
    patterns, _, _ = _dynamic_run(make_opt, (RandomFraction(0.7, seed=5), RandomFraction(0.7, seed=5)),
                                  attach=attach)
    assert not all(torch.equal(patterns[0], p) for p in patterns[1:])  # the pattern did move


def test_dynamic_threshold_shrinks_the_pattern():
    patterns, s, model = _dynamic_run(lambda p: torch.optim.SGD(p, lr=0.5), (ScalarThreshold(0.12),
                                                                            ScalarThreshold(0.12)), steps=3)
    assert patterns[-1].numel() < patterns[0].numel()


def test_a_new_pattern_drops_conversions_kept_for_the_old_one():
    model = mlp()
    s = scorch.schedule(model)
    s["0.weight"].sparsify(RandomFraction(0.5, seed=0), dynamic=True).set_format("csr")
    s.apply()
    w = model[0].weight
    with torch.no_grad():
        old = scorch.asformat(w, "csc")  # kept on w for the next conversion
        s.step()
        assert not torch.equal(old.to_dense(), w.to_dense())
        torch.testing.assert_close(scorch.asformat(w, "csc").to_dense(), w.to_dense())


def test_step_only_touches_the_given_optimizer_parameters():
    model = mlp()
    s = scorch.schedule(model)
    s["0.weight"].sparsify(RandomFraction(0.5, seed=0), dynamic=True)
    s["2.weight"].sparsify(RandomFraction(0.5, seed=1), dynamic=True)
    s.apply()
    only_second = torch.optim.SGD([model[2].weight], lr=0.1)
    first, second = model[0].weight.levels[1].crd.clone(), model[2].weight.levels[1].crd.clone()
    s.step(only_second)
    assert torch.equal(model[0].weight.levels[1].crd, first)
    assert not torch.equal(model[2].weight.levels[1].crd, second)


# --- activations ----------------------------------------------------------------------------------------------

def test_output_sparsified_per_forward_with_gradients():
    model = mlp()
    ref = masked_copy(model, {})
    sp = ScalarFraction(0.5)
    s = scorch.schedule(model)
    s.output("0").sparsify(sp).set_format("csr")
    s.apply()
    seen = []
    model[1].register_forward_hook(lambda m, a, out: seen.append(out))
    x = _x(6, 16).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y = model(x)
    h = ref[0](x_ref)
    y_ref = ref[4](ref[3](ref[2](torch.relu(h * sp.mask(h.detach())))))
    torch.testing.assert_close(y, y_ref)
    assert isinstance(seen[0], scorch.SparseTensor) and seen[0].nnz == 6 * 32 // 2
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)  # the gradient flows back through the sparse activation
    torch.testing.assert_close(model[0].weight.grad, ref[0].weight.grad)
    other = _x(6, 16, seed=7)  # another batch, another mask
    h2 = ref[0](other)
    torch.testing.assert_close(model(other), ref[4](ref[3](ref[2](torch.relu(h2 * sp.mask(h2.detach()))))))


def test_output_ranks_flattened_or_kept_by_format():
    model = mlp()
    s = scorch.schedule(model)
    s.output("1").set_format("coo")  # ReLU's nonzeros, 3-d COO
    s.output("3").sparsify(ScalarThreshold(0.5)).set_format("csr")  # 2-d format: flattened
    s.apply()
    x = _x(2, 3, 16)
    relu = model[1](model[0](x))
    assert isinstance(relu, scorch.SparseTensor) and relu.shape == (2, 3, 32) and relu.format.ndim == 3
    torch.testing.assert_close(relu.to_dense(), torch.relu(model[0](x)))
    tanh = model[3](_x(2, 3, 24))
    assert tanh.shape == (6, 24) and tanh.format == scorch.formats.csr
    with torch.no_grad():
        assert isinstance(model[3](_x(4, 24)), scorch.SparseTensor)


def test_output_that_is_not_a_tensor_is_refused():
    class Pair(torch.nn.Module):
        def forward(self, x):
            return x, x

    model = torch.nn.Sequential(Pair())
    s = scorch.schedule(model)
    s.output("0").set_format("csr")
    s.apply()
    with pytest.raises(TypeError, match="output of '0' is a tuple"):
        model(_x(2, 2))
    with pytest.raises(TypeError):
        s.output("0").sparsify(ScalarFraction(0.5), dynamic=True)  # activations are always per forward


# --- summary and undo -----------------------------------------------------------------------------------------

def test_summary_reports_formats_densities_and_bytes(capsys):
    model, _, masks, s = _apply_mlp()
    s.output("1").set_format("coo")
    rows = s.summary()
    printed = capsys.readouterr().out
    assert "0.weight" in printed and "bsr(4, 8)" in printed and "total" in printed and "output of 1" in printed
    by_name = {r["name"]: r for r in rows if r["kind"] == "param"}
    r = by_name["0.weight"]
    assert r["shape"] == (32, 16) and r["format"] == "csr" and r["density"] == pytest.approx(0.25)
    nnz = int(masks["0.weight"].sum())
    assert r["dense_bytes"] == 32 * 16 * 8 and r["bytes"] == nnz * 8 + nnz * 2 + 33 * 4  # values, crd (16-bit: packed), pos
    assert str(rows) == printed.rstrip("\n")


def test_undo_restores_dense_parameters_with_current_values():
    model, ref, _, s = _apply_mlp()
    s.output("1").set_format("coo")
    s.apply()
    x = _x(3, 16)
    assert isinstance(model[1](model[0](x)), scorch.SparseTensor)
    s.undo()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    torch.testing.assert_close(model(x), ref(x))
    assert not isinstance(model[1](model[0](x)), scorch.SparseTensor)  # the hook is gone
    s.apply()  # and the plans can be applied again
    assert isinstance(model[0].weight, scorch.SparseTensor)
    torch.testing.assert_close(model(x), ref(x))
