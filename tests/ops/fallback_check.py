"""``falls_back``: the check every test of an op without a sparse rule (for its arguments) makes."""
from __future__ import annotations

import re
import warnings

import pytest

import scorch

from conftest import assert_matches_dense


def falls_back(sparse_call, dense_call, op: str):
    """``sparse_call()`` runs on the dense form: torch's result (``dense_call()``), a ``DensifyWarning`` naming
    ``op``, a count of ``op`` in ``scorch.stats()["fallback"]`` (the counters are reset first); and
    ``DensifyError`` in strict mode."""
    scorch.reset_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sparse_call()
    assert any(issubclass(w.category, scorch.DensifyWarning) and op in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    assert scorch.stats()["fallback"] == {op: 1}, scorch.stats()
    expected = dense_call()
    if isinstance(expected, (tuple, list)):
        for g, e in zip(got, expected):
            assert_matches_dense(g, e)
    else:
        assert_matches_dense(got, expected)
    with scorch.strict(), pytest.raises(scorch.DensifyError, match=re.escape(op) + ".*strict"):
        sparse_call()
    return got
