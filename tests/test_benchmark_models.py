"""The benchmark group ``models`` (benchmarks/models.py): its builder prunes every encoder Linear of a BERT with
``scorch.schedule``, in each format, and the pruned model computes what the dense model holding the same weights
computes; the torch.sparse peer and the fine-tuning check hold too. A tiny BERT (1 layer, 64 wide) keeps it fast."""
import pytest
import torch

import scorch
from benchmarks import models
from benchmarks.cases import QUICK, relative_error, run_peers
from benchmarks.timing import Table

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

LINEAR_NAMES = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                "intermediate.dense", "output.dense")


@pytest.fixture(scope="module")
def tiny():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                                     vocab_size=100, max_position_embeddings=64)
    return config, transformers.BertModel(config).eval()


@pytest.mark.parametrize("pruning", models.BERT_PRUNINGS, ids=lambda p: p.name)
def test_prune_makes_every_encoder_linear_sparse_and_matches_the_masked_model(tiny, pruning):
    config, dense = tiny
    sparse, masked, names = models.prune(dense, pruning)
    assert sorted(names) == sorted(f"encoder.layer.0.{n}.weight" for n in LINEAR_NAMES)
    params, masked_params = dict(sparse.named_parameters()), dict(masked.named_parameters())
    for name in names:
        w = params[name]
        assert isinstance(w, scorch.SparseTensor)
        assert w.format == scorch.formats.named.resolve(pruning.format)
        pattern = w.detach().to_dense() != 0
        assert torch.equal(pattern, pruning.sparsifier().mask(dict(dense.named_parameters())[name].detach()))
        # 90%: a tenth of 64 x 64 entries rounded, or 2 of the 16 blocks; 2:4 keeps half
        assert pattern.float().mean().item() <= (0.5 if pruning.format == "nm(2, 4)" else 0.125), name
        assert torch.equal(masked_params[name], w.detach().to_dense())
        assert not torch.equal(masked_params[name], dict(dense.named_parameters())[name])  # the dense one is pruned
    # the rest of the model (embeddings, biases, norms, pooler) is the dense model's
    for name, p in dense.named_parameters():
        if name not in names:
            assert type(params[name]) is torch.nn.Parameter and torch.equal(params[name], p)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, ref = sparse(input_ids=ids).last_hidden_state, masked(input_ids=ids).last_hidden_state
    assert relative_error(got, ref) < 1e-5
    assert models.weight_bytes(sparse, names) < sum(dense.get_parameter(n).nbytes for n in names)


def test_torch_csr_peer_and_the_training_check(tiny):
    config, dense = tiny
    sparse, masked, names = models.prune(dense, models.CSR)
    peer = models.torch_csr(masked, names)
    assert all(peer.get_submodule(n.rsplit(".", 1)[0]).weight.layout == torch.sparse_csr for n in names)
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative_error(peer(input_ids=ids).last_hidden_state, masked(input_ids=ids).last_hidden_state) < 1e-5
    built = {"pruned": {models.CSR.name: (sparse, masked, names)}, "names": names}
    note = models._check_training(built, ids, torch.randn(1, 16, config.hidden_size))
    assert "embeddings' gradient" in note and "weights after AdamW" in note
    # the check fails where the pruned model's weights differ from the dense one's
    with torch.no_grad():
        dict(masked.named_parameters())[names[0]].mul_(1.5)
    with pytest.raises(AssertionError, match="fine-tuning step is wrong"):
        models._check_training(built, ids, torch.randn(1, 16, config.hidden_size))


def test_run_peers_takes_a_looser_bound_for_the_named_peers():
    """The bf16 rows are checked at a 16-bit tolerance; the others keep the float32 one."""
    ref = torch.ones(8)
    peers = {"ref": lambda: ref, "close": lambda: ref + 5e-3, "also close": lambda: ref + 5e-3}
    t = Table("models", "test", "setup")
    run_peers(t, peers, "ref", QUICK, tolerances={"close": 1e-2})
    assert t.row("close").timing is not None
    assert t.row("also close").timing is None and t.row("also close").status.startswith("WRONG RESULT")
    assert "close: 5.0e-03 (tolerance 0.01)" in t.notes[0]


def test_a_compiled_peer_is_judged_slow_by_its_second_call():
    """A ``torch.compile``d peer's first call is its compilation: named in ``compiles``, it is timed in the rounds
    when its later calls are fast; a peer not named, slow on its first call, is timed on one call only."""
    import dataclasses
    import time
    cfg = dataclasses.replace(QUICK, slow_s=0.05, repeat=3)

    def compiling():
        calls = []

        def call():
            if not calls:
                time.sleep(0.1)
            calls.append(1)
            return torch.ones(4)
        return call
    t = Table("compile", "test", "setup")
    run_peers(t, {"ref": lambda: torch.ones(4), "compiled": compiling(), "not named": compiling()}, "ref", cfg,
              compiles=frozenset({"compiled"}))
    assert t.row("compiled").timing.runs >= 3
    assert t.row("not named").timing.runs == 1
    assert "Slow peers" in t.notes[-1] and "not named" in t.notes[-1] and "compiled," not in t.notes[-1]


def test_without_transformers_the_bert_rows_say_so(monkeypatch):
    monkeypatch.setattr(models, "transformers_or_none", lambda: "transformers: ModuleNotFoundError; pip install")
    bert = models.Bert(1)
    for t in (models.bert_inference(bert, QUICK, 1), models.bert_finetune(bert, QUICK, 1)):
        assert t.rows and all(r.timing is None and r.status.startswith("not installed (transformers") for r in t.rows)
