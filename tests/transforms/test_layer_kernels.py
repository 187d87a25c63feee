"""A linear layer is one low-precision kernel, as torch's `linear`/`addmm` is: its bias add
belongs to it, not to a float32 op that reads its result (see docs/autocast.md, "Linear
layers, biases and gates")."""

import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp

from helpers import F16, F32, eqn_dtypes, jaxpr_eqns

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import torch_training_parity as parity  # noqa: E402


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        hidden = nn.gelu(nn.Dense(16, name="hidden")(x))
        return nn.Dense(10, name="out")(hidden)


MODEL = Classifier()
X = jax.random.normal(jax.random.key(0), (4, 8))
LABELS = jnp.arange(4)
PARAMS = MODEL.init(jax.random.key(1), X)


def loss(params, x, labels, scale=1.0):
    logits = MODEL.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean() * scale


@pytest.mark.parametrize("rules", [None, [("out", "float16")]])
def test_cross_entropy_after_a_dense_reads_float16_logits(rules):
    # torch: the last Linear returns float16 logits (bias added inside its kernel); the
    # cross-entropy casts them to float32. Before: the bias add was pulled into the float32
    # chain of the loss (float32 logits), whatever rule named the layer.
    f = jamp.autocast(loss, device_type="cuda", dtype=F16, rules=rules)
    jaxpr = jax.make_jaxpr(f)(PARAMS, X, LABELS).jaxpr
    dots = jaxpr_eqns(jaxpr, "dot_general")
    assert [eqn_dtypes(e)[0] for e in dots] == [["float16", "float16"]] * 2
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    (read,) = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
               and e.params["new_dtype"] == F32 and e.invars[0].aval.shape == (4, 10)]
    logits = read.invars[0]
    assert logits.aval.dtype == F16
    # The float16 logits are the layer's whole result: its bias is added before they are
    # rounded (in float16, or in float32 inside the kernel and rounded once).
    while producer[logits].primitive.name == "convert_element_type":
        logits = producer[logits].invars[0]
    assert producer[logits].primitive.name == "add"


def test_bias_gradient_is_a_float16_sum_that_overflows_as_torch_s_does():
    # torch's float16 bias gradient sums the batch's float16 cotangents to float16: here each
    # cotangent is finite, their sum is not, and GradScaler skips the step. Before: summed in
    # float32, finite.
    x = jax.random.normal(jax.random.key(2), (64, 8))
    labels = jnp.zeros(64, jnp.int32)
    scale = 2.0 ** 17
    f = jamp.autocast(loss, device_type="cuda", dtype=F16)
    grads = jax.jit(jax.grad(f))(PARAMS, x, labels, scale)["params"]["out"]
    assert not np.isfinite(np.asarray(grads["bias"])).all()
    reference = jax.grad(loss)(PARAMS, x, labels, scale)["params"]["out"]["bias"]
    assert np.isfinite(np.asarray(reference)).all()


def test_float16_training_skips_the_steps_torch_skips(torch):
    # The MLP of benchmarks/torch_training_parity.py, 64-256-256-10 with GELU, trained in torch
    # and in jamp from the same weights on the same batches (float16 autocast, GradScaler that
    # grows every step until the gradients overflow). Before: jamp's logits were float32 and its
    # output bias gradient a float32 sum, so it did not skip step 3, where torch's overflows.
    layers = parity.weights()
    data = parity.batches(steps=4, batch=8)
    torch_skipped, torch_scales = parity.torch_run(layers, data)
    skipped, scales = parity.jamp_run(layers, data)
    assert skipped == torch_skipped and any(skipped)
    assert scales == torch_scales
