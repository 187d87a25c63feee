"""Fixtures shared by the loss-scaling tests."""

import jax
import pytest


@pytest.fixture(params=["eager", "jit"])
def maybe_jit(request):
    """Runs the test once eagerly and once with the function under test wrapped in jax.jit."""
    if request.param == "jit":
        return jax.jit
    return lambda fn, **kwargs: fn
