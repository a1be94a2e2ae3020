import os

import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def assert_matches_dense(result, expected):
    """The one comparison every op test uses: a scorch result (sparse or dense) against the dense torch one."""
    from scorch import SparseTensor
    got = result.to_dense() if isinstance(result, SparseTensor) else result
    assert tuple(got.shape) == tuple(expected.shape), (got.shape, expected.shape)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    if expected.dtype.is_floating_point:
        torch.testing.assert_close(got, expected)
    else:
        assert torch.equal(got, expected)
