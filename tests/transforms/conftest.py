"""Helpers for the autocast tests: read the dtypes ops run in from lowered StableHLO and jaxprs;
a small NNX model with training state.

Exposed as fixtures so test modules need no package imports.
"""

import re

import jax
import numpy as np
import pytest
from flax import nnx

_ELEMENT = re.compile(r"tensor<(?:[0-9?]+x)*([a-z0-9]+)>")
_HLO_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
              "i32": "int32", "i64": "int64", "i1": "bool", "ui32": "uint32"}


def hlo_op_types(text: str, op: str) -> list[tuple[str, ...]]:
    """For each `stablehlo.<op>` in `text`, the element types of its operands and result."""
    found = []
    for line in text.splitlines():
        if re.search(rf"stablehlo\.{op}\b", line) is None:
            continue
        signature = line.rsplit(" : ", 1)[-1]
        found.append(tuple(_HLO_NAMES.get(t, t) for t in _ELEMENT.findall(signature)))
    return found


def lowered_op_types(f, *args, op: str) -> list[tuple[str, ...]]:
    return hlo_op_types(jax.jit(f).lower(*args).as_text(), op)


def jaxpr_eqns(jaxpr, name: str) -> list:
    """Every equation of primitive `name` in a jaxpr and its sub-jaxprs, outermost first."""
    found = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == name:
                found.append(eqn)
            for value in eqn.params.values():
                for v in (value if isinstance(value, (tuple, list)) else (value,)):
                    if hasattr(v, "eqns"):
                        walk(v)
                    elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                        walk(v.jaxpr)

    walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
    return found


def eqn_dtypes(eqn) -> tuple[list[str], list[str]]:
    return ([np.dtype(v.aval.dtype).name for v in eqn.invars],
            [np.dtype(v.aval.dtype).name for v in eqn.outvars])


class Inspect:
    hlo_op_types = staticmethod(hlo_op_types)
    lowered_op_types = staticmethod(lowered_op_types)
    jaxpr_eqns = staticmethod(jaxpr_eqns)
    eqn_dtypes = staticmethod(eqn_dtypes)


@pytest.fixture(scope="session")
def inspect():
    return Inspect


@pytest.fixture(params=["eager", "jit"])
def variant(request):
    """Runs a test eagerly and under `jax.jit` (chex.variants' two cases)."""
    return (lambda f: f) if request.param == "eager" else jax.jit


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
