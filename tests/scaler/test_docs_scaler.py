"""docs/scaler.md runs as written, top to bottom, and does what its text says (the
conventions are those of `doc_blocks`)."""

import pathlib

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

import doc_blocks
import jamp
import jamp.scaler as js

DOC = pathlib.Path(__file__).parents[2] / "docs" / "scaler.md"


def namespace():
    params = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.zeros(())}

    def loss_fn(p, batch):
        return jnp.mean((batch @ p["w"] + p["b"]) ** 2)

    return dict(jax=jax, jnp=jnp, optax=optax, jamp=jamp, js=js, flax=flax, params=params,
                loss_fn=loss_fn, generator_loss=loss_fn,
                feature_loss=lambda p, b: jnp.sum(p["w"] ** 2), batch=jnp.ones((4, 3)),
                tx=optax.adam(1e-2), opt_state=optax.adam(1e-2).init(params),
                loss_scale=js.DynamicLossScale(jnp.float32(2.0**15)))


def _jmp(ns):
    params, opt_state, ls = ns["train_step"](ns["params"], ns["opt_state"], ns["loss_scale"],
                                             ns["batch"])
    assert int(ls.counter) == 1 and not np.array_equal(params["w"], ns["params"]["w"])
    params2, _, ls2 = ns["train_step"](params, opt_state, ls, ns["batch"] * np.inf)
    assert np.array_equal(params2["w"], params["w"]) and float(ls2.loss_scale) == 2.0**14


def _grad_scaler(ns):
    params, opt_state, state = ns["train_step"](ns["params"], ns["opt_state"],
                                                ns["scaler_state"], ns["batch"])
    assert int(state.counter) == 1
    params2, _, state2 = ns["train_step"](params, opt_state, state, ns["batch"] * np.nan)
    assert np.array_equal(params2["w"], params["w"])
    assert ns["scaler"].get_scale(state2) == 32768.0


def _steps_move_the_params(calls, step="train_step"):
    def check(ns):
        params, opt_state = ns["params"], ns["opt_state"]
        for _ in range(calls):
            params, opt_state = ns[step](params, opt_state, ns["batch"])
        assert not np.array_equal(params["w"], ns["params"]["w"])

    return check


def _donated_cond(ns):
    # The block re-jits the wrapper section's train_step with donation and skip="cond".
    params = jax.tree_util.tree_map(jnp.array, ns["params"])
    opt_state = ns["tx"].init(params)
    new_params, new_state = ns["train_step"](params, opt_state, ns["batch"])
    assert params["w"].is_deleted()  # donated
    assert int(new_state.skipped_steps) == 0
    kept = np.asarray(new_params["w"])
    moments = np.asarray(new_state.inner_state[0].mu["w"])
    newer_params, newer_state = ns["train_step"](new_params, new_state, ns["batch"] * np.inf)
    np.testing.assert_array_equal(newer_params["w"], kept)
    np.testing.assert_array_equal(newer_state.inner_state[0].mu["w"], moments)
    assert int(newer_state.skipped_steps) == 1


def _two_losses(ns):
    _steps_move_the_params(1)({**ns, "opt_state": ns["tx"].init(ns["params"])})


def _flax_dynamic_scale(ns):
    state = ns["flax_state"]
    assert int(state.dynamic_scale.fin_steps) == 1
    skipped, _ = ns["flax_step"](state, ns["batch"] * np.inf)
    np.testing.assert_array_equal(skipped.params["w"], state.params["w"])
    assert float(skipped.dynamic_scale.scale) == 32768.0


def _one_call(ns):
    assert bool(ns["finite"]) and int(ns["loss_scale"].counter) == 1


def _own_loss_scale(ns):
    tx, params = ns["own_tx"], ns["params"]
    state = tx.init(params)
    ls = jamp.get_loss_scale(state)
    assert isinstance(ls, js.LossScale)
    grads = jax.grad(lambda p: ls.scale(ns["loss_fn"](p, ns["batch"] * np.inf)))(params)
    _, state = tx.update(grads, state, params)
    assert float(jamp.get_loss_scale(state).loss_scale) == 2.0**9
    assert int(state.skipped_steps) == 1


def _checkpoint(ns):
    # The restored state is the saved one, loss scale included: it continues the trajectory.
    assert flax.serialization.to_bytes(ns["opt_state"]) == ns["blob"]
    assert isinstance(jamp.get_loss_scale(ns["opt_state"]), js.GradScalerState)


CHECKS = {
    "js.DynamicLossScale(jnp.float32(2**15))": _jmp,
    "scaler_state = scaler.init()": _grad_scaler,
    "optax.clip_by_global_norm(1.0), optax.adamw(1e-3)": _steps_move_the_params(1),
    'skip="cond"': _donated_cond,
    "num_losses=2": _two_losses,
    "optax.MultiSteps": _steps_move_the_params(4, step="micro_step"),
    "dynamic_scale: jamp.DynamicScale": _flax_dynamic_scale,
    "jamp.scaled_value_and_grad": _one_call,
    "class HalvingLossScale": _own_loss_scale,
    "flax.serialization.to_bytes": _checkpoint,
}


def test_blocks_follow_the_convention():
    assert doc_blocks.convention_errors(DOC) == []


def test_blocks_run_and_do_what_the_text_says():
    # Every block runs, top to bottom, in one namespace (the first blocks take `params`,
    # `loss_fn`, `tx`... from `namespace`); the recipes' own checks are in test_recipes.py.
    doc_blocks.run_document(DOC, namespace=namespace(), checks=CHECKS)
