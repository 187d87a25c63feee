"""Loss scaling under the inputs a new user tries: changed settings, complex and int leaves,
flags of the wrong type, and errors that name what was written."""

import dataclasses

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp.scaler import NotScalarBoolError, StateDictKeyError

# --- states are values: arrays, and settings in the static structure ---------------------------


def test_equal_settings_give_one_tree_structure_and_one_compile():
    first, second = jamp.GradScaler().init(), jamp.GradScaler().init()
    assert jax.tree.structure(first) == jax.tree.structure(second)
    total = jax.tree.map(jnp.add, first, second)
    assert float(total.loss_scale) == 2.0**17 and total.growth_interval == 2000
    traces = []

    @jax.jit
    def step(state):
        traces.append(state)  # runs once per trace
        return state.adjust(jnp.array(False))

    for state in (first, second, step(first)):
        step(state)
    assert len(traces) == 1
    # Other settings are another structure: the step traces again and runs them.
    other = jamp.GradScaler(backoff_factor=0.25).init()
    assert jax.tree.structure(other) != jax.tree.structure(first)
    assert float(step(other).loss_scale) == 2.0**14 and len(traces) == 2


def test_loss_scaled_states_of_equal_settings_share_a_compile():
    params, grads = {"w": jnp.ones(3)}, {"w": jnp.ones(3)}
    txs = [jamp.loss_scaled(optax.sgd(0.1), jamp.GradScaler()) for _ in range(2)]
    states = [tx.init(params) for tx in txs]
    assert jax.tree.structure(states[0]) == jax.tree.structure(states[1])
    traces = []

    @jax.jit
    def update(opt_state):
        traces.append(opt_state)
        return txs[0].update(grads, opt_state, params)

    for state in states:
        update(state)
    assert len(traces) == 1


def test_setters_take_effect_at_the_next_update_whose_state_carries_them(variant):
    scaler = jamp.GradScaler(init_scale=2.0**16, growth_interval=1)
    state = scaler.init()
    scaler.set_growth_factor(4.0)
    new = variant(scaler.update)(state, jnp.array(False))
    assert scaler.get_scale(new) == 2.0**18 and new.growth_factor == 4.0
    assert float(new.adjust(True).loss_scale) == 2.0**20
    assert scaler.state_dict(new)["growth_factor"] == 4.0
    # A state is a value: the one made before the change keeps its settings.
    assert state.growth_factor == 2.0 and float(state.adjust(True).loss_scale) == 2.0**17


def test_loss_scaled_runs_the_settings_its_state_carries():
    scaler = jamp.GradScaler(init_scale=2.0**16, growth_interval=1)
    tx = jamp.loss_scaled(optax.sgd(0.1), scaler)  # takes the scaler's settings, as optax
    scaler.set_growth_factor(8.0)                  # takes a learning rate
    params, grads = {"w": jnp.ones(3)}, {"w": jnp.ones(3)}
    update = jax.jit(tx.update)
    _, opt_state = update(grads, tx.init(params), params)
    assert float(jamp.get_loss_scale(opt_state).loss_scale) == 2.0**17
    changed = dataclasses.replace(jamp.get_loss_scale(opt_state), growth_factor=4.0)
    _, opt_state = update(grads, opt_state._replace(loss_scale=changed), params)
    assert float(jamp.get_loss_scale(opt_state).loss_scale) == 2.0**19


def test_load_state_dict_returns_a_state_of_the_loaded_settings():
    scaler = jamp.GradScaler(growth_interval=3)
    before = scaler.init()
    state = scaler.load_state_dict({"scale": 8.0, "growth_factor": 3.0, "backoff_factor": 0.5,
                                    "growth_interval": 1, "_growth_tracker": 0})
    assert (state.growth_factor, state.growth_interval) == (3.0, 1)
    assert float(state.adjust(True).loss_scale) == 8.0 * 3.0
    assert (before.growth_factor, before.growth_interval) == (2.0, 3)


def test_a_state_made_by_hand_checks_its_settings():
    with pytest.raises(ValueError, match="growth_factor.*> 1.*0.5"):
        jamp.scaler.GradScalerState(jnp.float32(1.0), jnp.int32(0), growth_factor=0.5)
    with pytest.raises(TypeError, match="enabled"):
        jamp.scaler.GradScalerState(jnp.float32(1.0), jnp.int32(0), enabled="yes")


# --- complex and int leaves --------------------------------------------------------------------


def _complex_loss(p):
    return jnp.sum(jnp.real(jnp.conj(p["z"]) * p["z"])) + jnp.sum(p["x"] ** 2)


@pytest.mark.parametrize("loss_scale", ["dynamic", jamp.DynamicLossScale(jnp.float32(2**15))],
                         ids=["grad_scaler", "dynamic_loss_scale"])
def test_complex_grads_are_unscaled_and_checked(loss_scale, variant):
    params = {"z": jnp.array([1 + 2j, -3j], jnp.complex64), "x": jnp.ones(2)}
    tx = jamp.loss_scaled(optax.sgd(0.5), loss_scale)
    opt_state = tx.init(params)
    scaled = jax.grad(lambda p: jamp.get_loss_scale(opt_state).scale(_complex_loss(p)))(params)
    updates, new_state = variant(tx.update)(scaled, opt_state, params)
    sgd = optax.sgd(0.5)
    plain, _ = sgd.update(jax.grad(_complex_loss)(params), sgd.init(params))
    np.testing.assert_allclose(updates["z"], plain["z"], rtol=1e-6)
    assert updates["z"].dtype == jnp.complex64
    # inf in the real part alone (0 imaginary) is not finite.
    bad = {"z": jnp.array([jnp.inf + 0j, 0j], jnp.complex64), "x": jnp.ones(2)}
    updates, skipped = variant(tx.update)(bad, new_state, params)
    assert not bool(skipped.last_finite)
    np.testing.assert_array_equal(updates["z"], np.zeros(2, np.complex64))


@pytest.mark.parametrize("value", [complex(np.inf, 0), complex(0, np.nan), complex(np.nan, 1)])
def test_all_finite_reads_both_parts_of_complex_leaves(value):
    assert not bool(jamp.all_finite({"z": jnp.array([1j, value], jnp.complex64)}))
    assert bool(jamp.all_finite({"z": jnp.array([1j, 2 + 0j], jnp.complex64)}))
    scaler = jamp.GradScaler()
    _, found_inf = scaler.unscale(scaler.init(), {"z": jnp.array([value], jnp.complex64)})
    assert bool(found_inf)


@pytest.mark.parametrize("skip", ["select", "cond"])
def test_int_leaf_in_params_passes_through(skip, variant):
    params = {"w": jnp.array([1.0, -2.0]), "step": jnp.array(3, jnp.int32)}
    grads = {"w": jnp.array([0.5, 0.25]), "step": jnp.array(0, jnp.int32)}
    inner = optax.adamw(1e-1)
    tx = jamp.loss_scaled(inner, jamp.StaticLossScale(jnp.float32(1.0)), skip=skip)
    opt_state = tx.init(params)
    updates, opt_state = variant(tx.update)(grads, opt_state, params)
    expected, expected_inner = inner.update(grads, inner.init(params), params)
    np.testing.assert_allclose(updates["w"], expected["w"], rtol=1e-6)
    jax.tree_util.tree_map(np.testing.assert_allclose, opt_state.inner_state, expected_inner)
    # A skipped step keeps the inner state's values, in the types the inner update gives.
    bad = {"w": jnp.array([jnp.nan, 0.0]), "step": jnp.array(0, jnp.int32)}
    updates, skipped = variant(tx.update)(bad, opt_state, params)
    assert not bool(skipped.last_finite)
    jax.tree_util.tree_map(np.testing.assert_array_equal, skipped.inner_state,
                           opt_state.inner_state)
    np.testing.assert_array_equal(updates["w"], np.zeros(2))


# --- flags and values of the wrong kind ---------------------------------------------------------


@pytest.mark.parametrize("make,message", [
    (lambda: jamp.GradScaler(enabled="false"), "enabled='false'"),
    (lambda: jamp.GradScaler(enabled=1), "enabled=1"),
    (lambda: jamp.loss_scaled(optax.sgd(1.0), report="yes"), "report='yes'"),
    (lambda: jamp.GradScaler(growth_interval="2000"), "growth_interval='2000'"),
    (lambda: jamp.GradScaler(init_scale=None), "init_scale=None"),
    (lambda: jamp.loss_scaled(optax.sgd(1.0), True), "loss_scale=True"),
    (lambda: jamp.loss_scaled(optax.sgd(1.0), num_losses=True), "num_losses=True"),
    (lambda: jamp.DynamicLossScale("big"), "loss_scale='big'"),
])
def test_wrong_types_are_type_errors_naming_the_value(make, message):
    with pytest.raises(TypeError) as raised:
        make()
    assert message in str(raised.value)


@pytest.mark.parametrize("make,message", [
    (lambda: jamp.loss_scaled(optax.adam(1e-3), -5.0), "loss_scale=-5.0"),
    (lambda: jamp.loss_scaled(optax.adam(1e-3), "dyanmic"), "loss_scale='dyanmic'"),
    (lambda: jamp.GradScaler(backoff_factor=1.5), "backoff_factor=1.5"),
    (lambda: jamp.StaticLossScale(-2.0), "loss_scale=-2.0"),
    (lambda: jamp.loss_scaled(optax.sgd(1.0), num_losses=0), "num_losses=0"),
])
def test_bad_values_are_value_errors_naming_the_value_as_written(make, message):
    with pytest.raises(ValueError) as raised:
        make()
    assert message in str(raised.value)
    assert "Array(" not in str(raised.value)


def test_found_inf_of_the_wrong_shape_names_found_inf():
    scaler = jamp.GradScaler()
    with pytest.raises(NotScalarBoolError, match="found_inf.*shape \\(2,\\)"):
        scaler.update(scaler.init(), found_inf=jnp.zeros(2, bool))
    with pytest.raises(NotScalarBoolError, match="grads_finite"):
        jamp.DynamicLossScale(jnp.float32(2.0)).adjust(jnp.ones(2, bool))


def test_missing_state_dict_keys_raise_one_kind_of_error_everywhere():
    scaler = jamp.GradScaler()
    with pytest.raises(StateDictKeyError, match="_growth_tracker"):
        scaler.load_state_dict({"scale": 2.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 3})
    for target in (jamp.DynamicLossScale(jnp.float32(2.0)), scaler.init()):
        with pytest.raises(StateDictKeyError, match="lacks"):
            flax.serialization.from_state_dict(target, {})
    # torch's callers catch KeyError, flax's ValueError: both work.
    assert issubclass(StateDictKeyError, KeyError) and issubclass(StateDictKeyError, ValueError)
    assert str(StateDictKeyError("lacks x")) == "lacks x"


def test_jmp_accepts_zero_scales_and_so_does_jamp():
    zero = jamp.StaticLossScale(0.0)
    assert float(zero.scale(jnp.float32(3.0))) == 0.0
    dyn = jamp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(0.0), factor=2)
    for _ in range(4):
        dyn = dyn.adjust(False)
    assert float(dyn.loss_scale) == 0.25


def test_counters_saturate_instead_of_wrapping():
    tx = jamp.loss_scaled(optax.sgd(1.0), 1.0)
    params = {"w": jnp.ones(2)}
    top = jnp.iinfo(jnp.int32).max
    opt_state = tx.init(params)._replace(total_steps=jnp.int32(top), skipped_steps=jnp.int32(top))
    _, opt_state = tx.update({"w": jnp.full(2, jnp.nan)}, opt_state, params)
    assert int(opt_state.total_steps) == top and int(opt_state.skipped_steps) == top
