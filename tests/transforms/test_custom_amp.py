"""jamp.custom_fwd / jamp.custom_bwd on the fwd and bwd of a jax.custom_vjp (torch semantics)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp

from helpers import F32, W, X, lowered_op_types


def make_matmul(fwd_deco=lambda f: f, bwd_deco=lambda f: f):
    """A custom_vjp matmul whose fwd also reports (through the residual) its compute dtype."""

    @jax.custom_vjp
    def matmul(x, w):
        return x @ w

    def fwd(x, w):
        out = x @ w
        return out, (x, w)

    def bwd(res, g):
        x, w = res
        return (g @ w.T).astype(x.dtype), (x.T @ g).astype(w.dtype)

    matmul.defvjp(fwd_deco(fwd), bwd_deco(bwd))
    return matmul


def loss_of(matmul):
    return lambda x, w: jnp.sum(jnp.tanh(matmul(x, w)))


def grad_dots(matmul):
    g = jax.grad(jamp.autocast(loss_of(matmul), device_type="cpu"), argnums=(0, 1))
    return lowered_op_types(g, X, W, op="dot_general")


def test_undecorated_fwd_follows_autocast_and_bwd_runs_with_autocast_off():
    fwd, bwd1, bwd2 = grad_dots(make_matmul())
    assert fwd == ("bfloat16",) * 3
    # torch: a custom backward without custom_bwd runs outside autocast, in its inputs' types.
    assert {bwd1, bwd2} == {("float32",) * 3}


@pytest.mark.parametrize("cast,name", [(jnp.float32, "float32"), (jnp.float16, "float16")])
def test_cast_inputs_casts_and_runs_the_forward_with_autocast_off(cast, name, variant):
    matmul = make_matmul(fwd_deco=jamp.custom_fwd(cast_inputs=cast))
    dots = grad_dots(matmul)
    assert dots[0] == (name,) * 3
    g = variant(jax.grad(jamp.autocast(loss_of(matmul), device_type="cpu"), argnums=(0, 1)))
    gx, gw = g(X, W)
    want_x, want_w = jax.grad(loss_of(make_matmul()), argnums=(0, 1))(X, W)
    assert gx.dtype == gw.dtype == F32
    np.testing.assert_allclose(gx, want_x, rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(gw, want_w, rtol=3e-2, atol=3e-2)


def test_custom_bwd_runs_with_the_forwards_state():
    fwd, bwd1, bwd2 = grad_dots(make_matmul(bwd_deco=jamp.custom_bwd))
    assert fwd == bwd1 == bwd2 == ("bfloat16",) * 3


def test_custom_bwd_after_cast_inputs_keeps_autocast_state():
    # torch: bwd runs with the forward's *autocast state* (enabled, bfloat16), not with the
    # state custom_fwd set inside the forward.
    matmul = make_matmul(jamp.custom_fwd(cast_inputs=jnp.float32), jamp.custom_bwd)
    fwd, bwd1, bwd2 = grad_dots(matmul)
    assert fwd == ("float32",) * 3
    assert bwd1 == bwd2 == ("bfloat16",) * 3


def test_noops_outside_autocast(variant):
    plain = make_matmul()
    decorated = make_matmul(jamp.custom_fwd(cast_inputs=jnp.float16), jamp.custom_bwd)
    g_plain = jax.grad(loss_of(plain), argnums=(0, 1))
    g_deco = variant(jax.grad(loss_of(decorated), argnums=(0, 1)))
    got = g_deco(X, W)
    chex.assert_type(got, F32)
    chex.assert_trees_all_close(got, g_plain(X, W), rtol=1e-5, atol=1e-6)
    assert set(lowered_op_types(jax.grad(loss_of(decorated)), X, W,
                                op="dot_general")) == {("float32",) * 3}


def test_cast_inputs_none_is_the_function_itself():
    def fwd(x):
        return x, None

    assert jamp.custom_fwd(fwd) is fwd
    assert jamp.custom_fwd(cast_inputs=None)(fwd) is fwd


def test_cast_inputs_leaves_non_floating_inputs():
    @jax.custom_vjp
    def gather_scale(x, idx):
        return x[idx] * 2.0

    def fwd(x, idx):
        assert idx.dtype == jnp.int32
        return x[idx] * 2.0, (jnp.zeros_like(x), idx)

    def bwd(res, g):
        zeros, idx = res
        return zeros.at[idx].add(2.0 * g.astype(zeros.dtype)), None

    gather_scale.defvjp(jamp.custom_fwd(fwd, cast_inputs=jnp.float16), bwd)
    f = jamp.autocast(lambda x: jnp.sum(gather_scale(x, jnp.arange(2, dtype=jnp.int32))),
                      device_type="cpu")
    assert jax.grad(f)(X).dtype == F32
    np.testing.assert_allclose(jax.grad(f)(X)[:2], 2.0)


def test_bad_cast_inputs_is_refused():
    with pytest.raises(ValueError, match="float16, bfloat16, float32"):
        jamp.custom_fwd(lambda x: x, cast_inputs=jnp.int32)
