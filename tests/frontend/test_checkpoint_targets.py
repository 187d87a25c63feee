"""The targets users restore a checkpoint into besides a state of arrays: abstract ones
(`jax.eval_shape`'s result, `jax.ShapeDtypeStruct` leaves, with or without shardings) and Flax
NNX states (`nnx.state((model, optimizer))` after `jamp.initialize`, alone or nested)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jamp

from helpers import assert_trees_equal

PARAMS = {"w": jnp.arange(4, dtype=jnp.float16), "b": jnp.ones((), jnp.bfloat16)}
# O2's optimizer: float32 masters around a loss-scaled Adam (a GradScalerState among its leaves).
TX = jamp.master_weights(jamp.loss_scaled(optax.adam(0.1)))


def saved_state():
    state = {"params": PARAMS, "opt_state": TX.init(PARAMS), "step": jnp.int32(7)}
    # Numbers a fresh state does not hold: a backed-off loss scale, a counter, moved moments.
    updates, opt_state = TX.update(jax.tree_util.tree_map(jnp.ones_like, PARAMS),
                                   state["opt_state"], PARAMS)
    return dict(state, opt_state=opt_state)


def orbax_round_trip(tmp_path, state, target):
    ocp = pytest.importorskip("orbax.checkpoint")  # the `checkpoint` extra
    manager = ocp.CheckpointManager(tmp_path)
    jamp.save_checkpoint(manager, 0, state)
    manager.wait_until_finished()
    return jamp.restore_checkpoint(manager, target)


def bytes_round_trip(tmp_path, state, target):
    return jamp.checkpoint_from_bytes(target, jamp.checkpoint_to_bytes(state))


ROUND_TRIPS = {"orbax": orbax_round_trip, "msgpack": bytes_round_trip}

ABSTRACT = {
    "eval_shape": lambda state: jax.eval_shape(lambda: state),
    "bare ShapeDtypeStructs": lambda state: jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state),
}


@pytest.mark.parametrize("store, abstract", [("msgpack", "eval_shape"),
                                             ("msgpack", "bare ShapeDtypeStructs"),
                                             ("orbax", "eval_shape")])
def test_an_abstract_target_restores_concrete_arrays(tmp_path, store, abstract):
    state = saved_state()
    target = ABSTRACT[abstract](state)
    restored = ROUND_TRIPS[store](tmp_path, state, target)
    assert_trees_equal(restored, state)
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(restored))
    assert float(jamp.get_loss_scale(restored["opt_state"]).loss_scale) == float(
        jamp.get_loss_scale(state["opt_state"]).loss_scale)


def test_an_abstract_target_lands_on_its_shardings():
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    state = saved_state()
    split = NamedSharding(mesh, P("data"))
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split if x.ndim else
                                       NamedSharding(mesh, P())), state)
    restored = jamp.checkpoint_from_bytes(target, jamp.checkpoint_to_bytes(state))
    assert_trees_equal(restored, state)
    for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(target)):
        assert got.sharding == want.sharding


def test_an_abstract_target_of_another_dtype_is_refused_by_name():
    state = saved_state()
    target = jax.eval_shape(lambda: dict(state, params=dict(PARAMS, w=PARAMS["w"].astype(
        jnp.float32))))
    with pytest.raises(ValueError, match=r"\['params'\]\['w'\] is float16\[4\] in the checkpoint "
                                         r"and float32\[4\] in the target"):
        jamp.checkpoint_from_bytes(target, jamp.checkpoint_to_bytes(state))


# --- Flax NNX ----------------------------------------------------------------------------------


def nnx_training(seed):
    """An NNX model and optimizer set up at O2, after one step on a loss whose grads overflow
    float16 at the first scale (a skipped step and a backed-off scale) and one that does not."""
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    jamp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    return model, optimizer


@nnx.jit
def nnx_step(model, optimizer, size):
    def loss_fn(model):
        loss = jnp.mean(model(jnp.ones((3, 4))).astype(jnp.float32)) * size
        return jamp.scale_loss(loss, optimizer.opt_state)

    optimizer.update(model, nnx.grad(loss_fn)(model))


NNX_STATES = {
    "pair": lambda model, optimizer: nnx.state((model, optimizer)),
    "nested": lambda model, optimizer: {"model": nnx.state(model),
                                        "optimizer": nnx.state(optimizer)},
}


@pytest.mark.parametrize("states", NNX_STATES)
def test_an_nnx_training_state_round_trips_through_bytes(states):
    model, optimizer = nnx_training(0)
    for size in (1e6, 1.0):
        nnx_step(model, optimizer, jnp.float32(size))
    assert int(optimizer.opt_state.skipped_steps[...]) == 1
    saved = NNX_STATES[states](model, optimizer)
    blob = jamp.checkpoint_to_bytes(saved)

    fresh_model, fresh_optimizer = nnx_training(1)
    for target in (NNX_STATES[states](fresh_model, fresh_optimizer),
                   jax.eval_shape(lambda: NNX_STATES[states](fresh_model, fresh_optimizer))):
        restored = jamp.checkpoint_from_bytes(target, blob)
        assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(target)
    if states == "pair":
        nnx.update((fresh_model, fresh_optimizer), restored)
    else:
        nnx.update(fresh_model, restored["model"])
        nnx.update(fresh_optimizer, restored["optimizer"])
    assert_trees_equal(nnx.state((fresh_model, fresh_optimizer)),
                       nnx.state((model, optimizer)))
    assert float(jamp.get_loss_scale(fresh_optimizer.opt_state).loss_scale) == 32768.0
    assert fresh_model.kernel.dtype == np.dtype(jnp.float16)


def test_an_nnx_state_of_another_opt_level_is_refused_by_name():
    model, optimizer = nnx_training(0)
    other = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    other_optimizer = nnx.Optimizer(other, optax.adam(1e-2), wrt=nnx.Param)
    jamp.initialize(other, other_optimizer, opt_level="O1", verbosity=0)
    # nnx.state keeps the optimizer state's values, not jamp's types: the check compares leaves.
    with pytest.raises(ValueError, match=r"(?s)holds \[1\]\['opt_state'\]\['inner_state'\]"
                                         r".*\[0\]\['kernel'\] is float16\[4,2\] in the "
                                         r"checkpoint and float32\[4,2\] in the target"):
        jamp.checkpoint_from_bytes(nnx.state((other, other_optimizer)),
                                   jamp.checkpoint_to_bytes(nnx.state((model, optimizer))))
