"""Common jnp / lax / jax.nn functions under autocast (both tables): each op computes in the dtype
its table gives it, read from the transformed program, and the values, under jit and
differentiated, stay close to float32's. Weak-typed carries, mixed-type ops, scatter,
reduce_window, PRNG keys, integer operands."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jamp
from jamp.policy import ACCUMULATE_FP32, FP32, LOWER, autocast_table

from helpers import F32, W, X, jaxpr_equations

CASES = {
    "scan_weak_carry": lambda x, w: lax.scan(lambda c, r: (c + jnp.sum(r @ w), c), 0.0, x)[0],
    "fori_weak_carry": lambda x, w: lax.fori_loop(0, 3, lambda i, c: c * 0.5 + jnp.sum(x @ w), 0.0),
    "cond_python_scalar": lambda x, w: lax.cond(x[0, 0] < 0, lambda: jnp.sum(x @ w), lambda: 1.0),
    "where_literal": lambda x, w: jnp.where(x > 0, x @ w, 0.0),
    "einsum": lambda x, w: jnp.einsum("ij,jk->ik", x, w),
    "conv": lambda x, w: lax.conv_general_dilated(
        (x @ w)[None, None], w[None, None, :2, :2], (1, 1), "SAME")[0, 0],
    "dot_product_attention": lambda x, w: jax.nn.dot_product_attention(
        x[None, :, None, :], (x @ w)[None, :, None, :], x[None, :, None, :]),
    "logsumexp": lambda x, w: jax.nn.logsumexp(x @ w, axis=-1),
    "concatenate": lambda x, w: jnp.concatenate([x @ w, x]),
    "dynamic_update_slice": lambda x, w: lax.dynamic_update_slice(x, (x @ w)[:1], (1, 0)),
    "scatter_add": lambda x, w: x.at[0].add((x @ w)[1]),
    "clip": lambda x, w: jnp.clip(x @ w, -0.1, x),
    "pad": lambda x, w: jnp.pad(x @ w, 1, constant_values=0.5),
    "sort": lambda x, w: jnp.sort(x @ w),
    "cumsum": lambda x, w: jnp.cumsum(x @ w, axis=0),
    "relu_in_jit": jax.jit(lambda x, w: jax.nn.relu(x @ w)),
    "silu": lambda x, w: jax.nn.silu(x @ w),
    # `+ x` keeps the pooled values apart: x @ w alone has windows whose maximum is an exact tie
    # in real arithmetic, where the float32 reference's gradient follows rounding (which element
    # XLA's matmul rounds highest differs between its CPU emitters, so between jaxlib versions).
    "max_pool": lambda x, w: lax.reduce_window(x @ w + x, -jnp.inf, lax.max, (2, 2), (1, 1),
                                               "VALID"),
    "avg_pool": lambda x, w: lax.reduce_window(x @ w, 0.0, lax.add, (2, 2), (1, 1), "VALID"),
    "prng_noise": lambda x, w: x @ w + 0.01 * jax.random.normal(jax.random.key(0), (3, 4)),
    "float_pow": lambda x, w: jnp.abs(x @ w) ** 1.5,
    "integer_operand": lambda x, w: (x @ w) * jnp.arange(4),
    "erf": lambda x, w: jax.scipy.special.erf(x @ w),
    "var": lambda x, w: jnp.var(x @ w, axis=-1),
}


def total(f):
    return lambda x, w: jnp.sum(f(x, w))


@functools.cache
def float32_reference(name):
    """The case's value and its gradient in w as written, in one compiled program."""
    f = CASES[name]
    return jax.jit(lambda x, w: (f(x, w), jax.grad(total(f), argnums=1)(x, w)))(X, W)


def listed_ops(f, table):
    """(primitive, rule, dtypes of its floating inputs) for each op of `f`'s program that
    `table` lists, nested programs included."""
    found = []
    for eqn in jaxpr_equations(jax.make_jaxpr(f)(X, W)):
        rule = table.rule(eqn.primitive.name)
        if rule is not None:
            dtypes = {np.dtype(v.aval.dtype) for v in eqn.invars
                      if jnp.issubdtype(v.aval.dtype, jnp.floating)}
            found.append((eqn.primitive.name, rule, dtypes))
    return found


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_ops_compute_in_their_tables_dtype_close_to_float32(name, device_type):
    f = CASES[name]
    g = jamp.autocast(f, device_type=device_type)
    step = lambda x, w: (g(x, w), jax.grad(total(g), argnums=1)(x, w))

    table = autocast_table(device_type)
    low = table.default_dtype
    computes_in = {LOWER: {low}, FP32: {F32}, ACCUMULATE_FP32: {F32}}
    forward = listed_ops(g, table)
    assert any(rule == LOWER for _, rule, _ in forward)  # every case has a matmul
    assert [(op, d) for op, rule, d in forward if d != computes_in[rule]] == []
    # The backward's matmuls run low too. Its other ops are JAX's derivatives of the forward's
    # (a reduce_sum transposing a low broadcast is low), which no table lists.
    assert all(d == {low} for _, rule, d in listed_ops(step, table) if rule == LOWER)

    # One compiled program per run (op-by-op compiles would dominate the suite's time).
    got, grad = jax.jit(step)(X, W)
    want, want_grad = float32_reference(name)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)
    assert grad.dtype == F32
    np.testing.assert_allclose(grad, want_grad, rtol=1e-1, atol=1e-1)
