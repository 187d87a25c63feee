"""precision_report on a Flax linen model with a planted float16 overflow in one module, and on
a loss whose gradients underflow float16 at loss scale 1."""

import inspect
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp.debug import first_nonfinite, precision_report
from jamp.debug.report import LOSS_SCALE_CEILING, LOSS_SCALE_HEADROOM

F16 = dict(dtype=jnp.float16, device_type="cuda")


class Energy(nn.Module):
    """The planted overflow: activations scaled by 1e3 go through a Dense in float16."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32)(x * 1e3)  # planted
        return jnp.sum(h * h, axis=-1)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name="encoder")(x))
        x = nn.LayerNorm(name="norm")(x) * 30.0
        return Energy()(x) * 1e-9 + nn.Dense(1, name="head")(x)[..., 0]


def _line_of(function, marker: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if marker in line)


PLANTED_LINE = _line_of(Energy.__call__, "# planted")


def _loss(variables, x):
    return jnp.mean(Net().apply(variables, x))


@pytest.fixture(scope="module")
def planted():
    x = jax.random.normal(jax.random.key(0), (8, 16))
    variables = Net().init(jax.random.key(1), x)
    return variables, x, precision_report(_loss, variables, x, **F16)


def test_names_the_planted_module_and_line(planted):
    _, _, report = planted
    first = report.overflows[0]
    assert not first.backward
    assert first.module.startswith("Net/Energy_0")
    assert first.location.endswith(f"test_precision_report.py:{PLANTED_LINE}")
    assert "# planted" in first.code
    assert first.max_abs > first.largest == float(jnp.finfo(jnp.float16).max)
    assert {f.module.split("/")[1] for f in report.overflows if not f.backward} == {"Energy_0"}
    assert "Energy_0" in str(report) and "planted" in report.table()


def test_rules_move_only_the_planted_module_and_fix_it(planted):
    variables, x, report = planted
    assert report.rules_checked
    assert report.rules and all(p.startswith("/Net/Energy_0") for p, _ in report.rules)
    assert all(s is jnp.float32 for _, s in report.rules)
    low = jamp.autocast(_loss, **F16)
    fixed = jamp.autocast(_loss, **F16, rules=report.rules)
    reference, ref_grads = jax.value_and_grad(_loss)(variables, x)
    broken, _ = jax.jit(jax.value_and_grad(low))(variables, x)
    value, grads = jax.jit(jax.value_and_grad(fixed))(variables, x)
    assert not np.isfinite(broken)
    assert np.isfinite(value)
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
    assert abs(value - reference) <= 1e-2 * abs(reference)
    again = precision_report(_loss, variables, x, **F16, rules=report.rules)
    assert not [f for f in again.overflows if not f.backward]


def test_to_dict_is_json(planted):
    _, _, report = planted
    d = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert d["dtype"] == "float16" and d["loss_scale"] == 1.0
    assert d["problems"][0]["kind"] == "overflow" and d["problems"][0]["pass"] == "forward"
    assert d["rules"] == [[p, "float32"] for p, _ in report.rules]
    assert d["summary"] == report.summary()


def test_first_nonfinite_names_the_planted_line_under_jit(planted):
    variables, x, _ = planted
    found = first_nonfinite(_loss, variables, x, **F16)
    assert found is not None and not found.backward and "inf" in found.value
    assert found.module.startswith("Net/Energy_0")
    assert found.location.endswith(f":{PLANTED_LINE}")
    assert "planted" in str(found)
    assert first_nonfinite(_loss, variables, x, **F16, rules=_rules(planted)) is None


def _rules(planted):
    return planted[2].rules


# -- gradient underflow --------------------------------------------------------------------

SHRINK = 2.0 ** -20


def _small_loss(w, x, y):
    # A well-scaled regression whose loss is multiplied down: its float16 gradients flush to
    # zero at loss scale 1.
    pred = jnp.tanh(x @ w["a"]) @ w["b"]
    return jnp.mean((pred - y) ** 2) * SHRINK


@pytest.fixture(scope="module")
def regression():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(2), 4)
    w = {"a": jax.random.normal(k1, (8, 16)) / 3, "b": jax.random.normal(k2, (16, 1)) / 4}
    x = jax.random.normal(k3, (32, 8))
    y = jnp.sin(x[:, :1])
    return w, x, y, precision_report(_small_loss, w, x, y, **F16)


def test_underflow_at_scale_one_and_a_scale_that_removes_it(regression):
    w, x, y, report = regression
    assert report.gradient_underflow > 0.5
    assert any(f.kind == "underflow" and f.backward for f in report.problems)
    assert report.min_loss_scale is not None and report.min_loss_scale > 1
    assert report.min_loss_scale <= report.suggested_loss_scale <= report.max_loss_scale
    at_scale = precision_report(_small_loss, w, x, y, **F16,
                                loss_scale=report.suggested_loss_scale)
    assert at_scale.gradient_underflow <= 1e-3
    assert not at_scale.overflows


def test_training_at_the_suggested_scale_matches_float32(regression):
    w, x, y, report = regression
    low = jamp.autocast(_small_loss, **F16)

    def train(loss_fn, scale, steps=20):
        tx = optax.sgd(0.1 / SHRINK)
        params, state = w, tx.init(w)

        @jax.jit
        def step(params, state):
            grads = jax.grad(lambda p: loss_fn(p, x, y) * scale)(params)
            grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
            updates, state = tx.update(grads, state)
            return optax.apply_updates(params, updates), state

        for _ in range(steps):
            params, state = step(params, state)
        return float(_small_loss(params, x, y)) / SHRINK

    reference = train(_small_loss, 1.0)
    start = float(_small_loss(w, x, y)) / SHRINK
    scaled = train(low, report.suggested_loss_scale)
    unscaled = train(low, 1.0)
    assert reference < 0.8 * start
    assert abs(scaled - reference) <= 0.05 * reference
    assert abs(unscaled - reference) > 0.1 * reference


# -- arguments ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, words", [
    (dict(dtype="float8"), ValueError, ["'float8'", "float16", "bfloat16"]),
    (dict(dtype=jnp.float32), ValueError, ["float32", "float16 or bfloat16"]),
    (dict(device_type="gpux"), ValueError, ["'gpux'", "cuda"]),
    (dict(loss_scale=-1.0), ValueError, ["loss_scale=-1.0"]),
    (dict(loss_scale="big"), TypeError, ["loss_scale='big'"]),
    (dict(rules=[("Nope_*", jnp.float32)]), ValueError, ["'Nope_*'"]),
])
def test_bad_arguments_are_named(kwargs, error, words):
    options = {"dtype": jnp.float16, **kwargs}
    with pytest.raises(error) as info:
        precision_report(lambda x: jnp.sum(x), jnp.ones(3), **options)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_a_function_is_required():
    with pytest.raises(TypeError, match="precision_report's first argument.*got 3"):
        precision_report(3, jnp.ones(3))
    with pytest.raises(TypeError, match="first_nonfinite's first argument"):
        first_nonfinite("f", jnp.ones(3))


# -- a program already broken in float32 ----------------------------------------------------

def _broken(x, w):
    with jax.named_scope("energy"):
        h = jnp.sqrt(x @ w - 5.0)  # broken: NaN in float32 too
    return jnp.mean(h)


def test_a_shadow_already_nan_is_said_first_and_proposes_nothing():
    report = precision_report(_broken, jnp.ones((2, 4)), jnp.ones((4, 4)), **F16)
    found = report.shadow_nonfinite
    assert found.primitive == "sqrt" and found.value == "nan" and not found.backward
    assert found.module == "energy" and found.location.endswith(
        f":{_line_of(_broken, '# broken')}")
    assert report.rules == [] and not report.rules_checked
    assert report.min_loss_scale is None and report.max_loss_scale is None
    assert report.suggested_loss_scale is None and report.gradient_underflow is None
    first = str(report).splitlines()[0]
    assert "float32 shadow is not finite" in first and "energy" in first and "sqrt" in first
    assert "no rules" in report.summary() and "no loss scale" in report.summary()
    d = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert d["loss"] == "nan" and d["suggested_loss_scale"] is None
    assert d["shadow_nonfinite"]["primitive"] == "sqrt" and d["summary"] == report.summary()


# -- the suggested loss scale on the real float16 run ----------------------------------------

def test_the_real_float16_run_at_the_suggested_scale_keeps_every_gradient_leaf():
    # A Dense layer whose loss is scaled by 1e-9: float32 keeps all 64 kernel gradients; the
    # real float16 run at the suggested scale (not the shadow) must keep each of them too.
    dense = nn.Dense(4)
    x = jax.random.normal(jax.random.key(0), (8, 16))
    variables = dense.init(jax.random.key(1), x)

    def loss(variables, x):
        return jnp.mean(dense.apply(variables, x) ** 2) * 1e-9

    report = precision_report(loss, variables, x, **F16)
    scale = report.suggested_loss_scale
    assert report.min_loss_scale <= scale <= report.max_loss_scale / LOSS_SCALE_HEADROOM
    assert scale == max(report.min_loss_scale,
                        min(LOSS_SCALE_CEILING, report.max_loss_scale / LOSS_SCALE_HEADROOM))
    half = jamp.autocast(loss, **F16)
    scaled = jax.jit(jax.grad(lambda v: half(v, x) * scale))(variables)
    reference = jax.grad(loss)(variables, x)
    for kept, got in zip(jax.tree_util.tree_leaves(reference),
                         jax.tree_util.tree_leaves(scaled)):
        got = np.asarray(got) / scale
        assert np.all(np.isfinite(got))
        assert np.all(got[np.asarray(kept) != 0] != 0)
        np.testing.assert_allclose(got, kept, rtol=0, atol=1e-2 * np.max(np.abs(kept)))
