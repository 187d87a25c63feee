"""One decision for all devices: sharded grads under jit, and an axis_name under shard_map
and pmap (8 CPU devices, set up in tests/conftest.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jamp.scaler as js

try:
    shard_map = jax.shard_map
except AttributeError:  # jax < 0.7 keeps it in experimental
    from jax.experimental.shard_map import shard_map

N = 8

pytestmark = pytest.mark.skipif(jax.device_count() < N, reason="needs 8 devices")


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:N]), ("d",))


def grads_with_inf_on(device_index):
    g = np.ones((N, 4), np.float32)
    if device_index is not None:
        g[device_index, 1] = np.inf
    return {"w": jnp.asarray(g)}


@pytest.mark.parametrize("skip", ["select", "cond"])
@pytest.mark.parametrize("bad_device", [None, 0, 5, 7])
def test_sharded_grads_under_jit_make_one_decision(mesh, bad_device, skip):
    sharding = NamedSharding(mesh, P("d"))
    tx = js.loss_scaled(optax.adam(1e-2), js.GradScaler(init_scale=4.0), skip=skip)
    params = jax.device_put({"w": jnp.ones((N, 4))}, sharding)
    state = jax.jit(tx.init)(params)
    grads = jax.device_put(grads_with_inf_on(bad_device), sharding)
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    assert updates["w"].sharding.is_equivalent_to(sharding, 2)
    finite = new_state.last_finite
    assert finite.shape == () and bool(finite) is (bad_device is None)
    # Every shard of the updates followed the same decision.
    for shard in updates["w"].addressable_shards:
        assert (np.asarray(shard.data) != 0).all() == (bad_device is None)
        assert (np.asarray(shard.data) == 0).all() == (bad_device is not None)
    assert float(js.get_loss_scale(new_state).loss_scale) == (4.0 if bad_device is None else 2.0)


def per_replica_step(tx, axis_name):
    def step(grads, params):
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)
        return updates, state.last_finite[None], js.get_loss_scale(state).loss_scale[None]
    return step


@pytest.mark.parametrize("skip", ["select", "cond"])
@pytest.mark.parametrize("bad_device", [None, 3])
def test_shard_map_with_axis_name_all_replicas_agree(mesh, bad_device, skip):
    tx = js.loss_scaled(optax.sgd(1.0), js.GradScaler(init_scale=4.0), axis_name="d",
                        skip=skip)
    step = shard_map(per_replica_step(tx, "d"), mesh=mesh, in_specs=(P("d"), P("d")),
                     out_specs=(P("d"), P("d"), P("d")))
    grads = grads_with_inf_on(bad_device)
    updates, finite, scales = jax.jit(step)(grads, {"w": jnp.ones((N, 4))})
    assert finite.shape == (N,)
    assert (np.asarray(finite) == (bad_device is None)).all()
    assert (np.asarray(scales) == (4.0 if bad_device is None else 2.0)).all()
    assert (np.asarray(updates["w"]) == (0.0 if bad_device is not None else -0.25)).all()


def test_shard_map_without_axis_name_replicas_disagree(mesh):
    # The control: without axis_name each replica decides alone, so the test above can fail.
    tx = js.loss_scaled(optax.sgd(1.0), js.GradScaler(init_scale=4.0))
    step = shard_map(per_replica_step(tx, None), mesh=mesh, in_specs=(P("d"), P("d")),
                     out_specs=(P("d"), P("d"), P("d")))
    _, finite, _ = jax.jit(step)(grads_with_inf_on(3), {"w": jnp.ones((N, 4))})
    assert not bool(finite[3]) and bool(finite[0])


def test_pmap_with_axis_name_all_replicas_agree():
    tx = js.loss_scaled(optax.sgd(1.0), js.DynamicLossScale(jnp.float32(4.0)), axis_name="r")
    step = jax.pmap(per_replica_step(tx, "r"), axis_name="r")
    grads = {"w": grads_with_inf_on(6)["w"].reshape(N, 1, 4)}
    updates, finite, scales = step(grads, {"w": jnp.ones((N, 1, 4))})
    assert not np.asarray(finite).any()
    assert (np.asarray(scales) == 2.0).all()
    assert not np.asarray(updates["w"]).any()


def test_scaled_value_and_grad_under_shard_map_averages_and_agrees(mesh):
    def loss_fn(w, x):
        return jnp.sum(w * x)

    vg = js.scaled_value_and_grad(loss_fn, axis_name="d")

    def step(w, x):
        ls = js.DynamicLossScale(jnp.float32(2.0**10))
        value, grads, finite, ls = vg(ls, w, x)
        return value[None], grads, finite[None], ls.loss_scale[None]

    # Each replica holds its own copy of w (pmap style), so its grads are local until pmean.
    f = jax.jit(shard_map(step, mesh=mesh, in_specs=(P("d"), P("d")),
                          out_specs=(P("d"), P("d"), P("d"), P("d"))))
    x = jnp.arange(N * 3, dtype=jnp.float32).reshape(N, 3)
    w = jnp.ones((N, 3))
    value, grads, finite, scale = f(w, x)
    np.testing.assert_allclose(np.asarray(value), np.asarray(x).sum(1), rtol=1e-6)
    for row in np.asarray(grads):
        np.testing.assert_allclose(row, np.asarray(x).mean(0), rtol=1e-6)
    assert np.asarray(finite).all() and (np.asarray(scale) == 2.0**10).all()
    x = x.at[2, 0].set(jnp.nan)
    _, _, finite, scale = f(w, x)
    assert not np.asarray(finite).any() and (np.asarray(scale) == 2.0**9).all()


def test_all_finite_axis_name_under_pmap():
    f = jax.pmap(functools.partial(js.all_finite, axis_name="r"), axis_name="r")
    g = np.ones((N, 3), np.float32)
    assert np.asarray(f(g)).all()
    g[4, 0] = np.nan
    assert not np.asarray(f(g)).any()


@pytest.mark.parametrize("bad_device", [None, 2])
def test_cond_skip_under_shard_map_with_a_replicated_state(mesh, bad_device):
    # The state comes in replicated and leaves varying (its moments follow each replica's
    # grads), so the skipped branch of the cond must widen the old state's type to match.
    results = {}
    for skip in ("select", "cond"):
        tx = js.loss_scaled(optax.adam(0.5), js.GradScaler(init_scale=4.0), axis_name="d",
                            skip=skip)
        params = {"w": jnp.ones(4)}
        state = tx.init(params)

        def step(grads, params, state):
            updates, state = tx.update({"w": grads["w"][0]}, state, params)
            mu = state.inner_state[0].mu["w"]
            return updates["w"][None], mu[None], state.last_finite[None]

        step = shard_map(step, mesh=mesh, in_specs=(P("d"), P(), P()),
                         out_specs=(P("d"), P("d"), P("d")))
        results[skip] = jax.jit(step)(grads_with_inf_on(bad_device), params, state)
    for got, want in zip(results["cond"], results["select"]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    updates, mu, finite = results["cond"]
    assert (np.asarray(finite) == (bad_device is None)).all()
    # The grads arrive scaled by 4: mu = (1 - b1) * 1 / 4 on a finite step.
    assert (np.asarray(mu) == (0.0 if bad_device is not None else 0.025)).all()
    assert (np.asarray(updates) != 0).all() == (bad_device is None)
