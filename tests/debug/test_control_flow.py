"""The debugger looks inside scan, while, cond and checkpoint bodies, and inside regions."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jamp
from jamp.debug import first_nonfinite, precision_report

F16 = dict(dtype=jnp.float16, device_type="cuda")
W = 4.0 * jnp.eye(4)


def _growing(w, x):
    # Each iteration multiplies by 4 in float16: 1000 * 4**4 overflows at iteration 3.
    def step(c, _):
        c = c @ w
        return c, jnp.sum(c.astype(jnp.float32))
    _, sums = lax.scan(step, x, None, length=5)
    return sums


def test_scan_body_maxima_over_iterations_and_the_first_iteration():
    x = jnp.full((2, 4), 1000.0)
    report = precision_report(_growing, W, x, **F16)
    assert report.loss_scale is None and report.suggested_loss_scale is None
    dots = [f for f in report.findings if f.primitive == "dot_general"]
    assert dots and dots[0].kind == "overflow" and dots[0].max_abs == 1000.0 * 4 ** 5
    found = first_nonfinite(_growing, W, x, **F16)
    assert found.primitive == "dot_general" and found.iterations == (3,)
    assert "c = c @ w" in found.code


def test_while_body():
    def f(w, x, n):
        def body(carry):
            i, c = carry
            return i + 1, c @ w
        return lax.while_loop(lambda carry: carry[0] < n, body, (0, x))[1]

    report = precision_report(f, W, jnp.full((2, 4), 1000.0), jnp.int32(5), **F16)
    dots = [f for f in report.findings if f.primitive == "dot_general"]
    assert dots and dots[0].max_abs == 1000.0 * 4 ** 5 and dots[0].kind == "overflow"



def test_while_body_the_equation_that_made_the_nan_not_one_it_spread_to():
    # Iteration 0: `log` makes a NaN; iteration 1: `sin` reads it from the carry. `sin` comes
    # first in the body, yet it only passed the NaN on (anomaly mode names `log` too).
    def f(x):
        def body(carry):
            i, c = carry
            a = jnp.sin(c)
            return i + 1, jnp.where(i == 0, jnp.log(a - 2.0), a)
        return lax.while_loop(lambda carry: carry[0] < 3, body, (0, x))[1]

    found = first_nonfinite(f, jnp.ones(3), **F16)
    assert found.primitive == "log" and found.value == "nan"


def _grow_tenfold(c, w):
    h = c @ w
    return h * 10.0


def test_while_body_names_the_overflow_not_the_matmul_its_inf_turns_to_nan():
    # From ones, `h * 10.0` overflows float16 at iteration 4 (1e5); at iteration 5 the matmul
    # reads that inf and makes NaN (inf * 0). The matmul comes first in the body, yet the
    # multiply is named, in the while loop as in the same loop written as a scan.
    w, x = jnp.eye(4), jnp.ones((2, 4))

    def looped(w, x, n):
        return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, _grow_tenfold(c[1], w)),
                              (0, x))[1]

    def scanned(w, x):
        return lax.scan(lambda c, _: (_grow_tenfold(c, w), None), x, None, length=6)[0]

    found = first_nonfinite(looped, w, x, jnp.int32(6), **F16)
    assert (found.primitive, found.value, found.code) == ("mul", "inf", "return h * 10.0")
    found = first_nonfinite(scanned, w, x, **F16)
    assert (found.primitive, found.value, found.iterations) == ("mul", "inf", (4,))


def _solve(w, x):
    # A fixed-point solver: its forward holds a while loop, which JAX cannot differentiate in
    # reverse mode.
    def body(carry):
        i, h = carry
        return i + 1, jnp.tanh(h @ w + x)
    _, h = lax.while_loop(lambda carry: carry[0] < 3, body, (0, jnp.zeros_like(x)))
    return jnp.mean((h * 1e3) @ w)


def test_a_solver_in_the_forward_falls_back_to_the_forward_pass_with_a_note():
    w, x = W * 100, jnp.full((2, 4), 10.0)
    report = precision_report(_solve, w, x, **F16)
    assert report.loss_scale is None and report.gradient_underflow is None
    assert not any(f.backward for f in report.findings)
    assert report.overflows and report.loss is not None
    note, = report.notes
    assert "gradients are not analysed" in note and "while_loop" in note
    assert note in str(report) and report.to_dict()["notes"] == [note]
    with pytest.warns(UserWarning, match="gradients are not analysed"):
        found = first_nonfinite(_solve, w, x, **F16)
    assert found.primitive == "dot_general" and not found.backward


def test_backward_false_runs_the_forward_pass_only_without_a_note():
    w, x = W * 100, jnp.full((2, 4), 10.0)
    report = precision_report(_solve, w, x, **F16, backward=False)
    assert report.loss_scale is None and report.notes == () and report.overflows
    loss = lambda w, x: jnp.mean((x * 1e3) @ w)
    report = precision_report(loss, w, x, **F16, backward=False)
    assert not any(f.backward for f in report.findings) and report.notes == ()
    assert first_nonfinite(loss, w, x, **F16, backward=False).primitive == "dot_general"

@pytest.mark.parametrize("hot", [True, False])
def test_cond_branch_taken(hot):
    def f(w, x, hot):
        return lax.cond(hot, lambda x: (x * 1e3) @ w, lambda x: x @ w, x)

    report = precision_report(f, W * 10, jnp.full((2, 4), 10.0), jnp.bool_(hot), **F16)
    assert bool(report.overflows) == hot
    found = first_nonfinite(f, W * 10, jnp.full((2, 4), 10.0), jnp.bool_(hot), **F16)
    assert (found is not None) == hot


def test_checkpoint_body_and_its_backward():
    def loss(w, x):
        h = jax.checkpoint(lambda w, x: jnp.tanh((x * 1e3) @ w))(w, x)
        return jnp.mean(h.astype(jnp.float32))

    report = precision_report(loss, W * 10, jnp.full((2, 4), 10.0), **F16)
    assert any(f.kind == "overflow" and f.primitive == "dot_general" and not f.backward
               for f in report.findings)
    assert any(f.backward for f in report.findings)


class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.ones, (4, 4))
        with jamp.autocast(dtype=jnp.float16):  # a region of its own inside the module
            return (x * 1e3) @ w


class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.sum(Inner()(x).astype(jnp.float32) ** 2)


def test_a_region_inside_a_module_keeps_its_dtype_under_the_rules():
    # A module rule applies where the module begins; a region opened inside it nests inside
    # it, so the float16 region still overflows: the report says its rules did not fix it.
    x = jnp.full((2, 4), 100.0)
    variables = Outer().init(jax.random.key(0), x)
    report = precision_report(lambda v, x: Outer().apply(v, x), variables, x, **F16)
    assert report.overflows and report.rules and not report.rules_checked
    assert "rules did not remove every overflow" in report.table()
