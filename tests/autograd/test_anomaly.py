"""Anomaly detection (jamp.autograd.detect_anomaly / set_detect_anomaly): a NaN produced in the
forward or the backward of a checked function raises an error that names the primitive, the
pass and the user's forward line (file, line number, source text), eagerly, under jit and
under `jax.jit(jax.grad(f))`; with the mode off a function is unchanged."""

import pathlib
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp.autograd.anomaly_mode import (AnomalyError, FloatingPointAnomalyError,
                                        anomaly_checked, detect_anomaly,
                                        is_anomaly_check_nan_enabled, is_anomaly_enabled,
                                        set_detect_anomaly)
from jamp.autograd.function import Function

pytestmark = pytest.mark.filterwarnings("ignore:jamp anomaly detection is on")


@pytest.fixture(autouse=True)
def fresh_traces():
    """Each test traces its functions anew. JAX's trace caches outlive a test: `masked`
    traced first under `anomaly_checked` (by another test on the same worker) is then found
    in the cache by a plain `jax.jit(jax.grad(masked))`, whose note then names only the
    calling line, not the line inside `masked` (a known limitation of the forward-line note,
    which reads the cached trace's source information)."""
    jax.clear_caches()

HERE = pathlib.Path(__file__)
SOURCE = HERE.read_text().splitlines()


def line_of(marker: str) -> int:
    """The number of the line of this file that ends with the comment `# <marker>`."""
    return next(i for i, text in enumerate(SOURCE, 1) if text.endswith(f"# {marker}"))


def helper(y):
    return jnp.log(y)  # HELPER-LOG


def loss(x):
    y = jnp.sin(x)
    z = helper(y)  # LOSS-CALLS-HELPER
    return z.sum()


def masked(x):
    # Finite forward (the log's -inf is not selected); the backward of the log divides
    # the zero cotangent by zero.
    safe = jnp.where(x > 0, jnp.log(x), 0.0)  # MASKED-LOG
    return safe.sum()


POSITIVE = jnp.array([0.5, 1.0])
NEGATIVE = -POSITIVE
ZERO_ONE = jnp.array([0.0, 1.0])


def error_text(call) -> str:
    """The anomaly message `call()` raises: an AnomalyError eagerly, a JaxRuntimeError carrying
    it from a compiled program."""
    with pytest.raises(RuntimeError) as info:
        jax.block_until_ready(call())
    error = info.value
    assert isinstance(error, (AnomalyError, jax.errors.JaxRuntimeError)), repr(error)
    text = str(error)
    assert isinstance(error, AnomalyError) or "AnomalyError: " in text
    return text[text.rindex("AnomalyError: ") + len("AnomalyError: "):] \
        if not isinstance(error, AnomalyError) else text


def assert_forward_line(text: str, marker: str, function: str) -> None:
    line = line_of(marker)
    assert "Traceback of forward call that caused the error:" in text
    assert f'File "{HERE}", line {line}, in {function}' in text, text
    assert SOURCE[line - 1].strip() in text, text


def test_forward_nan_names_the_primitive_and_the_line(variant):
    text = error_text(lambda: variant(detect_anomaly()(loss))(NEGATIVE))
    assert text.startswith("'log' returned nan in its output 0 in the forward pass of loss.")
    assert_forward_line(text, "LOSS-CALLS-HELPER", "loss")
    assert_forward_line(text, "HELPER-LOG", "helper")


def test_backward_nan_names_the_forward_primitive_and_line(variant):
    text = error_text(lambda: variant(jax.grad(detect_anomaly()(masked)))(ZERO_ONE))
    assert text.startswith("'div' returned nan in its output 0 in the backward pass of masked "
                           "(part of the gradient of 'log').")
    assert_forward_line(text, "MASKED-LOG", "masked")


def test_jit_of_grad_names_the_forward_line():
    # jax_debug_nans names only the line that calls the jitted gradient here.
    step = jax.jit(jax.grad(detect_anomaly()(masked)))
    text = error_text(lambda: step(ZERO_ONE))
    assert "backward pass of masked" in text
    assert_forward_line(text, "MASKED-LOG", "masked")


def test_finite_values_pass_unchanged(variant):
    checked = detect_anomaly()(loss)
    np.testing.assert_allclose(variant(checked)(POSITIVE), loss(POSITIVE), rtol=1e-6)
    np.testing.assert_allclose(variant(jax.grad(checked))(POSITIVE), jax.grad(loss)(POSITIVE),
                               rtol=1e-6)


def test_transforms_compose():
    checked = detect_anomaly()(loss)
    batch = jnp.stack([POSITIVE, 2 * POSITIVE])
    np.testing.assert_allclose(jax.vmap(jax.grad(checked))(batch),
                               jax.vmap(jax.grad(loss))(batch), rtol=1e-6)
    # Forward mode cannot go through a custom_vjp: the primal is checked without one.
    np.testing.assert_allclose(jax.hessian(checked)(POSITIVE), jax.hessian(loss)(POSITIVE),
                               rtol=1e-5)


def test_check_nan_false_checks_no_values():
    assert np.isnan(jax.grad(detect_anomaly(check_nan=False)(masked))(ZERO_ONE)[0])


def test_check_inf_reports_infinities():
    text = error_text(lambda: jax.grad(detect_anomaly(check_inf=True)(masked))(ZERO_ONE))
    assert text.startswith("'log' returned inf in its output 0 in the forward pass of masked.")


def test_anomalies_from_outside_are_named():
    nan = jnp.array([np.nan, 1.0])
    text = error_text(lambda: detect_anomaly()(loss)(nan))
    assert text.startswith("argument args[0] of loss holds nan: it was produced outside loss.")

    def identity(x):
        return x * 1.0

    def outer(x):
        y = detect_anomaly()(identity)(x)
        return jnp.where(y > 0, jnp.log(y), 0.0).sum()

    text = error_text(lambda: jax.grad(outer)(ZERO_ONE))
    assert text.startswith("the gradient of output 0 of identity, flowing into its backward "
                           "pass, holds nan")


def test_pytrees_static_and_integer_values():
    def f(params, x, power, *, name="f"):
        return {"y": (jnp.tanh(params["w"] * x) ** power).sum(), "count": jnp.arange(3)}

    checked = detect_anomaly()(f)
    params = {"w": POSITIVE}
    out = checked(params, POSITIVE, 2, name="g")
    np.testing.assert_array_equal(out["count"], jnp.arange(3))
    grads = jax.grad(lambda p: checked(p, POSITIVE, 2)["y"])(params)
    np.testing.assert_allclose(grads["w"], jax.grad(lambda p: f(p, POSITIVE, 2)["y"])(params)["w"],
                               rtol=1e-6)


def test_closed_over_values_are_differentiated():
    # A model's parameters, closed over under jax.grad, reach the custom_vjp as inputs.
    def outer(w):
        return detect_anomaly()(lambda x: jnp.sin(w * x).sum())(POSITIVE)

    np.testing.assert_allclose(jax.jit(jax.grad(outer))(0.5),
                               jax.grad(lambda w: jnp.sin(w * POSITIVE).sum())(0.5), rtol=1e-6)


def test_nested_jit_and_checkpoint_show_the_whole_call():
    inner = jax.jit(helper)

    def outer(x):
        return jax.checkpoint(inner)(x).sum()  # OUTER-CALLS-INNER

    text = error_text(lambda: jax.jit(jax.grad(detect_anomaly()(outer)))(NEGATIVE))
    assert text.startswith("'log' returned nan")
    assert_forward_line(text, "OUTER-CALLS-INNER",
                        "test_nested_jit_and_checkpoint_show_the_whole_call.<locals>.outer")
    assert_forward_line(text, "HELPER-LOG", "helper")


def scanned_step(carry, x):
    y = jnp.where(x > 0, jnp.log(x), 0.0)  # SCAN-BODY-LOG
    return carry + y, 2.0 * y


def scanned(xs):
    carry, ys = jax.lax.scan(scanned_step, 0.0, xs)  # SCAN-CALL
    return carry + ys.sum()


def test_scan_bodies_are_checked_forward_and_backward():
    checked = detect_anomaly()(scanned)
    fine = jnp.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(jax.grad(checked)(fine), jax.grad(scanned)(fine), rtol=1e-6)
    text = error_text(lambda: jax.jit(jax.grad(checked))(jnp.array([1.0, 0.0, 3.0])))
    assert text.startswith("'div' returned nan in its output 0 in the backward pass of scanned "
                           "(part of the gradient of 'log').")
    assert_forward_line(text, "SCAN-CALL", "scanned")
    assert_forward_line(text, "SCAN-BODY-LOG", "scanned_step")
    text = error_text(lambda: jax.jit(checked)(-fine))
    assert text.startswith("'log' returned nan in its output 0 in the forward pass of scanned.")


def looped_step(carry):
    i, y = carry
    z = jnp.log(y - 1.0)  # WHILE-BODY-LOG
    return i + 1, y + z


def looped(x):
    i, y = jax.lax.while_loop(lambda c: c[0] < 3, looped_step, (0, x))  # WHILE-CALL
    return y.sum()


@pytest.mark.parametrize("jit", [False, True])
def test_while_bodies_are_checked(jit):
    checked = detect_anomaly()(looped)
    run = jax.jit(checked) if jit else checked
    fine = jnp.array([3.0, 4.0])
    np.testing.assert_allclose(run(fine), looped(fine), rtol=1e-6)
    text = error_text(lambda: run(jnp.array([3.0, 0.5])))
    assert text.startswith("'log' returned nan in its output 0 in the forward pass of looped.")
    assert_forward_line(text, "WHILE-CALL", "looped")
    assert_forward_line(text, "WHILE-BODY-LOG", "looped_step")


def log_branch(v):
    return jnp.where(v > 1.0, jnp.log(v - 1.0), 0.0)  # COND-BRANCH-LOG


def branched(x):
    y = jax.lax.cond(x.sum() > 0, log_branch, jnp.cos, x)  # COND-CALL
    return y.sum()


def test_cond_branches_are_checked_forward_and_backward():
    checked = detect_anomaly()(branched)
    fine = jnp.array([2.0, 3.0])
    np.testing.assert_allclose(jax.grad(checked)(fine), jax.grad(branched)(fine), rtol=1e-6)
    # The branch not taken is not reported, whatever it would have made.
    np.testing.assert_allclose(jax.jit(checked)(-fine), branched(-fine), rtol=1e-6)
    text = error_text(lambda: jax.jit(jax.grad(checked))(jnp.array([1.0, 3.0])))
    assert text.startswith("'div' returned nan in its output 0 in the backward pass of branched "
                           "(part of the gradient of 'log').")
    assert_forward_line(text, "COND-CALL", "branched")
    assert_forward_line(text, "COND-BRANCH-LOG", "log_branch")
    text = error_text(lambda: checked(jnp.array([0.5, 3.0])))
    assert text.startswith("'log' returned nan in its output 0 in the forward pass of branched.")
    assert_forward_line(text, "COND-BRANCH-LOG", "log_branch")


def test_switch_branches_are_checked():
    def switched(x):
        return jax.lax.switch(2, [jnp.sin, jnp.cos, log_branch], x).sum()

    text = error_text(lambda: jax.jit(detect_anomaly()(switched))(jnp.array([0.5, 3.0])))
    assert text.startswith("'log' returned nan in its output 0 in the forward pass of switched.")
    assert_forward_line(text, "COND-BRANCH-LOG", "log_branch")


class MyFunc(Function):
    @staticmethod
    def forward(ctx, inp):
        return inp * 1.0

    @staticmethod
    def backward(ctx, grad_output):
        raise RuntimeError("Some error in backward")


def run_fn(a):
    out = MyFunc.apply(a)  # RUN-FN-APPLY
    return out.sum()


@pytest.mark.parametrize("check_nan", [True, False])
def test_error_in_a_custom_backward_gets_the_forward_traceback(check_nan):
    # The seed's example: torch prints the traceback of the forward call before the error.
    with pytest.raises(RuntimeError, match="Some error in backward") as info:
        jax.grad(detect_anomaly(check_nan=check_nan)(run_fn))(jnp.ones((2, 2)))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert_forward_line(notes, "RUN-FN-APPLY", "run_fn")


def test_the_decorator_warns_as_torch_does():
    with pytest.warns(UserWarning, match="anomaly detection is on"):
        detect_anomaly()


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="check_nan"):
        detect_anomaly(check_nan="yes")
    with pytest.raises(TypeError, match="mode"):
        set_detect_anomaly(1)


# -- the mode ---------------------------------------------------------------------------------

def test_off_by_default_and_free():
    assert not is_anomaly_enabled()
    gated = anomaly_checked(masked)
    assert str(jax.make_jaxpr(gated)(ZERO_ONE)) == str(jax.make_jaxpr(masked)(ZERO_ONE))
    assert np.isnan(jax.grad(gated)(ZERO_ONE)[0])


def test_the_mode_switches_a_jitted_function():
    step = jax.jit(jax.grad(anomaly_checked(masked)))
    assert np.isnan(step(ZERO_ONE)[0])
    with detect_anomaly():
        assert is_anomaly_enabled() and is_anomaly_check_nan_enabled()
        assert_forward_line(error_text(lambda: step(ZERO_ONE)), "MASKED-LOG", "masked")
    assert np.isnan(step(ZERO_ONE)[0])  # jax.jit keys its cache on the mode
    with set_detect_anomaly(True, check_nan=False, check_inf=True):
        assert is_anomaly_enabled() and not is_anomaly_check_nan_enabled()
        assert "'log' returned inf" in error_text(lambda: step(ZERO_ONE))
    assert not is_anomaly_enabled()


def test_set_detect_anomaly_as_a_statement():
    try:
        set_detect_anomaly(True)
        assert is_anomaly_enabled()
        error_text(lambda: anomaly_checked(loss)(NEGATIVE))
    finally:
        set_detect_anomaly(False)
    assert not is_anomaly_enabled()




# -- any function, unmarked, inside the block (JAX's jax_debug_nans / jax_debug_infs) ---------

def unmarked_log(x):
    y = jnp.log(x)  # UNMARKED-LOG
    return (y * y).sum()


def unmarked_root(x):
    return jnp.sqrt(x).sum()  # UNMARKED-SQRT


DIFFERENTIATIONS = {
    "grad": jax.grad,
    "jit(grad)": lambda f: jax.jit(jax.grad(f)),
    "jit(vmap(grad))": lambda f: jax.jit(lambda x: jax.vmap(jax.grad(f))(x[None])[0]),
}


def floating_point_error(call, **block) -> FloatingPointError:
    """The error `call()` raises inside `with detect_anomaly(**block):`."""
    with pytest.raises(FloatingPointError) as info:
        with detect_anomaly(**block):
            jax.block_until_ready(call())
    return info.value


def notes(error: BaseException) -> str:
    return "\n".join(getattr(error, "__notes__", []))


def test_the_block_catches_a_forward_nan_of_any_function(variant):
    error = floating_point_error(lambda: variant(unmarked_log)(NEGATIVE))
    assert "nan" in str(error) and "log" in str(error)
    assert_forward_line(notes(error), "UNMARKED-LOG", "unmarked_log")


@pytest.mark.parametrize("differentiate", DIFFERENTIATIONS.values(), ids=DIFFERENTIATIONS)
def test_the_block_catches_a_forward_nan_under_differentiation(differentiate):
    error = floating_point_error(lambda: differentiate(unmarked_log)(NEGATIVE))
    assert "nan" in str(error)
    assert_forward_line(notes(error), "UNMARKED-LOG", "unmarked_log")


@pytest.mark.parametrize("differentiate", DIFFERENTIATIONS.values(), ids=DIFFERENTIATIONS)
def test_the_block_names_the_forward_line_of_a_backward_nan(differentiate):
    # The forward of `masked` is finite: only its backward makes the NaN. JAX's own error from
    # a jitted gradient names the primitive, not the line; the block's note names the line.
    step = differentiate(masked)
    assert np.isnan(step(ZERO_ONE)[0])  # outside the block: no check, as in torch
    error = floating_point_error(lambda: step(ZERO_ONE))
    # JAX's message names a primitive ("invalid value (nan) encountered in div"; jax 0.12 may
    # name the jitted jnp function instead, depending on what its caches hold).
    assert "nan" in str(error)
    assert_forward_line(notes(error), "MASKED-LOG", "masked")
    frames = [frame.filename for frame in traceback.extract_tb(error.__traceback__)]
    assert not any("interpreters" in name for name in frames), frames  # JAX's, filtered


def test_check_inf_catches_infinities_of_any_function():
    step = jax.jit(jax.grad(unmarked_root))  # d sqrt(x)/dx at 0 is inf; the forward is 0
    assert np.isinf(step(ZERO_ONE)[0])
    with detect_anomaly():
        assert np.isinf(step(ZERO_ONE)[0])  # NaN only, by default (torch's check)
    error = floating_point_error(lambda: step(ZERO_ONE), check_inf=True)
    assert "inf" in str(error)
    assert_forward_line(notes(error), "UNMARKED-SQRT", "unmarked_root")
    with detect_anomaly(check_nan=False):
        assert np.isnan(jax.jit(jax.grad(masked))(ZERO_ONE)[0])


def test_marked_functions_keep_the_richer_report_in_the_block():
    with detect_anomaly():
        text = error_text(lambda: jax.grad(anomaly_checked(masked))(ZERO_ONE))
    assert text.startswith("'div' returned nan in its output 0 in the backward pass of masked")
    assert_forward_line(text, "MASKED-LOG", "masked")


def jax_settings():
    return (jax.config.jax_debug_nans, jax.config.jax_debug_infs,
            jax.config.jax_traceback_filtering, is_anomaly_enabled())


def test_the_block_restores_the_settings_also_nested_and_on_errors():
    before = jax_settings()
    with detect_anomaly():
        assert jax_settings()[:2] == (True, False)
        with detect_anomaly(check_nan=False, check_inf=True):
            assert jax_settings()[:2] == (False, True)
            with detect_anomaly(check_nan=False):
                assert jax_settings()[:2] == (False, False)
            assert jax_settings()[:2] == (False, True)
        assert jax_settings()[:2] == (True, False)
    assert jax_settings() == before
    with pytest.raises(FloatingPointError):
        with detect_anomaly(check_inf=True):
            jax.jit(jax.grad(masked))(ZERO_ONE)
    assert jax_settings() == before
    with pytest.raises(ValueError, match="not an anomaly"):
        with detect_anomaly():
            raise ValueError("not an anomaly")
    assert jax_settings() == before


def test_set_detect_anomaly_turns_jax_checks_on_for_the_process():
    before = jax_settings()
    step = jax.jit(jax.grad(masked))
    try:
        set_detect_anomaly(True)
        assert jax_settings()[:2] == (True, False) and is_anomaly_enabled()
        with pytest.raises(FloatingPointError, match="nan"):
            step(ZERO_ONE)
        set_detect_anomaly(True, check_nan=False, check_inf=True)
        assert jax_settings()[:2] == (False, True)
        with pytest.raises(FloatingPointError, match="inf"):
            jax.jit(jax.grad(unmarked_root))(ZERO_ONE)
    finally:
        set_detect_anomaly(False)
    assert jax_settings() == before
    assert np.isnan(step(ZERO_ONE)[0])


@pytest.mark.parametrize("block", [detect_anomaly, lambda: set_detect_anomaly(True)],
                         ids=["detect_anomaly", "set_detect_anomaly"])
def test_the_error_leaving_a_block_is_caught_as_torch_users_catch_it(block):
    # torch's anomaly mode raises RuntimeError; JAX's checks raise FloatingPointError. The
    # error leaving the block is both (and an AnomalyError), with JAX's message.
    with pytest.raises(RuntimeError) as info:
        with block():
            jax.jit(jax.grad(masked))(ZERO_ONE)
    error = info.value
    assert type(error) is FloatingPointAnomalyError
    assert isinstance(error, FloatingPointError) and isinstance(error, AnomalyError)
    assert "nan" in str(error)  # JAX's message
    assert_forward_line(notes(error), "MASKED-LOG", "masked")
    # An error that is not JAX's check goes on as it was raised.
    with pytest.raises(ValueError, match="^mine$"):
        with block():
            raise ValueError("mine")


def test_set_detect_anomaly_as_a_block_names_the_line_and_restores():
    before = jax_settings()
    with pytest.raises(FloatingPointError) as info:
        with set_detect_anomaly(True):
            jax.jit(jax.grad(masked))(ZERO_ONE)
    assert_forward_line(notes(info.value), "MASKED-LOG", "masked")
    assert jax_settings() == before
    with set_detect_anomaly(False):
        assert np.isnan(jax.jit(jax.grad(masked))(ZERO_ONE)[0])
    assert jax_settings() == before


def test_the_block_names_a_jitted_helper_and_a_scan_by_their_call_lines():
    inner = jax.jit(masked)

    def nested(x):
        return 2.0 * inner(x)  # NESTED-CALLS-MASKED

    error = floating_point_error(lambda: jax.jit(jax.grad(nested))(ZERO_ONE))
    assert_forward_line(notes(error), "NESTED-CALLS-MASKED",
                        "test_the_block_names_a_jitted_helper_and_a_scan_by_their_call_lines."
                        "<locals>.nested")
    assert_forward_line(notes(error), "MASKED-LOG", "masked")
    # A scan runs as one operation: the note stops at the line that called it.
    error = floating_point_error(lambda: jax.jit(jax.grad(scanned))(ZERO_ONE))
    assert_forward_line(notes(error), "SCAN-CALL", "scanned")


# What anomaly mode catches, as torch users write it: eagerly and jitted, forward and backward.
ANOMALIES = {
    "forward": lambda: unmarked_log(NEGATIVE),
    "jit": lambda: jax.jit(unmarked_log)(NEGATIVE),
    "grad": lambda: jax.grad(masked)(ZERO_ONE),
    "jit(grad)": lambda: jax.jit(jax.grad(masked))(ZERO_ONE),
}


@pytest.mark.parametrize("call", ANOMALIES.values(), ids=ANOMALIES)
def test_inside_the_block_the_error_is_caught_as_a_runtime_error(call):
    # torch users catch the anomaly inside the block; the error JAX's check raises there is
    # already the anomaly error, not only once it leaves the block.
    with detect_anomaly():
        with pytest.raises(RuntimeError) as info:
            call()
        assert type(info.value) is FloatingPointAnomalyError
        assert "nan" in str(info.value)


@pytest.mark.parametrize("call", [ANOMALIES["forward"], ANOMALIES["jit(grad)"]],
                         ids=["forward", "jit(grad)"])
def test_after_the_statement_the_error_is_a_runtime_error(call):
    try:
        set_detect_anomaly(True)
        with pytest.raises(RuntimeError) as info:
            call()
    finally:
        set_detect_anomaly(False)
    assert type(info.value) is FloatingPointAnomalyError


def test_jax_checks_outside_anomaly_mode_raise_jax_error():
    # jax_debug_nans turned on by the user, not by anomaly mode, raises JAX's own error type
    # (also after anomaly mode was on and off, in either form).
    with detect_anomaly():
        pass
    set_detect_anomaly(True)
    set_detect_anomaly(False)
    with jax.debug_nans(True), pytest.raises(FloatingPointError) as info:
        jax.jit(unmarked_log)(NEGATIVE)
    assert type(info.value) is FloatingPointError
