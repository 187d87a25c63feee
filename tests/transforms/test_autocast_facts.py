"""The passes autocast's interpreter consults (`autocast_facts`), each on small jaxprs: run
alone over a program evaluated as traced, and through the interpreter, whose dtypes they
decide."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp import _jax_internals as jx
from jamp.policy import autocast_table
from jamp.policy.dtypes import is_floating
from jamp.transforms import autocast_facts
from jamp.transforms import autocast_rules as rules
from jamp.transforms import interpreter

from helpers import BF16, F16, F32, W, X, jaxpr_eqns

B = jnp.linspace(-0.1, 0.1, 4, dtype=jnp.float32)
REGION = rules.Region(enabled=True, dtype=BF16, table=autocast_table("cpu"))


def observed(f, *args, carries=()):
    """`f`'s jaxpr and the passes told of one evaluation of it on `args`, each equation bound
    as traced (`carries`: positions of arguments bound as a loop body's carries)."""
    closed = jax.make_jaxpr(f)(*args)
    values: dict = {}

    def read(atom):
        return atom.val if isinstance(atom, jx.Literal) else values[atom]

    facts = autocast_facts.Facts(read)
    for var, value in zip(closed.jaxpr.constvars, closed.consts, strict=True):
        values[var] = value
        facts.bind(var, value)
    for i, (var, value) in enumerate(zip(closed.jaxpr.invars, args, strict=True)):
        values[var] = value
        facts.bind(var, value, carry=i in carries)
    for eqn in closed.jaxpr.eqns:
        outs = jx.bind(eqn, eqn.params, [read(a) for a in eqn.invars])
        floating = [o.dtype for o in outs if is_floating(o)]
        if floating:
            facts.kernels.note(eqn, REGION, rules.widest(floating))
        facts.note(eqn, outs)
        values.update(zip(eqn.outvars, outs, strict=True))
    return closed.jaxpr, facts


def autocast(f, *args, dtype=BF16):
    """`f` under the interpreter in a region of `dtype`, and the jaxpr it runs."""
    closed = jax.make_jaxpr(f)(*args)
    region = rules.Region(enabled=True, dtype=dtype, table=autocast_table("cpu"))

    def run(*a):
        return interpreter.eval_jaxpr(closed, a, region, interpreter.Context())

    return run, jax.make_jaxpr(run)(*args)


def out_dtypes(jaxpr, name):
    return [np.dtype(e.outvars[0].aval.dtype) for e in jaxpr_eqns(jaxpr, name)]


# -- scalar-likes --------------------------------------------------------------------------------

def test_a_weak_scalar_and_its_broadcast_are_scalar_like_an_array_is_not():
    jaxpr, facts = observed(lambda x, s: x * jnp.broadcast_to(s, x.shape), X, 3.0)
    x, s = jaxpr.invars
    broadcast = jaxpr.eqns[0].outvars[0]
    assert facts.scalar_likes.follows(s)
    assert facts.scalar_likes.follows(broadcast)
    assert not facts.scalar_likes.follows(x)


def test_a_rank0_literal_is_scalar_like():
    jaxpr, facts = observed(lambda x: x * 2.0, X)
    (mul,) = jaxpr.eqns
    assert [facts.scalar_likes.follows(a) for a in mul.invars] == [False, True]


def test_a_loop_carry_is_never_scalar_like():
    # A time or a sum started from 0.0 is weak-typed, but it is the loop's value.
    jaxpr, facts = observed(lambda t, x: t + x, 0.0, X, carries=(0,))
    assert not facts.scalar_likes.follows(jaxpr.invars[0])
    jaxpr, facts = observed(lambda t, x: t + x, 0.0, X)
    assert facts.scalar_likes.follows(jaxpr.invars[0])


def test_a_weak_scalar_follows_the_other_operand():
    s = jnp.asarray(3.0)  # weak-typed, as a Python float traced
    run, jaxpr = autocast(lambda x, w, s: (x @ w) * s, X, W, s)
    assert out_dtypes(jaxpr, "mul") == [BF16]
    (out,) = run(X, W, s)
    assert out.dtype == BF16
    np.testing.assert_allclose(np.asarray(out, np.float32), (X @ W) * 3.0, rtol=2e-2,
                               atol=2e-2)


def test_a_loop_carry_started_from_a_python_float_leads_what_is_added_to_it():
    # The step's low value is added to the float32 sum, not the sum rounded to bfloat16.
    def f(xs, w):
        return lax.scan(lambda t, x: (t + (x @ w)[0, 0], None), 0.0, xs)[0]

    xs = jnp.stack([X, X + 1.0])
    run, jaxpr = autocast(f, xs, W)
    (scan,) = jaxpr_eqns(jaxpr, "scan")
    assert out_dtypes(scan.params["jaxpr"], "add") == [F32]
    (out,) = run(xs, W)
    assert out.dtype == F32


# -- constants -----------------------------------------------------------------------------------

def test_a_constant_and_what_moves_it_are_known_with_their_magnitude():
    jaxpr, facts = observed(lambda x: jnp.where(x > 0, x, jnp.full(x.shape, -1e9)), X)
    broadcast = next(e for e in jaxpr.eqns if e.primitive.name == "broadcast_in_dim")
    assert float(facts.constants.of(broadcast.invars[0])) == 1e9
    assert float(facts.constants.of(broadcast.outvars[0])) == 1e9
    assert facts.constants.of(jaxpr.invars[0]) is None


def test_a_constant_never_rounds_to_infinity_in_float16():
    # A mask value beyond float16's range: selected, it saturates at float16's largest.
    def masked(x, w):
        return jnp.where(x > 0, x @ w, -1e9)

    run, jaxpr = autocast(masked, X, W, dtype=F16)
    (out,) = run(X, W)
    assert out.dtype == F16
    assert np.isfinite(np.asarray(out)).all()
    assert np.asarray(out, np.float32).min() == -np.finfo(np.float16).max


def test_a_constant_added_computes_in_the_constants_dtype():
    run, jaxpr = autocast(lambda x, w: x @ w + 1e6, X, W, dtype=F16)
    assert out_dtypes(jaxpr, "add") == [F32]
    (out,) = run(X, W)
    np.testing.assert_allclose(np.asarray(out), X @ W + 1e6, rtol=1e-6)


# -- weights and kernels -------------------------------------------------------------------------

def test_weights_moved_or_concatenated_stay_weights_what_is_computed_from_them_does_not():
    jaxpr, facts = observed(lambda a, b: (jnp.concatenate([a.T, b]), a * 2.0), W, W)
    concatenated, doubled = jaxpr.outvars
    assert concatenated in facts.weights
    assert doubled not in facts.weights


def test_a_matmul_of_a_weight_is_a_linear_layer_and_its_bias_follows():
    x, w, b = (v.astype(BF16) for v in (X, W, B))
    jaxpr, facts = observed(lambda x, w, b: x @ w + b, x, w, b)
    dot = next(e for e in jaxpr.eqns if e.primitive.name == "dot_general")
    add = jaxpr.eqns[-1]
    assert facts.kernels.is_linear_layer(dot, REGION)
    assert add.invars[facts.kernels.follower(add)] in facts.weights


def test_a_full_size_value_added_to_a_layer_is_no_bias():
    x, w = X.astype(BF16), W.astype(BF16)
    jaxpr, facts = observed(lambda x, w, r: x @ w + r, x, w, x)
    assert facts.kernels.follower(jaxpr.eqns[-1]) is None


def test_a_bias_added_to_a_matmuls_low_result_follows_it():
    # The layer is one kernel: its bias, rounded to bfloat16 as torch casts it, is added to the
    # float32 accumulator, and the sum rounded once.
    run, jaxpr = autocast(lambda x, w, b: x @ w + b, X, W, B)
    assert out_dtypes(jaxpr, "dot_general") == [F32]
    assert out_dtypes(jaxpr, "add") == [F32]
    (out,) = run(X, W, B)
    assert out.dtype == BF16
    # A residual promotes, as torch adds it outside the layer's kernel.
    run, jaxpr = autocast(lambda x, w, r: x @ w + r, X, W, X)
    assert out_dtypes(jaxpr, "dot_general") == [BF16]
    assert run(X, W, X)[0].dtype == F32


def test_a_bias_concatenated_from_weights_follows_a_layer_of_concatenated_kernels():
    # flax's OptimizedLSTMCell: its gates' kernels and biases concatenated.
    def gates(x, w1, w2, b1, b2):
        return x @ jnp.concatenate([w1, w2], axis=1) + jnp.concatenate([b1, b2])

    run, _ = autocast(gates, X, W, W, B, B)
    assert run(X, W, W, B, B)[0].dtype == BF16
