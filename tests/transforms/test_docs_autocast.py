"""docs/autocast.md runs as written, top to bottom, and does what its text says.

The conventions (which blocks run, in what namespace, how a block is kept from running) are
those of `doc_blocks`; the pycon blocks are doctests, so the error messages they show are the
ones raised.
"""

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np

import doc_blocks
from helpers import jaxpr_equations

DOC = pathlib.Path(__file__).parents[2] / "docs" / "autocast.md"
LOW = (jnp.float16, jnp.bfloat16)


def test_blocks_follow_the_convention():
    assert doc_blocks.convention_errors(DOC) == []
    assert sum(b.runs for b in doc_blocks.blocks(DOC)) >= 4


def _intro(ns):
    assert ns["value"].dtype == jnp.float32
    assert {g.dtype for g in jax.tree_util.tree_leaves(ns["grads"])} == {jnp.dtype(jnp.float32)}


def _torch_forms(ns):
    # The outputs come back in the traced dtypes, the region's float16 matmul included.
    assert ns["forward"](ns["x"], jnp.eye(4)).dtype == jnp.float32
    assert ns["loss"](ns["params"], ns["batch"]).dtype == jnp.float32


def _masked(ns):
    np.testing.assert_allclose(ns["out"], [[1.0, 0.0], [0.5, 0.5]], atol=1e-6)


def _table(ns):
    table = ns["table"]
    assert table.rule("logistic") == "fp32" and table.rule("cumsum") is None
    assert table.rule("dot_general") == "bfloat16"
    assert ns["loss"](ns["params"], ns["batch"]).dtype == jnp.float32


def _primitive_names(ns):
    block = next(b.code for b in doc_blocks.blocks(DOC) if "primitive_names(softmax" in b.code)
    definition, call = block.rsplit("\n\n", 1)
    call, shown = call.split("\n# ", 1)
    exec(definition, ns)
    assert eval(call, ns) == eval(shown)


def _regions(ns):
    f, x, w = ns["f"], ns["x"], ns["w"]
    assert ns["jamp"].autocast(f, device_type="cpu")(x, w).dtype == jnp.float32
    raw = ns["jamp"].autocast(f, device_type="cpu", cast_outputs=False)
    assert raw(x, w).dtype == jnp.bfloat16  # `a @ c`, back in the region's dtype


def _outputs(ns):
    assert ns["logits"].dtype in LOW


def _linen(ns):
    assert ns["logits"].dtype == jnp.float32
    stats = ns["updates"]["batch_stats"]["BatchNorm_0"]
    assert not np.allclose(stats["mean"], 0.0)
    assert {u.dtype for u in jax.tree.leaves(ns["updates"])} == {jnp.dtype(jnp.float32)}


def _nnx(ns):
    model = ns["model"]
    assert not np.allclose(model.bn.mean[...], 0.0)  # the batch statistics moved
    assert int(model.dropout.rngs.count[...]) == 2  # two calls, two masks drawn
    chex.assert_shape(ns["y"], (4, 8))
    chex.assert_type(ns["y"], jnp.float32)


def _nnx_functional(ns):
    assert ns["y"].dtype == jnp.float32
    assert not np.allclose(ns["new_state"]["bn"]["mean"][...], 0.0)


def _custom(ns):
    assert ns["grads"].dtype == jnp.float32 and np.all(np.isfinite(ns["grads"]))
    # The fwd and bwd given to defvjp are jamp's wrappers around the ones written.
    fused = ns["fused"]
    assert fused.fwd.__wrapped__ is ns["fused_fwd"] and fused.bwd.__wrapped__ is ns["fused_bwd"]


def _dot_dtypes(fn, *args):
    return [e.invars[0].aval.dtype for e in jaxpr_equations(jax.make_jaxpr(fn)(*args).jaxpr)
            if e.primitive.name == "dot_general"]


def _linen_rules(ns):
    assert _dot_dtypes(ns["ruled"], ns["weights"], ns["x"]) == [jnp.float16, jnp.float32]
    assert ns["stats"]["batch_stats"]["BatchNorm_0"]["mean"].dtype == jnp.float32


def _nnx_rules(ns):
    chex.assert_shape(ns["tower_out"], (ns["x"].shape[0], 4))
    ns["tower"].eval()  # BatchNorm's statistics are not updated inside make_jaxpr's trace
    low = ns["jamp"].policy.autocast_table(jax.default_backend()).default_dtype
    assert _dot_dtypes(ns["tower_forward"], ns["x"]) == [low, jnp.float32]


CHECKS = {
    "jax.jit(jax.value_and_grad(loss))": _intro,
    '@jamp.autocast("cpu")': _torch_forms,
    "def masked_softmax": _masked,
    '.without("cumsum")': _table,
    "primitive_names(softmax": _primitive_names,
    "(regions nest)": _regions,
    "cast_outputs=False": _outputs,
    "jamp.autocast(model.apply, dtype=jnp.bfloat16)": _linen,
    '("BatchNorm_*", jnp.float32)': _linen_rules,
    '("blocks/1", jnp.float32)': _nnx_rules,
    "nnx.value_and_grad(jamp.autocast(loss_fn))": _nnx,
    "nnx.split(model)": _nnx_functional,
    "jamp.custom_bwd(fused_bwd)": _custom,
}


def test_blocks_run_and_do_what_the_text_says():
    doc_blocks.run_document(DOC, checks=CHECKS)
