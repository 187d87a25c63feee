"""The demo's byte-level GPT in fp8: every recipe (LM head in bfloat16, the blocks' linear
layers in fp8) ends a short run within 0.03 nats/byte of float32's validation loss, and fp8
without scaling does not (so this test can fail)."""

import functools
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

from demo import float32_loss, fp8_rules  # noqa: E402
from models import ByteGPT  # noqa: E402
from text_data import batches, load_corpus, split  # noqa: E402

# Small enough for the suite, large enough to learn: 20 Adam steps of 16 x 32 bytes take
# float32 from ln(256) = 5.5 to about 3.4 nats/byte (fp8 without scaling: about 4.2).
STEPS, BATCH, SEQ = 20, 16, 32
MODEL = ByteGPT(width=32, depth=1, num_heads=2)
TOLERANCE = 0.03


def _unscaled(x, dtype=jnp.float8_e4m3fn):
    """A float8 cast at scale 1 (saturating), back in float32."""
    return jamp.fp8.saturating_cast(x.astype(jnp.float32), dtype).astype(jnp.float32)


@jax.custom_vjp
def _unscaled_dense(x, kernel):
    return _unscaled(x) @ _unscaled(kernel)


def _unscaled_dense_fwd(x, kernel):
    return _unscaled_dense(x, kernel), (x, kernel)


def _unscaled_dense_bwd(saved, g):
    # rowwise's casts (e4m3 for the gradients too) with every scale 1: gradients of about
    # 1 / (tokens in the batch) and below flush to zero in e4m3.
    x, kernel = saved
    g8 = _unscaled(g)
    d_x = g8 @ _unscaled(kernel).T
    d_kernel = _unscaled(x).reshape(-1, x.shape[-1]).T @ g8.reshape(-1, g.shape[-1])
    return d_x.astype(x.dtype), d_kernel.astype(kernel.dtype)


_unscaled_dense.defvjp(_unscaled_dense_fwd, _unscaled_dense_bwd)


def _without_scaling(next_fun, args, kwargs, context):
    """Every Dense layer (the head too) multiplies float8 values cast without scales."""
    if type(context.module) is nn.Dense and context.method_name == "__call__":
        params = context.module.variables["params"]
        return _unscaled_dense(args[0], params["kernel"]) + params["bias"]
    return next_fun(*args, **kwargs)


def _fp8_without_scaling(params, windows):
    with nn.intercept_methods(_without_scaling):
        return float32_loss(MODEL.apply)(params, windows)


@functools.cache
def _data():
    return split(load_corpus())


@functools.cache
def _params():
    return jax.jit(MODEL.init)(jax.random.key(0), np.zeros((1, SEQ), np.int32))["params"]


@jax.jit
def _valid_loss(params, windows):
    return float32_loss(MODEL.apply)(params, windows)


def _validation_after_training(loss, delayed: bool = False, states: list | None = None
                               ) -> float:
    """The float32 validation loss of the params `loss` trained (the same batches each run);
    `delayed`: `loss` runs the delayed recipe, whose state the step threads (and appends to
    `states` at the end)."""
    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, state, fp8_state, windows):
        if delayed:  # the state's gradient is its next value
            grads, fp8_state = jax.grad(jamp.fp8.with_state(loss), argnums=(1, 0))(
                fp8_state, params, windows)
        else:
            grads = jax.grad(loss)(params, windows)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, fp8_state

    params = _params()
    state = tx.init(params)
    stream = batches(_data()[0], BATCH, SEQ, seed=1)
    windows = next(stream)
    fp8_state = jamp.fp8.init_autocast_state(loss, params, windows) if delayed else None
    for _ in range(STEPS):
        params, state, fp8_state = step(params, state, fp8_state, windows)
        windows = next(stream)
    if states is not None:
        states.append(fp8_state)
    valid = batches(_data()[1], BATCH, SEQ, seed=2)
    return float(np.mean([_valid_loss(params, next(valid)) for _ in range(2)]))


@functools.cache
def _float32() -> float:
    return _validation_after_training(float32_loss(MODEL.apply))


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed",
                                  "mxfp8"])
def test_every_recipe_trains_within_tolerance_of_float32(name):
    states: list = []
    fp8 = _validation_after_training(jamp.autocast(
        float32_loss(MODEL.apply), dtype=jnp.bfloat16, rules=fp8_rules(jamp.fp8.recipe(name))),
        delayed=name == "delayed", states=states)
    assert abs(fp8 - _float32()) <= TOLERANCE, (fp8, _float32())
    if name == "delayed":
        # The state went through every step: each GEMM's three histories hold an amax per
        # step (a frozen state, scale 1 throughout, trains about as well on this model).
        for site, state in states[0].items():
            for history in (state.input_amax_history, state.kernel_amax_history,
                            state.output_grad_amax_history):
                assert np.count_nonzero(history) == STEPS, site


def test_fp8_without_scaling_is_half_a_nat_worse():
    assert _float32() < 4.0  # float32 learned
    assert _validation_after_training(_fp8_without_scaling) >= _float32() + 0.5
