"""scaled_value_and_grad: value, unscaled grads, finiteness and the next loss scale in one call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training.dynamic_scale import DynamicScale

import jamp.scaler as js


def loss_fn(params, x):
    return jnp.mean((x @ params["w"]) ** 2) + jnp.sum(params["b"] ** 2)


PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2), "b": jnp.array([0.5, -0.25])}
X = jnp.arange(12.0).reshape(4, 3) / 10


@pytest.mark.parametrize("make_ls", [
    lambda: js.DynamicLossScale(jnp.float32(2.0**15), period=2),
    lambda: js.GradScaler(growth_interval=2).init(),
    lambda: js.StaticLossScale(jnp.float32(256.0)),
    lambda: js.NoOpLossScale(),
], ids=["dynamic", "grad_scaler", "static", "noop"])
def test_finite_step_matches_jax_value_and_grad(make_ls, variant):
    ls = make_ls()
    value, grads, finite, new_ls = variant(js.scaled_value_and_grad(loss_fn))(ls, PARAMS, X)
    want_value, want_grads = jax.value_and_grad(loss_fn)(PARAMS, X)
    # The loss as fun computed it, not scaled and unscaled (eager runs match bit for bit).
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for k in PARAMS:
        np.testing.assert_allclose(grads[k], want_grads[k], rtol=1e-6)
    assert finite.dtype == jnp.bool_ and bool(finite)
    assert type(new_ls) is type(ls)
    if isinstance(ls, js.DynamicLossScale):
        assert int(new_ls.counter) == 1
    if isinstance(ls, js.GradScalerState):
        assert int(new_ls.counter) == 1


def test_value_is_not_round_tripped_through_the_scale():
    # 0.1 * 3 scaled by 3 and divided back would not be bit-exact; the value is fun's own.
    ls = js.StaticLossScale(jnp.float32(3.0))
    value, _, _, _ = js.scaled_value_and_grad(lambda w: jnp.sum(w) * 0.1)(ls, jnp.ones(3))
    assert float(value) == float(jnp.sum(jnp.ones(3)) * 0.1)


def test_non_finite_step_backs_off(variant):
    ls = js.GradScaler().init()
    bad_x = X.at[1, 1].set(jnp.inf)
    value, grads, finite, new_ls = variant(js.scaled_value_and_grad(loss_fn))(ls, PARAMS, bad_x)
    assert not bool(finite)
    assert float(new_ls.loss_scale) == 32768.0 and int(new_ls.counter) == 0


def test_has_aux_and_argnums(variant):
    def fn(w, b, x):
        loss = jnp.sum((x @ w + b) ** 2)
        return loss, {"pred_mean": jnp.mean(x @ w)}

    ls = js.DynamicLossScale(jnp.float32(64.0))
    vg = variant(js.scaled_value_and_grad(fn, argnums=(0, 1), has_aux=True))
    (loss, aux), (gw, gb), finite, _ = vg(ls, PARAMS["w"], PARAMS["b"], X)
    (want_loss, want_aux), (ww, wb) = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(
        PARAMS["w"], PARAMS["b"], X)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(aux["pred_mean"], want_aux["pred_mean"], rtol=1e-6)
    np.testing.assert_allclose(gw, ww, rtol=1e-6)
    np.testing.assert_allclose(gb, wb, rtol=1e-6)
    assert bool(finite)


def test_agrees_with_flax_dynamic_scale_on_values_grads_and_finiteness():
    for x in (X, X.at[0, 0].set(jnp.nan)):
        ds = DynamicScale(scale=2.0**10)
        _, ds_finite, ds_value, ds_grads = ds.value_and_grad(loss_fn)(PARAMS, x)
        value, grads, finite, _ = js.scaled_value_and_grad(loss_fn)(
            js.DynamicLossScale(jnp.float32(2.0**10)), PARAMS, x)
        assert bool(finite) == bool(ds_finite)
        if bool(finite):
            np.testing.assert_allclose(value, ds_value, rtol=1e-6)
            for k in PARAMS:
                np.testing.assert_allclose(grads[k], ds_grads[k], rtol=1e-6)


def test_half_precision_loss_is_scaled_without_overflow():
    # The float16 loss (32) times 2**12 would overflow in float16; the scale promotes it to
    # float32, while the float16 backward (2**12 * 8) still fits.
    def fn(w):
        return jnp.sum(w.astype(jnp.float16) * jnp.float16(8.0))

    ls = js.DynamicLossScale(jnp.float32(2.0**12))
    assert ls.scale(fn(jnp.ones(4))).dtype == jnp.float32
    value, grads, finite, _ = js.scaled_value_and_grad(fn)(ls, jnp.ones(4, jnp.float32))
    assert bool(finite) and value.dtype == jnp.float16
    np.testing.assert_array_equal(grads, np.full(4, 8.0, np.float32))
    assert float(value) == 32.0
