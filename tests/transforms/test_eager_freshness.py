"""An eager autocast call is an eager call: whatever Python state the function reads is read on
every call, as calling the function without autocast reads it; under `jax.jit` the program is
the one jit traced, as without autocast."""

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jamp

from helpers import X, compiles_during

SCALE = 2.0  # a global the function reads, changed by a test


def eager_twice(fn, change):
    """`fn` under autocast and without, called, then `change()`d, then called again."""
    auto = jamp.autocast(fn, device_type="cpu")
    before = (auto(X), fn(X))
    change()
    return before, (auto(X), fn(X))


def assert_fresh(fn, change, before_scale, after_scale):
    (auto_before, plain_before), (auto_after, plain_after) = eager_twice(fn, change)
    chex.assert_trees_all_close(auto_before, plain_before, X * before_scale, rtol=1e-2)
    chex.assert_trees_all_close(auto_after, plain_after, X * after_scale, rtol=1e-2)


def test_a_field_of_a_closed_over_namespace():
    config = types.SimpleNamespace(scale=2.0)
    assert_fresh(lambda x: x * config.scale, lambda: setattr(config, "scale", 5.0), 2.0, 5.0)


def test_a_closed_over_python_float():
    scale = 2.0

    def change():
        nonlocal scale
        scale = 5.0

    assert_fresh(lambda x: x * scale, change, 2.0, 5.0)


def test_a_global():
    def change():
        global SCALE
        SCALE = 5.0

    try:
        assert_fresh(lambda x: x * SCALE, change, 2.0, 5.0)
    finally:
        globals()["SCALE"] = 2.0


def test_a_python_list_appended_to():
    factors = [2.0]
    assert_fresh(lambda x: x * sum(factors), lambda: factors.append(3.0), 2.0, 5.0)


def test_an_attribute_of_a_user_object_read_through_a_method():
    class Scaler:
        def __init__(self):
            self.scale = 2.0

        def __call__(self, x):
            return x * self.scale

    scaler = Scaler()
    assert_fresh(scaler, lambda: setattr(scaler, "scale", 5.0), 2.0, 5.0)


def test_a_python_attribute_of_a_flax_module():
    class Scaled(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.scale = 2.0  # a plain Python attribute, not a Variable

        def __call__(self, x):
            return self.linear(x) * self.scale

    model = Scaled()
    expected = model.linear(X)
    auto = jamp.autocast(model, device_type="cpu")
    chex.assert_trees_all_close(auto(X), expected * 2.0, rtol=2e-2, atol=2e-2)
    model.scale = 5.0
    chex.assert_trees_all_close(auto(X), model(X), expected * 5.0, rtol=2e-2, atol=2e-2)


def test_state_no_key_can_see():
    # Read from a library object (not walked) inside a user object: only tracing sees it.
    holder = types.SimpleNamespace(box=[types.SimpleNamespace(scale=2.0)])
    assert_fresh(lambda x: x * holder.box[0].scale,
                 lambda: setattr(holder.box[0], "scale", 5.0), 2.0, 5.0)


def test_a_repeated_eager_call_runs_the_function_and_compiles_once():
    runs = []
    config = types.SimpleNamespace(scale=2.0, step=0)

    def f(x):
        runs.append(config.step)  # a side effect, as an eager call has
        return x * config.scale

    auto = jamp.autocast(f, device_type="cpu")
    auto(X)
    for step in (1, 2):
        config.step = step  # read by the function, but not by its program
        assert compiles_during(lambda: auto(X)) == 0
    assert runs == [0, 1, 2]


def test_under_jit_the_program_is_the_one_jit_traced():
    config = types.SimpleNamespace(scale=2.0)

    def f(x):
        return x * config.scale

    jitted_auto, jitted_plain = jax.jit(jamp.autocast(f, device_type="cpu")), jax.jit(f)
    before = (jitted_auto(X), jitted_plain(X))
    config.scale = 5.0
    after = (jitted_auto(X), jitted_plain(X))  # served from jit's cache: traced with 2.0
    chex.assert_trees_all_close(*before, X * 2.0, rtol=1e-2)
    chex.assert_trees_all_close(*after, X * 2.0, rtol=1e-2)
    # A new input shape traces again, with the scale read then.
    chex.assert_trees_all_close(jitted_auto(X[:2]), jitted_plain(X[:2]), X[:2] * 5.0,
                                rtol=1e-2)


def test_under_grad_the_function_is_read_afresh():
    config = types.SimpleNamespace(scale=2.0)
    loss = jamp.autocast(lambda x: jnp.sum(x * config.scale), device_type="cpu")
    chex.assert_trees_all_close(jax.grad(loss)(X), np.full(X.shape, 2.0, np.float32))
    config.scale = 5.0
    chex.assert_trees_all_close(jax.grad(loss)(X), np.full(X.shape, 5.0, np.float32))


def test_literals_are_keyed_by_their_bits():
    fill = {"value": 0.0}
    auto = jamp.autocast(lambda x: jnp.copysign(jnp.ones_like(x), fill["value"]),
                         device_type="cpu")
    chex.assert_trees_all_equal(auto(X), np.ones(X.shape, np.float32))
    fill["value"] = -0.0  # equal to 0.0, but not the same program
    chex.assert_trees_all_equal(auto(X), -np.ones(X.shape, np.float32))
    fill["value"] = float("nan")
    auto(X)
    fill["value"] = float("nan")  # another NaN object (NaN != NaN): the same program
    assert compiles_during(lambda: auto(X)) == 0


def test_python_values_handed_back_are_told_apart_as_plain_python_does():
    # 1, True and 1.0 are equal, and so are 0.0 and -0.0, yet each call hands back its own.
    config = types.SimpleNamespace(value=1)
    auto = jamp.autocast(lambda x: (x, config.value), device_type="cpu")
    for value in (1, True, 1.0, -0.0, 0.0):
        config.value = value
        got = auto(X)[1]
        assert type(got) is type(value) and repr(got) == repr(value)
