"""The higher-order helpers: an identity interpreter that rebuilds every control-flow
primitive reproduces jax's values and keeps the primitives; an interpreter with side results
collects them out of loops and branches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jamp import _jax_internals as jx
from jamp.walker import control_flow as cf
from jamp.walker.evaluate import Interpreter


class Identity(Interpreter):
    """Rebuilds each higher-order primitive around its body evaluated by itself."""

    def _scan(self, env, eqn, invals):
        return cf.scan(eqn, invals, self.body())[0]

    def _while(self, env, eqn, invals):
        return cf.while_loop(eqn, invals, self.body(),
                             lambda closed, args: self.evaluate(closed, args)[0])[0]

    def _cond(self, env, eqn, invals):
        return cf.switch(eqn, invals[0], invals[1:], self.body())[0]

    def _remat(self, env, eqn, invals):
        return cf.remat(eqn, invals, self.body())[0]

    def _jit(self, env, eqn, invals):
        return cf.jit(eqn, invals, self.body())[0]

    def _custom_jvp(self, env, eqn, invals):
        return cf.custom_jvp(eqn, invals, self.body())[0]

    def _custom_vjp(self, env, eqn, invals):
        return cf.custom_vjp(eqn, invals, self.body())[0]

    def _shard_map(self, env, eqn, invals):
        return cf.shard_map(eqn, invals, self.body())[0]

    rules = {"scan": _scan, "while": _while, "cond": _cond, "remat2": _remat,
             **dict.fromkeys(jx.FUNCTION_CALLS, _jit), "custom_jvp_call": _custom_jvp,
             "custom_vjp_call": _custom_vjp, "shard_map": _shard_map}


def _names(closed):
    return sorted(eqn.primitive.name for eqn in jx.equations(closed.jaxpr))


@jax.custom_vjp
def _clipped(x):
    return jnp.sin(x)


_clipped.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (jnp.clip(g * c, -0.1, 0.1),))


def _scan_fn(x):
    def step(c, xi):
        return c * 0.5 + jnp.sin(xi), c + xi
    return lax.scan(step, x[0], x, reverse=True, unroll=2)


def _while_fn(x):
    return lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 1.5 + x), (0, x))[1]


def _cond_fn(x):
    return lax.switch((x.sum() > 0).astype(jnp.int32) + 1,
                      [jnp.sin, jnp.cos, lambda v: v * 3.0], x)


def _remat_fn(x):
    policy = jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint(lambda v: jnp.sin(jnp.sin(v)), policy=policy)(x)


def _jit_fn(x):
    return jax.jit(lambda v: jnp.exp(v) * 2)(x) + 1


def _custom_jvp_fn(x):
    return jax.nn.relu(x) + jax.nn.softplus(x)


def _custom_vjp_fn(x):
    return _clipped(x * 2.0)


def _shard_map_fn(x):
    mesh = jax.make_mesh((2,), ("i",))
    return jax.shard_map(lambda v: jnp.sin(v) * 2, mesh=mesh, in_specs=jax.P(),
                         out_specs=jax.P())(x)


CASES = {"scan": _scan_fn, "while": _while_fn, "cond": _cond_fn, "remat": _remat_fn,
         "jit": _jit_fn, "custom_jvp": _custom_jvp_fn, "custom_vjp": _custom_vjp_fn,
         "shard_map": _shard_map_fn}


@pytest.mark.parametrize("name", sorted(CASES))
def test_identity_reproduces_values_and_primitives(name):
    fn = CASES[name]
    x = jnp.linspace(-1.0, 1.5, 4)
    closed = jax.make_jaxpr(fn)(x)
    rebuilt = jax.make_jaxpr(lambda v: Identity().evaluate(closed, [v]))(x)
    assert _names(rebuilt) == _names(closed)
    want = jax.tree_util.tree_leaves(fn(x))
    got = jax.jit(lambda v: Identity().evaluate(closed, [v]))(x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("name", ["custom_jvp", "custom_vjp", "remat", "scan"])
def test_identity_keeps_gradients(name):
    fn = CASES[name]
    x = jnp.linspace(-1.0, 1.5, 4)
    closed = jax.make_jaxpr(fn)(x)
    loss = lambda f: lambda v: sum(jnp.sum(o) for o in jax.tree_util.tree_leaves(f(v)))
    want = jax.grad(loss(fn))(x)
    got = jax.grad(loss(lambda v: Identity().evaluate(closed, [v])))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)


class Maxima(Interpreter):
    """Collects, per `sin` equation (by its position), the largest magnitude it returned."""

    def __init__(self):
        self.where = ()

    def _sin(self, env, eqn, invals):
        outs = self.default(env, eqn, invals)
        env.extras[(*self.where, env.index)] = jnp.max(jnp.abs(outs[0]))
        return outs

    def _inner(self, env, branch=()):
        where = (*self.where, env.index, *branch)

        def body(closed, args):
            outer, self.where = self.where, where
            try:
                return self.run(closed, args)
            finally:
                self.where = outer
        return body

    def _scan(self, env, eqn, invals):
        outs, extras = cf.scan(eqn, invals, self._inner(env))
        env.extras.update(extras)  # per iteration
        return outs

    def _while(self, env, eqn, invals):
        outs, extras = cf.while_loop(eqn, invals, self._inner(env),
                                     lambda closed, args: jx.eval_closed(closed, args)[0],
                                     combine=jnp.maximum)
        env.extras.update(extras)
        return outs

    def _cond(self, env, eqn, invals):
        branches = range(len(eqn.params["branches"]))
        outs, extras = cf.switch(eqn, invals[0], invals[1:],
                                 [self._inner(env, (k,)) for k in branches])
        env.extras.update(extras)
        return outs

    def _remat(self, env, eqn, invals):
        outs, extras = cf.remat(eqn, invals, self._inner(env))
        env.extras.update(extras)
        return outs

    rules = {"sin": _sin, "scan": _scan, "while": _while, "cond": _cond, "remat2": _remat}


def _extras(fn, x):
    closed = jax.make_jaxpr(fn)(x)
    return jax.jit(lambda v: Maxima().run(closed, [v]))(x)


def test_scan_stacks_extras_per_iteration():
    x = jnp.array([0.1, 0.2, 0.3])
    outs, extras = _extras(lambda v: lax.scan(lambda c, xi: (c, jnp.sin(xi * c)), 1.0, v), x)
    (stacked,) = extras.values()
    np.testing.assert_allclose(stacked, jnp.sin(x), rtol=1e-6)


def test_while_combines_extras_in_the_carry():
    def fn(v):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1]) + 1.0),
                              (0, v))[1]

    x = jnp.array([0.5])
    outs, extras = _extras(fn, x)
    (largest,) = extras.values()
    values, v = [], x
    for _ in range(3):
        values.append(jnp.sin(v))
        v = jnp.sin(v) + 1.0
    np.testing.assert_allclose(largest, max(float(w[0]) for w in values), rtol=1e-6)
    np.testing.assert_allclose(outs[0], v, rtol=1e-6)


@pytest.mark.parametrize("branch", [0, 1])
def test_switch_unions_extras_with_zeros(branch):
    def fn(v):
        return lax.cond(v[0] > 0, lambda u: jnp.sin(u) + 2.0, lambda u: jnp.sin(jnp.sin(u)), v)

    x = jnp.array([0.7 if branch else -0.7])
    outs, extras = _extras(fn, x)
    # cond's branches are (false, true); each sin has its own key, the other branch's zero.
    assert len(extras) == 3
    made = {k: float(v) for k, v in extras.items() if float(v) != 0.0}
    np.testing.assert_allclose(outs[0], fn(x), rtol=1e-6)
    assert len(made) == (1 if branch else 2)


def test_remat_returns_extras():
    outs, extras = _extras(functools.partial(jax.checkpoint(lambda v: jnp.sin(v) * 2)),
                           jnp.array([0.3, 0.4]))
    (largest,) = extras.values()
    np.testing.assert_allclose(largest, jnp.sin(0.4), rtol=1e-6)


def test_while_without_combine_refuses_extras():
    closed = jax.make_jaxpr(
        lambda v: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])),
                                 (0, v))[1])(jnp.ones(1))
    eqn = closed.jaxpr.eqns[-1]
    interpreter = Maxima()
    with pytest.raises(ValueError, match="combine"):
        jax.make_jaxpr(lambda v: cf.while_loop(eqn, [0, v], interpreter._inner(
            interpreter.new_env(closed)), lambda c, a: jx.eval_closed(c, a)[0]))(jnp.ones(1))


def test_pytree_values_ride_through_a_scan():
    """Values may be pytrees: each (low, high) pair is carried and sliced leaf by leaf."""

    class Paired(Interpreter):
        def read(self, env, atom):
            if isinstance(atom, jx.Literal):
                value = super().read(env, atom)
                return value, np.asarray(value, np.float32) if value.dtype == np.float16 \
                    else value
            return env.values[atom]

        def default(self, env, eqn, invals):
            low = jx.bind(eqn, eqn.params, [v[0] for v in invals])
            high = jx.bind(eqn, _wide(eqn.params), [v[1] for v in invals])
            return list(zip(low, high, strict=True))

        def _scan(self, env, eqn, invals):
            return cf.scan(eqn, invals, self.body())[0]

        rules = {"scan": _scan}

    def _wide(params):
        return {k: np.float32 if v is jnp.float16 or v == np.dtype(np.float16) else v
                for k, v in params.items()}

    def fn(v):
        return lax.scan(lambda c, xi: (c + xi * xi, c), jnp.float16(0), v)

    x = jnp.full(4, 300.0, jnp.float16)
    closed = jax.make_jaxpr(fn)(x)
    (carry, ys) = jax.jit(lambda a, b: Paired().evaluate(closed, [(a, b)]))(
        x, x.astype(jnp.float32))
    assert carry[0].dtype == jnp.float16 and carry[1].dtype == jnp.float32
    assert np.isinf(carry[0]) and carry[1] == 360000.0
