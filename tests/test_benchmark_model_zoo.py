"""The ResNet-18 and TransformerEncoder cases of the benchmark group ``models`` (benchmarks/model_zoo.py): what they
prune, that the pruned models compute what the masked dense ones do in both memory formats, and that the training
step's check fails on a wrong step. Small widths keep it fast."""
import pytest
import torch

import scorch
from benchmarks import model_zoo
from benchmarks.models import BERT_PRUNINGS
from benchmarks.resnet import resnet18


@pytest.mark.parametrize("pruning", model_zoo.RESNET_PRUNINGS, ids=lambda p: p.name)
def test_resnet_pruning_takes_every_conv_but_the_2_4_stem(pruning):
    torch.manual_seed(0)
    dense = resnet18(num_classes=10, width=8).eval()
    sparse, masked, names = model_zoo._prune(dense, model_zoo._resnet_selection, pruning)
    convs = [f"{n}.weight" for n, m in dense.named_modules() if isinstance(m, torch.nn.Conv2d)]
    assert names == (convs[1:] if pruning.format == "nm(2, 4)" else convs)
    params = dict(sparse.named_parameters())
    assert all(isinstance(params[n], scorch.SparseTensor) for n in names)
    assert type(params["fc.weight"]) is torch.nn.Parameter
    x = torch.randn(2, 3, 32, 32)
    peers, refs = model_zoo._pruned_peers({"pruned": {pruning.name: (sparse, masked, names)}}, [pruning],
                                          lambda m, i: m(i), (("", x), ("cl", x.to(memory_format=torch.channels_last))))
    with torch.no_grad():
        for name, run in peers.items():
            got, ref = run(), refs[name]()
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_encoder_pruning_takes_the_attention_and_feed_forward_weights():
    torch.manual_seed(0)
    dense = model_zoo.encoder(2).eval()
    sparse, masked, names = model_zoo._prune(dense, model_zoo._encoder_selection, BERT_PRUNINGS[0])
    assert sorted(names) == sorted(f"layers.{i}.{w}" for i in range(2) for w in (
        "self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight"))
    x = torch.randn(1, 16, 768)
    with torch.no_grad():
        torch.testing.assert_close(sparse(x), masked(x), rtol=1e-4, atol=1e-5)


def test_the_step_check_passes_a_right_step_and_fails_a_wrong_one():
    torch.manual_seed(1)
    dense = resnet18(num_classes=10, width=8)
    sparse, masked, names = model_zoo._prune(dense.eval(), model_zoo._resnet_selection, model_zoo.RESNET_PRUNINGS[0])
    x, labels = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])

    def step(model, opt):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), labels).backward()
        opt.step()
        return model.bn1.weight.grad

    note = model_zoo._step_check(model_zoo._fresh((sparse, masked), model_zoo._sgd), names, step, "bn1")
    assert "bn1" in note and "weights after the step" in note
    with torch.no_grad():
        masked.get_parameter(names[3]).mul_(1.5)
    with pytest.raises(AssertionError, match="training step is wrong"):
        model_zoo._step_check(model_zoo._fresh((sparse, masked), model_zoo._sgd), names, step, "bn1")
