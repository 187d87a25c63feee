"""The examples of docs/scaler.md run as written and do what the text says."""

import pathlib
import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import doc_blocks
import jamp
import jamp.scaler as js

DOC = pathlib.Path(__file__).parents[2] / "docs" / "scaler.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def namespace():
    params = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.zeros(())}

    def loss_fn(p, batch):
        return jnp.mean((batch @ p["w"] + p["b"]) ** 2)

    return dict(jax=jax, jnp=jnp, optax=optax, jamp=jamp, js=js, flax=flax, params=params,
                loss_fn=loss_fn, generator_loss=loss_fn,
                feature_loss=lambda p, b: jnp.sum(p["w"] ** 2), batch=jnp.ones((4, 3)),
                tx=optax.adam(1e-2), opt_state=optax.adam(1e-2).init(params),
                loss_scale=js.DynamicLossScale(jnp.float32(2.0**15)))


def block_with(text):
    found = [b for b in BLOCKS if text in b]
    assert len(found) == 1, text
    return found[0]


def test_whole_document_runs_in_order():
    # Every block runs, top to bottom, in one namespace; the tests below check what they do.
    assert not doc_blocks.convention_errors(DOC)
    doc_blocks.run_document(DOC, namespace=namespace())


def test_jmp_block():
    ns = namespace()
    exec(block_with("js.DynamicLossScale(jnp.float32(2**15))"), ns)
    params, opt_state, ls = ns["train_step"](ns["params"], ns["opt_state"], ns["loss_scale"],
                                             ns["batch"])
    assert int(ls.counter) == 1 and not np.array_equal(params["w"], ns["params"]["w"])
    params2, opt_state2, ls2 = ns["train_step"](params, opt_state, ls, ns["batch"] * np.inf)
    assert np.array_equal(params2["w"], params["w"]) and float(ls2.loss_scale) == 2.0**14


def test_grad_scaler_block():
    ns = namespace()
    exec(block_with("scaler_state = scaler.init()"), ns)
    params, opt_state, state = ns["train_step"](ns["params"], ns["opt_state"],
                                                ns["scaler_state"], ns["batch"])
    assert int(state.growth_tracker) == 1
    params2, _, state2 = ns["train_step"](params, opt_state, state, ns["batch"] * np.nan)
    assert np.array_equal(params2["w"], params["w"])
    assert ns["scaler"].get_scale(state2) == 32768.0


@pytest.mark.parametrize("text,calls", [
    ("optax.clip_by_global_norm(1.0), optax.adamw(1e-3)", 1),
    ("num_losses=2", 1),
    ("optax.MultiSteps", 4),
])
def test_wrapper_blocks(text, calls):
    ns = namespace()
    exec(block_with(text), ns)
    if "opt_state = tx.init(params)" not in block_with(text):
        ns["opt_state"] = ns["tx"].init(ns["params"])
    step = ns.get("train_step") or ns["micro_step"]
    params, opt_state = ns["params"], ns["opt_state"]
    for _ in range(calls):
        params, opt_state = step(params, opt_state, ns["batch"])
    assert not np.array_equal(params["w"], ns["params"]["w"])


def test_donated_cond_block():
    # The block re-jits the wrapper section's train_step with donation and skip="cond".
    ns = namespace()
    exec(block_with("optax.clip_by_global_norm(1.0), optax.adamw(1e-3)"), ns)
    exec(block_with('skip="cond"'), ns)
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


def test_one_call_block():
    ns = namespace()
    exec(block_with("jamp.scaled_value_and_grad"), ns)
    assert bool(ns["finite"]) and int(ns["loss_scale"].counter) == 1


def test_checkpoint_block():
    ns = namespace()
    tx = jamp.loss_scaled(optax.adam(1e-2))
    ns.update(tx=tx, opt_state=tx.init(ns["params"]))
    exec(block_with("flax.serialization.to_bytes"), ns)
    assert isinstance(ns["opt_state"], js.LossScaledState)


def test_flax_dynamic_scale_block():
    ns = namespace()
    exec(block_with("dynamic_scale: jamp.DynamicScale"), ns)
    state = ns["flax_state"]
    assert int(state.dynamic_scale.fin_steps) == 1
    skipped, _ = ns["flax_step"](state, ns["batch"] * np.inf)
    np.testing.assert_array_equal(skipped.params["w"], state.params["w"])
    assert float(skipped.dynamic_scale.scale) == 32768.0
