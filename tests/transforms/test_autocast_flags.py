"""autocast's flags are bools: anything else is a TypeError naming it, numpy bools act as
bools, and None means torch's default."""

import jax.numpy as jnp
import numpy as np
import pytest

import jamp

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
