"""The whole training state through jamp's checkpoints (orbax and flax msgpack): the run continues
bit for bit, another mesh is a reshard, and a state set up differently is refused by name."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from jax.sharding import NamedSharding, PartitionSpec as P

import jamp
from jamp.frontend.checkpoint import check_checkpoint_layout, checkpoint_layout

from helpers import assert_trees_equal

ocp = pytest.importorskip("orbax.checkpoint")  # the `checkpoint` extra

# The second loss's grads are infinite at these steps: a skip and a back-off of its scale.
FAULTS = [1.0, 1.0, np.inf, 1.0, 1.0, np.inf, 1.0, 1.0]
SAVED_AT = 4


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(nn.relu(nn.Dense(16)(x)))


def amp_state(opt_level="O2", num_losses=2, **overrides):
    model = MLP()
    variables = model.init(jax.random.key(0), jnp.ones((2, 8)))
    apply_fn, variables, tx = jamp.initialize(model.apply, variables, optax.adam(1e-2),
                                              opt_level=opt_level, num_losses=num_losses,
                                              verbosity=0, **overrides)
    params = variables["params"]
    return apply_fn, tx, {"params": params, "opt_state": tx.init(params),
                          "step": jnp.zeros([], jnp.int32)}


def make_step(apply_fn, tx):
    x = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)

    @jax.jit
    def step(state, fault):
        params, opt_state = state["params"], state["opt_state"]

        def loss(p, k):
            out = apply_fn({"params": p}, x).astype(jnp.float32)
            losses = (jnp.mean(out ** 2), jnp.mean(out) * fault)
            return jamp.scale_loss(losses[k], opt_state, k)

        grads = [jax.grad(loss)(params, k) for k in range(2)]
        updates, opt_state = tx.update(grads, opt_state, params)
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
                "step": state["step"] + 1}

    return step


@pytest.fixture(scope="module")
def trained():
    """The uninterrupted run: the state after each step."""
    apply_fn, tx, state = amp_state()
    step = make_step(apply_fn, tx)
    states = []
    for fault in FAULTS:
        state = step(state, jnp.float32(fault))
        states.append(state)
    return step, states


def orbax_round_trip(tmp_path, state, target):
    manager = ocp.CheckpointManager(tmp_path / "checkpoints")
    assert jamp.save_checkpoint(manager, int(state["step"]), state)
    manager.wait_until_finished()
    # A fresh manager, as a new process has.
    return jamp.restore_checkpoint(ocp.CheckpointManager(tmp_path / "checkpoints"), target)


def bytes_round_trip(tmp_path, state, target):
    path = tmp_path / "state.msgpack"
    path.write_bytes(jamp.checkpoint_to_bytes(state))
    return jamp.checkpoint_from_bytes(target, path.read_bytes())


ROUND_TRIPS = {"orbax": orbax_round_trip, "msgpack": bytes_round_trip}


@pytest.mark.parametrize("store", ROUND_TRIPS)
def test_restored_state_continues_the_uninterrupted_run_bit_for_bit(tmp_path, store, trained):
    step, states = trained
    saved = states[SAVED_AT - 1]
    _, _, fresh = amp_state()
    state = ROUND_TRIPS[store](tmp_path, saved, fresh)
    # Everything came back: params, float32 masters, Adam's moments and count, both loss scales
    # with their counters, the step and skip counts.
    assert_trees_equal(state, saved)
    opt_state = state["opt_state"]
    assert int(opt_state.skipped_steps) == 1 and int(state["step"]) == SAVED_AT
    assert float(jamp.get_loss_scale(opt_state, 1).loss_scale) == 32768.0
    for i, fault in enumerate(FAULTS[SAVED_AT:], start=SAVED_AT):
        state = step(state, jnp.float32(fault))
        assert_trees_equal(state, states[i])
    assert int(state["opt_state"].skipped_steps) == 2


MISMATCHES = {
    "num_losses": (dict(num_losses=1), r"has 2 loss scale\(s\) \(num_losses=2\), the target's "
                                       r"at \['opt_state'\].inner_state has 1 "
                                       r"\(num_losses=1\): set num_losses=2"),
    "O1": (dict(opt_level="O1"), r"the checkpoint keeps float32 master weights \(at "
                                 r"\['opt_state'\]: opt level O2.*the target keeps none"),
    "bfloat16 model": (dict(cast_model_type=jnp.bfloat16),
                       r"\['params'\]\['Dense_0'\]\['kernel'\] is float16\[16,8\] in the "
                       r"checkpoint and bfloat16\[16,8\] in the target"),
}


@pytest.mark.parametrize("store", ROUND_TRIPS)
@pytest.mark.parametrize("mismatch", MISMATCHES)
def test_a_state_set_up_differently_is_refused_by_name(tmp_path, store, mismatch, trained):
    overrides, message = MISMATCHES[mismatch]
    _, _, target = amp_state(**overrides)
    with pytest.raises(ValueError, match=message):
        ROUND_TRIPS[store](tmp_path, trained[1][0], target)


def test_static_and_dynamic_loss_scales_are_told_apart():
    _, _, o1 = amp_state("O1", num_losses=1)
    _, _, o0 = amp_state("O0", num_losses=1)
    with pytest.raises(ValueError, match=r"\['DynamicLossScale'\], the target's .* "
                                         r"\['CountingStaticLossScale'\]: a static scale"):
        check_checkpoint_layout(checkpoint_layout(o1), o0)
    check_checkpoint_layout(checkpoint_layout(o1), jax.eval_shape(lambda: o1))  # fits


def fsdp(tree, mesh):
    """Each leaf split over "data" along its first dimension that the mesh divides."""
    def sharding(x):
        dims = [d for d, n in enumerate(x.shape) if n % mesh.size == 0]
        spec = [None] * x.ndim
        if dims:
            spec[dims[0]] = "data"
        return NamedSharding(mesh, P(*spec))
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, sharding(x)), tree)


@pytest.mark.parametrize("store", ROUND_TRIPS)
def test_a_checkpoint_from_8_devices_restores_onto_4_resharded(tmp_path, store, trained):
    eight = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    four = jax.make_mesh((4,), ("data",), devices=jax.devices()[4:8])
    saved = fsdp(trained[1][SAVED_AT - 1], eight)
    kernel = saved["opt_state"].masters["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P("data", None) and len(kernel.sharding.device_set) == 8
    _, _, fresh = amp_state()
    target = fsdp(fresh, four)
    state = ROUND_TRIPS[store](tmp_path, saved, target)
    assert_trees_equal(state, saved)
    for got, want in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(target)):
        assert got.sharding == want.sharding


def test_restore_errors_say_what_is_missing(tmp_path):
    _, _, state = amp_state()
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        jamp.restore_checkpoint(ocp.CheckpointManager(tmp_path / "empty"), state)
    manager = ocp.CheckpointManager(tmp_path / "plain")
    manager.save(0, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    with pytest.raises(ValueError, match="not written by jamp.save_checkpoint"):
        jamp.restore_checkpoint(manager, state)
    with pytest.raises(ValueError, match="not written by checkpoint_to_bytes"):
        jamp.checkpoint_from_bytes(state, serialization.to_bytes(state))
