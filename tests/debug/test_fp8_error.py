"""precision_report(..., fp8=recipe): each module's fp8 error against float32 and the rules that
keep the modules fp8 hurts most in bfloat16."""

import json

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jamp
from jamp.debug import precision_report
from jamp.debug import fp8_error
from jamp.debug.fp8_error import FP8_MIN_SNR_DB


def _loss(w, v, x):
    with jax.named_scope("smooth"):
        h = jnp.tanh(x @ w)
    with jax.named_scope("outlier"):
        # One token a million times larger than the others: a tensorwise scale set by it
        # leaves the other tokens in float8's subnormals.
        y = (h * jnp.array([[1e6]] + [[1.0]] * 31)) @ v
    return jnp.mean(y ** 2)


def _args():
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (16, 16)), jax.random.normal(k[1], (16, 8)),
            jax.random.normal(k[2], (32, 16)))


def test_tensorwise_keeps_the_module_with_an_outlier_token_in_bfloat16():
    recipe = jamp.fp8.recipe("tensorwise")
    report = precision_report(_loss, *_args(), dtype=jnp.bfloat16, fp8=recipe)
    by_module = {e.module: e for e in report.fp8}
    assert [e.module for e in report.fp8] == ["outlier", "smooth"]  # worst first
    assert by_module["outlier"].snr_db < FP8_MIN_SNR_DB < by_module["smooth"].snr_db
    assert by_module["smooth"].snr_db > 25  # e4m3's rounding alone
    assert report.fp8_rules == [("/outlier", jnp.bfloat16), ("/smooth", recipe)]
    text = report.table()
    assert "fp8 rules=[('/outlier', jnp.bfloat16), ('/smooth', jamp.fp8.recipe('tensorwise'))]" \
        in text
    assert json.loads(json.dumps(report.to_dict()))["fp8_rules"][0] == ["/outlier", "bfloat16"]


def test_rowwise_scales_each_token_on_its_own_and_keeps_every_module_fp8():
    recipe = jamp.fp8.recipe("rowwise")
    errors, rules = fp8_error.measure(_loss, _args(), {}, recipe)
    assert all(e.snr_db > FP8_MIN_SNR_DB for e in errors)
    assert {p for p, s in rules if s == recipe} == {"/outlier", "/smooth"}


def test_a_scan_measures_every_iteration_as_the_unrolled_loop_does():
    def layer(h, w):
        with jax.named_scope("layer"):
            return jnp.tanh(h @ w), None

    def scanned(ws, x):
        return jnp.sum(lax.scan(layer, x, ws)[0])

    def unrolled(ws, x):
        for w in ws:
            x = layer(x, w)[0]
        return jnp.sum(x)

    k = jax.random.split(jax.random.key(1), 2)
    # Each iteration its own scales (the third layer's weights ten times larger).
    ws = jax.random.normal(k[0], (3, 8, 8)) * jnp.array([1.0, 0.1, 10.0])[:, None, None]
    args, recipe = (ws, jax.random.normal(k[1], (4, 8))), jamp.fp8.recipe("tensorwise")
    (scan,), _ = fp8_error.measure(scanned, args, {}, recipe)
    (loop,), _ = fp8_error.measure(unrolled, args, {}, recipe)
    assert (scan.module, scan.gemms, loop.gemms) == ("layer", 1, 3)
    assert scan.snr_db == pytest.approx(loop.snr_db, abs=1e-3)
    assert 20 < scan.snr_db < 40


def test_a_float8_dtype_is_refused_with_how_to_write_a_recipe():
    with pytest.raises(TypeError, match=r"fp8=float8_e4m3fn is a float8 dtype.*"
                                        r"jamp\.fp8\.recipe\(\"tensorwise\"\)"):
        precision_report(_loss, *_args(), dtype=jnp.bfloat16, fp8=jnp.float8_e4m3fn)
