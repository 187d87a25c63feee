"""Fixtures for the torch.autograd port's tests."""

import jax
import pytest


@pytest.fixture
def x64():
    """JAX's 64-bit mode for one test (restored after it: tests share a process), so values
    compare with torch's in float64."""
    with jax.enable_x64(True):
        yield
