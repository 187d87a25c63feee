"""Checkpoints through flax.serialization (msgpack, no pickle) continue the same trajectory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization

import jamp.scaler as js

from helpers import assert_trees_equal

FAULTS = np.array([1, 1, np.inf, 1, 1, 1, np.nan, 1, 1, 1, 1, np.inf, 1, 1, 1, 1], np.float32)

KINDS = [
    ("grad_scaler", lambda: js.GradScaler(growth_interval=2), 1),
    ("dynamic", lambda: js.DynamicLossScale(jnp.float32(2.0**12), period=2,
                                            min_loss_scale=np.float32(8.0)), 1),
    ("static", lambda: 512.0, 1),
    ("noop", lambda: js.NoOpLossScale(), 1),
    ("two_losses", lambda: [js.GradScaler(growth_interval=3), js.DynamicLossScale(
        jnp.float32(64.0), period=2)], 2),
]


def make(kind):
    _, make_ls, num_losses = kind
    tx = js.loss_scaled(optax.adam(1e-2), make_ls(), num_losses=num_losses)
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}

    @jax.jit
    def step(params, state, fault):
        grads = []
        for loss_id in range(num_losses):
            ls = js.get_loss_scale(state, loss_id)
            fault_k = fault if loss_id == 0 else jnp.float32(1.0)
            grads.append(jax.grad(lambda p, ls=ls, fault_k=fault_k, loss_id=loss_id: ls.scale(
                jnp.sum(p["w"] ** 2) * fault_k + jnp.sum(p["b"]) * (loss_id + 1)))(params))
        updates, state = tx.update(grads[0] if num_losses == 1 else grads, state, params)
        return optax.apply_updates(params, updates), state

    return tx, params, step


@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_round_trip_through_bytes_continues_the_same_trajectory(kind):
    tx, params, step = make(kind)
    state = tx.init(params)
    straight = []
    p, s = params, state
    for f in FAULTS:
        p, s = step(p, s, jnp.float32(f))
        straight.append((p, s))

    p, s = params, state
    for f in FAULTS[:7]:
        p, s = step(p, s, jnp.float32(f))
    blob = serialization.to_bytes((p, s))
    # Restore into a fresh target, as a new process would.
    p, s = serialization.from_bytes((params, tx.init(params)), blob)
    for i, f in enumerate(FAULTS[7:], start=7):
        p, s = step(p, s, jnp.float32(f))
        assert_trees_equal((p, s), straight[i])
    assert int(s.skipped_steps) == 3 and int(s.total_steps) == len(FAULTS)


def test_state_dict_layout():
    state = js.GradScaler(init_scale=8.0).init()
    assert set(serialization.to_state_dict(state)) == {"loss_scale", "counter"}
    dyn = js.DynamicLossScale(jnp.float32(4.0))
    assert set(serialization.to_state_dict(dyn)) == {"loss_scale", "counter"}
    assert serialization.to_state_dict(js.StaticLossScale(jnp.float32(2.0))) == {}
    counting = js.CountingStaticLossScale(jnp.float32(2.0), counter=jnp.int32(3))
    assert serialization.to_state_dict(counting) == {"counter": 3}
    restored = serialization.from_bytes(js.CountingStaticLossScale(jnp.float32(2.0)),
                                        serialization.to_bytes(counting))
    assert int(restored.counter) == 3 and float(restored.loss_scale) == 2.0


def test_restore_keeps_dtypes_and_static_settings():
    target = js.DynamicLossScale(jnp.float32(4.0), period=7, min_loss_scale=np.float32(2.0))
    saved = js.DynamicLossScale(jnp.float32(32.0), counter=jnp.int32(5), period=7,
                                min_loss_scale=np.float32(2.0))
    restored = serialization.from_bytes(target, serialization.to_bytes(saved))
    assert restored.loss_scale.dtype == jnp.float32 and float(restored.loss_scale) == 32.0
    assert restored.counter.dtype == jnp.int32 and int(restored.counter) == 5
    assert restored.period == 7 and float(restored.min_loss_scale) == 2.0


def test_restore_from_a_wrong_state_names_the_missing_fields():
    target = js.GradScaler().init()
    with pytest.raises(ValueError, match="lacks.*counter"):
        serialization.from_state_dict(target, {"loss_scale": np.float32(2.0)})


def test_grad_scaler_state_dict_through_msgpack():
    scaler = js.GradScaler(growth_interval=3)
    state = scaler.init()
    for found in (False, True, False, False):
        state = scaler.update(state, jnp.array(found))
    blob = serialization.msgpack_serialize(scaler.state_dict(state))
    loaded = serialization.msgpack_restore(blob)
    other = js.GradScaler()
    restored = other.load_state_dict(loaded)
    assert other.state_dict(restored) == scaler.state_dict(state)
    assert other.get_growth_interval() == 3
