"""Sparse parameters: nn.Parameter, optimizers updating values on the pattern, state_dict and torch.save, and
a training run that matches dense training (gradients masked to the pattern) step by step."""
import io

import pytest
import torch

import scorch

F64 = torch.float64


def _weight(seed=0, shape=(8, 6), density=0.4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64) * (torch.rand(shape, generator=g) < density)


class Net(torch.nn.Module):
    def __init__(self, w, fmt):
        super().__init__()
        self.w = torch.nn.Parameter(scorch.asformat(w, fmt) if fmt else w.clone())
        self.b = torch.nn.Parameter(torch.zeros(w.shape[0], 1, dtype=F64))

    def forward(self, x):
        return torch.tanh(self.w @ x + self.b)


def test_a_sparse_tensor_is_a_parameter():
    net = Net(_weight(), "csr")
    assert isinstance(net.w, scorch.SparseTensor) and isinstance(net.w, torch.nn.Parameter)
    assert net.w.requires_grad and net.w.is_leaf
    assert [n for n, _ in net.named_parameters()] == ["w", "b"]


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.05),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("fmt", ["csr", "coo", "csc", "bsr(2, 2)"])
def test_training_matches_dense_training_on_the_pattern(fmt, opt):
    w = _weight(1)
    sparse_net, dense_net = Net(w, fmt), Net(w, None)
    pattern = sparse_net.w.detach().to_dense() != 0
    if fmt.startswith("bsr"):  # BSR stores whole blocks: its pattern is the blocks' cells
        pattern = torch.zeros_like(pattern)
        from scorch.formats import storage
        leaf, dims, inside = storage.coordinates(sparse_net.w.format, sparse_net.w.shape, sparse_net.w.levels)
        pattern[tuple(dims[:, inside])] = True
    opt_s, opt_d = OPTIMIZERS[opt](sparse_net.parameters()), OPTIMIZERS[opt](dense_net.parameters())
    g = torch.Generator().manual_seed(2)
    levels = sparse_net.w.levels
    losses = []
    x = torch.randn(6, 4, generator=g, dtype=F64)
    y = torch.randn(8, 4, generator=g, dtype=F64)
    for step in range(5):
        for net, opt_ in ((sparse_net, opt_s), (dense_net, opt_d)):
            opt_.zero_grad()
            loss = ((net(x) - y) ** 2).mean()
            loss.backward()
            if net is dense_net:
                net.w.grad *= pattern  # the dense model trained on the same pattern
            else:
                assert isinstance(net.w.grad, scorch.SparseTensor)
            opt_.step()
            losses.append(loss.item())
        torch.testing.assert_close(sparse_net.w.detach().to_dense(), dense_net.w.detach() * pattern)
        torch.testing.assert_close(sparse_net.b, dense_net.b)
    assert all(x is y for x, y in zip(sparse_net.w.levels, levels))  # in place: the pattern never changed
    assert losses[-2] < losses[0]


def test_state_dict_round_trip_and_torch_save(tmp_path):
    net = Net(_weight(3), "csr")
    sd = net.state_dict()
    assert isinstance(sd["w"], scorch.SparseTensor) and not sd["w"].requires_grad
    path = tmp_path / "net.pt"
    torch.save(sd, path)
    loaded = torch.load(path)  # weights_only=True: SparseTensors are allowed
    other = Net(_weight(4), "coo")
    other.load_state_dict(loaded)
    assert other.w.format == scorch.asformat(_weight(4), "coo").format  # the destination keeps its format
    torch.testing.assert_close(other.w.detach().to_dense(), net.w.detach().to_dense())
    assert other.w.requires_grad and isinstance(other.w, torch.nn.Parameter)
    # the whole module pickles too, parameters staying parameters
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert isinstance(again.w, torch.nn.Parameter) and isinstance(again.w, scorch.SparseTensor)
    torch.testing.assert_close(again(torch.ones(6, 2, dtype=F64)), net(torch.ones(6, 2, dtype=F64)))


def test_a_loaded_checkpoint_is_validated():
    s = scorch.asformat(_weight(5), "csr")
    s.levels[1].crd[0] = 99  # corrupt: a column out of range
    buf = io.BytesIO()
    torch.save({"w": s}, buf)
    buf.seek(0)
    with pytest.raises(Exception, match="out of range|column|coordinate"):
        torch.load(buf)


def test_in_place_ops_need_the_same_pattern():
    a = scorch.asformat(_weight(6), "csr")
    b = scorch.asformat(_weight(7), "csr")
    union = a.clone().add_(b)  # another pattern: the union replaces the arrays (tests/test_faults.py)
    torch.testing.assert_close(union.to_dense(), a.to_dense() + b.to_dense())
    with pytest.raises(ValueError, match="different patterns"):
        a.clone().div_(b)
    z = torch.zeros_like(a)
    assert all(x is y for x, y in zip(z.levels, a.levels)) and float(z.values().abs().sum()) == 0
    z.add_(a, alpha=2).mul_(0.5)
    torch.testing.assert_close(z.to_dense(), a.to_dense())
    with pytest.raises(NotImplementedError, match="dense tensor"):
        a.add_(torch.ones(8, 6, dtype=F64))
