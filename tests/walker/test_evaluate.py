"""The one evaluation loop: reading, writing, rules and the default bind."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp import _jax_internals as jx
from jamp.walker.evaluate import Env, Interpreter, literal_value


def _primitives(closed):
    return [eqn.primitive.name for eqn in closed.jaxpr.eqns]


def test_plain_interpreter_reproduces_values_and_program():
    def f(x, w):
        return jnp.tanh(x @ w + 1.0).sum(), x * 2

    x, w = jnp.arange(6.0).reshape(2, 3), jnp.ones((3, 4))
    closed = jax.make_jaxpr(f)(x, w)
    got = Interpreter().evaluate(closed, [x, w])
    for g, want in zip(got, jax.tree_util.tree_leaves(f(x, w)), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-6)
    again = jax.make_jaxpr(lambda *a: Interpreter().evaluate(closed, a))(x, w)
    assert _primitives(again) == _primitives(closed)


def test_rule_changes_only_its_primitive():
    class Doubled(Interpreter):
        def _sin(self, env, eqn, invals):
            return [2 * v for v in self.default(env, eqn, invals)]

        rules = {"sin": _sin}

    def f(x):
        return jnp.sin(x) + jnp.cos(x)

    x = jnp.array([0.5, 1.0])
    closed = jax.make_jaxpr(f)(x)
    np.testing.assert_allclose(Doubled().evaluate(closed, [x])[0],
                               2 * jnp.sin(x) + jnp.cos(x), rtol=1e-6)


def test_literals_read_as_numpy_values_of_their_dtype():
    closed = jax.make_jaxpr(lambda x: x + jnp.float16(3.0))(jnp.ones(2, jnp.float16))
    literal = next(a for a in closed.jaxpr.eqns[-1].invars if isinstance(a, jx.Literal))
    value = literal_value(literal)
    assert isinstance(value, np.ndarray) and value.dtype == np.float16 and value == 3.0


def test_hooks_see_each_equation_index_and_write():
    seen = []

    class Recording(Interpreter):
        def operands(self, env, eqn):
            seen.append((env.index, eqn.primitive.name))
            return super().operands(env, eqn)

        def write(self, env, var, value):
            env.extras[len(env.extras)] = jnp.asarray(value).sum()
            super().write(env, var, value)

    closed = jax.make_jaxpr(lambda x: jnp.exp(jnp.sin(x)))(jnp.ones(3))
    outs, extras = Recording().run(closed, [jnp.ones(3)])
    assert seen == [(0, "sin"), (1, "exp")]
    # The input, then each equation's result.
    assert len(extras) == 3
    np.testing.assert_allclose(extras[2], outs[0].sum(), rtol=1e-6)


def test_consts_replace_the_jaxprs_own():
    y = jnp.array([1.0, 2.0])
    closed = jax.make_jaxpr(lambda x: x + y)(jnp.zeros(2))
    if not closed.jaxpr.constvars:
        pytest.skip("this jax inlines closed-over arrays as literals")
    got = Interpreter().evaluate(closed, [jnp.zeros(2)], consts=[jnp.array([5.0, 6.0])])
    np.testing.assert_allclose(got[0], [5.0, 6.0])


def test_body_makes_a_fresh_env_per_run():
    made = []

    class Counting(Interpreter):
        def new_env(self, closed):
            made.append(closed)
            return Env()

    closed = jax.make_jaxpr(jnp.sin)(1.0)
    body = Counting().body()
    body(closed, [1.0])
    body(closed, [2.0])
    assert made == [closed, closed]
