"""Fixtures for the autocast tests: a small NNX model with training state."""

import pytest
from flax import nnx


class TrainNet(nnx.Module):
    """Linear -> BatchNorm -> Dropout: the NNX state a training step updates."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.bn(self.linear(x)))


@pytest.fixture(scope="session")
def train_net():
    """The `TrainNet` class (an NNX model with BatchNorm statistics and Dropout RNG counts)."""
    return TrainNet
