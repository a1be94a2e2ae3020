"""``scorch.nn.SparseLinear``, ``patch_model`` and ``reformat_model``; ``scorch.nn.modules`` is torch's."""
import copy
import math

import pytest
import torch

import scorch
from scorch.nn import NM, BlockFraction, ScalarFraction, SparseLinear, patch_model, reformat_model

F64 = torch.float64


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# --- SparseLinear ---------------------------------------------------------------------------------------------

def test_sparse_linear_is_a_drop_in_linear():
    torch.manual_seed(0)
    layer = SparseLinear(32, 16, density=0.25, dtype=F64)
    assert isinstance(layer, torch.nn.Linear) and (layer.in_features, layer.out_features) == (32, 16)
    w = layer.weight
    assert isinstance(w, scorch.SparseTensor) and isinstance(w, torch.nn.Parameter) and w.requires_grad
    assert w.format == scorch.formats.csr and w.nnz == 128 and w.dtype == F64
    assert type(layer.bias) is torch.nn.Parameter and layer.bias.shape == (16,)
    bound = 1 / math.sqrt(32)  # nn.Linear's initialization, kept on the pattern
    assert w.values().abs().max() <= bound and w.values().abs().max() > bound / 2
    x = _x(4, 32)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w.detach().to_dense(), layer.bias))
    layer(x).sum().backward()
    assert isinstance(layer.weight.grad, scorch.SparseTensor) and layer.bias.grad is not None
    assert "format=csr" in repr(layer) and "density=0.25" in repr(layer)


def test_sparse_linear_init_is_seeded_and_options_work():
    torch.manual_seed(3)
    a = SparseLinear(16, 16, bias=False)
    torch.manual_seed(3)
    b = SparseLinear(16, 16, bias=False)
    assert a.bias is None and torch.equal(a.weight.to_dense(), b.weight.to_dense())
    assert a.weight.nnz == round(0.1 * 256)  # the default density
    c = SparseLinear(16, 32, format="coo", sparsifier=NM(1, 4))
    assert c.weight.format == scorch.formats.coo and (c.weight.to_dense().reshape(-1, 4) != 0).sum(1).max() == 1
    d = SparseLinear(32, 32, format="bsr(8, 8)", sparsifier=BlockFraction(0.75, (8, 8)))
    assert d.weight.format == scorch.formats.bsr(8, 8) and d.weight.nnz == 4 * 64
    with pytest.raises(ValueError, match="not both"):
        SparseLinear(4, 4, density=0.5, sparsifier=NM(2, 4))
    with pytest.raises(ValueError, match="density"):
        SparseLinear(4, 4, density=1.5)
    with pytest.raises(TypeError, match="Sparsifier"):
        SparseLinear(4, 4, sparsifier="magnitude")


def test_sparse_linear_reset_parameters_draws_a_new_pattern():
    torch.manual_seed(0)
    layer = SparseLinear(16, 16, density=0.5)
    before = layer.weight.to_dense()
    layer.reset_parameters()
    assert isinstance(layer.weight, scorch.SparseTensor) and layer.weight.nnz == 128
    assert not torch.equal(before, layer.weight.to_dense())


def test_sparse_linear_from_dense():
    torch.manual_seed(0)
    dense = torch.nn.Linear(16, 8).double()
    with torch.no_grad():
        dense.weight[:, ::2] = 0
    layer = SparseLinear.from_dense(dense)  # default: the nonzeros
    assert layer.weight.nnz == 64 and layer.weight.format == scorch.formats.csr
    x = _x(3, 16)
    torch.testing.assert_close(layer(x), dense(x))
    pruned = SparseLinear.from_dense(dense, ScalarFraction(0.75), format="coo")
    assert pruned.weight.nnz == 32 and pruned.weight.format == scorch.formats.coo
    torch.testing.assert_close(pruned(x), torch.nn.functional.linear(x, ScalarFraction(0.75)(dense.weight.detach()),
                                                                     dense.bias))
    assert type(dense.weight) is torch.nn.Parameter  # the source is not changed
    with pytest.raises(TypeError):
        SparseLinear.from_dense(torch.nn.Conv1d(2, 2, 1))


# --- patch_model ----------------------------------------------------------------------------------------------

def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 16)).double()


def test_patch_model_by_module_regex():
    model = _mlp()
    ref = copy.deepcopy(model)
    out = patch_model(model, {r"[02]": {"density": 0.25}, r"4": {"density": 0.5, "block": (8, 8)}})
    assert out is model
    assert model[0].weight.format == scorch.formats.csr and model[0].weight.nnz == 64 * 32 // 4
    assert model[2].weight.nnz == 64 * 32 // 4
    w4 = model[4].weight
    assert w4.format == scorch.formats.bsr(8, 8) and w4.nnz == 16 * 32 // 2  # half of the 8 blocks, whole
    with torch.no_grad():
        ref[0].weight.copy_(ScalarFraction(0.75)(ref[0].weight))
        ref[2].weight.copy_(ScalarFraction(0.75)(ref[2].weight))
        ref[4].weight.copy_(BlockFraction(0.5, (8, 8))(ref[4].weight))
    assert all(type(m.bias) is torch.nn.Parameter for m in (model[0], model[2], model[4]))
    x = _x(5, 32)
    torch.testing.assert_close(model(x), ref(x))


def test_patch_model_options():
    model = _mlp()
    patch_model(model, {r".*": {"sparsifier": NM(2, 4), "format": "coo"},  # every module with a weight
                        r"4": {"density": 0.5, "block": (4, 4), "format": "csr"}})  # the last key wins for 4
    assert model[0].weight.format == scorch.formats.coo and model[2].weight.format == scorch.formats.coo
    assert model[4].weight.format == scorch.formats.bsr(4, 4)
    with pytest.raises(KeyError, match="no module with a weight matches '1'"):
        patch_model(_mlp(), {"1": {"density": 0.5}})  # ReLU has no weight
    with pytest.raises(ValueError, match="unknown option.*sparsity"):
        patch_model(_mlp(), {"0": {"sparsity": 0.5}})
    with pytest.raises(ValueError, match="not both"):
        patch_model(_mlp(), {"0": {"density": 0.5, "sparsifier": NM(2, 4)}})
    with pytest.raises(ValueError, match="scorch.schedule"):
        patch_model(_mlp(), {"0": {"density": 0.5, "dynamic": True}})
    with pytest.raises(ValueError, match="block"):
        patch_model(_mlp(), {"0": {"density": 0.5, "block": 8}})


def test_patch_model_transformer_encoder_feed_forward():
    torch.manual_seed(0)
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                                      num_layers=2, enable_nested_tensor=False).double()
    ref = copy.deepcopy(enc)
    patch_model(enc, {r"layers\.\d+\.linear[12]": {"density": 0.3}})
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "linear" in name and name.endswith("weight"):
                p.copy_(ScalarFraction(0.7)(p))
    x = _x(2, 6, 16)
    torch.testing.assert_close(enc(x), ref(x), rtol=1e-5, atol=1e-5)


# --- reformat_model -------------------------------------------------------------------------------------------

def _pruned_mlp():
    model = _mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel())) < 0.3)
    return model


def test_reformat_model_with_name_and_weight():
    model = _pruned_mlp()
    ref = copy.deepcopy(model)
    seen = []

    def choose(name, weight):
        seen.append((name, tuple(weight.shape)))
        return {"0.weight": "csr", "2.weight": "ell", "4.weight": "bsr(8, 8)"}.get(name)

    assert reformat_model(model, choose) is model
    assert seen == [(n, tuple(p.shape)) for n, p in ref.named_parameters()]  # every parameter, in order
    for name, fmt in (("0.weight", "csr"), ("2.weight", "ell"), ("4.weight", "bsr(8, 8)")):
        p = model.get_parameter(name)
        assert p.format == scorch.formats.resolve(fmt, 2)
        assert torch.equal(p.detach().to_dense(), ref.get_parameter(name))  # no new pruning
    assert model[0].weight.nnz == int((ref[0].weight != 0).sum())  # the pattern is the nonzeros
    assert type(model[0].bias) is torch.nn.Parameter  # None: left dense
    x = _x(4, 32)
    torch.testing.assert_close(model(x), ref(x))


def test_reformat_model_with_weight_only():
    model = _pruned_mlp()
    reformat_model(model, lambda w: "coo" if w.dim() == 2 and w.shape[0] >= 32 else None)
    assert isinstance(model[0].weight, scorch.SparseTensor) and isinstance(model[2].weight, scorch.SparseTensor)
    assert type(model[4].weight) is torch.nn.Parameter and type(model[0].bias) is torch.nn.Parameter
    with pytest.raises(TypeError, match="fn returned int for '0.weight'"):
        reformat_model(_mlp(), lambda name, w: 3)
    with pytest.raises(TypeError, match="signature"):
        reformat_model(_mlp(), lambda a, b, c: None)
    with pytest.raises(TypeError):
        reformat_model(_mlp(), "csr")


# --- scorch.nn.modules stays torch's package ------------------------------------------------------------------

def test_scorch_nn_modules_is_torchs():
    import importlib
    assert scorch.nn.modules is torch.nn.modules
    assert scorch.nn.modules.batchnorm._BatchNorm is torch.nn.modules.batchnorm._BatchNorm
    assert importlib.import_module("scorch.nn.modules.linear") is torch.nn.modules.linear


@pytest.mark.parametrize("fmt,block", [("bsr(16, 16)", (16, 16)), ("bsr(4, 4)", (4, 4)), ("bsc(8, 4)", (8, 4))])
def test_sparse_linear_density_in_a_blocked_format_keeps_that_fraction_of_blocks(fmt, block):
    """``SparseLinear(format="bsr(16, 16)", density=0.1)`` pruned single entries at random, then stored every
    block still holding one: all of them (no memory or speed gained)."""
    torch.manual_seed(0)
    layer = scorch.nn.SparseLinear(256, 128, format=fmt, density=0.1)
    w = layer.weight
    assert w.format == scorch.asformat(torch.eye(16), fmt).format
    blocks = (w.to_dense().reshape(128 // block[0], block[0], 256 // block[1], block[1]) != 0).any(3).any(1)
    assert abs(blocks.float().mean().item() - 0.1) < 0.02
    assert abs(w.values().numel() / (256 * 128) - 0.1) < 0.02
