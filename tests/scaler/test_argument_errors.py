"""Loss scaling's arguments of the wrong type or value: each error names the value as the
user wrote it, and one error kind serves every missing state-dict key."""

import flax.serialization
import jax.numpy as jnp
import optax
import pytest

import jamp
from jamp.scaler import NotScalarBoolError, StateDictKeyError


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
