"""jamp.policy's surface: one list of device types, flags that are bools, the op tables' one
public home, the PEP 561 marker, and the jax bound stated once."""

import importlib.metadata
import importlib.resources
import pathlib
import re

import jax
import numpy as np
import pytest

import jamp
from jamp.policy import autocast_tables
from jamp._checks import check_bool
from jamp.policy.autocast_tables import (
    ACCEPTED_DEVICE_TYPES, DEFAULT_TABLES, DEVICE_ALIASES, autocast_table, canonical_device_type)
from jamp.policy.opt_levels import properties

ROOT = pathlib.Path(__file__).resolve().parents[2]


# -- device types: one list, rocm and gpu included ---------------------------------------------

def test_the_accepted_device_types_are_the_tables_and_their_aliases():
    assert set(ACCEPTED_DEVICE_TYPES) == set(DEFAULT_TABLES) | set(DEVICE_ALIASES)
    assert len(ACCEPTED_DEVICE_TYPES) == len(set(ACCEPTED_DEVICE_TYPES))
    assert {"rocm", "gpu"} <= set(ACCEPTED_DEVICE_TYPES)


@pytest.mark.parametrize("spelling", ACCEPTED_DEVICE_TYPES)
def test_every_accepted_device_type_selects_a_table(spelling):
    for written in (spelling, spelling.upper(), f" {spelling} "):
        table = autocast_table(written)
        assert table is DEFAULT_TABLES[canonical_device_type(written)]


@pytest.mark.parametrize("alias", ["rocm", "ROCm", "gpu"])
def test_gpu_aliases_select_the_cuda_table(alias):
    assert canonical_device_type(alias) == "cuda"
    region = jamp.autocast(device_type=alias)
    assert region.device_type == "cuda"
    assert region.table is DEFAULT_TABLES["cuda"]


@pytest.mark.parametrize("bad", ["xpu", "Cuda:0", " metal ", ""])
def test_an_unknown_device_type_is_named_as_written_beside_every_accepted_one(bad):
    with pytest.raises(ValueError) as info:
        canonical_device_type(bad)
    message = str(info.value)
    assert repr(bad) in message
    for accepted in ACCEPTED_DEVICE_TYPES:
        assert repr(accepted) in message
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        jamp.autocast(device_type=bad)


@pytest.mark.parametrize("bad", [3, None, jax.devices()[0]])
def test_a_device_type_that_is_not_a_string_is_a_type_error(bad):
    with pytest.raises(TypeError, match="device_type") as info:
        canonical_device_type(bad)
    assert "'rocm'" in str(info.value)


def test_the_docs_name_every_accepted_device_type():
    docs = (ROOT / "docs" / "autocast.md").read_text()
    for accepted in ACCEPTED_DEVICE_TYPES:
        assert f'"{accepted}"' in docs


# -- flags are bools ----------------------------------------------------------------------------

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


# -- the op tables' one public home ---------------------------------------------------------------

TABLE_NAMES = ("ACCUMULATE_FP32", "DEFAULT_TABLES", "FP32", "LOWER", "OpTable", "autocast_table")


@pytest.mark.parametrize("name", TABLE_NAMES)
def test_op_tables_are_public_in_jamp_policy_only(name):
    assert name in jamp.policy.__all__
    assert getattr(jamp.policy, name) is getattr(autocast_tables, name)
    assert name not in jamp.transforms.__all__
    assert not hasattr(jamp.transforms, name)


def test_a_table_from_jamp_policy_drives_autocast():
    table = jamp.policy.autocast_table("cpu").updated({"dot_general": "float16"})
    x = np.ones((2, 2), np.float32)
    out = jamp.autocast(lambda a: a @ a, op_table=table, cast_outputs=False)(x)
    assert out.dtype == np.float16


def test_readme_and_docs_point_to_jamp_policy_for_the_tables():
    readme = (ROOT / "README.md").read_text()
    docs = (ROOT / "docs" / "autocast.md").read_text()
    row = next(line for line in readme.splitlines() if "autocast op lists" in line)
    assert "jamp.policy." in row and "jamp.transforms" not in row
    assert "from jamp.transforms import FP32" not in docs
    assert "jamp.transforms.autocast_table" not in docs


# -- comments that are true -----------------------------------------------------------------------

def test_policy_keys_serve_both_the_parser_and_the_dtype_hint():
    # dtypes.POLICY_KEYS: get_policy parses with the keys, parse_dtype hints with them.
    assert jamp.policy.get_policy("compute=bf16") == jamp.policy.get_policy("c=bf16")
    with pytest.raises(ValueError, match="Did you mean 'compute=float16'"):
        jamp.policy.parse_dtype("compute_float16")


# -- packaging ------------------------------------------------------------------------------------

def test_the_installed_package_carries_the_pep_561_marker():
    marker = importlib.resources.files("jamp") / "py.typed"
    assert marker.is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_data = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^jamp = \[.*"py\.typed".*\]', package_data, re.M)


def _jax_requirement() -> str:
    pyproject = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"jax(>=[^"]+)"', pyproject).group(1)


def test_the_installed_jax_is_inside_the_supported_range():
    spec = dict(re.findall(r"([<>]=?)([\d.]+)", _jax_requirement()))
    installed = tuple(int(p) for p in importlib.metadata.version("jax").split(".")[:2])
    assert installed >= tuple(int(p) for p in spec[">="].split("."))
    assert installed < tuple(int(p) for p in spec["<"].split("."))


def test_the_readme_version_table_states_the_same_jax_range_and_why():
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| jax / jaxlib"))
    assert f"`{_jax_requirement()}`" in row
    assert "_jax_internals.py" in row  # the reason for the cap is stated beside it
