"""Apex's opt levels: the presets of its frontend and every override check."""

import re
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from jamp.policy import OPT_LEVELS, AmpConfigurationWarning, Properties, properties

from helpers import BF16, F16, F32

OPTIONS = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions",
           "keep_batchnorm_fp32", "master_weights", "loss_scale")

# Apex's frontend, row by row, with JAX dtypes for torch's.
PRESETS = {
    "O0": (True, "O0", F32, False, None, False, 1.0),
    "O1": (True, "O1", None, True, None, None, "dynamic"),
    "O2": (True, "O2", F16, False, True, True, "dynamic"),
    "O3": (True, "O3", F16, False, False, False, 1.0),
}


@pytest.mark.parametrize("level", sorted(PRESETS))
def test_presets(level):
    props = properties(level)
    expected = dict(zip(OPTIONS, PRESETS[level]))
    assert props.options == expected
    for name, value in expected.items():
        assert getattr(props, name) == value
    assert list(props.options) == list(OPTIONS)
    assert OPT_LEVELS[level].brief.startswith(level)


@pytest.mark.parametrize("bad", ["00", "O4", "o1", "01", 1, None, "O"])
def test_unknown_opt_level(bad):
    with pytest.raises(RuntimeError) as info:
        properties(bad)
    message = str(info.value)
    assert repr(bad) in message
    assert "'O0', 'O1', 'O2', 'O3'" in message
    assert "the prefix O is the letter O, not the number zero" in message


# (level, override, value, warns)
CHECKS = [
    # cast_model_type: O1 keeps weights fp32
    ("O1", "cast_model_type", jnp.float16, True),
    ("O1", "cast_model_type", jnp.bfloat16, True),
    ("O1", "cast_model_type", jnp.float32, False),
    ("O1", "cast_model_type", False, False),
    ("O2", "cast_model_type", jnp.bfloat16, False),
    ("O3", "cast_model_type", jnp.bfloat16, False),
    ("O0", "cast_model_type", jnp.float16, False),
    # patch_torch_functions (autocast) belongs to O1
    ("O0", "patch_torch_functions", True, True),
    ("O2", "patch_torch_functions", True, True),
    ("O3", "patch_torch_functions", True, True),
    ("O1", "patch_torch_functions", True, False),
    ("O2", "patch_torch_functions", False, False),
    # keep_batchnorm_fp32 makes no sense with O1
    ("O1", "keep_batchnorm_fp32", True, True),
    ("O1", "keep_batchnorm_fp32", False, True),
    ("O1", "keep_batchnorm_fp32", "True", True),
    ("O2", "keep_batchnorm_fp32", False, False),
    ("O3", "keep_batchnorm_fp32", True, False),
    ("O0", "keep_batchnorm_fp32", True, False),
    # master_weights make no sense with O1
    ("O1", "master_weights", True, True),
    ("O1", "master_weights", False, True),
    ("O2", "master_weights", False, False),
    ("O3", "master_weights", True, False),
    ("O0", "master_weights", True, False),
]


@pytest.mark.parametrize("level,name,value,warns", CHECKS)
def test_override_checks_warn(level, name, value, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        props = properties(level, **{name: value})
    ours = [w for w in caught if issubclass(w.category, AmpConfigurationWarning)]
    assert len(ours) == (1 if warns else 0), [str(w.message) for w in ours]
    if warns:
        assert name.split("_")[0] in str(ours[0].message) or "O1" in str(ours[0].message)
    assert props.opt_level == level


@pytest.mark.parametrize("level,name,value,warns", [c for c in CHECKS if c[3]])
def test_strict_turns_the_warning_into_apex_error(level, name, value, warns):
    with pytest.raises(RuntimeError):
        properties(level, strict=True, **{name: value})


def test_warnings_filter_can_turn_it_into_an_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpConfigurationWarning)
        with pytest.raises(AmpConfigurationWarning):
            properties("O1", master_weights=True)


def test_assignment_after_construction_is_checked():
    props = properties("O1")
    with pytest.warns(AmpConfigurationWarning):
        props.keep_batchnorm_fp32 = True
    assert props.keep_batchnorm_fp32 is True
    with pytest.raises(AttributeError, match="fused_optimizer"):
        props.fused_optimizer = True


@pytest.mark.parametrize("value,stored", [
    (True, True), (False, False), (None, None), ("True", True), ("False", False)])
def test_keep_batchnorm_fp32_values(value, stored):
    props = properties("O2")
    props.keep_batchnorm_fp32 = value
    assert props.keep_batchnorm_fp32 is stored


@pytest.mark.parametrize("bad", ["true", "yes", 1, 0, "None"])
def test_keep_batchnorm_fp32_rejects(bad):
    with pytest.raises(ValueError, match="keep_batchnorm_fp32"):
        properties("O2", keep_batchnorm_fp32=bad)


@pytest.mark.parametrize("value,stored", [
    ("dynamic", "dynamic"), (128, 128.0), (128.0, 128.0), ("128.0", 128.0), ("1e3", 1000.0),
    (0.5, 0.5)])
def test_loss_scale_values(value, stored):
    for level in PRESETS:
        props = properties(level, loss_scale=value)
        assert props.loss_scale == stored
        assert type(props.loss_scale) is type(stored)


@pytest.mark.parametrize("bad", ["dynamc", "abc", 0, -1.0, "inf", float("nan")])
def test_loss_scale_rejects(bad):
    with pytest.raises(ValueError, match="loss_scale"):
        properties("O1", loss_scale=bad)


@pytest.mark.parametrize("bad", [[1.0], True])
def test_loss_scale_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match=re.escape(f"loss_scale={bad!r}")):
        properties("O1", loss_scale=bad)


def test_none_overrides_keep_the_preset():
    assert properties("O2", loss_scale=None, master_weights=None) == properties("O2")


def test_enabled_override():
    assert properties("O1", enabled=False).enabled is False


def test_cast_model_type_accepts_dtype_spellings():
    assert properties("O2", cast_model_type="bfloat16").cast_model_type == BF16
    assert properties("O2", cast_model_type="bf16").cast_model_type == BF16
    with pytest.raises(ValueError, match="cast_model_type"):
        properties("O2", cast_model_type=jnp.int8)


def test_unknown_option():
    with pytest.raises(ValueError, match="fused_optimizer") as info:
        properties("O2", fused_optimizer=True)
    assert "keep_batchnorm_fp32" in str(info.value)


@pytest.mark.parametrize("name,value", [
    ("enabled", "False"), ("enabled", 1), ("patch_torch_functions", "True"),
    ("patch_torch_functions", 0), ("master_weights", "False"), ("master_weights", 1)])
def test_properties_flags_refuse_non_bools(name, value):
    with pytest.raises(TypeError, match=re.escape(f"{name}={value!r}")):
        properties("O2", **{name: value})
    props = properties("O2")
    with pytest.raises(TypeError, match=name):
        setattr(props, name, value)
    assert getattr(props, name) == properties("O2").options[name]  # left as it was


def test_properties_flags_take_numpy_bools_as_bools():
    props = properties("O2", enabled=np.bool_(True), master_weights=np.bool_(False),
                       keep_batchnorm_fp32=np.bool_(True))
    assert props.enabled is True
    assert props.master_weights is False
    assert props.keep_batchnorm_fp32 is True


def test_keep_batchnorm_fp32_keeps_apexs_strings():
    assert properties("O2", keep_batchnorm_fp32="False").keep_batchnorm_fp32 is False
    assert properties("O2", keep_batchnorm_fp32="True").keep_batchnorm_fp32 is True
    with pytest.raises(ValueError, match="keep_batchnorm_fp32"):
        properties("O2", keep_batchnorm_fp32="false")


def test_master_weights_none_still_means_the_levels_default():
    props = properties("O1")
    props.master_weights = None
    assert props.master_weights is None


@pytest.mark.parametrize("strict", ["yes", 1, None])
def test_strict_must_be_a_bool(strict):
    with pytest.raises(TypeError, match=re.escape(f"strict={strict!r}")):
        properties("O1", strict=strict)


def test_properties_default_and_repr():
    props = Properties()
    assert props.options == dict(enabled=False, opt_level=None, cast_model_type=None,
                                 patch_torch_functions=False, keep_batchnorm_fp32=None,
                                 master_weights=None, loss_scale=1.0)
    text = repr(properties("O2"))
    for name in OPTIONS:
        assert name in text
    with pytest.raises(AttributeError):
        props.no_such_option
