"""More pruned models against their dense selves in the group ``models`` (issue 45): ResNet-18 and torch's own
``nn.TransformerEncoder``.

ResNet-18 (``benchmarks.resnet``, torchvision's layout, random weights, 224 x 224 inputs) with every convolution
weight pruned by ``scorch.schedule``: ``csr`` 90% unstructured (magnitude, ``ScalarFraction``), and 2:4
(``nm(2, 4)``) on every convolution but the 7 x 7 stem, whose matrix view has 147 columns (3 channels x 49 taps),
not a multiple of 4: ``scorch.schedule`` refuses it, so the stem stays dense in the 2:4 model. The classifier (a
512 -> 1000 Linear) stays dense in both. Inference (eval mode) at batch 1 and 8 against the dense fp32 model in
torch's default layout (NCHW) and in channels_last (model and input), as a peer row; each pruned model on an NCHW
and on a channels_last input (a sparse convolution's output follows its input's memory format, as torch's do, so
the BatchNorms, ReLUs and the max pool run channels_last too: torch's NCHW max pool takes 6 ms at batch 1, its
channels_last one 0.3). The targets take the faster layout on each side (named in the target). A training step
(train mode with frozen BatchNorm, cross entropy on random labels, backward, SGD with momentum) at batch 1 and 8,
with no target.

``nn.TransformerEncoder`` at BERT-base's shape (d_model 768, 12 heads, feed-forward 3072, GELU, batch_first) with
every attention and feed-forward weight (``in_proj_weight``, ``out_proj.weight``, ``linear1.weight``,
``linear2.weight``) pruned as the BERT tables prune (csr 90%, bsr(16, 16) 90% of the blocks, 2:4), at batch 1 and
8 x 128 tokens, inference, and a fine-tuning step at 90% csr (dropout, mean squared error to a random target,
AdamW), with the BERT targets. The stack is ``ENCODER_LAYERS`` copies of one layer shape and has no embedding, so
its ratios are those of 12 layers; fewer layers keep the group's run short. In eval mode the dense encoder takes
torch's fused fast path (``torch._transformer_encoder_layer_fwd``); the pruned ones, whose weights are
SparseTensors, take the Python path, their products in scorch.

Every sparse model is checked against the dense model holding the same pruned weights before it is timed; a
training step against the same step of the masked dense model (fresh copies): a gradient that passes every layer's
backward, every pruned weight's gradient on its pattern, and the weights after the optimizer's step. Each table
is timed in at most ``ROUNDS`` interleaved rounds (``BUDGET_S`` seconds), said in its notes, to keep the group
short.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F

import scorch

from .cases import Config, _ratio_target, relative_error, run_peers
from .models import BERT_GOALS, BERT_PRUNINGS, CSR, FINETUNE_GOAL, Pruning, _dense_ratios
from .resnet import resnet18
from .timing import Table

IMAGE = 224
DENSE, DENSE_CL = "dense fp32 model", "dense fp32 model, channels_last"
CL_INPUT = ", channels_last input"
RESNET_PRUNINGS = (Pruning("scorch csr 90%", lambda: scorch.nn.ScalarFraction(0.9), "csr"),
                   Pruning("scorch nm(2, 4), stem dense", lambda: scorch.nn.NM(2, 4), "nm(2, 4)"))
#: the issue's goals over the faster dense ResNet-18 (inference)
RESNET_GOALS = {RESNET_PRUNINGS[0].name: 2.0, RESNET_PRUNINGS[1].name: 1.2}
#: a training step's check: float32 sums in another order through a deep network's backward
STEP_TOLERANCE = 1e-3
ENCODER = dict(d_model=768, nhead=12, dim_feedforward=3072)
ENCODER_LAYERS = 4
ENCODER_WEIGHTS = r"layers\.\d+\.(self_attn\.(in_proj_weight|out_proj\.weight)|linear[12]\.weight)"
SEQ = 128


def _prune(model: torch.nn.Module, selection, pruning: Pruning):
    """``(sparse, masked, names)``: a copy of ``model`` with the weights ``selection(schedule)`` picks pruned and
    stored as SparseTensors, a dense copy holding the same pruned weights, and the pruned weights' names."""
    sparse = copy.deepcopy(model)
    s = scorch.schedule(sparse)
    names = selection(s, pruning)
    s.apply()
    masked = copy.deepcopy(model)
    stored = dict(sparse.named_parameters())
    with torch.no_grad():
        for name in names:
            masked.get_parameter(name).copy_(stored[name].to_dense())
    return sparse, masked, names


def _resnet_selection(s, pruning: Pruning):
    names = [f"{n}.weight" for n, m in s.model.named_modules() if isinstance(m, torch.nn.Conv2d)
             and not (n == "conv1" and pruning.format == "nm(2, 4)")]
    for name in names:
        s[name].sparsify(pruning.sparsifier()).set_format(pruning.format)
    return names


def _encoder_selection(s, pruning: Pruning):
    return s.regex(ENCODER_WEIGHTS).sparsify(pruning.sparsifier()).set_format(pruning.format).names


class Models:
    """A dense model and its pruned copies, built on first use and dropped after the last table that needs them."""

    def __init__(self, build, selection, prunings, size: int):
        self._make, self._selection, self._prunings = build, selection, prunings
        self.size = size  # (the image side of ResNet-18; the encoder's layers)
        self._built = None

    def get(self):
        if self._built is None:
            torch.manual_seed(0)
            dense = self._make(self.size).eval()
            self._built = dict(dense=dense, pruned={p.name: _prune(dense, self._selection, p)
                                                    for p in self._prunings})
        return self._built

    def after(self, thunk):
        try:
            return thunk()
        finally:
            self._built = None


def encoder(layers: int = ENCODER_LAYERS) -> torch.nn.TransformerEncoder:
    layer = torch.nn.TransformerEncoderLayer(**ENCODER, activation="gelu", batch_first=True)
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _fastest(t: Table, names) -> str:
    """The name of the fastest timed row of ``names`` (the first name where none is timed)."""
    timed = [t.row(n) for n in names if t.row(n) is not None and t.row(n).timing is not None]
    return min(timed, key=lambda r: r.timing.median).name if timed else names[0]


def _pruned_peers(built, prunings, run, inputs) -> tuple:
    """``(peers, refs)``: each pruned model on each input (``inputs``: (row-name suffix, input)), and the masked
    dense model holding its weights on the same input."""
    peers, refs = {}, {}
    for p in prunings:
        sparse, masked, _ = built["pruned"][p.name]
        for suffix, inp in inputs:
            peers[p.name + suffix] = lambda m=sparse, i=inp: run(m, i)
            refs[p.name + suffix] = lambda m=masked, i=inp: run(m, i)
    return peers, refs


def resnet_inference(models: Models, cfg: Config, batch: int) -> Table:
    image = models.size
    t = Table("models", f"ResNet-18, batch {batch}, {image} x {image}, inference",
              "benchmarks.resnet.resnet18() (torchvision's layout), eval, no gradients, random weights and input; "
              "every conv weight pruned by scorch.schedule (2:4: all but the 7 x 7 stem, whose 147 columns take no "
              "2:4), the classifier dense")
    t.scorch, t.torch = RESNET_PRUNINGS[0].name, DENSE
    built = models.get()
    x = torch.randn(batch, 3, image, image, generator=torch.Generator().manual_seed(batch))
    cl_model = copy.deepcopy(built["dense"]).to(memory_format=torch.channels_last)
    x_cl = x.contiguous(memory_format=torch.channels_last)

    def run(model, inp):
        with torch.no_grad():
            return model(inp)

    peers = {DENSE: lambda: run(built["dense"], x), DENSE_CL: lambda: run(cl_model, x_cl)}
    sparse_peers, refs = _pruned_peers(built, RESNET_PRUNINGS, run, (("", x), (CL_INPUT, x_cl)))
    run_peers(t, {**peers, **sparse_peers}, DENSE, cfg, refs)
    _dense_ratios(t, DENSE)
    if image == IMAGE:
        base = _fastest(t, (DENSE, DENSE_CL))
        for p in RESNET_PRUNINGS:
            name, goal = _fastest(t, (p.name, p.name + CL_INPUT)), RESNET_GOALS[p.name]
            t.targets.append(_ratio_target(t, f"{p.name} >= {goal:g}x faster than the dense fp32 model (the faster "
                                              f"layout of each: {name} over {base})", goal, base, name))
    return t


def _step_check(pairs, names, step, through: str) -> str:
    """One ``step(model, opt)`` of each fresh (sparse, masked dense) pair; ``step`` returns the gradient named
    ``through`` (one that passes every layer's backward); it, each pruned weight's gradient on its pattern and the
    weights after the step must agree within ``STEP_TOLERANCE``. Returns the note."""
    (sparse, s_opt), (masked, m_opt) = pairs
    errs = {through: relative_error(step(sparse, s_opt), step(masked, m_opt))}
    s_params, m_params = dict(sparse.named_parameters()), dict(masked.named_parameters())
    grad = weight = 0.0
    for n in names:
        sp, dp = s_params[n], m_params[n]
        on = sp.detach().to_dense() != 0
        grad = max(grad, relative_error(sp.grad.to_dense() * on, dp.grad * on))
        weight = max(weight, relative_error(sp.detach().to_dense(), dp.detach() * on))
    errs["pruned weights' gradients on the pattern"], errs["weights after the step on the pattern"] = grad, weight
    bad = {k: v for k, v in errs.items() if v > STEP_TOLERANCE}
    if bad:
        raise AssertionError("the training step is wrong: " + ", ".join(f"{k} {v:.1e}" for k, v in bad.items()))
    return (f"One step of fresh copies checked against the masked dense model (max |diff| / max |ref|, tolerance "
            f"{STEP_TOLERANCE:g}): " + "; ".join(f"{k} {v:.1e}" for k, v in errs.items()) + ".")


def _train(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in train mode but its BatchNorms on their running statistics (frozen BatchNorm, as detection and
    segmentation models fine-tune): batch statistics of one 224 x 224 image at ResNet's last 7 x 7 maps, where a
    pruned channel varies little, turn float32 rounding into 10% gradient differences between two right models
    (measured: 6e-3 on the stem BatchNorm's weight gradient, 0.1 on the pruned weights'), so no check could hold."""
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.eval()
    return model


def _fresh(pair, optimizer):
    """Train-mode copies (``_train``) of ``pair``'s models, each with its optimizer."""
    return [(m, optimizer(m.parameters())) for m in (_train(copy.deepcopy(pair[0])), _train(copy.deepcopy(pair[1])))]


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def resnet_training(models: Models, cfg: Config, batch: int) -> Table:
    image = models.size
    t = Table("models", f"ResNet-18 training step, batch {batch}, {image} x {image}",
              "train mode, BatchNorm frozen (on its running statistics); cross entropy on random labels; backward; "
              "SGD (momentum 0.9) over all parameters; every conv weight pruned as in the inference tables")
    built = models.get()
    gen = torch.Generator().manual_seed(batch)
    x, labels = torch.randn(batch, 3, image, image, generator=gen), torch.randint(0, 1000, (batch,), generator=gen)
    names = {p.name: f"{p.name} step" for p in RESNET_PRUNINGS}
    dense_name, cl_name = f"{DENSE} step", f"{DENSE_CL} step"
    t.scorch, t.torch = names[RESNET_PRUNINGS[0].name], dense_name

    def step(model, opt, inp=x):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(inp), labels).backward()
        opt.step()
        return model.bn1.weight.grad  # (the stem's BatchNorm: every layer's backward is behind it)

    checks, peers, refs = [], {}, {}
    dense = _fresh((built["dense"], built["dense"]), _sgd)[0]
    cl_model = _train(copy.deepcopy(built["dense"])).to(memory_format=torch.channels_last)
    cl = (cl_model, _sgd(cl_model.parameters()))
    x_cl = x.contiguous(memory_format=torch.channels_last)
    peers = {dense_name: lambda: step(*dense), cl_name: lambda: step(*cl, inp=x_cl)}
    for p in RESNET_PRUNINGS:
        sparse, masked, pruned = built["pruned"][p.name]
        if batch == 1:  # (the whole check once: a step at batch 8 takes seconds; its first call is checked below)
            checks.append(f"{p.name}: " + _step_check(_fresh((sparse, masked), _sgd), pruned, step,
                                                        "the stem BatchNorm's weight gradient"))
        (s_pair, m_pair) = _fresh((sparse, masked), _sgd)
        peers[names[p.name]] = lambda m=s_pair: step(*m)
        refs[names[p.name]] = lambda m=m_pair: step(*m)  # (the timed model's first step against the masked model's)
    run_peers(t, peers, dense_name, cfg, refs, tolerances={n: STEP_TOLERANCE for n in peers})
    _dense_ratios(t, dense_name)
    if not checks:
        checks.append("Each pruned model's first timed step checked against the masked dense model's (above); the "
                      "pruned weights' gradients and the weights after the step are checked at batch 1.")
    t.notes += checks
    return t


def _encoder_title(layers: int, batch: int, what: str) -> str:
    return f"nn.TransformerEncoder (BERT-base layers, {layers} of them), batch {batch} x {SEQ} tokens, {what}"


def _encoder_setup(layers: int, what: str) -> str:
    return (f"torch.nn.TransformerEncoder(TransformerEncoderLayer(768, 12, 3072, gelu, batch_first), {layers}); "
            f"{what}; the {layers * 4} attention and feed-forward weights (in_proj_weight, out_proj.weight, linear1, "
            f"linear2) pruned by scorch.schedule. {layers} layers, not BERT-base's 12: the stack repeats one "
            "layer shape and has no embedding, so the ratios are those of 12 layers")


def encoder_inference(models: Models, cfg: Config, batch: int) -> Table:
    t = Table("models", _encoder_title(models.size, batch, "inference"),
              _encoder_setup(models.size, "eval (the dense model on torch's fused fast path), no gradients, input "
                             f"{batch} x {SEQ} x 768 random"))
    t.scorch, t.torch = CSR.name, DENSE
    built = models.get()
    x = torch.randn(batch, SEQ, ENCODER["d_model"], generator=torch.Generator().manual_seed(batch))

    def run(model, inp):
        with torch.no_grad():
            return model(inp)

    peers, refs = _pruned_peers(built, BERT_PRUNINGS, run, (("", x),))
    run_peers(t, {DENSE: lambda: run(built["dense"], x), **peers}, DENSE, cfg, refs)
    _dense_ratios(t, DENSE)
    for p in BERT_PRUNINGS if models.size == ENCODER_LAYERS else ():
        goal = BERT_GOALS[p.name]
        t.targets.append(_ratio_target(t, f"{p.name} >= {goal:g}x faster than the dense fp32 encoder (BERT's target)",
                                       goal, DENSE, p.name))
    return t


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def encoder_finetune(models: Models, cfg: Config, batch: int) -> Table:
    dense_name, sparse_name = "dense fp32 fine-tuning step", "scorch csr 90% fine-tuning step"
    t = Table("models", _encoder_title(models.size, batch, "fine-tuning step"),
              _encoder_setup(models.size, "train mode (dropout 0.1); loss = mean((output - target)^2), target "
                             "random; backward (the input's gradient too); AdamW over all parameters; 90% csr against "
                             "the dense model holding the same weights"))
    t.scorch, t.torch = sparse_name, dense_name
    built = models.get()
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, SEQ, ENCODER["d_model"], generator=gen)
    target = torch.randn(batch, SEQ, ENCODER["d_model"], generator=gen)

    def step(model, opt):
        torch.manual_seed(0)  # (the same dropout masks in every model's step)
        opt.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_()
        (model(inp) - target).square().mean().backward()
        opt.step()
        return inp.grad

    sparse, masked, names = built["pruned"][CSR.name]
    check = _step_check(_fresh((sparse, masked), _adamw), names, step, "the input's gradient")
    # (timed: fresh copies again; the dense one holds the pruned weights: a dense product's time does not depend on
    # its values, and the sparse step's first call is checked against it)
    (s_model, s_opt), (m_model, m_opt) = _fresh((sparse, masked), _adamw)
    run_peers(t, {dense_name: lambda: step(m_model, m_opt), sparse_name: lambda: step(s_model, s_opt)}, dense_name,
              cfg, tolerances={sparse_name: STEP_TOLERANCE})
    t.notes.append(check)
    if models.size == ENCODER_LAYERS:
        t.targets.append(_ratio_target(t, f"{sparse_name} >= {FINETUNE_GOAL:g}x faster than the dense step (BERT's "
                                          "target)", FINETUNE_GOAL, dense_name, sparse_name))
    return t


#: --quick: ResNet-18 on 64 x 64 images, a one-layer encoder (no targets)
QUICK_IMAGE, QUICK_LAYERS = 64, 1
#: timed rounds and seconds per table at most (the suite's 20 and 40 s would add 10 minutes to the group)
ROUNDS, BUDGET_S = 7, 15.0


def _rounds_noted(table: Table, cfg: Config) -> Table:
    table.notes.append(f"Timed in at most {cfg.repeat} interleaved rounds ({cfg.budget_s:g} s a table, at least 3 "
                       "rounds) to keep the group short.")
    return table


def tasks(cfg: Config, batches) -> list:
    """(title, thunk) of the group's ResNet-18 and encoder tables, at ``batches``; each model set built on its
    first table and dropped after its last."""
    cfg = dataclasses.replace(cfg, repeat=min(cfg.repeat, ROUNDS), budget_s=min(cfg.budget_s, BUDGET_S), min_s=0.0)
    resnet = Models(lambda image: resnet18(), _resnet_selection, RESNET_PRUNINGS, QUICK_IMAGE if cfg.quick else IMAGE)
    enc = Models(encoder, _encoder_selection, BERT_PRUNINGS, QUICK_LAYERS if cfg.quick else ENCODER_LAYERS)
    out = []
    for models, parts in ((resnet, (("ResNet-18", resnet_inference), ("ResNet-18 training step", resnet_training))),
                          (enc, (("TransformerEncoder", encoder_inference),
                                 ("TransformerEncoder fine-tuning step", encoder_finetune)))):
        group = [(f"{name}, batch {b}", lambda f=f, b=b, m=models: _rounds_noted(f(m, cfg, b), cfg))
                 for name, f in parts for b in batches]
        title, last = group[-1]
        group[-1] = (title, lambda last=last, m=models: m.after(last))
        out += group
    return out
