"""Autocast's op parity with torch, item by item: float32-list ops compute in float32 from the
start of their chain, lower-list ops return the low dtype (bias and gates included), a matmul of
a low and a float32 input returns the low dtype, linear algebra composites run in float32, and
complex numbers built from lowered parts work. Read from the transformed jaxpr and the lowered
program, eagerly and under jit."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax import lax

import jamp

from helpers import BF16, F16, F32, W, X, hlo_op_types, lowered_op_types

LOW = {"cpu": BF16, "cuda": F16}


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
def test_matmul_of_a_low_and_a_float32_input_returns_low(op, device_type, variant):
    low = LOW[device_type]
    f = raw(op, device_type=device_type)
    a = X.astype(low)
    assert variant(f)(a, W).dtype == low
    # Accumulation inside the op is XLA's business; the op's result type is the low one.
    for types in lowered_op_types(f, a, W, op="dot_general"):
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
def test_linear_algebra_composites_compute_in_float32(name, device_type, variant):
    fn = LINALG[name]
    f = raw(fn, device_type=device_type)
    x = jnp.eye(4, dtype=jnp.float32) + 0.01
    got = variant(f)(A, x)
    assert got.dtype == F32
    np.testing.assert_allclose(got, fn(A, x), rtol=3e-2, atol=3e-2)
    matmuls = lowered_op_types(f, A, x, op="dot_general")
    # The user's `a @ x` lowers; every matmul inside the composite runs in float32.
    low = LOW[device_type].name
    assert matmuls[0] == (low, low, low)
    assert all(t == ("float32",) * 3 for t in matmuls[1:])
    assert name in ("solve", "inv", "tensorinv") or len(matmuls) > 1  # in the derivative
    # The derivative under jit in both variants: eagerly, its dozens of primitives would each
    # compile on their own, and the eager path is the forward's above.
    loss = lambda g: lambda a, x: jnp.sum(g(a, x))
    np.testing.assert_allclose(jax.jit(jax.grad(loss(f)))(A, x), jax.grad(loss(fn))(A, x),
                               rtol=5e-2, atol=5e-2)


# -- item 2: lower-list ops return the low dtype, bias and gates included ----------------------

CELLS = {
    "LSTMCell": lambda: nn.LSTMCell(8),
    "OptimizedLSTMCell": lambda: nn.OptimizedLSTMCell(8),
    "GRUCell": lambda: nn.GRUCell(8),
    "SimpleCell": lambda: nn.SimpleCell(8),
}


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("name", sorted(CELLS))
def test_rnn_cells_return_the_low_dtype(name, device_type, variant):
    cell = CELLS[name]()
    x = X[:2]
    carry = cell.initialize_carry(jax.random.key(0), x.shape)
    params = cell.init(jax.random.key(1), carry, x)
    f = raw(cell.apply, device_type=device_type)
    new_carry, y = variant(f)(params, carry, x)
    low = LOW[device_type]
    assert {a.dtype for a in jax.tree.leaves((new_carry, y))} == {low}
    chex.assert_trees_all_close(  # chex compares the low dtype's values as float32
        (new_carry, y), cell.apply(params, carry, x), rtol=5e-2, atol=5e-2)


def test_nnx_lstm_cell_returns_the_low_dtype(variant):
    cell = nnx.LSTMCell(4, 8, rngs=nnx.Rngs(0))
    x = X[:2]
    carry = cell.initialize_carry(x.shape, nnx.Rngs(1))
    f = raw(lambda cell, carry, x: cell(carry, x), device_type="cpu")
    assert {a.dtype for a in jax.tree.leaves(variant(f)(cell, carry, x))} == {BF16}


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("op", [
    lambda x, w, b: x @ w.T + b,                       # linear
    lambda x, w, b: b + jnp.dot(x, w.T),               # addmm(bias, x, w.T)
    lambda x, w, b: jnp.einsum("bij,bjk->ik", jnp.stack([x, x]), jnp.stack([w.T, w.T])) + b,
    lambda x, w, b: (x @ w.T + b) * w[0],              # a scale inside the kernel
], ids=["linear", "addmm", "addbmm", "scaled"])
def test_linear_ops_with_a_bias_return_the_low_dtype(op, device_type, variant):
    low = LOW[device_type]
    b = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)
    for x in (X, X.astype(low)):  # float32 inputs, and a low input mixed in
        f = raw(op, device_type=device_type)
        assert variant(f)(x, W, b).dtype == low
        text = jax.jit(f).lower(x, W, b).as_text()
        # The bias is added to the float32 accumulator inside the kernel, and the sum
        # rounded once to the low dtype.
        assert set(hlo_op_types(text, "add")) == {("float32",)}


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_conv_with_bias_returns_the_low_dtype(device_type, variant):
    conv = nn.Conv(4, (3, 3))
    images = jnp.ones((1, 5, 5, 3))
    params = conv.init(jax.random.key(0), images)
    assert variant(raw(conv.apply, device_type=device_type))(params, images).dtype == \
        LOW[device_type]


def test_residuals_and_masks_added_to_a_layer_still_promote(variant):
    # Full-size values added to a layer's result are added outside torch's kernel.
    f = raw(lambda x, w, mask: (x + x @ w, x @ w + mask), device_type="cpu")
    residual, masked = variant(f)(X, W, jnp.where(X > 0, 0.0, -1e9))
    assert residual.dtype == F32 and masked.dtype == F32
