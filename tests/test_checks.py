"""The argument checks every public entry point shares (`jamp._checks`)."""

import numpy as np
import pytest

from jamp._checks import check_bool


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.bool_(False)])
def test_check_bool_takes_python_and_numpy_bools(value):
    result = check_bool("flag", value)
    assert type(result) is bool and result == bool(value)


@pytest.mark.parametrize("value", ["no", "False", "True", 0, 1, 1.0, None, np.array([True])])
def test_check_bool_refuses_anything_else_naming_the_parameter_and_the_value(value):
    with pytest.raises(TypeError) as info:
        check_bool("cast_outputs", value)
    assert f"cast_outputs={value!r}" in str(info.value)
    assert "must be True or False" in str(info.value)
