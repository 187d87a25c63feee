"""The autocast interpreter run on a traced jaxpr directly: it reads the dtypes of tracers,
arrays and literals alike, refuses a wrong number of arguments, and its loop rules settle
carry dtypes, keep a cond's interface and run a custom_vjp's bwd with autocast off."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jamp.policy import autocast_table
from jamp.transforms import autocast_rules as rules
from jamp.transforms import interpreter

from helpers import BF16, F32, W, X, jaxpr_eqns, lowered_op_types


def matmul(x, w):
    return x @ w


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
    # An extra argument is not dropped without a word, nor a missing one found only when it
    # is read.
    closed = jax.make_jaxpr(matmul)(X, W)
    with pytest.raises(ValueError, match="zip"):
        interpreter.eval_jaxpr(closed, args, _region(), interpreter.Context())



# -- the loop rules ------------------------------------------------------------------------------

def transformed(f, *args):
    """`f` under the interpreter (bfloat16 region), and the jaxpr it runs."""
    closed = jax.make_jaxpr(f)(*args)

    def run(*a):
        return interpreter.eval_jaxpr(closed, a, _region(), interpreter.Context())

    return run, jax.make_jaxpr(run)(*args)


def carry_dtypes(eqn, num_carry):
    return [np.dtype(v.aval.dtype) for v in eqn.outvars[:num_carry]]


XS = jnp.stack([X, X * 0.5, -X])


def test_a_scan_carry_the_body_lowers_settles_in_the_low_dtype(variant):
    # torch's recurrent layers return their states in the low dtype.
    def rnn(h, xs, w):
        return lax.scan(lambda h, x: (jnp.tanh((h + x) @ w), None), h, xs)[0]

    run, jaxpr = transformed(rnn, X, XS, W)
    (scan,) = jaxpr_eqns(jaxpr, "scan")
    assert carry_dtypes(scan, 1) == [BF16]
    (out,) = variant(run)(X, XS, W)
    assert out.dtype == BF16
    np.testing.assert_allclose(np.asarray(out, np.float32), rnn(X, XS, W), atol=3e-2)


def test_a_scan_carry_the_body_adds_to_keeps_its_traced_dtype():
    # An accumulator in bfloat16 would lose its small steps: it keeps float32 even where it
    # starts from a lowered value.
    def total(h, xs, w):
        return lax.scan(lambda acc, x: (acc + x @ w, None), h @ w, xs)[0]

    run, jaxpr = transformed(total, X, XS, W)
    (scan,) = jaxpr_eqns(jaxpr, "scan")
    assert carry_dtypes(scan, 1) == [F32]
    body = scan.params["jaxpr"]
    assert [np.dtype(e.outvars[0].aval.dtype) for e in jaxpr_eqns(body, "dot_general")] == [BF16]


def test_a_while_carry_the_body_lowers_settles_in_the_low_dtype(variant):
    def loop(h, w):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)),
                              (0, h))[1]

    run, jaxpr = transformed(loop, X, W)
    (loop_eqn,) = jaxpr_eqns(jaxpr, "while")
    assert [np.dtype(v.aval.dtype) for v in loop_eqn.outvars] == [np.dtype(np.int32), BF16]
    (out,) = variant(run)(X, W)
    assert out.dtype == BF16
    np.testing.assert_allclose(np.asarray(out, np.float32), loop(X, W), atol=3e-2)


def test_a_cond_keeps_its_interface_and_lowers_inside(variant):
    def branch(p, x, w):
        return lax.cond(p, lambda x: x @ w, lambda x: x * 2.0, x)

    run, jaxpr = transformed(branch, jnp.asarray(True), X, W)
    (cond,) = jaxpr_eqns(jaxpr, "cond")
    assert [np.dtype(v.aval.dtype) for v in cond.outvars] == [F32]
    dots = [e for branch in cond.params["branches"] for e in jaxpr_eqns(branch, "dot_general")]
    assert [np.dtype(e.outvars[0].aval.dtype) for e in dots] == [BF16]
    for p in (True, False):
        (out,) = variant(run)(jnp.asarray(p), X, W)
        assert out.dtype == F32
        np.testing.assert_allclose(out, branch(p, X, W), atol=2e-2)


@jax.custom_vjp
def _product(x, w):
    return x @ w


def _product_fwd(x, w):
    return x @ w, (x, w)


def _product_bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g


_product.defvjp(_product_fwd, _product_bwd)


def test_a_custom_vjp_bwd_runs_with_autocast_off():
    # torch's rule for custom backward functions: the forward lowers, the user's backward
    # runs in the dtypes it was written for.
    closed = jax.make_jaxpr(_product)(X, W)

    def loss(x, w):
        (out,) = interpreter.eval_jaxpr(closed, [x, w], _region(), interpreter.Context())
        return out.astype(np.float32).sum()

    types = lowered_op_types(jax.value_and_grad(loss, argnums=(0, 1)), X, W,
                             op="dot_general")
    assert sorted(t[-1] for t in types) == ["bfloat16", "float32", "float32"]
    gx, gw = jax.grad(loss, argnums=(0, 1))(X, W)
    want = jax.grad(lambda x, w: _product(x, w).sum(), argnums=(0, 1))(X, W)
    assert gx.dtype == gw.dtype == F32
    np.testing.assert_allclose(gx, want[0], rtol=1e-6)
    np.testing.assert_allclose(gw, want[1], rtol=1e-6)


def _swap(c):
    return c[1], c[0]


@pytest.mark.parametrize("loop", [
    lambda c, xs: lax.scan(lambda c, x: (_swap(c), None), c, xs)[0],
    lambda c, xs: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, *_swap(c[1:])),
                                 (0, *c))[1:],
], ids=["scan", "while"])
def test_a_loop_whose_carries_never_settle_keeps_its_traced_interface(loop, variant):
    # Carries that swap a low and a float32 value take a new dtype at every step.
    def swapping(x, w, xs):
        return loop((x, x @ w), xs)

    run, jaxpr = transformed(swapping, X, W, XS)
    (loop_eqn,) = [e for e in jaxpr.eqns if e.primitive.name in ("scan", "while")]
    assert [np.dtype(v.aval.dtype) for v in loop_eqn.outvars][-2:] == [F32, F32]
    outs = variant(run)(X, W, XS)
    for got, want in zip(outs, swapping(X, W, XS), strict=True):
        assert got.dtype == F32
        np.testing.assert_allclose(got, want, atol=2e-2)
