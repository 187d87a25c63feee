"""`jamp.DynamicScale` against flax's own `DynamicScale`, run live: same fields, same results,
the same trajectory step for step."""

import dataclasses
import functools

import flax.serialization
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import dynamic_scale as flax_ds
from flax.training import train_state
from jax.sharding import Mesh, PartitionSpec as P

import jamp

FAULTS = [1.0, 1.0, 1.0, 1e30, 1.0, np.inf, 1.0, 1.0, 1.0, 1.0, np.nan, 1.0]


def _loss(params, x):
    # float16 inside, as mixed-precision code has it: large scales overflow for real.
    h = jnp.asarray(params["w"], jnp.float16) * jnp.asarray(x, jnp.float16)
    return jnp.sum(h**2) + jnp.sum(params["b"]), {"mean": jnp.mean(h)}


def _loss_no_aux(params, x):
    return _loss(params, x)[0]


def _run(cls, variant, settings, has_aux):
    params = {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array(0.25)}
    fn = _loss if has_aux else _loss_no_aux
    step = variant(lambda ds, p, x: ds.value_and_grad(fn, has_aux=has_aux)(p, x))
    ds, trail = cls(**settings), []
    for fault in FAULTS:
        result = step(ds, params, jnp.float32(fault))
        ds = result.dynamic_scale
        trail.append(result)
    return trail


SETTINGS = [
    dict(growth_interval=2),
    dict(growth_interval=1, growth_factor=4.0, backoff_factor=0.25),
    dict(growth_interval=0, scale=2.0**14, minimum_scale=2.0**11, backoff_factor=0.125),
    dict(growth_interval=3, minimum_scale=None, scale=3.0),
]


# Each setting drives the scale its own way; an aux output changes what is returned, not how
# the scale moves, so one setting runs with it.
CASES = [(settings, False) for settings in SETTINGS] + [(SETTINGS[0], True)]


@pytest.mark.parametrize("settings,has_aux", CASES,
                         ids=[f"{'aux' if a else 'value'}-{s}" for s, a in CASES])
def test_trajectory_matches_flax_step_for_step(settings, has_aux, variant):
    ours = _run(jamp.DynamicScale, variant, settings, has_aux)
    theirs = _run(flax_ds.DynamicScale, variant, settings, has_aux)
    for mine, flax_result in zip(ours, theirs, strict=True):
        assert type(mine).__name__ == "DynamicScaleResult"
        assert bool(mine.finite) == bool(flax_result.finite)
        for a, b in [(mine.dynamic_scale.scale, flax_result.dynamic_scale.scale),
                     (mine.dynamic_scale.fin_steps, flax_result.dynamic_scale.fin_steps)]:
            assert jnp.asarray(a).dtype == jnp.asarray(b).dtype
            np.testing.assert_array_equal(a, b)
        chex.assert_trees_all_equal((mine.aux, mine.grad),
                                    (flax_result.aux, flax_result.grad))
    # The faults really drove the scale: it backed off and grew.
    scales = [float(r.dynamic_scale.scale) for r in ours]
    assert len(set(scales)) > 2


def test_fields_defaults_and_result_match_flax():
    def described(cls):
        return [(f.name, f.default, f.metadata.get("pytree_node", True))
                for f in dataclasses.fields(cls)]

    assert described(jamp.DynamicScale) == described(flax_ds.DynamicScale)
    assert jamp.DynamicScaleResult._fields == flax_ds.DynamicScaleResult._fields
    ours, theirs = jamp.DynamicScale(), flax_ds.DynamicScale()
    assert jax.tree_util.tree_leaves(ours) == jax.tree_util.tree_leaves(theirs)


def test_argnums_and_grad_without_value():
    ds = jamp.DynamicScale(scale=8.0)
    f = lambda a, b: jnp.sum(a * b)
    a, b = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    _, finite, value, grads = ds.value_and_grad(f, argnums=(0, 1))(a, b)
    expected = flax_ds.DynamicScale(scale=8.0).value_and_grad(f, argnums=(0, 1))(a, b)
    chex.assert_trees_all_equal((value, grads),
                                (expected.aux, expected.grad))
    result = ds.grad(f, argnums=1)(a, b)
    assert result.aux is None
    np.testing.assert_array_equal(result.grad, a)
    result = ds.grad(lambda a: (jnp.sum(a), "aux"), has_aux=True)(a)
    assert result.aux == "aux"


class _State(train_state.TrainState):
    dynamic_scale: jamp.DynamicScale


def test_lives_in_a_train_state_under_jit_and_round_trips():
    params = {"w": jnp.array([1.0, -2.0])}
    state = _State.create(apply_fn=None, params=params, tx=optax.sgd(0.1),
                          dynamic_scale=jamp.DynamicScale(growth_interval=1))

    @jax.jit
    def train_step(state, x):
        ds, finite, loss, grads = state.dynamic_scale.value_and_grad(
            lambda p: jnp.sum((p["w"] * x) ** 2))(state.params)
        new = state.apply_gradients(grads=grads)
        new = new.replace(params=jax.tree_util.tree_map(
            functools.partial(jnp.where, finite), new.params, state.params),
            opt_state=jax.tree_util.tree_map(
            functools.partial(jnp.where, finite), new.opt_state, state.opt_state))
        return new.replace(dynamic_scale=ds), loss

    state, _ = train_step(state, jnp.float32(1.0))
    state, _ = train_step(state, jnp.float32(1.0))
    assert float(state.dynamic_scale.scale) == 65536.0 * 2
    before = state.params
    state, _ = train_step(state, jnp.float32(np.inf))
    chex.assert_trees_all_equal(state.params, before)
    assert float(state.dynamic_scale.scale) == 65536.0
    restored = flax.serialization.from_bytes(
        _State.create(apply_fn=None, params=params, tx=optax.sgd(0.1),
                      dynamic_scale=jamp.DynamicScale(growth_interval=1)),
        flax.serialization.to_bytes(state))
    assert float(restored.dynamic_scale.scale) == 65536.0
    assert int(restored.dynamic_scale.fin_steps) == int(state.dynamic_scale.fin_steps)


def test_axis_name_averages_like_flax_under_shard_map():
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    x = jnp.arange(8.0).at[5].set(jnp.inf)  # one replica overflows

    def run(cls):
        def step(x):
            result = cls(scale=4.0).value_and_grad(lambda w: jnp.sum(w * x), axis_name="data")(
                jnp.float32(1.0))
            return result.dynamic_scale.scale, result.finite, result.grad

        f = jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P())
        return jax.jit(f)(x)

    ours, theirs = run(jamp.DynamicScale), run(flax_ds.DynamicScale)
    assert not bool(ours[1]) and not bool(theirs[1])
    chex.assert_trees_all_equal(ours, theirs)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(growth_interval="10"), TypeError, "growth_interval='10'"),
    (dict(growth_factor=-2.0), ValueError, "growth_factor=-2.0"),
    (dict(backoff_factor="half"), TypeError, "backoff_factor='half'"),
    (dict(minimum_scale=-1.0), ValueError, "minimum_scale=-1.0"),
])
def test_bad_settings_name_the_value(kwargs, error, message):
    with pytest.raises(error) as raised:
        jamp.DynamicScale(**kwargs)
    assert message in str(raised.value)
