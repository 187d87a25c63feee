"""docs/autocast.md runs as written, top to bottom, and does what its text says.

The conventions (which blocks run, in what namespace, how a block is kept from running) are
those of `doc_blocks`; the pycon blocks are doctests, so the error messages they show are the
ones raised.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import doc_blocks

DOC = pathlib.Path(__file__).parents[1] / "docs" / "autocast.md"
LOW = (jnp.float16, jnp.bfloat16)


def test_blocks_follow_the_convention():
    assert doc_blocks.convention_errors(DOC) == []
    assert sum(b.runs for b in doc_blocks.blocks(DOC)) >= 4


def _intro(ns):
    assert ns["value"].dtype == jnp.float32
    assert {g.dtype for g in jax.tree_util.tree_leaves(ns["grads"])} == {jnp.dtype(jnp.float32)}


def _masked(ns):
    np.testing.assert_allclose(ns["out"], [[1.0, 0.0], [0.5, 0.5]], atol=1e-6)


def _primitive_names(ns):
    block = next(b.code for b in doc_blocks.blocks(DOC) if "primitive_names(jax.nn" in b.code)
    call, shown = block.split("\n# ", 1)
    assert eval(call, ns) == eval(shown)


def _outputs(ns):
    assert ns["logits"].dtype in LOW


def _linen(ns):
    assert ns["logits"].dtype == jnp.float32
    stats = ns["updates"]["batch_stats"]["BatchNorm_0"]
    assert not np.allclose(stats["mean"], 0.0) and stats["mean"].dtype == jnp.float32


def _nnx(ns):
    model = ns["model"]
    assert not np.allclose(model.bn.mean[...], 0.0)  # the batch statistics moved
    assert int(model.dropout.rngs.count[...]) == 2  # two calls, two masks drawn
    assert ns["y"].shape == (4, 8)


def _custom(ns):
    assert ns["grads"].dtype == jnp.float32 and np.all(np.isfinite(ns["grads"]))


CHECKS = {
    "jax.jit(jax.value_and_grad(loss))": _intro,
    "def masked_softmax": _masked,
    "primitive_names(jax.nn.softmax": _primitive_names,
    "cast_outputs=False": _outputs,
    "jamp.autocast(model.apply, dtype=jnp.bfloat16)": _linen,
    "nnx.value_and_grad(jamp.autocast(loss_fn))": _nnx,
    "jamp.custom_bwd(fused_bwd)": _custom,
}


def test_blocks_run_and_do_what_the_text_says():
    doc_blocks.run_document(DOC, checks=CHECKS)
