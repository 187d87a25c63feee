"""What the debugger takes besides arrays of floats: PRNG keys and integers among the
arguments, `argnums`, and the mistakes a user makes with them (each named as written, with
what is accepted)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jamp
from jamp.debug import first_nonfinite, precision_report

F16 = dict(dtype=jnp.float16, device_type="cuda")


def _dropout_loss(w, x, key, n):
    h = x @ w
    keep = jax.random.bernoulli(key, 0.5, h.shape)
    return jnp.mean(jnp.where(keep, h, 0.0) * n)


def _scan_loss(w, xs, key):
    """A key carried and split through a scan, and passed through a cond."""
    def step(carry, x):
        h, k = carry
        k, sub = jax.random.split(k)
        noise = lax.cond(jnp.sum(x) > 0, lambda s: jax.random.normal(s, h.shape),
                         lambda s: jnp.zeros(h.shape), sub)
        h = jnp.tanh(h @ w + x + noise)
        return (h, k), jnp.sum(h)
    _, ys = lax.scan(step, (jnp.zeros((2, 4)), key), xs)
    return jnp.mean(ys ** 2)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey],
                         ids=["typed", "raw"])
def test_prng_keys_and_integers_among_the_arguments(make_key):
    w, x = jnp.full((4, 4), 0.5), jnp.ones((2, 4))
    args = (w, x, make_key(0), jnp.int32(3))
    report = precision_report(_dropout_loss, *args, **F16)
    assert np.isfinite(report.loss) and np.isfinite(report.low_loss)
    assert report.loss == pytest.approx(float(_dropout_loss(*args)), rel=1e-3)
    assert {f.dtype for f in report.findings} == {"float16"}
    assert any(f.backward for f in report.findings)
    assert first_nonfinite(_dropout_loss, *args, **F16) is None

    xs = jnp.ones((3, 2, 4))
    report = precision_report(_scan_loss, w, xs, make_key(1), **F16)
    assert np.isfinite(report.loss)
    assert report.loss == pytest.approx(float(_scan_loss(w, xs, make_key(1))), rel=1e-2)
    assert first_nonfinite(_scan_loss, w, xs, make_key(1), **F16) is None


def _loss(w, x):
    return jnp.mean((x @ w) ** 2)


W, X = jnp.ones((4, 4)), jnp.ones((2, 4))


@pytest.mark.parametrize("argnums, error, words", [
    ("0", TypeError, ["argnums='0'", "int or a tuple of ints"]),
    (1.0, TypeError, ["argnums=1.0", "int or a tuple of ints"]),
    (True, TypeError, ["argnums=True", "int or a tuple of ints"]),
    ((), ValueError, ["argnums=()", "-2 to 1", "backward=False"]),
    (2, ValueError, ["argnums=2", "2 positional arguments", "-2 to 1"]),
    (-3, ValueError, ["argnums=-3", "2 positional arguments", "-2 to 1"]),
    ((0, 5), ValueError, ["argnums=(0, 5)", "2 positional arguments", "-2 to 1"]),
])
def test_bad_argnums_are_named(argnums, error, words):
    for debugger in (precision_report, first_nonfinite):
        with pytest.raises(error) as info:
            debugger(_loss, W, X, argnums=argnums, **F16)
        message = str(info.value)
        assert debugger.__name__ in message and all(w in message for w in words), message


def test_argnums_at_an_integer_argument_is_named():
    with pytest.raises(TypeError) as info:
        precision_report(_dropout_loss, W, X, jax.random.key(0), jnp.int32(3), argnums=(0, 3),
                         **F16)
    message = str(info.value)
    assert "argnums=(0, 3)" in message and "argument 3" in message and "int32" in message


def test_argnums_as_a_tuple_and_negative():
    report = precision_report(_loss, W, X, argnums=(0, -1), **F16)
    single = precision_report(_loss, W, X, argnums=0, **F16)
    assert len([f for f in report.findings if f.backward]) > \
        len([f for f in single.findings if f.backward])


def test_a_float64_or_float32_dtype_names_the_half_dtypes():
    for dtype in ("float64", jnp.float32):
        with pytest.raises(ValueError) as info:
            precision_report(_loss, W, X, dtype=dtype, device_type="cuda")
        message = str(info.value)
        assert "precision_report" in message and repr(dtype) in message, message
        assert "float16 or bfloat16" in message and "bfloat16, float32" not in message, message


@pytest.mark.parametrize("wrap", [
    lambda f: jamp.autocast(f, dtype=jnp.bfloat16, device_type="cpu"),
    lambda f: jax.jit(jamp.autocast(f, dtype=jnp.float16, device_type="cuda")),
    lambda f: jamp.autocast(dtype=jnp.float16, device_type="cuda")(f),
], ids=["autocast", "jit-of-autocast", "decorator"])
def test_a_function_already_under_autocast_is_refused(wrap):
    for debugger in (precision_report, first_nonfinite):
        with pytest.raises(TypeError) as info:
            debugger(wrap(_loss), W, X, **F16)
        message = str(info.value)
        assert debugger.__name__ in message and "already" in message and \
            "jamp.autocast" in message, message


def test_an_autocast_region_inside_the_function_is_fine():
    def loss(w, x):
        with jamp.autocast(enabled=False):
            h = x @ w
        return jnp.mean(h ** 2)
    assert precision_report(loss, W, X, **F16).findings == ()
