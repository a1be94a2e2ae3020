"""Pruned models against their dense selves (issue 43, "model sparsity pays"): the group ``models``.

BERT-base (``transformers.BertModel(BertConfig())``: built from its config, random weights, nothing downloaded;
eval mode) with every encoder Linear weight (12 layers x query, key, value, attention output, intermediate,
output: 72 matrices) pruned by ``scorch.schedule`` and stored as a SparseTensor, in each format: ``csr`` 90%
unstructured (magnitude), ``bsr(16, 16)`` 90% of the 16 x 16 blocks, ``nm(2, 4)``. The modules' code is
unchanged: their ``F.linear`` reaches scorch through the SparseTensor weight. Inference at batch 1 and 8 x 128
tokens against the dense fp32 model, with the dense model in bfloat16 and torch.sparse CSR weights (torch's
``F.linear`` takes a CSR weight) beside; a fine-tuning step (forward, backward, AdamW) at 90% csr against the
dense step; the bytes of the pruned weights against the dense ones.

Each sparse model is checked, before timing, against the dense model holding the same pruned weights (the
SparseTensor's ``to_dense()``), the bf16 model against the fp32 one with a 16-bit tolerance. The fine-tuning
step is checked on fresh copies of both models: the gradient that reaches the embeddings (it passes every pruned
layer's backward), every pruned weight's gradient on its pattern, and the weights AdamW leaves on the pattern;
then the timed step's first call is checked on the embeddings' gradient again (run_peers).

A Llama-style MLP block's projections, gate/up 4096 -> 11008 and down 11008 -> 4096, in float32 and bfloat16,
pruned 50% and 70% unstructured (csr) and 2:4 (``nm(2, 4)``), at 1 token (decode) and 16 tokens, against the
dense Linear of the same dtype.

The tables' ratio column is over the ``scorch csr 90%`` row (the suite's convention: one scorch row per table);
the speedup of every row over the dense model is in the first note and in the targets.

Without ``transformers`` (``pip install -e .[bench]``) the BERT rows read "not installed" and the MLP rows run.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import scorch

from .cases import Config, _ratio_target, relative_error, run_peers, TOLERANCE
from .half import TOLERANCE_16
from .peers import INSTALL_HINT
from .timing import Row, Table, Target

SEQ = 128  # tokens per sequence
#: the encoder's Linear weights (12 layers x 6): attention query, key, value and output, intermediate, output
ENCODER_LINEARS = (r"encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense"
                   r"|intermediate\.dense|output\.dense)\.weight")
LINEARS_PER_LAYER = 6
DENSE, BF16, TORCH_CSR = "dense fp32 model", "dense bf16 model", "torch.sparse CSR weights 90%"
#: a 12-layer bf16 model against the fp32 one: each layer's products rounded to 8 bits, renormalized by LayerNorm
BF16_MODEL_TOLERANCE = 5e-2


@dataclass(frozen=True)
class Pruning:
    """One way to prune: the row's name, the sparsifier and the format ``scorch.schedule`` stores the weight in."""
    name: str
    sparsifier: Callable[[], scorch.nn.Sparsifier]
    format: str


BERT_PRUNINGS = (Pruning("scorch csr 90%", lambda: scorch.nn.ScalarFraction(0.9), "csr"),
                 Pruning("scorch bsr(16, 16) 90%", lambda: scorch.nn.BlockFraction(0.9, (16, 16)), "bsr(16, 16)"),
                 Pruning("scorch nm(2, 4)", lambda: scorch.nn.NM(2, 4), "nm(2, 4)"))
CSR = BERT_PRUNINGS[0]
MLP_PRUNINGS = (Pruning("scorch csr 50%", lambda: scorch.nn.ScalarFraction(0.5), "csr"),
                Pruning("scorch csr 70%", lambda: scorch.nn.ScalarFraction(0.7), "csr"),
                Pruning("scorch nm(2, 4)", lambda: scorch.nn.NM(2, 4), "nm(2, 4)"))
#: the issue's goals: speedup over the dense model (BERT, both batches) and over the dense Linear (MLP)
BERT_GOALS = {"scorch csr 90%": 3.0, "scorch bsr(16, 16) 90%": 4.0, "scorch nm(2, 4)": 1.3}
FINETUNE_GOAL, BYTES_GOAL = 2.0, 0.2
MLP_GOALS = {"scorch csr 50%": 1.1, "scorch csr 70%": 1.7, "scorch nm(2, 4)": 1.3}


@dataclass(frozen=True)
class Sizes:
    bert_layers: int
    batches: tuple          # inference batches (x SEQ tokens)
    finetune_batches: tuple
    mlp: tuple              # (model width, MLP width): gate/up width -> MLP width, down back
    tokens: tuple


FULL = Sizes(bert_layers=12, batches=(1, 8), finetune_batches=(1, 8), mlp=(4096, 11008), tokens=(1, 16))
QUICK = Sizes(bert_layers=2, batches=(1,), finetune_batches=(1,), mlp=(1024, 2752), tokens=(1, 16))


# --- BERT --------------------------------------------------------------------------------------------------

def transformers_or_none():
    """``transformers``, or the reason it cannot be imported (a str)."""
    try:
        import transformers
    except Exception as e:  # noqa: BLE001  (missing, or broken by another package's version)
        return f"transformers: {type(e).__name__}: {e}; {INSTALL_HINT}"
    return transformers


def prune(model: torch.nn.Module, pruning: Pruning):
    """``(sparse, masked, names)``: a copy of ``model`` whose encoder Linear weights ``scorch.schedule`` prunes and
    stores as SparseTensors, a dense copy holding the same pruned weights (``to_dense()``), and the pruned
    parameters' names."""
    sparse = copy.deepcopy(model)
    s = scorch.schedule(sparse)
    sel = s.regex(ENCODER_LINEARS).sparsify(pruning.sparsifier()).set_format(pruning.format)
    s.apply()
    masked = copy.deepcopy(model)
    stored = dict(sparse.named_parameters())
    with torch.no_grad():
        for name, p in masked.named_parameters():
            if name in sel.names:
                p.copy_(stored[name].to_dense())
    return sparse, masked, sel.names


def torch_csr(masked: torch.nn.Module, names) -> torch.nn.Module:
    """A copy of ``masked`` whose ``names`` weights are torch sparse CSR tensors: ``nn.Linear`` passes them to
    ``F.linear``, which takes a CSR weight (no gradients: inference only)."""
    model = copy.deepcopy(masked)
    for name in names:
        owner, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        w = getattr(owner, attr).detach().to_sparse_csr()
        del owner._parameters[attr]
        setattr(owner, attr, w)
    return model


def weight_bytes(model: torch.nn.Module, names) -> int:
    """Bytes the named weights take as stored (a SparseTensor's values and index arrays)."""
    params = dict(model.named_parameters())
    return sum(scorch.nn.storage_bytes(params[n]) for n in names)


class Bert:
    """The models of the BERT tables, built on first use and shared by them."""

    def __init__(self, layers: int):
        self.layers = layers
        self._built = None

    def after(self, thunk):
        """``thunk()`` (the last BERT table), then drop the models, whether it returned or raised."""
        try:
            return thunk()
        finally:
            self._built = None

    def get(self):
        if self._built is None:
            self._built = self._build()
        return self._built

    def _build(self):
        tf = transformers_or_none()
        if isinstance(tf, str):
            return tf
        torch.manual_seed(0)
        config = tf.BertConfig(num_hidden_layers=self.layers)
        dense = tf.BertModel(config).eval()
        pruned = {p.name: prune(dense, p) for p in BERT_PRUNINGS}
        _, masked_csr, names = pruned[CSR.name]
        return dict(config=config, dense=dense, bf16=copy.deepcopy(dense).to(torch.bfloat16),
                    torch_csr=torch_csr(masked_csr, names), pruned=pruned, names=names)


def _missing_table(t: Table, names, why: str) -> Table:
    t.rows = [Row(n, status=f"not installed ({why})") for n in names]
    return t


def _dense_ratios(t: Table, dense: str) -> None:
    """The first note after the check: every row's speedup over ``dense`` (its time / the row's)."""
    ratios = [f"{r.name} {t.ratio(dense, r.name):.2f}x" for r in t.rows if r.timing and r.name != dense]
    t.notes.insert(1, f"Speedup over the {dense} (its time / the row's): " + ("; ".join(ratios) or "none timed") + ".")


def bert_inference(bert: Bert, cfg: Config, batch: int) -> Table:
    layers = bert.layers
    t = Table("models", f"BERT{'-base' if layers == 12 else f' ({layers} layers)'}, batch {batch} x {SEQ} tokens, "
              "inference", f"transformers BertModel(BertConfig(num_hidden_layers={layers})), eval, no gradients; "
              f"input_ids {batch} x {SEQ} random; the {layers * LINEARS_PER_LAYER} encoder Linear weights pruned by "
              "scorch.schedule (scorch rows) or held as torch sparse CSR tensors (90%, csr's pattern)")
    t.scorch, t.torch = CSR.name, DENSE
    names = [DENSE, BF16, TORCH_CSR] + [p.name for p in BERT_PRUNINGS]
    built = bert.get()
    if isinstance(built, str):
        return _missing_table(t, names, built)
    ids = torch.randint(0, built["config"].vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(batch))

    def run(model):
        with torch.no_grad():
            return model(input_ids=ids).last_hidden_state.float()  # (bf16: numpy, which checks, has no bfloat16)

    peers = {DENSE: lambda: run(built["dense"]), BF16: lambda: run(built["bf16"]),
             TORCH_CSR: lambda: run(built["torch_csr"])}
    refs = {TORCH_CSR: lambda: run(built["pruned"][CSR.name][1])}
    for p in BERT_PRUNINGS:
        sparse, masked, _ = built["pruned"][p.name]
        peers[p.name] = lambda m=sparse: run(m)
        refs[p.name] = lambda m=masked: run(m)
    run_peers(t, peers, DENSE, cfg, refs, tolerances={BF16: BF16_MODEL_TOLERANCE})
    _dense_ratios(t, DENSE)
    full = layers == 12
    for p in BERT_PRUNINGS if full else ():
        goal = BERT_GOALS[p.name]
        t.targets.append(_ratio_target(t, f"{p.name} >= {goal:g}x faster than the dense fp32 model", goal, DENSE,
                                       p.name))
    dense_bytes = sum(built["dense"].get_parameter(n).nbytes for n in built["names"])
    stored = {p.name: weight_bytes(built["pruned"][p.name][0], built["names"]) for p in BERT_PRUNINGS}
    t.notes.append(f"Weight bytes of the {len(built['names'])} pruned Linears (values and index arrays): dense fp32 "
                   f"{dense_bytes / 1e6:.1f} MB; " + "; ".join(f"{n} {b / 1e6:.1f} MB ({b / dense_bytes:.3f}x)"
                                                            for n, b in stored.items()) + ".")
    if full and batch == min(FULL.batches):  # (the bytes do not depend on the batch: one table holds the targets)
        for p in BERT_PRUNINGS[:2]:
            t.targets.append(Target(f"{p.name}: weights <= {BYTES_GOAL:g}x the dense bytes", BYTES_GOAL,
                                    stored[p.name] / dense_bytes, higher=False))
    return t


def _finetune_step(model, opt, ids, target, clock=None):
    """One fine-tuning step (mean squared error to ``target``); returns the gradient that reached the word
    embeddings (through every layer). (Not ``mean(output^2)``: the output leaves a LayerNorm, whose rows have
    mean square 1 whatever the weights, so that loss has a gradient of rounding noise.) ``clock``: a list that
    receives the seconds of the step's phases (forward, backward, optimizer step)."""
    torch.manual_seed(0)  # the same dropout masks in every model's step
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = (model(input_ids=ids).last_hidden_state - target).square().mean()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    if clock is not None:
        clock.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return model.embeddings.word_embeddings.weight.grad


#: rounds of the fine-tuning step's phase breakdown (a note beside the timed step)
PHASE_ROUNDS = 7


def _shared_params(model, pruned_names) -> int:
    """Entries of ``model``'s parameters outside its pruned weights (those both models of the step hold dense)."""
    pruned = set(pruned_names)
    return sum(p.numel() for n, p in model.named_parameters() if n not in pruned)


def _phases_note(steps: dict, shared: int) -> str:
    """The medians of each step's phases, its steps run in turn ``PHASE_ROUNDS`` times: where a pruned model's
    step spends what it does not share with the dense one (the optimizer step over the dense parameters both
    hold, word embeddings first, is the same work in each)."""
    clocks = {name: [] for name in steps}
    for _ in range(PHASE_ROUNDS):
        for name, step in steps.items():
            step(clocks[name])
    med = {name: [statistics.median(c[i] for c in clock) * 1e3 for i in range(3)] for name, clock in clocks.items()}
    parts = "; ".join(f"{name}: forward {f:.1f}, backward {b:.1f}, AdamW step {o:.1f}"
                      for name, (f, b, o) in med.items())
    (fd, bd, od), (fs, bs, os_) = med.values()
    return (f"Phases of the step (median ms of {PHASE_ROUNDS} rounds, steps in turn): {parts}. Forward and "
            f"backward alone: {(fd + bd) / (fs + bs):.2f}x; AdamW step {od / os_:.2f}x (both models hold the "
            f"{shared:,} dense parameters outside the pruned Linears, the word "
            "embeddings' 23.4M first).")


def _training_pair(built):
    """Fresh train-mode copies of the csr-pruned model and of the dense model holding its weights, each with its
    AdamW."""
    sparse, masked, _ = built["pruned"][CSR.name]
    sparse, masked = copy.deepcopy(sparse).train(), copy.deepcopy(masked).train()
    return [(m, torch.optim.AdamW(m.parameters(), lr=1e-4)) for m in (sparse, masked)]


def _check_training(built, ids, target) -> str:
    """One step of each fresh copy; the embeddings' gradient, each pruned weight's gradient on its pattern and the
    updated weights on the pattern must agree. Returns the note."""
    (sparse, s_opt), (masked, m_opt) = _training_pair(built)
    errs = {"embeddings' gradient": relative_error(_finetune_step(sparse, s_opt, ids, target),
                                                   _finetune_step(masked, m_opt, ids, target))}
    s_params, m_params = dict(sparse.named_parameters()), dict(masked.named_parameters())
    grad = weight = 0.0
    for n in built["names"]:
        sp, dp = s_params[n], m_params[n]
        on = sp.detach().to_dense() != 0  # (a kept weight AdamW moved to exactly 0 is as good as off the pattern)
        grad = max(grad, relative_error(sp.grad.to_dense() * on, dp.grad * on))
        weight = max(weight, relative_error(sp.detach().to_dense(), dp.detach() * on))
    errs["pruned weights' gradients on the pattern"], errs["weights after AdamW on the pattern"] = grad, weight
    bad = {k: v for k, v in errs.items() if v > TOLERANCE}
    if bad:
        raise AssertionError("scorch csr 90% fine-tuning step is wrong: " + ", ".join(f"{k} {v:.1e}"
                                                                                     for k, v in bad.items()))
    return ("One step of fresh copies checked against the dense model holding the pruned weights (max |diff| / max "
            "|ref|): " + "; ".join(f"{k} {v:.1e}" for k, v in errs.items()) + ".")


def bert_finetune(bert: Bert, cfg: Config, batch: int) -> Table:
    layers = bert.layers
    dense_name, sparse_name = "dense fp32 fine-tuning step", "scorch csr 90% fine-tuning step"
    t = Table("models", f"BERT{'-base' if layers == 12 else f' ({layers} layers)'} fine-tuning step, batch {batch} x"
              f" {SEQ} tokens", "train mode (dropout); loss = mean((last_hidden_state - target)^2), target random; "
              f"backward; AdamW step over all parameters; the {layers * LINEARS_PER_LAYER} encoder Linear weights 90% "
              "csr (scorch.schedule) against the dense model")
    t.scorch, t.torch = sparse_name, dense_name
    built = bert.get()
    if isinstance(built, str):
        return _missing_table(t, [dense_name, sparse_name], built)
    ids = torch.randint(0, built["config"].vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(batch))
    target = torch.randn(batch, SEQ, built["config"].hidden_size, generator=torch.Generator().manual_seed(batch))
    check = _check_training(built, ids, target)
    # the timed pair: fresh copies again (the checked ones took a step; the dense one now holds weights off the
    # pattern). Its dense model holds the pruned weights: a dense product's time does not depend on its values.
    (sparse, s_opt), (masked, m_opt) = _training_pair(built)
    run_peers(t, {dense_name: lambda: _finetune_step(masked, m_opt, ids, target),
                  sparse_name: lambda: _finetune_step(sparse, s_opt, ids, target)}, dense_name, cfg)
    t.notes.append(check)
    t.notes.append(_phases_note({dense_name: lambda c: _finetune_step(masked, m_opt, ids, target, c),
                                 sparse_name: lambda c: _finetune_step(sparse, s_opt, ids, target, c)},
                                _shared_params(sparse, built["names"])))
    if layers == 12:
        t.targets.append(_ratio_target(t, f"{sparse_name} >= {FINETUNE_GOAL:g}x faster than the dense step",
                                       FINETUNE_GOAL, dense_name, sparse_name))
    return t


# --- the Llama-style MLP's projections --------------------------------------------------------------------

class MLPWeights:
    """A projection's weight, its pruned SparseTensors, in one dtype: built on first use, the last one kept (a
    4096 x 11008 projection and its three pruned copies take about 0.7 GB in fp32)."""

    def __init__(self):
        self._key, self._value = None, None

    def get(self, d_in: int, d_out: int, dtype: torch.dtype):
        key = (d_in, d_out, dtype)
        if self._key != key:
            self._key = self._value = None
            g = torch.Generator().manual_seed(d_in * 7 + d_out)
            w = (torch.randn(d_out, d_in, generator=g) / d_in ** 0.5).to(dtype)
            sparse = {p.name: p.sparsifier().sparsify(w, p.format)
                      for p in MLP_PRUNINGS}
            self._key, self._value = key, (w, sparse)
        return self._value


def mlp_projection(weights: MLPWeights, cfg: Config, d_in: int, d_out: int, dtype: torch.dtype,
                   tokens: int) -> Table:
    kind = "gate/up" if d_in < d_out else "down"
    dt = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    dense_name = f"dense nn.Linear, {dt}"
    t = Table("models", f"Llama-style MLP {kind} projection {d_in} -> {d_out}, {dt}, {tokens} token"
              f"{'s' if tokens > 1 else ''}", f"F.linear(x, W): W {d_out} x {d_in} {dt}, no bias, x {tokens} x {d_in}"
              f"{' (decode)' if tokens == 1 else ''}; W pruned by magnitude (csr 50%, 70%) or 2:4 (nm(2, 4))")
    t.scorch, t.torch = MLP_PRUNINGS[1].name, dense_name
    w, sparse = weights.get(d_in, d_out, dtype)
    x = torch.randn(tokens, d_in, generator=torch.Generator().manual_seed(tokens)).to(dtype)

    def run(weight):
        with torch.no_grad():
            return F.linear(x, weight).float()

    peers = {dense_name: lambda: run(w)}
    peers.update({name: (lambda s=s: run(s)) for name, s in sparse.items()})
    refs = {name: (lambda s=s: run(s.to_dense())) for name, s in sparse.items()}
    tol = TOLERANCE_16 if dtype != torch.float32 else TOLERANCE
    run_peers(t, peers, dense_name, cfg, refs, tolerances={name: tol for name in sparse})
    _dense_ratios(t, dense_name)
    dense_bytes = w.nbytes
    t.notes.append(f"Weight bytes: dense {dense_bytes / 1e6:.1f} MB; " + "; ".join(
        f"{n} {scorch.nn.storage_bytes(s) / 1e6:.1f} MB ({scorch.nn.storage_bytes(s) / dense_bytes:.2f}x)"
        for n, s in sparse.items()) + ".")
    if (d_in, d_out) in (FULL.mlp, FULL.mlp[::-1]):
        for name, goal in MLP_GOALS.items():
            t.targets.append(_ratio_target(t, f"{name} >= {goal:g}x faster than the {dense_name}", goal, dense_name,
                                           name))
    return t


# --- the group -------------------------------------------------------------------------------------------

def tasks(cfg: Config) -> list:
    """(title, thunk) for each table of the group; the BERT models are built once, on the first BERT table."""
    sizes = QUICK if cfg.quick else FULL
    # every peer is timed in rounds: a model's first call compiles its kernels (scorch) or sets up oneDNN (bf16),
    # and says nothing of the calls after it, so no peer is "slow" here (the suite times those on one more call)
    cfg = dataclasses.replace(cfg, slow_s=float("inf"))
    bert = Bert(sizes.bert_layers)
    out = [(f"BERT, batch {b}, inference", lambda b=b: bert_inference(bert, cfg, b)) for b in sizes.batches]
    out += [(f"BERT fine-tuning step, batch {b}", lambda b=b: bert_finetune(bert, cfg, b))
            for b in sizes.finetune_batches]
    title, last = out[-1]
    out[-1] = (title, lambda: bert.after(last))  # (the MLP tables need the memory more than the models)
    from . import model_zoo  # (it takes the BERT prunings and goals from here)
    out += model_zoo.tasks(cfg, sizes.batches)
    weights = MLPWeights()
    width, hidden = sizes.mlp
    for d_in, d_out in ((width, hidden), (hidden, width)):
        for dtype in (torch.float32, torch.bfloat16):
            out += [(f"MLP {d_in} -> {d_out}, {dtype}, {n} tokens",
                     lambda d_in=d_in, d_out=d_out, dtype=dtype, n=n:
                     mlp_projection(weights, cfg, d_in, d_out, dtype, n)) for n in sizes.tokens]
    return out
