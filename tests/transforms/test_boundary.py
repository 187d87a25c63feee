"""What crosses an autocast function's boundary: torch's call forms, outputs that are not arrays,
errors that name the user's function, and the cache of transformed programs (a repeated call
runs the function, as an eager call does, but neither transforms nor compiles it again, and never
serves stale values)."""

import dataclasses
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jamp

from helpers import BF16, F16, F32, W, X, compiles_during


# -- torch's call forms ----------------------------------------------------------------------

def test_device_type_first_as_torch_writes_it(variant):
    applied = jamp.autocast("cuda", dtype=jnp.float16, cast_outputs=False)(lambda x, w: x @ w)
    assert variant(applied)(X, W).dtype == F16

    @jamp.autocast("cpu", cast_outputs=False)
    def decorated(x, w):
        return x @ w

    assert variant(decorated)(X, W).dtype == BF16

    def with_region(x, w):
        with jamp.autocast("cuda", dtype=jnp.float16):
            inside = x @ w
        return inside, x @ w

    inside, outside = variant(jamp.autocast(with_region, device_type="cpu",
                                            cast_outputs=False))(X, W)
    assert (inside.dtype, outside.dtype) == (F16, BF16)
    assert jamp.autocast("gpu").device_type == "cuda"
    # torch's positional dtype, enabled, cache_enabled
    region = jamp.autocast("cuda", jnp.bfloat16, False, False)
    assert (region.dtype, region.enabled, region.cache_enabled) == (BF16, False, False)


def test_options_given_twice_or_by_position_after_a_function_are_refused():
    with pytest.raises(TypeError, match="dtype twice"):
        jamp.autocast("cuda", jnp.float16, dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="by keyword after a function"):
        jamp.autocast(lambda x: x, "cuda")


@pytest.mark.parametrize("bad", [3, 2.5, [1, 2], np.ones(2)])
def test_first_argument_neither_function_nor_device_is_refused(bad):
    with pytest.raises(TypeError, match=r"first argument must be a function .* or a device"):
        jamp.autocast(bad)


def test_device_type_given_twice_is_refused():
    with pytest.raises(TypeError, match="device type twice: 'cuda' .* device_type='cpu'"):
        jamp.autocast("cuda", device_type="cpu")


def test_unknown_positional_device_type_is_refused():
    with pytest.raises(ValueError, match="Unknown autocast device_type 'xpu'"):
        jamp.autocast("xpu")


# -- outputs that are not arrays -------------------------------------------------------------

def test_non_array_outputs_come_back_as_they_were_returned(variant):
    def f(x, w, tag):
        return {"logits": x @ w, "tag": tag, "note": "ok", "scale": 0.5, "none": None}

    def call(x, w):  # checked inside, since jax.jit itself returns only arrays
        out = jamp.autocast(f, device_type="cpu")(x, w, "train")
        assert out["tag"] == "train" and out["note"] == "ok" and out["none"] is None
        assert out["scale"] == 0.5 and type(out["scale"]) is float
        return out["logits"]

    assert variant(call)(X, W).dtype == F32


def test_a_module_returned_is_the_module_passed():
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    same, y = jamp.autocast(lambda m, x: (m, m(x)), device_type="cpu")(model, X)
    assert same is model and y.dtype == F32


# -- errors name the user's function ---------------------------------------------------------

def my_loss(params, batch):
    if batch["x"].sum() > 0:  # Python control flow on a traced value: an error
        return params["w"].sum()
    return 0.0


def test_errors_name_the_users_function_and_argument():
    call = jamp.autocast(my_loss, device_type="cpu")
    with pytest.raises(jax.errors.TracerBoolConversionError) as raised:
        call({"w": W}, {"x": X, "tag": "train"})
    message = str(raised.value)
    assert "my_loss at" in message and "test_boundary.py" in message
    assert "argument batch['x']" in message
    assert "flat_fn" not in message and "autocast.py" not in message


# -- the cache of traced programs ------------------------------------------------------------

class Counter:
    """Counts the function's runs (traces). An object: the closure walk keys it by identity, and
    its count changes no program."""

    def __init__(self):
        self.traces = 0


def test_a_repeated_eager_call_runs_the_function_but_does_not_compile_again():
    counter = Counter()

    @jax.jit
    def layer(x, w):
        return jnp.tanh(x @ w)

    def loss(x, w):
        counter.traces += 1
        return jnp.sum(layer(layer(x, w), w))

    auto = jamp.autocast(loss, device_type="cpu")
    first = auto(X, W)
    assert counter.traces == 1
    assert compiles_during(lambda: auto(X, W)) == 0 and counter.traces == 2
    # Built again (as inside a training loop), the transform finds the same program.
    assert compiles_during(lambda: jamp.autocast(loss, device_type="cpu")(X, W)) == 0
    # New input types make another program.
    assert compiles_during(lambda: auto(X[:2], W)) > 0
    np.testing.assert_allclose(auto(X, W), first)


def test_the_cache_never_serves_stale_closed_over_values():
    counter = Counter()
    w = W
    scale = 2.0

    def f(x):
        counter.traces += 1
        return (x @ w) * scale

    auto = jamp.autocast(f, device_type="cpu")
    np.testing.assert_allclose(auto(X), (X @ W) * 2.0, rtol=2e-2, atol=2e-2)
    w = W * 3.0  # a new array bound to the closed-over name: an input of the same program
    assert compiles_during(lambda: auto(X)) == 0
    np.testing.assert_allclose(auto(X), (X @ W) * 6.0, rtol=2e-2, atol=2e-2)
    scale = 5.0  # a Python scalar is part of the program: another program
    np.testing.assert_allclose(auto(X), (X @ W) * 15.0, rtol=2e-2, atol=2e-2)
    assert counter.traces == 4


def test_arrays_held_by_objects_are_read_afresh():
    config = types.SimpleNamespace(shift=jnp.ones(4))  # a standard-library object: walked too

    class Trainer:  # user code: its arrays are inputs of the program
        def __init__(self):
            self.w = W
            self.opt_state = jnp.zeros(3)  # updated every step, never read by the loss

        def loss(self, x):
            counter.traces += 1
            return x @ self.w + config.shift

    counter = Counter()
    trainer = Trainer()
    auto = jamp.autocast(trainer.loss, device_type="cpu")
    np.testing.assert_allclose(auto(X), X @ W + 1.0, rtol=2e-2, atol=2e-2)
    trainer.w, trainer.opt_state = -W, trainer.opt_state + 1.0
    config.shift = 2.0 * jnp.ones(4)
    assert compiles_during(lambda: auto(X)) == 0
    np.testing.assert_allclose(auto(X), -(X @ W) + 2.0, rtol=2e-2, atol=2e-2)


class LibraryHolder:
    """Stands for an object of a library (jamp does not walk into those): its array is not an
    input of the program."""

    __module__ = "optax.some_module"

    def __init__(self, w):
        self.w = w


def test_arrays_behind_a_library_object_are_read_by_tracing_again():
    holder = LibraryHolder(W)
    counter = Counter()

    def f(x):
        counter.traces += 1
        return x @ holder.w

    auto = jamp.autocast(f, device_type="cpu")
    np.testing.assert_allclose(auto(X), X @ W, rtol=2e-2, atol=2e-2)
    holder.w = -W
    np.testing.assert_allclose(auto(X), -(X @ W), rtol=2e-2, atol=2e-2)
    assert counter.traces == 2


def test_nnx_modules_updated_by_an_optimizer_are_read_afresh():
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    counter = Counter()

    def f(x):
        counter.traces += 1
        return model(x)

    forward = jamp.autocast(f, device_type="cpu")
    before = forward(X)
    grads = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(model)
    optimizer.update(model, grads)
    assert compiles_during(lambda: forward(X)) == 0
    after = forward(X)
    assert not np.allclose(after, before)
    np.testing.assert_allclose(after, model(X), rtol=2e-2, atol=2e-2)


# -- what the cache must tell apart (each case once traced the wrong program) -----------------

def test_a_closed_over_scalar_array_is_read_as_a_value():
    w = jnp.asarray(2.0)  # used as an array and read with float(): a constant of the program
    counter = Counter()

    def f(x):
        counter.traces += 1
        return x * w + float(w)

    auto = jamp.autocast(f, device_type="cpu")
    np.testing.assert_allclose(auto(X), X * 2.0 + 2.0, rtol=2e-2)
    assert compiles_during(lambda: auto(X)) == 0  # the same value: the same program
    w = jnp.asarray(3.0)
    np.testing.assert_allclose(auto(X), X * 3.0 + 3.0, rtol=2e-2)


def test_a_small_numpy_array_changed_in_place_is_read_again():
    table = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    auto = jamp.autocast(lambda x: x + table, device_type="cpu")
    np.testing.assert_allclose(auto(X), X + table, rtol=2e-2)
    table[0] = 10.0
    np.testing.assert_allclose(auto(X), X + table, rtol=2e-2)


def test_two_names_bound_to_one_array_then_one_rebound():
    a = b = W
    auto = jamp.autocast(lambda x: x @ a + 10.0 * (x @ b), device_type="cpu")
    np.testing.assert_allclose(auto(X), 11.0 * (X @ W), rtol=2e-2, atol=2e-2)
    a = 2.0 * W
    np.testing.assert_allclose(auto(X), 12.0 * (X @ W), rtol=2e-2, atol=2e-2)


@dataclasses.dataclass
class Config:  # eq without hash: keyed by identity, and held by the cache so ids stay its own
    scale: float


def test_unhashable_static_arguments_are_told_apart():
    auto = jamp.autocast(lambda x, config: x * config.scale, device_type="cpu")
    got = []
    for scale in (1.0, 2.0, 3.0, 4.0, 5.0):
        config = Config(scale)  # freed after each call: a new one may reuse its id
        got.append(float(auto(jnp.ones(()), config)))
        del config
    assert got == [1.0, 2.0, 3.0, 4.0, 5.0]


class Stateful(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(3))
        self.count = nnx.Variable(0)          # a Python int
        self.buffer = nnx.data(jnp.zeros(3))  # an array attribute
        self.items = nnx.List([jnp.zeros(3), jnp.ones(3)])  # arrays in an nnx.List
        self.stats = nnx.Variable({"sum": jnp.zeros(3)})


def _update_everything(m, x):
    m.count.set_value(m.count.get_value() + 1)
    m.buffer = m.buffer + x
    m.items[0] = m.items[0] + x
    m.stats.set_value({"sum": m.stats.get_value()["sum"] + x})
    m.sow(nnx.Intermediate, "seen", x * 2.0)  # a new attribute on the first call
    return m.w[...] * x


@pytest.mark.filterwarnings(r"ignore:Using .Module.sow\(\). outside:DeprecationWarning")
def test_every_kind_of_nnx_state_is_written_back_as_without_autocast():
    x = jnp.arange(3.0)
    plain, auto = Stateful(), Stateful()
    step = jamp.autocast(_update_everything, device_type="cpu")
    for _ in range(2):
        _update_everything(plain, x)
        step(auto, x)
    for name in ("count", "buffer", "items", "stats", "seen"):
        want, got = nnx.state(plain, name), nnx.state(auto, name)
        assert not any(isinstance(g, jax.core.Tracer) for g in jax.tree.leaves(got))
        chex.assert_trees_all_close(got, want, rtol=1e-7)


class LinearBN(nnx.Module):
    def __init__(self, seed):
        self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(seed))
        self.bn = nnx.BatchNorm(4, rngs=nnx.Rngs(seed))

    def __call__(self, x):
        return self.bn(self.linear(x))


def test_returned_state_and_modules_are_this_calls():
    x = jax.random.normal(jax.random.key(0), (8, 4)) + 1.0
    step = jamp.autocast(lambda m, x: (m(x), m.bn, nnx.state(m, nnx.BatchStat)),
                         device_type="cpu")
    for model in (LinearBN(0), LinearBN(1)):  # the same structure: one program serves both
        _, bn, stats = step(model, x)
        assert bn is model.bn
        assert not np.allclose(model.bn.mean[...], 0.0)
        np.testing.assert_allclose(stats["bn"]["mean"][...], model.bn.mean[...])


def test_modules_behind_objects_and_callables_are_updated():
    class Trainer:
        def __init__(self):
            self.model = nnx.BatchNorm(4, rngs=nnx.Rngs(0))

    x = jax.random.normal(jax.random.key(1), (8, 4)) + 1.0
    trainer = Trainer()
    jamp.autocast(lambda x: trainer.model(x), device_type="cpu")(x)   # behind an object
    assert not np.allclose(trainer.model.mean[...], 0.0)
    model = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    jamp.autocast(lambda call, x: call(x), device_type="cpu")(model.__call__, x)  # a method
    assert not np.allclose(model.mean[...], 0.0)


def test_a_mutable_output_is_new_on_every_call():
    auto = jamp.autocast(lambda x: (x * 2.0, types.SimpleNamespace(tag="fresh")),
                         device_type="cpu")
    _, first = auto(X)
    first.tag = "changed by the caller"
    _, second = auto(X)
    assert second is not first and second.tag == "fresh"


def test_a_function_that_fails_leaves_the_module_as_it_was():
    model = Stateful()

    def fails(m, x):
        m.extra = nnx.Variable(x * 2.0)  # attached, then the function raises
        m.w = nnx.Param(x + 1.0)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        jamp.autocast(fails, device_type="cpu")(model, jnp.arange(3.0))
    assert not hasattr(model, "extra")
    np.testing.assert_array_equal(model.w[...], jnp.ones(3))  # concrete, usable


class _Holder:
    """Not a pytree: what a model may return around its arrays."""

    def __init__(self, value):
        self.value = value


def test_an_object_holding_computed_arrays_is_refused_not_leaked(variant):
    # jax.jit refuses the output; handed back as it is, the object would hold a tracer.
    auto = jamp.autocast(lambda x, w: _Holder(x @ w), device_type="cpu")
    with pytest.raises(TypeError, match=r"returned a _Holder object holding arrays it computed"):
        variant(lambda x, w: auto(x, w).value)(X, W)
    # One holding only what it was given, or no arrays, comes back as it was.
    given = jamp.autocast(lambda x: (x * 2.0, _Holder(W)), device_type="cpu")
    assert given(X)[1].value is W
