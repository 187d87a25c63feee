"""The one table of primitive names: every name in it is a primitive of the running JAX (or
one that only some supported versions have), and what reads it agrees with it."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jamp
from jamp import _jax_internals as jx
from jamp.policy import primitives
from jamp.autograd import dependence
from jamp.autograd.anomaly_mode import _Evaluation
from jamp.debug.shadow import Evaluator
from jamp.policy.primitives import ROLES, VERSION_SPECIFIC, unknown_names
from jamp.transforms.interpreter import Autocast
from jamp.walker import walk


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_name_of_the_table_is_a_primitive_of_this_jax(role):
    unknown = unknown_names(sorted(ROLES[role]))
    assert not unknown, f"{role} names {unknown}: no primitive of jax {jax.__version__}"


@pytest.mark.parametrize("interpreter", [Autocast, Evaluator, _Evaluation],
                         ids=["autocast", "debugger", "anomaly"])
def test_the_call_primitives_and_every_evaluator_rule_name_primitives_of_this_jax(interpreter):
    assert unknown_names(sorted(jx.CALLS | set(interpreter.rules))) == []


def test_the_walk_and_dependence_rule_names_are_primitives_of_this_jax():
    assert unknown_names(sorted(set(walk._RUNS) | set(dependence._FLOW_RULES))) == []


def test_the_check_names_what_is_no_primitive():
    # Once in the table: `copy_p` is the Python name of the primitive `copy`, and jnp.argsort
    # traces to `sort`.
    assert unknown_names(["copy", "copy_p", "sort", "argsort"]) == ["copy_p", "argsort"]
    assert unknown_names(sorted(VERSION_SPECIFIC)) == []


def test_every_public_set_of_names_is_a_role_of_the_table():
    sets = {name for name, value in vars(primitives).items()
            if name.isupper() and isinstance(value, frozenset)}
    assert sets == set(ROLES) | {"VERSION_SPECIFIC"}


def ragged_dot(x):
    # Two groups of rows, each multiplied by its own (4, 5) matrix.
    return lax.ragged_dot(x, jnp.ones((2, 4, 5)), jnp.array([3, 3], jnp.int32))


# One program per matmul, with its FLOPs: 2 x (multiply-adds).
MATMUL_PROGRAMS = {
    "dot_general": (lambda x: x @ jnp.ones((4, 5)), 2 * 6 * 4 * 5),
    "ragged_dot_general": (ragged_dot, 2 * 6 * 4 * 5),
    "conv_general_dilated": (lambda x: lax.conv_general_dilated(
        x[None, None], jnp.ones((1, 1, 2, 2)), (1, 1), "VALID"), 2 * 5 * 3 * 2 * 2),
}


def test_every_matmul_has_a_program():
    assert set(MATMUL_PROGRAMS) == primitives.MATMULS


@pytest.mark.parametrize("name", sorted(primitives.MATMULS))
def test_every_matmul_is_lowered_by_the_tables_and_its_flops_are_counted(name):
    fn, flops = MATMUL_PROGRAMS[name]
    x = jnp.ones((6, 4))
    assert name in jamp.policy.primitive_names(fn, x)
    for table in jamp.policy.DEFAULT_TABLES.values():
        assert table.rule(name) == jamp.policy.LOWER
    report = jamp.profile.amp_report(jamp.autocast(fn, device_type="cpu"), x)
    assert report.flops == {"bfloat16": flops}
    assert report.half_flops_fraction == 1.0


def test_a_ragged_dot_contracting_its_ragged_dimension_counts_each_group_its_segment():
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=())

    def f(a, b):
        return lax.ragged_dot_general(a, b, jnp.array([2, 4], jnp.int32), numbers)

    a, b = jnp.ones((6, 3)), jnp.ones((6, 5))
    assert f(a, b).shape == (2, 3, 5)
    # Each group sums its own rows: the groups together multiply all 6 once.
    assert jamp.profile.amp_report(f, a, b).flops == {"float32": 2 * 6 * 3 * 5}


def test_primitive_names_lives_in_jamp_policy():
    assert "primitive_names" in jamp.policy.__all__
    assert jamp.policy.primitive_names is primitives.primitive_names
    assert jamp.policy.primitive_names(jnp.sin, 1.0) == ["sin"]
