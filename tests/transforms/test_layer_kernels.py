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

from helpers import F16, F32, eqn_dtypes, jaxpr_eqns, lowered_op_types

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
    # (The bias, broadcast to the logits' shape in float16, is widened too.)
    (read,) = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
               and e.params["new_dtype"] == F32 and e.invars[0].aval.shape == (4, 10)
               and producer[e.invars[0]].primitive.name != "broadcast_in_dim"]
    logits = read.invars[0]
    assert logits.aval.dtype == F16
    # The float16 logits are the layer's whole result: its bias is added before they are
    # rounded (in float16, or in float32 inside the kernel and rounded once).
    while producer[logits].primitive.name in ("convert_element_type", "reduce_precision"):
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
    mlp = parity.MODELS["mlp"]
    data = mlp.batches(steps=4, batch=8)
    torch_skipped, torch_scales = parity.torch_run(mlp, data)
    skipped, scales = parity.jamp_run(mlp, data)
    assert skipped == torch_skipped and any(skipped)
    assert scales == torch_scales


# -- kernels computed in float32 inside and rounded once ------------------------------------

RNG = np.random.default_rng(0)
ACT = RNG.standard_normal((32, 64)).astype(np.float32)
KERNEL = (RNG.standard_normal((64, 256)) / 8).astype(np.float32)
BIAS = RNG.standard_normal(256).astype(np.float32)


def bfloat16_of(f, *args):
    """`f` under cpu autocast, its result as float32 numbers."""
    out = jamp.autocast(f, device_type="cpu", cast_outputs=False)(*args)
    assert out.dtype == jnp.bfloat16
    return np.asarray(out.astype(F32))


def test_bfloat16_linear_rounds_once_as_torch_s_kernel(torch):
    # torch's CPU linear accumulates in float32, adds its (bfloat16) bias there and rounds
    # once. Before: the matmul's result was rounded, then the sum again (about a quarter of
    # the outputs 1 ulp off torch's).
    linear = torch.nn.Linear(64, 256)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(KERNEL.T.copy()))
        linear.bias.copy_(torch.from_numpy(BIAS))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = linear(torch.from_numpy(ACT)).float().numpy()
    got = bfloat16_of(lambda x, w, b: x @ w + b, ACT, KERNEL, BIAS)
    assert (got == want).mean() >= 0.99


def test_python_float_scale_is_applied_in_float32_and_rounded_once(torch):
    # torch multiplies a bfloat16 tensor by a Python float at float32 and rounds once.
    # Before: the constant was rounded to bfloat16 first (0.3 is not a bfloat16).
    # Small integers: the matmul is exact in bfloat16, whatever XLA fuses of its rounding.
    x, w = (RNG.integers(-2, 3, shape).astype(np.float32) for shape in ((32, 64), (64, 256)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = (torch.from_numpy(x) @ torch.from_numpy(w) * 0.3).float().numpy()
    got = bfloat16_of(lambda x, w: x @ w * 0.3, x, w)
    assert (got == want).all()


def test_a_linear_kernel_differentiates_to_low_precision_matmuls():
    # The forward accumulates in float32; the backward's matmuls take and return the low
    # dtype, as torch's do (differentiated as written, they would read float32 cotangents).
    f = jamp.autocast(lambda x, w, b: jnp.sum((x @ w + b) ** 2), device_type="cpu")
    dots = lowered_op_types(jax.grad(f, argnums=(0, 1, 2)), ACT, KERNEL, BIAS,
                            op="dot_general")
    assert sorted(dots) == [("bfloat16",) * 3] * 2 + [("bfloat16", "bfloat16", "float32")]


def test_a_bias_gradient_is_summed_in_float32_and_rounded_once():
    # torch sums a Linear's low output gradient into its bias gradient accumulating in float32
    # and rounds once. Before: summed in the low dtype (XLA's fused float16 sums round as
    # they go; the parity benchmark's float16 MLP then skipped step 17, torch does not).
    f = jamp.autocast(lambda x, w, b: jnp.sum(jnp.sin(x @ w + b)), device_type="cpu",
                      dtype=F16)
    sums = lowered_op_types(jax.grad(f, argnums=2), ACT, KERNEL, BIAS, op="reduce")
    assert sums == [("float32",) * 3] * 2   # the bias gradient's and the loss's


def torch_linear(torch):
    """torch's Linear holding KERNEL and BIAS."""
    linear = torch.nn.Linear(64, 256)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(KERNEL.T.copy()))
        linear.bias.copy_(torch.from_numpy(BIAS))
    return linear


def test_bfloat16_gelu_computes_in_float32_and_rounds_once_as_torch_s_kernel(torch):
    # torch's CPU gelu reads the Linear's bfloat16 output, computes in float32 (1/sqrt(2) a
    # float32 constant) and rounds once. Before: its constant and each step rounded (about a
    # quarter of the outputs off torch's).
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.nn.functional.gelu(torch_linear(torch)(torch.from_numpy(ACT)))
    got = bfloat16_of(lambda x, w, b: jax.nn.gelu(x @ w + b, approximate=False),
                      ACT, KERNEL, BIAS)
    assert (got == want.float().numpy()).mean() >= 0.99


def test_bfloat16_attention_softmax_matches_torch_s_kernels(torch):
    # Scores of two activations scaled by a Python float, then softmax: torch rounds the
    # scores' matmul, scales at float32 and rounds, and its softmax computes in float32 and
    # rounds once. Before: XLA dropped the matmul's rounding where the scaling widened it
    # again (excess precision), and softmax rounded at each step (most probabilities off).
    q, k = (ACT[:, :32].reshape(2, 16, 32), ACT[:, 32:].reshape(2, 16, 32))
    scale = 1 / np.sqrt(32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        tq, tk = torch.from_numpy(q), torch.from_numpy(k)
        want = torch.softmax(tq @ tk.transpose(-2, -1) * float(scale), dim=-1)
    got = bfloat16_of(lambda q, k: jax.nn.softmax(q @ k.transpose(0, 2, 1) * float(scale)),
                      q, k)
    assert (got == want.float().numpy()).mean() >= 0.99


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_step0_bfloat16_loss_is_nearer_torch_s_than_torch_s_own_rounding(torch, name):
    # The MLP and the pre-LN causal transformer of benchmarks/torch_training_parity.py at their
    # initial weights: jamp's bfloat16 loss is within half of the distance between torch's
    # bfloat16 and float32 losses. Before: as far from torch's as torch's float32 loss (median
    # ratio about 0.9 for both).
    model = parity.MODELS[name]
    ratios = parity.gap_ratios(model, model.batches(5, 32, seed=2))
    assert np.median(ratios) <= 0.5
