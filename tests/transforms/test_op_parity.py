"""Autocast's op parity with torch, item by item: float32-list ops compute in float32 from the
start of their chain, lower-list ops return the low dtype (bias and gates included), a matmul of
a low and a float32 input returns the low dtype, linear algebra composites run in float32, and
complex numbers built from lowered parts work. Read from the transformed jaxpr and the lowered
program, eagerly and under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jamp

BF16, F16, F32 = (np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
LOW = {"cpu": BF16, "cuda": F16}

X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
W = jnp.linspace(0.5, -0.5, 16, dtype=jnp.float32).reshape(4, 4)


def raw(f, **kw):
    return jamp.autocast(f, cast_outputs=False, **kw)


# -- item 3: a matmul of a low and a float32 input ------------------------------------------

@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("op", [
    lambda a, b: a @ b,
    lambda a, b: jnp.matmul(a, b),
    lambda a, b: jnp.einsum("ij,jk->ik", a, b),
    lambda a, b: jnp.dot(a, b),
    lambda a, b: jnp.vecdot(a, b.T[:3]),
], ids=["matmul", "jnp.matmul", "einsum", "dot", "vecdot"])
def test_matmul_of_a_low_and_a_float32_input_returns_low(op, device_type, variant, inspect):
    low = LOW[device_type]
    f = raw(op, device_type=device_type)
    a = X.astype(low)
    assert variant(f)(a, W).dtype == low
    # Accumulation inside the op is XLA's business; the op's result type is the low one.
    for types in inspect.lowered_op_types(f, a, W, op="dot_general"):
        assert types == (low.name,) * 3


# -- item 5: complex numbers from lowered parts -----------------------------------------------

@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_complex_from_lowered_parts(device_type, variant):
    def polar(x, w):
        magnitude, angle = jnp.abs(x @ w), x @ w.T
        return lax.complex(magnitude * jnp.cos(angle), magnitude * jnp.sin(angle))

    def view_as_complex(x, w):
        pairs = (x @ w).reshape(3, 2, 2)
        return lax.complex(pairs[..., 0], pairs[..., 1])

    for fn in (polar, view_as_complex):
        got = variant(raw(fn, device_type=device_type))(X, W)
        assert got.dtype == jnp.complex64
        np.testing.assert_allclose(got, fn(X, W), rtol=3e-2, atol=3e-2)


# -- item 4: linear algebra composites compute in float32 ------------------------------------

A = (jnp.eye(4) * 3.0 + jnp.linspace(-0.5, 0.5, 16).reshape(4, 4)).astype(jnp.float32)
LINALG = {
    "pinv": lambda a, x: jnp.linalg.pinv(a @ x),
    "lstsq": lambda a, x: jnp.linalg.lstsq(a @ x, x)[0],
    "solve": lambda a, x: jnp.linalg.solve(a @ x, x),
    "inv": lambda a, x: jnp.linalg.inv(a @ x),
    "tensorinv": lambda a, x: jnp.linalg.tensorinv((a @ x).reshape(2, 2, 4), ind=2),
    "expm": lambda a, x: jax.scipy.linalg.expm(0.1 * (a @ x)),
}


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("name", sorted(LINALG))
def test_linear_algebra_composites_compute_in_float32(name, device_type, variant, inspect):
    fn = LINALG[name]
    f = raw(fn, device_type=device_type)
    x = jnp.eye(4, dtype=jnp.float32) + 0.01
    got = variant(f)(A, x)
    assert got.dtype == F32
    np.testing.assert_allclose(got, fn(A, x), rtol=3e-2, atol=3e-2)
    matmuls = inspect.lowered_op_types(f, A, x, op="dot_general")
    # The user's `a @ x` lowers; every matmul inside the composite runs in float32.
    low = LOW[device_type].name
    assert matmuls[0] == (low, low, low)
    assert all(t == ("float32",) * 3 for t in matmuls[1:])
    assert name in ("solve", "inv", "tensorinv") or len(matmuls) > 1  # in the derivative
    loss = lambda g: lambda a, x: jnp.sum(g(a, x))
    np.testing.assert_allclose(variant(jax.grad(loss(f)))(A, x), jax.grad(loss(fn))(A, x),
                               rtol=5e-2, atol=5e-2)
