"""docs/apex.md's code runs top to bottom and does what its text says."""

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np

import doc_blocks

DOC = pathlib.Path(__file__).parents[2] / "docs" / "apex.md"


def _levels(ns):
    v = ns["amp_variables"]
    assert v["params"]["Conv_0"]["kernel"].dtype == jnp.float16
    assert v["params"]["BatchNorm_0"]["scale"].dtype == jnp.float32
    assert v["batch_stats"]["BatchNorm_0"]["mean"].dtype == jnp.float32


def _step(ns):
    assert np.isfinite(float(ns["loss"]))
    stats = jax.tree_util.tree_leaves(ns["batch_stats"])
    assert {s.dtype for s in stats} == {np.dtype(np.float32)}
    masters = ns["jamp"].master_params(ns["opt_state"])
    chex.assert_trees_all_equal(
        ns["params"], jax.tree_util.tree_map(lambda p, m: m.astype(p.dtype), ns["params"], masters))


def _clipping(ns):
    assert {m.dtype for m in jax.tree_util.tree_leaves(ns["masters"])} == {np.dtype(np.float32)}


def _state_dict(ns):
    assert ns["saved"] == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 3}}
    assert ns["jamp"].state_dict(ns["restored"]) == ns["saved"]


def _gan(ns):
    jamp = ns["jamp"]
    assert set(jamp.state_dict(ns["d_state"])) == {"loss_scaler0", "loss_scaler1",
                                                   "loss_scaler2"}
    assert jamp.state_dict(ns["d_state"])["loss_scaler0"]["unskipped"] == 1
    assert jamp.state_dict(ns["d_state"])["loss_scaler2"]["unskipped"] == 0  # not its loss
    assert jamp.state_dict(ns["g_state"])["loss_scaler2"]["unskipped"] == 1


def _nnx(ns):
    assert ns["model"].conv.kernel.dtype == jnp.float16
    assert ns["model"].bn.scale.dtype == jnp.float32
    assert ns["losses"][-1] < ns["losses"][0]
    assert ns["masters"]["conv"]["kernel"].dtype == jnp.float32
    restored = ns["jax"].tree_util.tree_leaves(ns["restored"])
    assert all(isinstance(x, ns["jax"].Array) for x in restored)


CHECKS = {
    "apply_fn, amp_variables, tx = jamp.initialize(": _levels,
    "def train_step(": _step,
    "clipped_tx = ": _clipping,
    "saved = jamp.state_dict": _state_dict,
    "g_tx.update([None, None, g_grads]": _gan,
    "jamp.load_state_dict(optimizer.opt_state, checkpoint)": _nnx,
}


def test_blocks_follow_the_convention():
    assert doc_blocks.convention_errors(DOC) == []


def test_blocks_run_and_do_what_the_text_says():
    doc_blocks.run_document(DOC, checks=CHECKS)
