"""The cpu table's `scalar_results` rule (a sum of arrays to one number, and the chain feeding
it, compute in float32) where it must hold beyond a bare `autocast(loss)`: per-example losses
returned beside their mean, `jax.grad` inside autocast, and rules other than `FP32`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp.policy import LOWER, OpTable, autocast_table
from jamp.walker.walk import equations

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)

_K = jax.random.split(jax.random.PRNGKey(0), 3)
W = jax.random.normal(_K[0], (8, 50)) * 2.0
X = jax.random.normal(_K[1], (16, 8))
Y = jax.random.randint(_K[2], (16,), 0, 50)


def _loss(w, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()


def _input_dtypes(fn, *args, primitive):
    """The input dtypes of every `primitive` equation in fn's jaxpr, sub-jaxprs included."""
    found = [tuple(v.aval.dtype for v in eqn.invars)
             for eqn in equations(jax.make_jaxpr(fn)(*args)) if eqn.primitive.name == primitive]
    assert found, f"no {primitive} in the program"
    return found


def test_plain_loss_chain_is_float32():
    # The baseline the commit establishes: log_softmax's exp runs in float32 on the cpu table.
    f = jamp.autocast(_loss, device_type="cpu")
    assert all(d == (F32,) for d in _input_dtypes(f, W, X, Y, primitive="exp"))


def test_loss_chain_stays_float32_when_per_example_losses_are_returned():
    # `return loss, {"per_example": ce}` (or a metric such as ce.max()) must not change the
    # dtypes the loss itself computes in: torch's cross_entropy is float32 whatever its
    # result is used for. Got: the whole log_softmax chain falls back to bfloat16.
    def loss_aux(w, x, y):
        ce = optax.softmax_cross_entropy_with_integer_labels(x @ w, y)
        return ce.mean(), ce

    f = jamp.autocast(loss_aux, device_type="cpu")
    assert all(d == (F32,) for d in _input_dtypes(f, W, X, Y, primitive="exp"))


def test_loss_chain_stays_float32_with_grad_inside_autocast():
    # docs/autocast.md: "`jax.grad` inside: the gradient computation is transformed like any
    # other code". The forward of autocast(value_and_grad(loss)) must compute the loss as
    # autocast(loss) does; got: the backward's reuse of the softmax's exp (a residual) breaks
    # the float32 chain, so the forward exp runs in bfloat16 and the loss value differs.
    f = jamp.autocast(jax.value_and_grad(_loss), device_type="cpu")
    assert all(d == (F32,) for d in _input_dtypes(f, W, X, Y, primitive="exp"))
    plain = jamp.autocast(_loss, device_type="cpu")
    np.testing.assert_allclose(float(f(W, X, Y)[0]), float(plain(W, X, Y)), rtol=1e-6)


@pytest.mark.parametrize("rule, expected", [(LOWER, F16), (jnp.bfloat16, BF16)])
def test_scalar_results_other_than_fp32_is_honoured(rule, expected):
    # OpTable accepts any rule for scalar_results and documents it as "the rule of a sum that
    # reduces arrays to one number, whatever its primitive's rule says". Got: only FP32 takes
    # effect (through the dataflow pass); the interpreter's _fixed_dtype asks the table
    # without the scalar flag, so LOWER or a dtype is silently ignored.
    cuda = autocast_table("cuda")
    table = OpTable(cuda.device_type, cuda.default_dtype, dict(cuda.rules),
                    scalar_results=rule)
    a, b = jnp.linspace(0.0, 1.0, 32), jnp.linspace(1.0, 2.0, 32)
    total = jamp.autocast(lambda a: jnp.sum(a * a), op_table=table)
    assert _input_dtypes(total, a, primitive="reduce_sum") == [(expected,)]
    # A dot product of two vectors is no sum of the rule's and no matrix product: it runs in
    # its inputs' dtype (torch's dot and vdot are on no list).
    dot = jamp.autocast(lambda a, b: jnp.dot(a, b), op_table=table)
    assert _input_dtypes(dot, a, b, primitive="dot_general") == [(F32, F32)]
