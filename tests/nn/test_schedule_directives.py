"""Per-layer directives: ``s["fc.weight"].schedule(order=..., parallel=...)`` and ``s["block"].schedule(...)`` reach
the kernels of that layer's products, checked as ``scorch.einsum(schedule=...)`` checks them."""
import pickle
import re

import pytest
import torch

import scorch
from scorch.nn import ScalarFraction


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(24, 16)
        self.fc2 = torch.nn.Linear(16, 8)
        self.proj = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return torch.einsum("ij,bj->bi", self.proj, self.fc2(h).reshape(-1, 8))


def _model(seed=0):
    torch.manual_seed(seed)
    return Net()


def _sparse(model, **directives):
    s = scorch.schedule(model)
    s["fc1.weight"].sparsify(ScalarFraction(0.6))
    if directives:
        s["fc1.weight"].schedule(**directives)
    return s


@pytest.mark.parametrize("directives", [dict(order="oib", parallel="o"), dict(order="boi", parallel="b"),
                                        dict(order="bio"), dict(order="oib", parallel="none"),
                                        dict(spec={"order": "iob"}),
                                        dict(spec=scorch.Directives(order=("b", "o", "i")))])
def test_values_and_gradients_equal_the_default_schedule(directives):
    x = torch.randn(2, 5, 24)
    ref_model, model = _model(), _model()
    _sparse(ref_model).apply()
    spec = directives.pop("spec", None)
    s = _sparse(model)
    s["fc1.weight"].schedule(spec, **directives)
    s.apply()
    y_ref, y = ref_model(x), model(x)
    torch.testing.assert_close(y, y_ref)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    for (name, p_ref), (_, p) in zip(ref_model.named_parameters(), model.named_parameters()):
        g_ref, g = p_ref.grad, p.grad
        torch.testing.assert_close(g.to_dense() if isinstance(g, scorch.SparseTensor) else g,
                                   g_ref.to_dense() if isinstance(g_ref, scorch.SparseTensor) else g_ref, msg=name)


def test_the_directives_reach_the_kernel_and_explain_shows_them():
    model = _model()
    _sparse(model, order="boi", parallel="b").apply()
    x = torch.randn(6, 24)
    e = scorch.explain(model.fc1, x)
    assert "directives:   order boi, parallel b (the layer's, from scorch.schedule)" in e
    assert e.directives.order == ("b", "o", "i") and e.directives.parallel == "b"
    assert "the user's schedule (parallel over b)" in e
    undirected = _model()
    _sparse(undirected).apply()
    # the undirected layer runs the weight family's kernels: no compiled plan of the general lowering
    assert scorch.explain(undirected.fc1, x).directives is None
    # the order's other walk: the CSR weight converted to CSC first, as einsum(schedule="iob") does
    s = _sparse(model, order="iob")
    s.apply()
    e = scorch.explain(model.fc1, x)
    assert "reformat:" in e and e.directives.order == ("i", "o", "b")


@pytest.mark.parametrize("directives, message", [
    (dict(order="oib", parallel="i"), "only the outermost loop ('o') runs in parallel"),
    (dict(order="ibo"), "puts b between the levels of the sparse operand"),
    (dict(order="oi"), "must name each index"),
    (dict(workspace="hash"), "a hash workspace assembles the sparse output of several sparse operands"),
    (dict(order="iob", transpose=False), "transpose=False forbids converting it"),
    (dict(order="iob", parallel="i"), "would race"),
])
def test_illegal_directives_raise_at_apply_with_einsums_message(directives, message):
    model = _model()
    w = model.fc1.weight
    s = _sparse(model, **directives)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        s.apply()
    assert "'fc1.weight'" in str(info.value)
    assert model.fc1.weight is w  # nothing replaced
    sparse = scorch.asformat(torch.randn(16, 24), "csr")
    with pytest.raises(ValueError) as by_einsum:
        scorch.einsum("oi,bi->ob", sparse, torch.randn(3, 24), schedule=directives)
    assert str(by_einsum.value) in str(info.value)


def test_bad_fields_raise_at_the_call():
    s = scorch.schedule(_model())
    with pytest.raises(ValueError, match="unknown schedule fields"):
        s["fc1.weight"].schedule(loop="oib")
    with pytest.raises(ValueError, match="workspace"):
        s["fc1.weight"].schedule(workspace="tree")
    with pytest.raises(TypeError, match="not both"):
        s["fc1.weight"].schedule("oib", parallel="o")
    with pytest.raises(TypeError, match="schedule= takes"):
        s["fc1.weight"].schedule(3)


def test_directives_of_a_generic_einsum_are_checked_at_the_first_call():
    model = _model()
    s = scorch.schedule(model)
    s["proj"].sparsify(ScalarFraction(0.5)).schedule(order="ibj")  # proj's product: einsum("ij,bj->bi")
    s.apply()
    x = torch.randn(3, 24)
    with pytest.raises(ValueError, match="puts b between the levels"):
        model(x)
    s["proj"].schedule(order="bij", parallel="b")
    s.apply()
    ref = _model()
    r = scorch.schedule(ref)
    r["proj"].sparsify(ScalarFraction(0.5))
    r.apply()
    y, y_ref = model(x), ref(x)
    torch.testing.assert_close(y, y_ref)
    y.square().sum().backward()  # (the gradients' products are the compiler's: the order names the forward's)
    y_ref.square().sum().backward()
    torch.testing.assert_close(model.proj.grad.to_dense(), ref.proj.grad.to_dense())
    e = scorch.explain(lambda a: torch.einsum("ij,bj->bi", model.proj, a), torch.randn(3, 8))
    assert e.directives.order == ("b", "i", "j")


def test_a_modules_directives_reach_the_products_in_its_forward():
    model, ref = _model(), _model()
    s, r = scorch.schedule(model), scorch.schedule(ref)
    for sched in (s, r):
        sched["fc2.weight"].sparsify(ScalarFraction(0.5))
    s["fc2"].schedule(order="boi", parallel="b")
    s.apply(), r.apply()
    x = torch.randn(4, 24)
    out = model.fc2(torch.relu(model.fc1(x)))
    assert not isinstance(out, scorch.SparseTensor)  # directives alone do not sparsify the output
    y, y_ref = model(x), ref(x)
    torch.testing.assert_close(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(model.fc2.weight.grad.to_dense(), ref.fc2.weight.grad.to_dense())
    e = scorch.explain(model.fc2, torch.randn(4, 16))
    assert e.directives.order == ("b", "o", "i")
    # outside the module's forward the same weight runs the compiler's schedule
    assert scorch.explain(lambda a: torch.nn.functional.linear(a, model.fc2.weight), torch.randn(4, 16)).directives \
        is None
    s["fc2"].schedule(order="ibo")
    with pytest.raises(ValueError, match="module 'fc2'.*puts b between"):
        s.apply()


def test_directives_are_refused_where_the_op_takes_none():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())
    with pytest.raises(NotImplementedError, match="'0.weight' cannot take directives"):
        scorch.schedule(model)["0.weight"].schedule(order="oib")


def test_summary_repr_undo_and_state_dict(capsys):
    model = _model()
    dense_state = {k: v.clone() for k, v in model.state_dict().items()}
    plain = _model()
    _sparse(plain).apply()
    s = _sparse(model, order="boi", parallel="b")
    s["fc2"].schedule(order="oib")
    assert "fc1.weight: ScalarFraction" in repr(s) and "schedule order boi, parallel b" in repr(s)
    assert "module fc2: dense output, schedule order oib" in repr(s)
    s.apply()
    rows = s.summary(print_it=True)
    shown = capsys.readouterr().out
    assert "schedule of fc1.weight: order boi, parallel b" in shown
    assert "schedule of fc2 (module): order oib" in shown
    assert {r["name"]: r["schedule"] for r in rows} == {"fc1.weight": "order boi, parallel b", "fc2": "order oib"}
    # the state dict is that of the same model without directives, and loads into a dense model
    state, plain_state = model.state_dict(), plain.state_dict()
    assert list(state) == list(plain_state)
    for k in state:
        assert "_directives" not in getattr(state[k], "__dict__", {})
        torch.testing.assert_close(state[k].to_dense() if isinstance(state[k], scorch.SparseTensor) else state[k],
                                   plain_state[k].to_dense() if isinstance(plain_state[k], scorch.SparseTensor)
                                   else plain_state[k])
    back = pickle.loads(pickle.dumps(model.fc1.weight))
    assert "_directives" not in back.__dict__
    w = model.fc1.weight
    s.undo()
    assert "_directives" not in w.__dict__ and not isinstance(model.fc1.weight, scorch.SparseTensor)
    x = torch.randn(3, 24)
    assert scorch.explain(model.fc2, torch.randn(3, 16)) == "(no compiled plan: dense operands go straight to torch)\n"
    assert not model.fc2._forward_pre_hooks and not model.fc2._forward_hooks
    model.load_state_dict(dense_state)
    torch.testing.assert_close(model(x), Net.forward(model, x))


def test_training_steps_with_directives_match_the_default():
    torch.manual_seed(1)
    x, t = torch.randn(8, 24), torch.randn(8, 8)
    models = []
    for directives in ({}, dict(order="boi", parallel="b")):
        m = _model()
        _sparse(m, **directives).apply()
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), t).backward()
            opt.step()
        models.append(m)
    torch.testing.assert_close(models[0](x), models[1](x))
    assert models[1].fc1.weight.__dict__.get("_directives") is not None  # kept through the optimizer's steps
