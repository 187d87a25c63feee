"""Common jnp / lax / jax.nn functions run under autocast (both tables), under jit and
differentiated, with values close to float32: weak-typed carries, mixed-type ops, scatter,
reduce_window, PRNG keys, integer operands."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jamp

X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
W = jnp.linspace(0.5, -0.5, 16, dtype=jnp.float32).reshape(4, 4)

CASES = {
    "scan_weak_carry": lambda x, w: lax.scan(lambda c, r: (c + jnp.sum(r @ w), c), 0.0, x)[0],
    "fori_weak_carry": lambda x, w: lax.fori_loop(0, 3, lambda i, c: c * 0.5 + jnp.sum(x @ w), 0.0),
    "cond_python_scalar": lambda x, w: lax.cond(x[0, 0] < 0, lambda: jnp.sum(x @ w), lambda: 1.0),
    "where_literal": lambda x, w: jnp.where(x > 0, x @ w, 0.0),
    "einsum": lambda x, w: jnp.einsum("ij,jk->ik", x, w),
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
    "max_pool": lambda x, w: lax.reduce_window(x @ w, -jnp.inf, lax.max, (2, 2), (1, 1), "VALID"),
    "avg_pool": lambda x, w: lax.reduce_window(x @ w, 0.0, lax.add, (2, 2), (1, 1), "VALID"),
    "prng_noise": lambda x, w: x @ w + 0.01 * jax.random.normal(jax.random.key(0), (3, 4)),
    "float_pow": lambda x, w: jnp.abs(x @ w) ** 1.5,
    "integer_operand": lambda x, w: (x @ w) * jnp.arange(4),
    "erf": lambda x, w: jax.scipy.special.erf(x @ w),
    "var": lambda x, w: jnp.var(x @ w, axis=-1),
}


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_runs_close_to_float32(name, device_type):
    f = CASES[name]
    g = jamp.autocast(f, device_type=device_type)
    loss = lambda f: (lambda x, w: jnp.sum(f(x, w)))
    # One compiled program per case keeps the suite quick on two cores.
    got, grad = jax.jit(lambda x, w: (g(x, w), jax.grad(loss(g), argnums=1)(x, w)))(X, W)
    want = f(X, W)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(grad, jax.grad(loss(f), argnums=1)(X, W), rtol=1e-1, atol=1e-1)
