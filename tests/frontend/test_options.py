"""`jamp.initialize`'s options, one object both forms (linen and NNX) read, and the variables
it accepts beside the float32 params."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
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
    assert apply_fn(new_variables, jnp.ones((2, 4))).dtype == jnp.float32  # Apex's outputs
    tx.init(new_variables["params"])



@jax.tree_util.register_pytree_node_class
class Pair:
    """An output type of the user's own, with Apex's `to(dtype)`; a pytree, as a traced
    function's outputs must be (O1's autocast refuses one that is not)."""

    def __init__(self, a):
        self.a = a

    def to(self, dtype):
        return Pair(self.a.astype(dtype))

    def tree_flatten(self):
        return (self.a,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def _outputs(y, x):
    """A pytree of outputs: floating, integer, the user's type, a Python number, and the input
    as the model saw it."""
    return {"logits": y, "ids": jnp.argmax(y, -1), "pair": Pair(y), "temperature": 0.5,
            "seen": x}


class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _outputs(nn.Dense(3)(x), x)


class Nnx(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return _outputs(self.dense(x), x)


X4 = jnp.ones((2, 4))


def _linen(level, **overrides):
    """`Linen` set up at `level`: its apply on the returned variables, the returned kernel,
    and the returned optimizer's state after one step."""
    model = Linen()
    variables = model.init(jax.random.key(0), X4)
    apply_fn, variables, tx = jamp.initialize(model.apply, variables, optax.sgd(0.1),
                                              opt_level=level, verbosity=0, **overrides)
    params = variables["params"]
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    _, state = tx.update(grads, tx.init(params), params)
    return (lambda x: apply_fn(variables, x)), params["Dense_0"]["kernel"], state


def _nnx(level, **overrides):
    """The same with `Nnx`, set up in place."""
    model = Nnx(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    jamp.initialize(model, optimizer, opt_level=level, verbosity=0, **overrides)
    optimizer.update(model, jax.tree_util.tree_map(jnp.ones_like, nnx.state(model, nnx.Param)))
    return model, model.dense.kernel[...], optimizer.opt_state


FORMS = {"linen": _linen, "nnx": _nnx}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_cast_model_type_false_leaves_the_model_uncast_at_every_level(form, level):
    # Apex's multi-model tests call initialize(..., cast_model_type=False): its _initialize
    # casts the model, its inputs and its outputs only where cast_model_type is truthy.
    run, kernel, state = FORMS[form](level, cast_model_type=False)
    assert kernel.dtype == jnp.float32
    assert jamp.state_dict(state)["loss_scaler0"]["unskipped"] == 1
    out = run(X4.astype(jnp.bfloat16))
    assert out["seen"].dtype == jnp.bfloat16 and out["logits"].dtype == jnp.float32


def test_a_numpy_false_reads_as_false_as_properties_keep_it():
    props = jamp.properties("O2", cast_model_type=np.False_)
    assert props.cast_model_type is False  # as Apex stores it, printed as False
    assert "cast_model_type        : False" in repr(props)


@pytest.mark.parametrize("name,value,error,accepted", [
    ("cast_model_type", True, ValueError, r"a floating dtype .*False .*None"),
    ("cast_model_type", "False", ValueError, r"a floating dtype .*False .*None"),
    ("cast_model_type", 0, ValueError, r"a floating dtype .*False .*None"),
    ("cast_model_outputs", False, ValueError, r"a floating dtype .*None"),
    ("master_weights", "False", TypeError, r"True, False or None"),
    ("patch_torch_functions", "True", TypeError, r"True, False or None"),
    ("keep_batchnorm_fp32", "true", ValueError, r"True, False, None or the string 'True'"),
    ("loss_scale", "Dynamic", ValueError, r"'dynamic', a number or a string holding"),
])
def test_a_value_apex_does_not_accept_is_refused_naming_it_and_the_accepted_ones(
        name, value, error, accepted):
    model = nn.BatchNorm(use_running_average=True)
    variables = model.init(jax.random.key(0), X4)
    with pytest.raises(error, match=re.escape(f"{name}={value!r}")) as raised:
        jamp.initialize(model.apply, variables, opt_level="O2", verbosity=0, **{name: value})
    assert re.search(accepted, str(raised.value))


def _run(form, level, **overrides):
    if form == "linen":
        model = Linen()
        apply_fn, variables = jamp.initialize(model.apply, model.init(jax.random.key(0), X4),
                                              opt_level=level, verbosity=0, **overrides)
        return apply_fn(variables, X4)
    return jamp.initialize(Nnx(nnx.Rngs(0)), opt_level=level, verbosity=0, **overrides)(X4)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_cast_model_returns_float32_outputs_as_apex_does(form, level):
    # Apex's patched forward casts the outputs to cast_model_outputs, float32 when None: the
    # floating tensors and the user's types with a `to`, nothing else.
    out = _run(form, level)
    assert out["logits"].dtype == out["pair"].a.dtype == out["seen"].dtype == jnp.float32
    assert out["ids"].dtype == jnp.int32 and out["temperature"] == 0.5
    assert _run(form, level, cast_model_outputs=jnp.float16)["logits"].dtype == jnp.float16


@pytest.mark.parametrize("form", sorted(FORMS))
def test_cast_model_outputs_applies_where_the_model_is_not_cast(form):
    out = _run(form, "O2", cast_model_type=False, cast_model_outputs=jnp.bfloat16)
    assert out["logits"].dtype == out["pair"].a.dtype == jnp.bfloat16
    assert out["ids"].dtype == jnp.int32
