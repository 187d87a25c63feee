"""`jamp.initialize`'s options, one object both forms (linen and NNX) read, and the variables
it accepts beside the float32 params."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jamp
from jamp.frontend.options import InitializeOptions


def test_options_are_frozen_and_check_enabled_at_once():
    options = InitializeOptions(opt_level="O2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.opt_level = "O1"
    with pytest.raises(TypeError, match="enabled must be True or False"):
        InitializeOptions(enabled="false")


def test_counts_are_checked_only_when_enabled():
    disabled = InitializeOptions(enabled=False, num_losses=0)
    assert disabled.num_losses == 0  # Apex returns at once when disabled
    with pytest.raises(ValueError, match="num_losses must be an integer >= 1"):
        InitializeOptions(num_losses=0).checked_counts()
    assert InitializeOptions(num_losses=2.0).checked_counts().num_losses == 2


@pytest.mark.parametrize("form", ["linen", "nnx"])
def test_both_forms_refuse_a_bad_opt_level_with_apexs_message(form):
    if form == "linen":
        model = nn.Dense(2)
        args = (model.apply, model.init(jax.random.key(0), jnp.ones((1, 3))))
    else:
        args = (nnx.Linear(3, 2, rngs=nnx.Rngs(0)),)
    with pytest.raises(RuntimeError, match="Unexpected optimization level 'O4'"):
        jamp.initialize(*args, opt_level="O4", verbosity=0)


def test_python_floats_beside_the_params_are_left_as_they_are():
    # A collection holding a Python number (a temperature, say) has no dtype to check: the
    # float32 check looks at arrays only.
    model = nn.Dense(3)
    variables = dict(model.init(jax.random.key(0), jnp.ones((2, 4))))
    variables["consts"] = {"temperature": 0.5}
    apply_fn, new_variables, tx = jamp.initialize(model.apply, variables, optax.sgd(0.1),
                                                  opt_level="O2", verbosity=0)
    assert new_variables["consts"] == {"temperature": 0.5}
    assert new_variables["params"]["kernel"].dtype == jnp.float16
    assert apply_fn(new_variables, jnp.ones((2, 4))).dtype == jnp.float16
    tx.init(new_variables["params"])
