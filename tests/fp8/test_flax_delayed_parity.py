"""The delayed recipe equals Flax's `fp8_ops.Fp8DotGeneralOp` (Transformer Engine's delayed
scaling) over five training steps: outputs, gradients, scales and amax histories.

Both start from scales of 1 and empty histories, so the first step quantizes at scale 1 (the
inputs here exceed float8's range then and saturate in both); the test holds jamp to Flax on
that step too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax.linen import fp8_ops

import jamp

HISTORY = 8
DENSE = (((2,), (0,)), ((), ()))


def _inputs(step):
    keys = jax.random.split(jax.random.key(step), 2)
    # Magnitudes that move from step to step, beyond e4m3's 448 at the first.
    x = jax.random.normal(keys[0], (2, 4, 32)) * (600.0 / (step + 1))
    cotangent = jax.random.normal(keys[1], (2, 4, 16)) * 10.0 ** -step
    return x, cotangent


def _flax_run(kernel):
    model = nn.Dense(16, use_bias=False, dot_general_cls=fp8_ops.Fp8DotGeneralOp)
    x, _ = _inputs(0)
    variables = model.init(jax.random.key(0), x)
    collection = fp8_ops.OVERWRITE_WITH_GRADIENT
    meta = jax.tree.map(lambda v: jnp.zeros((HISTORY,)) if v.shape == (1024,) else v,
                        variables[collection])

    def loss(kernel, meta, x, cotangent):
        out = model.apply({"params": {"kernel": kernel}, collection: meta}, x)
        return jnp.sum(out * cotangent), out

    return _train(loss, kernel, meta, lambda meta: meta["Fp8DotGeneralOp_0"])


def _jamp_run(kernel):
    recipe = jamp.fp8.recipe("delayed", amax_history_length=HISTORY)

    def loss(kernel, state, x, cotangent):
        out = jamp.fp8.dot_general(x, kernel, DENSE, recipe, state=state)
        return jnp.sum(out * cotangent), out

    return _train(loss, kernel, jamp.fp8.init_delayed_state(recipe), lambda s: s._asdict())


def _train(loss, kernel, state, fields):
    @jax.jit
    def step(kernel, state, x, cotangent):
        (_, out), (d_kernel, d_x, new_state) = jax.value_and_grad(
            loss, argnums=(0, 2, 1), has_aux=True)(kernel, state, x, cotangent)
        return kernel - 1e-2 * d_kernel, new_state, (out, d_kernel, d_x)

    trajectory = []
    for i in range(5):
        x, cotangent = _inputs(i)
        kernel, state, results = step(kernel, state, x, cotangent)
        trajectory.append((results, fields(state)))
    return trajectory


@pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated")
def test_five_steps_match_flax():
    kernel = jax.random.normal(jax.random.key(7), (32, 16)) * 0.2
    expected, actual = _flax_run(kernel), _jamp_run(kernel)
    for step, ((e_results, e_state), (a_results, a_state)) in enumerate(zip(expected, actual)):
        for what, a, e in zip(("output", "kernel grad", "input grad"), a_results, e_results):
            np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6 * float(jnp.abs(e).max()),
                                       err_msg=f"step {step}: {what}")
        assert set(a_state) == set(e_state)
        for field in e_state:
            np.testing.assert_allclose(a_state[field], e_state[field], rtol=1e-6,
                                       err_msg=f"step {step}: {field}")
    # The histories filled and the scales left 1: the comparison saw delayed scaling work.
    assert float(actual[-1][1]["input_amax_history"][4]) > 0
    assert float(actual[-1][1]["output_grad_scale"][0]) != 1.0
