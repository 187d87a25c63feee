"""The one walk over a program: every equation, with the equations around it and how many
times it runs per run of the program."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jamp
from jamp.walker.walk import Enclosing, equations, walk

X = jnp.ones((2, 2))


def sites(f, *args):
    """(primitive, enclosing primitives and body indices, times, written) of each site."""
    return [(s.eqn.primitive.name, [(e.eqn.primitive.name, e.body) for e in s.path], s.times,
             s.written) for s in walk(jax.make_jaxpr(f)(*args))]


def test_a_first_order_program_is_its_equations_once_each():
    assert sites(lambda x: jnp.sin(x) @ x, X) == [
        ("sin", [], 1, True), ("dot_general", [], 1, True)]


def test_a_scan_body_runs_once_per_iteration_and_nested_scans_multiply():
    def f(x):
        def outer(c, _):
            inner = lax.scan(lambda d, _: (jnp.sin(d), None), c, length=3)[0]
            return inner, None
        return lax.scan(outer, x, length=4)[0]

    assert sites(f, X) == [
        ("scan", [], 1, True),
        ("scan", [("scan", 0)], 4, True),
        ("sin", [("scan", 0), ("scan", 0)], 12, True)]


def test_each_cond_branch_runs_as_often_as_the_cond_and_is_named_by_its_index():
    def f(x):
        return lax.scan(lambda c, _: (lax.cond(c[0, 0] > 0, jnp.sin, jnp.cos, c), None), x,
                        length=5)[0]

    found = [s for s in sites(f, X) if s[0] in ("sin", "cos")]
    assert found == [("cos", [("scan", 0), ("cond", 0)], 5, True),
                     ("sin", [("scan", 0), ("cond", 1)], 5, True)]


def test_a_while_loop_condition_and_body_count_once():
    def f(x):
        return lax.while_loop(lambda c: c[0, 0] < 10, lambda c: jnp.exp(c), x)

    found = [s for s in sites(f, X) if s[0] in ("lt", "exp")]
    assert found == [("lt", [("while", 0)], 1, True), ("exp", [("while", 1)], 1, True)]


def test_a_jit_body_called_twice_is_written_once_and_runs_twice():
    g = jax.jit(jnp.tanh)
    found = [s for s in sites(lambda x: g(g(x)), X)]
    assert found == [("jit", [], 1, True), ("tanh", [("jit", 0)], 1, True),
                     ("jit", [], 1, True), ("tanh", [("jit", 0)], 1, False)]


def test_a_shard_map_body_runs_on_each_device_of_its_manual_axes():
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])

    def f(x):
        body = jax.shard_map(jnp.sin, mesh=mesh, in_specs=P("a"), out_specs=P("a"),
                             axis_names={"a"})
        return body(x)

    # Placed as the specs say (from jax 0.12 a mesh's axes are explicit: shard_map checks).
    x = jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P("a", None)))
    found = [s for s in sites(f, x) if s[0] == "sin"]
    assert found == [("sin", [("shard_map", 0)], 2, True)]


def test_the_path_holds_the_enclosing_equations_themselves():
    closed = jax.make_jaxpr(lambda x: jax.checkpoint(jnp.sin)(x))(X)
    remat, sin = list(walk(closed))
    assert sin.path == (Enclosing(remat.eqn, 0),)
    assert sin.path[0].eqn is closed.jaxpr.eqns[0]


def test_equations_are_the_walks_in_its_order_and_give_primitive_names():
    def f(x):
        return jax.jit(jnp.sin)(x) + lax.cond(True, jnp.cos, jnp.exp, x)

    closed = jax.make_jaxpr(f)(X)
    assert list(equations(closed)) == [s.eqn for s in walk(closed)]
    names = jamp.policy.primitive_names(f, X)
    assert names == list(dict.fromkeys(e.primitive.name for e in equations(closed)))
    # Each equation before its bodies' equations; a cond's branches by index (False first).
    assert names == ["jit", "sin", "cond", "exp", "cos", "add"]


def test_an_open_and_a_closed_jaxpr_walk_alike():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(np.float32(1))
    assert [s.eqn for s in walk(closed)] == [s.eqn for s in walk(closed.jaxpr)]
