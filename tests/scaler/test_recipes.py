"""The recipes of docs/scaler.md taken from torch's AMP examples run as written and keep torch's
semantics: clipping and logging see unscaled grads, a gradient penalty is computed from unscaled
grads, and optimizers sharing one scaler each skip on their own infs while the one scale backs
off once.

Each test runs the recipes' set-up block and one recipe's blocks in a fresh namespace. A test
that changes a name the blocks use (the float32 loss for `amp_loss`, a loss whose grads hold
inf) does it before the first call traces the step.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import doc_blocks  # noqa: E402

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "scaler.md"
SETUP = "Recipes from torch's AMP examples"
CLIPPING = "Working with unscaled gradients: clipping, inspecting"
PENALTY = "Gradient penalty"
SHARED = "Several models and optimizers sharing one scaler"
TREE_EQUAL = np.testing.assert_array_equal


def recipe(*headings):
    """A fresh namespace that ran the set-up and then the blocks under `headings`."""
    ns = {"__name__": "__recipes__"}
    for heading in (SETUP, *headings):
        found = [b for b in doc_blocks.blocks(DOC) if b.heading == heading]
        assert found and all(b.runs for b in found), heading
        for block in found:
            doc_blocks.run_block(block, ns, DOC)
    return ns


def at_scale(ns, scale):
    scaler = ns["scaler"]
    return scaler.update(scaler.init(), new_scale=scale)


def assert_trees(check, a, b, **kwargs):
    jax.tree_util.tree_map(lambda x, y: check(np.asarray(x), np.asarray(y), **kwargs), a, b)


def test_recipe_blocks_follow_the_convention_and_run_in_order():
    assert doc_blocks.convention_errors(DOC) == []
    recipe(CLIPPING, PENALTY, SHARED)


# Working with unscaled gradients


def _float32(ns):
    """The recipe with autocast off: the scaled path must then agree with no scaling at all."""
    ns["amp_loss"] = ns["loss_fn"]
    if "amp_grad_norm" in ns:
        ns["amp_grad_norm"] = ns["grad_norm"]
    return ns


def test_clipping_and_logging_see_the_unscaled_grads():
    ns = _float32(recipe(CLIPPING))
    params, x, y = ns["params"], ns["x"], ns["y"]
    true_grads = jax.grad(ns["loss_fn"])(params, x, y)
    true_norm = float(optax.tree.norm(true_grads))
    # max_norm above the true norm: nothing is clipped, though the scaled norm is 65536 times
    # larger; clipping the scaled grads would have shrunk the step to nothing.
    ns["max_norm"] = 2 * true_norm
    new_params, _, state, grad_norm = ns["train_step"](
        params, ns["tx"].init(params), ns["scaler"].init(), x, y)
    np.testing.assert_allclose(grad_norm, true_norm, rtol=1e-6)
    assert_trees(np.testing.assert_allclose, new_params,
                 jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, true_grads),
                 rtol=1e-5, atol=1e-7)
    assert int(state.counter) == 1


def test_clipping_below_the_true_norm_clips_to_max_norm_in_float16():
    ns = recipe(CLIPPING)
    params, x, y = ns["params"], ns["x"], ns["y"]
    true_norm = float(optax.tree.norm(jax.grad(ns["loss_fn"])(params, x, y)))
    ns["max_norm"] = true_norm / 4
    new_params, _, state, grad_norm = ns["train_step"](
        params, ns["tx"].init(params), ns["scaler"].init(), x, y)
    np.testing.assert_allclose(grad_norm, true_norm, rtol=1e-2)  # float16 grads, unscaled
    step = jax.tree_util.tree_map(jnp.subtract, new_params, params)
    np.testing.assert_allclose(optax.tree.norm(step), 0.1 * true_norm / 4, rtol=1e-3)
    assert float(state.loss_scale) == 2.0**16 and int(state.counter) == 1


def test_an_overflow_step_is_skipped_though_its_norm_is_not_finite():
    ns = recipe(CLIPPING)
    params = ns["params"]
    opt_state = ns["tx"].init(params)
    new_params, new_opt_state, state, grad_norm = ns["train_step"](
        params, opt_state, ns["scaler"].init(), ns["x"].at[0, 0].set(jnp.inf), ns["y"])
    assert not np.isfinite(grad_norm)
    assert_trees(TREE_EQUAL, new_params, params)
    assert float(state.loss_scale) == 2.0**15 and int(state.counter) == 0


def test_loss_scaled_logs_the_unscaled_norm_and_clips_the_unscaled_grads():
    ns = recipe(CLIPPING)
    params, x, y = ns["params"], ns["x"], ns["y"]
    true_grads = jax.grad(ns["loss_fn"])(params, x, y)
    true_norm = float(optax.tree.norm(true_grads))
    # Under the text's max_norm the true grads pass unclipped; their scaled copies would not.
    assert true_norm < ns["max_norm"] < 2.0**16 * true_norm
    new_params, opt_state, grad_norm = ns["wrapped_step"](
        params, ns["wrapped"].init(params), x, y)
    np.testing.assert_allclose(grad_norm, true_norm, rtol=1e-2)
    step = jax.tree_util.tree_map(jnp.subtract, new_params, params)
    expected = jax.tree_util.tree_map(lambda g: -0.1 * g, true_grads)
    error = optax.tree.norm(jax.tree_util.tree_map(jnp.subtract, step, expected))
    assert error / optax.tree.norm(expected) < 1e-2
    assert bool(opt_state.last_finite) and int(opt_state.skipped_steps) == 0


def test_loss_scaled_clips_inside_to_max_norm():
    ns = recipe(CLIPPING)
    params, x, y = ns["params"], ns["x"], ns["y"]
    true_norm = float(optax.tree.norm(jax.grad(ns["loss_fn"])(params, x, y)))
    ns["max_norm"] = true_norm / 4
    ns["wrapped"] = ns["jamp"].loss_scaled(
        optax.chain(optax.clip_by_global_norm(ns["max_norm"]), optax.sgd(0.1)))
    new_params, _, _ = ns["wrapped_step"](params, ns["wrapped"].init(params), x, y)
    step = jax.tree_util.tree_map(jnp.subtract, new_params, params)
    np.testing.assert_allclose(optax.tree.norm(step), 0.1 * true_norm / 4, rtol=1e-3)


# Gradient penalty


def _reference_penalized_grads(ns):
    loss_fn, grad_norm = ns["loss_fn"], ns["grad_norm"]
    x, y = ns["x"], ns["y"]
    penalized = lambda p: loss_fn(p, x, y) + grad_norm(jax.grad(loss_fn)(p, x, y))
    return jax.grad(penalized)(ns["params"])


def test_penalty_is_the_unscaled_one_in_float32():
    ns = _float32(recipe(PENALTY))
    params, x, y = ns["params"], ns["x"], ns["y"]
    reference = ns["grad_norm"](jax.grad(ns["loss_fn"])(params, x, y))
    for scale in (1.0, 2.0**16, 2.0**24):
        np.testing.assert_allclose(ns["penalty"](params, at_scale(ns, scale), x, y), reference,
                                   rtol=1e-6)


def test_penalty_in_float16_does_not_depend_on_the_scale():
    ns = recipe(PENALTY)
    params, x, y = ns["params"], ns["x"], ns["y"]
    reference = ns["grad_norm"](jax.grad(ns["loss_fn"])(params, x, y))
    penalties = [ns["penalty"](params, at_scale(ns, s), x, y) for s in (2.0**4, 2.0**16)]
    np.testing.assert_allclose(penalties[0], penalties[1], rtol=1e-3)
    np.testing.assert_allclose(penalties[1], reference, rtol=2e-2)


def test_input_gradient_penalty_is_the_unscaled_one():
    # The text's WGAN-GP variant: the same unscale, differentiating with respect to x.
    ns = _float32(recipe(PENALTY))
    scaler, params, x, y = ns["scaler"], ns["params"], ns["x"], ns["y"]
    state = scaler.init()
    scaled = jax.grad(lambda x: scaler.scale(state, ns["amp_loss"](params, x, y)))(x)
    grads, found_inf = scaler.unscale(state, scaled)
    reference = ns["grad_norm"](jax.grad(ns["loss_fn"], argnums=1)(params, x, y))
    np.testing.assert_allclose(ns["amp_grad_norm"](grads), reference, rtol=1e-6)
    assert not bool(found_inf)


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_penalty_step_follows_the_penalized_loss(precision):
    ns = recipe(PENALTY)
    if precision == "float32":
        _float32(ns)
    params, tx = ns["params"], ns["tx"]
    # The penalty's own grads are about 1: 2**16 would overflow float16, as torch's would; the
    # scaler would back off to a scale that fits within a few steps.
    new_params, _, state = ns["penalty_step"](params, tx.init(params), at_scale(ns, 2.0**12),
                                              ns["x"], ns["y"])
    assert int(state.counter) == 1 and float(state.loss_scale) == 2.0**12
    step = jax.tree_util.tree_map(jnp.subtract, new_params, params)
    expected = jax.tree_util.tree_map(lambda g: -0.1 * g, _reference_penalized_grads(ns))
    error = optax.tree.norm(jax.tree_util.tree_map(jnp.subtract, step, expected))
    assert error / optax.tree.norm(expected) < (1e-5 if precision == "float32" else 5e-3)


# Several models and optimizers sharing one scaler


@jax.custom_vjp
def inf_grads(tree):
    """The identity, whose backward fills the cotangents with inf: an overflow in one model."""
    return tree


inf_grads.defvjp(lambda tree: (tree, None),
                 lambda _, g: (jax.tree_util.tree_map(lambda t: jnp.full_like(t, jnp.inf), g),))


def _two_models(poisoned=None):
    ns = recipe(SHARED)
    if poisoned is not None:
        losses = ns["amp_losses"]
        if poisoned == "a":
            ns["amp_losses"] = lambda pa, pb, x, y: losses(inf_grads(pa), pb, x, y)
        else:
            ns["amp_losses"] = lambda pa, pb, x, y: losses(pa, inf_grads(pb), x, y)
    params_a = ns["params"]
    params_b = jax.tree_util.tree_map(lambda w: -w / 2, params_a)
    # 2**10: a scale under which the clean step's float16 grads stay finite.
    inputs = (params_a, params_b, ns["tx_a"].init(params_a), ns["tx_b"].init(params_b),
              at_scale(ns, 2.0**10))
    return inputs, ns["two_model_step"](*inputs, ns["x"], ns["y"])


@pytest.fixture(scope="module")
def clean_two_model_step():
    return _two_models()


def test_two_models_finite_step_updates_both(clean_two_model_step):
    (pa, pb, _, _, _), (new_a, new_b, opt_a, _, state) = clean_two_model_step
    assert not np.array_equal(new_a["w1"], pa["w1"]) and not np.array_equal(new_b["w1"], pb["w1"])
    assert int(opt_a[0].count) == 1
    assert float(state.loss_scale) == 2.0**10 and int(state.counter) == 1


@pytest.mark.parametrize("poisoned", ["a", "b"])
def test_an_inf_in_one_model_skips_only_its_optimizer(poisoned, clean_two_model_step):
    (pa, pb, opt_a, opt_b, _), out = _two_models(poisoned)
    new_a, new_b, new_opt_a, new_opt_b, state = out
    clean_a, clean_b, clean_opt_a, clean_opt_b, _ = clean_two_model_step[1]
    if poisoned == "a":
        assert_trees(TREE_EQUAL, (new_a, new_opt_a), (pa, opt_a))  # A skipped its step
        assert_trees(np.testing.assert_allclose, (new_b, new_opt_b), (clean_b, clean_opt_b),
                     rtol=1e-6)  # B stepped as it would have without A's inf
    else:
        assert_trees(TREE_EQUAL, (new_b, new_opt_b), (pb, opt_b))
        assert_trees(np.testing.assert_allclose, (new_a, new_opt_a), (clean_a, clean_opt_a),
                     rtol=1e-6)
    # One scale, backed off once, and the finite-step count reset.
    assert float(state.loss_scale) == 2.0**9 and int(state.counter) == 0


def test_loss_scaled_over_both_models_skips_both():
    # The documented JAX form where it differs: one wrapped multi_transform, one decision.
    ns = recipe(SHARED)
    jamp = ns["jamp"]
    params = {"a": ns["params"], "b": jax.tree_util.tree_map(jnp.negative, ns["params"])}
    labels = {k: jax.tree_util.tree_map(lambda _, k=k: k, v) for k, v in params.items()}
    tx = jamp.loss_scaled(optax.multi_transform({"a": ns["tx_a"], "b": ns["tx_b"]}, labels))
    opt_state = tx.init(params)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    grads["a"]["w1"] = grads["a"]["w1"].at[0, 0].set(jnp.inf)
    updates, new_state = tx.update(grads, opt_state, params)
    assert all(not np.any(u) for u in jax.tree_util.tree_leaves(updates))
    assert float(jamp.get_loss_scale(new_state).loss_scale) == 2.0**15
