"""autocast's flags are bools, and the interpreter's leaner internals keep their behaviour."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp.policy import autocast_table
from jamp import _jax_internals as jx
from jamp.transforms import autocast_rules as rules
from jamp.transforms import interpreter

from helpers import BF16, F32, W, X


def matmul(x, w):
    return x @ w


# -- flags --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["enabled", "cache_enabled", "cast_outputs"])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, 1.0])
def test_a_flag_that_is_not_a_bool_is_a_type_error_naming_it(name, value):
    message = f"{name} must be True or False, got {name}={value!r}"
    with pytest.raises(TypeError) as info:
        jamp.autocast(matmul, device_type="cpu", **{name: value})
    assert message in str(info.value)
    with pytest.raises(TypeError, match=f"{name}="):
        jamp.autocast(device_type="cpu", **{name: value})  # a region or decorator


@pytest.mark.parametrize("name", ["enabled", "cast_outputs"])
def test_none_is_no_flag(name):
    with pytest.raises(TypeError, match=f"{name}=None"):
        jamp.autocast(matmul, **{name: None})


def test_torchs_positional_flags_are_checked_too():
    with pytest.raises(TypeError, match="enabled='no'"):
        jamp.autocast("cpu", None, "no")
    with pytest.raises(TypeError, match="cache_enabled='off'"):
        jamp.autocast("cpu", jnp.bfloat16, True, "off")


def test_cache_enabled_none_means_torchs_default():
    assert jamp.autocast(device_type="cpu", cache_enabled=None).cache_enabled is True


def test_numpy_bools_act_as_bools(variant):
    kept = variant(jamp.autocast(matmul, device_type="cpu", cast_outputs=np.bool_(False)))
    assert kept(X, W).dtype == BF16
    cast_back = variant(jamp.autocast(matmul, device_type="cpu", cast_outputs=np.bool_(True)))
    assert cast_back(X, W).dtype == F32
    region = jamp.autocast(device_type="cpu", enabled=np.bool_(False),
                           cache_enabled=np.bool_(False))
    assert region.enabled is False and region.cache_enabled is False
    off = variant(region(lambda x, w: (x @ w).dtype == F32))
    assert off(X, W)


def test_a_string_false_no_longer_turns_autocast_on():
    # Before, cast_outputs="no" counted as True and returned float32 outputs without a word.
    with pytest.raises(TypeError):
        jamp.autocast(matmul, device_type="cpu", cast_outputs="no")(X, W)


# -- the interpreter without its stand-ins -------------------------------------------------------

def test_stand_ins_for_old_jax_are_gone():
    assert not hasattr(interpreter, "dtype_of")
    assert not hasattr(jx, "typeof")
    source = inspect.getsource(jx)
    assert "get_aval" not in source  # jax.core.get_aval was removed in jax 0.10.0
    assert "isinstance(bind_params, tuple)" not in source
    # `bind` now passes get_bind_params' dict straight on: test_compositions'
    # test_custom_vjp_bwd_still_used re-binds a custom_vjp (its fwd and bwd are subfuns there).


def _region():
    return rules.Region(enabled=True, dtype=BF16, table=autocast_table("cpu"))


def test_the_interpreter_reads_dtypes_of_tracers_arrays_and_literals(variant):
    # A weak Python scalar becomes a literal of the jaxpr; x and w are arrays or tracers.
    closed = jax.make_jaxpr(lambda x, w: (x @ w) * 2.0 + 1)(X, W)

    def run(x, w):
        return interpreter.eval_jaxpr(closed, [x, w], _region(), interpreter.Context())

    (out,) = variant(run)(X, W)
    assert out.dtype == BF16
    np.testing.assert_allclose(np.asarray(out, np.float32), (X @ W) * 2.0 + 1, rtol=2e-2,
                               atol=2e-2)


@pytest.mark.parametrize("args", [[X], [X, W, W]], ids=["too few", "too many"])
def test_the_interpreter_refuses_a_wrong_number_of_arguments(args):
    # The environment is filled with zip(..., strict=True): an extra argument is no longer
    # dropped without a word, nor a missing one found only when it is read.
    closed = jax.make_jaxpr(matmul)(X, W)
    with pytest.raises(ValueError, match="zip"):
        interpreter.eval_jaxpr(closed, args, _region(), interpreter.Context())

