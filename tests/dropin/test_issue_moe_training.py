"""The issue's mixture-of-experts program followed by a loss, ``backward()`` and an optimizer step: under scorch
it runs with no warning (warnings are errors here) and no dense fallback (``scorch.stats()``), its output is a
plain dense tensor, and every value is torch's."""
import warnings

import pytest
import torch

import scorch

from issue_moe import train, train_reference


@pytest.mark.parametrize("deferral", ["auto", "all", "off"])
def test_training_step_without_warning_or_fallback(deferral):
    scorch.reset_stats()
    with warnings.catch_warnings(), scorch.deferral(deferral):
        warnings.simplefilter("error")
        got = train(scorch)
    assert scorch.stats() == {"densified": {}, "fallback": {}}
    assert type(got["y"]) is torch.Tensor  # dense, as torch's sparse x dense convention (inference rule 4)
    want = train_reference(torch)
    for key in want:
        torch.testing.assert_close(got[key].detach(), want[key].detach(), rtol=1e-4, atol=1e-5, msg=key)
