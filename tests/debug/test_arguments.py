"""What the debugger takes besides arrays of floats: PRNG keys and integers among the
arguments, `argnums`, and the mistakes a user makes with them (each named as written, with
what is accepted)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

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
