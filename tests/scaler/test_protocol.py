"""The loss-scale protocol and the pytree style every loss scale shares: every scale is a
`LossScale`, the wrapper, the checkpoint code and the Apex state take a loss scale written by a
user, pytrees round-trip through the constructor, and settings come back from `jax.jit` as
the objects given."""

import dataclasses

import flax.serialization
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from flax import struct

import jamp
import jamp.scaler as js

from helpers import assert_trees_equal


@js.loss_scale_dataclass
class HalvingLossScale:
    """A user's own loss scale: halves on a bad step, never grows, counts finite steps."""

    loss_scale: jax.Array
    counter: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros([], jnp.int32))
    floor: float = struct.field(pytree_node=False, default=1.0)

    def scale(self, tree):
        return jax.tree_util.tree_map(lambda x: x * self.loss_scale, tree)

    def unscale(self, tree):
        return jax.tree_util.tree_map(lambda x: x / self.loss_scale, tree)

    def adjust(self, grads_finite):
        halved = jnp.maximum(self.loss_scale / 2, self.floor).astype(self.loss_scale.dtype)
        return dataclasses.replace(
            self, loss_scale=jnp.where(grads_finite, self.loss_scale, halved),
            counter=self.counter + grads_finite.astype(jnp.int32))


# Every loss scale jamp has, built with settings away from their defaults.
SCALES = {
    "noop": lambda: js.NoOpLossScale(),
    "static": lambda: js.StaticLossScale(jnp.float32(512.0)),
    "counting": lambda: js.CountingStaticLossScale(jnp.float32(512.0),
                                                   counter=jnp.int32(3)),
    "dynamic": lambda: js.DynamicLossScale(jnp.float32(2.0**12), counter=jnp.int32(2),
                                           period=5, factor=4, min_loss_scale=np.float32(2.0),
                                           max_loss_scale=2.0**20),
    "grad_scaler": lambda: js.GradScaler(init_scale=64.0, growth_interval=7).init(),
    "user": lambda: HalvingLossScale(jnp.float32(256.0), floor=4.0),
}


@pytest.mark.parametrize("name", sorted(SCALES))
def test_every_loss_scale_is_a_loss_scale(name):
    assert isinstance(SCALES[name](), js.LossScale)


def test_jmp_style_isinstance_holds_for_jmp_objects_too():
    for ls in (jmp.NoOpLossScale(), jmp.StaticLossScale(2.0),
               jmp.DynamicLossScale(jnp.float32(2.0))):
        assert isinstance(ls, js.LossScale)
    assert not isinstance(jamp.DynamicScale(), js.LossScale)  # flax's `scale` is a value
    assert not isinstance(2.0, js.LossScale)


def test_the_counter_has_one_name():
    counting = [n for n in SCALES if isinstance(SCALES[n](), js.CountingLossScale)]
    assert counting == ["counting", "dynamic", "grad_scaler", "user"]
    assert int(js.GradScaler().init().counter) == 0


def _train(ls, faults):
    tx = js.loss_scaled(optax.sgd(0.5), ls)
    params = jnp.array([1.0, -2.0])

    @jax.jit
    def step(params, state, fault):
        scale = js.get_loss_scale(state)
        grads = jax.grad(lambda p: scale.scale(jnp.sum(p ** 2) * fault))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for f in faults:
        params, state = step(params, state, jnp.float32(f))
    return tx, params, state


def test_the_wrapper_takes_a_loss_scale_written_by_a_user():
    _, params, state = _train(HalvingLossScale(jnp.float32(256.0), floor=4.0),
                              [1.0, np.inf, 1.0, np.nan, np.nan, np.nan, np.nan, np.nan])
    ls = js.get_loss_scale(state)
    assert type(ls) is HalvingLossScale and ls.floor == 4.0
    assert float(ls.loss_scale) == 4.0 and int(ls.counter) == 2
    assert int(state.skipped_steps) == 6
    np.testing.assert_allclose(params, [0.0, 0.0])  # two plain sgd steps of 0.5


def test_the_wrapper_takes_jmps_own_loss_scale():
    _, params, state = _train(jmp.DynamicLossScale(jnp.float32(2.0**15), period=1),
                              [1.0, np.inf])
    assert float(js.get_loss_scale(state).loss_scale) == 2.0**15
    np.testing.assert_allclose(params, [0.0, 0.0])


def test_the_checkpoint_code_takes_a_loss_scale_written_by_a_user():
    tx, params, state = _train(HalvingLossScale(jnp.float32(256.0)), [1.0, np.inf, 1.0])
    blob = flax.serialization.to_bytes(state)
    restored = flax.serialization.from_bytes(tx.init(params), blob)
    assert_trees_equal(restored, state)
    assert flax.serialization.to_state_dict(js.get_loss_scale(state)) == {
        "loss_scale": 128.0, "counter": 2}


def test_the_apex_state_takes_a_loss_scale_written_by_a_user():
    tx, params, state = _train(HalvingLossScale(jnp.float32(256.0)), [1.0, np.inf, 1.0])
    assert jamp.state_dict(state) == {"loss_scaler0": {"loss_scale": 128.0, "unskipped": 2}}
    assert float(jamp.scale_loss(jnp.float32(0.5), state)) == 64.0
    loaded = jamp.load_state_dict(tx.init(params),
                                  {"loss_scaler0": {"loss_scale": 32.0, "unskipped": 5}})
    ls = js.get_loss_scale(loaded)
    assert type(ls) is HalvingLossScale
    assert ls.loss_scale.dtype == jnp.float32 and float(ls.loss_scale) == 32.0
    assert ls.counter.dtype == jnp.int32 and int(ls.counter) == 5


@pytest.mark.parametrize("name", sorted(SCALES))
def test_apex_state_round_trip_for_every_loss_scale(name):
    tx = js.loss_scaled(optax.sgd(0.1), SCALES[name]())
    state = tx.init(jnp.ones(2))
    saved = jamp.state_dict(state)
    assert jamp.state_dict(jamp.load_state_dict(tx.init(jnp.ones(2)), saved)) == saved


@pytest.mark.parametrize("name", sorted(SCALES) + ["flax_dynamic_scale"])
def test_pytree_round_trip_through_the_constructor(name):
    ls = jamp.DynamicScale(growth_interval=3) if name == "flax_dynamic_scale" else SCALES[name]()
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(rebuilt) is type(ls)
    for field in dataclasses.fields(ls):
        assert getattr(rebuilt, field.name) is getattr(ls, field.name), field.name
    # The leaves are named by their fields, as a flax struct's are (orbax's paths).
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
    static = [f.name for f in dataclasses.fields(ls) if not f.metadata.get("pytree_node", True)]
    assert paths == [f".{f.name}" for f in dataclasses.fields(ls) if f.name not in static]


@pytest.mark.parametrize("name", sorted(SCALES))
def test_pytrees_rebuild_from_stand_in_leaves(name):
    # eval_shape, sharding trees and `tree_map(lambda _: None, ...)` rebuild the scale from
    # leaves that are not numbers: the constructor must let them through.
    tx = js.loss_scaled(optax.adam(1e-3), SCALES[name]())
    shapes = jax.eval_shape(tx.init, jnp.ones(3))
    assert type(shapes.loss_scale) is type(SCALES[name]())
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, tx.init(jnp.ones(3)))
    assert type(shardings.loss_scale) is type(SCALES[name]())
    jax.tree_util.tree_map(lambda _: None, SCALES[name]())


@pytest.mark.parametrize("name", sorted(SCALES))
def test_pytrees_rebuild_from_any_leaves(name):
    # A tree of paths (what checkpointers build) or of differences is no loss scale to check.
    paths = jax.tree_util.tree_map_with_path(lambda p, _: jax.tree_util.keystr(p),
                                             SCALES[name]())
    assert all(isinstance(p, str) for p in jax.tree_util.tree_leaves(paths))
    jax.tree_util.tree_map(lambda x: -1 - x, SCALES[name]())
    with pytest.raises(TypeError, match="loss_scale='big'"):
        js.DynamicLossScale("big")  # the constructor still checks what a caller gives


SETTINGS = [1.0, np.float32(1.0), np.ones([], np.float32), jnp.float32(1.0)]


@pytest.mark.parametrize("floor", SETTINGS, ids=lambda s: type(s).__name__)
def test_min_loss_scale_comes_back_from_jit_as_given(floor):
    ls = js.DynamicLossScale(jnp.float32(4.0), min_loss_scale=floor, factor=4)
    assert ls.min_loss_scale is floor
    assert jax.jit(lambda s: s)(ls).min_loss_scale is floor
    stepped = jax.jit(lambda s: s.adjust(jnp.array(False)))(ls)
    assert stepped.min_loss_scale is floor and stepped.factor == 4
    assert float(stepped.loss_scale) == 1.0


def test_one_jitted_step_keeps_each_scales_own_settings():
    # Equal values of other types must not share a trace: each call gets its own object back.
    step = jax.jit(lambda s: s.adjust(jnp.array(True)))
    for floor in SETTINGS:
        out = step(js.DynamicLossScale(jnp.float32(4.0), min_loss_scale=floor))
        assert out.min_loss_scale is floor


@pytest.mark.parametrize("make,names", [
    (lambda: js.GradScaler(growth_factor=4.0, growth_interval=3).init(),
     ("growth_factor", "backoff_factor", "growth_interval", "enabled")),
    (lambda: js.StaticLossScale(np.float32(8.0)), ("loss_scale",)),
    (lambda: js.CountingStaticLossScale(8.0), ("loss_scale",)),
    (lambda: jamp.DynamicScale(minimum_scale=np.float32(2.0)),
     ("growth_factor", "growth_interval", "minimum_scale")),
])
def test_settings_come_back_from_jit_as_given(make, names):
    ls = make()
    out = jax.jit(lambda s: s)(ls)
    for name in names:
        assert getattr(out, name) is getattr(ls, name), name


@pytest.mark.parametrize("name", sorted(SCALES) + ["flax_dynamic_scale"])
def test_checkpoint_round_trip_for_every_loss_scale(name):
    if name == "flax_dynamic_scale":
        saved = jamp.DynamicScale(fin_steps=jnp.int32(4), scale=jnp.float32(1024.0))
        target = jamp.DynamicScale(fin_steps=jnp.int32(0))
    else:
        saved = SCALES[name]()
        for finite in (True, False, True):
            saved = saved.adjust(jnp.array(finite))
        target = SCALES[name]()
    restored = flax.serialization.from_bytes(target, flax.serialization.to_bytes(saved))
    assert type(restored) is type(saved)
    for leaf_saved, leaf_restored in zip(jax.tree_util.tree_leaves(saved),
                                         jax.tree_util.tree_leaves(restored), strict=True):
        assert np.asarray(leaf_restored).dtype == np.asarray(leaf_saved).dtype
        np.testing.assert_array_equal(leaf_restored, leaf_saved)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(target)


def test_a_subclass_that_adds_a_setting_compares_and_crosses_jit_with_it():
    @js.loss_scale_dataclass
    class Labelled(js.StaticLossScale):
        label: str = struct.field(pytree_node=False, default="a")

    ls = Labelled(np.float32(8.0))
    assert ls == Labelled(np.float32(8.0)) and ls != Labelled(np.float32(8.0), "b")
    out = jax.jit(lambda s: s)(ls)
    assert out.label == "a" and out.loss_scale is ls.loss_scale


def test_every_name_jmp_exports_is_exported_by_jamp_and_its_modules():
    for name in jmp.__all__:
        module = jamp.policy if hasattr(jamp.policy, name) else jamp.scaler
        assert getattr(jamp, name) is getattr(module, name), name
        assert name in jamp.__all__ and name in module.__all__, name
