"""The README's code runs as written, top to bottom, and does what its text says.

The conventions (which blocks run, in what namespace, how a block is kept from running) are
those of `doc_blocks`.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

import doc_blocks
from helpers import jaxpr_equations

DOC = pathlib.Path(__file__).parents[1] / "README.md"


def test_blocks_follow_the_convention():
    assert doc_blocks.convention_errors(DOC) == []
    assert sum(b.runs for b in doc_blocks.blocks(DOC)) >= 4


def _tour(ns):
    assert int(ns["opt_state"].total_steps) == 1 and bool(ns["opt_state"].last_finite)


def _initialize(ns):
    weights = ns["weights"]
    assert weights["Dense_0"]["kernel"].dtype == jnp.float16
    assert weights["BatchNorm_0"]["scale"].dtype == jnp.float32
    masters = ns["jamp"].master_params(ns["opt_state"])
    assert masters["Dense_0"]["kernel"].dtype == jnp.float32
    np.testing.assert_array_equal(weights["Dense_0"]["kernel"],
                                  masters["Dense_0"]["kernel"].astype(jnp.float16))
    assert ns["jamp"].state_dict(ns["opt_state"]) == {
        "loss_scaler0": {"loss_scale": 65536.0, "unskipped": 1}}
    text = ns["train_step"].lower(weights, ns["batch_stats"], ns["opt_state"], ns["images"],
                                  ns["labels"]).as_text()
    results = re.findall(r"stablehlo\.dot_general.*?->\s*tensor<(?:[0-9?]+x)*(\w+)>", text)
    assert results and set(results) == {"f16"}  # "every matmul of that step runs in float16"


def _policy(ns):
    assert str(ns["policy"]) == "p=full,c=bf16,o=full"
    assert ns["logits"].dtype == jnp.float32


def _opt_levels(ns):
    props = ns["props"]
    assert (props.cast_model_type, props.master_weights, props.loss_scale) == (
        jnp.float16, True, 128.0)
    assert len(props.options) == 7


def _region(ns):
    assert ns["value"].dtype == jnp.float32
    leaves = jax.tree_util.tree_leaves
    for g, p in zip(leaves(ns["grads"]), leaves(ns["params"]), strict=True):
        assert g.dtype == p.dtype and np.all(np.isfinite(g))


def _profile(ns):
    rows = {row.key: row for row in ns["prof"].key_averages()}
    assert rows["step"].count == 3
    matmul_flops = 2 * 16 * 64 * 128 + 2 * 16 * 128 * 32
    assert sum(r.flops for r in rows.values() if r.kind == "op") == 3 * matmul_flops
    assert ns["report"].flops == {"bfloat16": matmul_flops}


def _rules(ns):
    variables = ns["net"].init(jax.random.key(0), ns["images"])
    jaxpr = jax.make_jaxpr(lambda v, x: ns["ruled"](v, x, train=False))(variables, ns["images"])
    dots = [e.invars[0].aval.dtype for e in jaxpr_equations(jaxpr.jaxpr)
            if e.primitive.name == "dot_general"]
    assert dots == [jnp.float16, jnp.float32] and ns["logits"].dtype == jnp.float32


def _debugging(ns):
    report = ns["report"]
    assert [p for p, _ in report.rules] == ["/Net/hot"] and report.rules_checked
    assert report.summary().startswith("Net/hot overflows float16; rules=[('/Net/hot', "
                                       "jnp.float32)]")
    assert np.isfinite(ns["value"])
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(ns["grads"]))
    found = ns["first_nonfinite"](ns["loss"], ns["variables"], ns["x"], dtype=jnp.float16,
                                  device_type="cuda")
    assert found.module == "Net/hot" and "x * 1e3" in found.code


CHECKS = {
    "def step(": _tour,
    "jamp.get_policy(": _policy,
    "jamp.initialize(": _initialize,
    "jamp.properties(": _opt_levels,
    "jamp.autocast(enabled=False)": _region,
    '("BatchNorm_*", jnp.float32)': _rules,
    "report = amp_report(step": _profile,
    "precision_report(loss, variables": _debugging,
}


def test_blocks_run_and_do_what_the_text_says():
    doc_blocks.run_document(DOC, checks=CHECKS)


def test_the_convention_catches_untested_blocks(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```\nx = 1\n```\n"                                   # no language
        "```text\n>>> 1 + 1\n2\n```\n"                         # a session outside pycon
        "<!-- not run: -->\n```python\nx = 2\n```\n"           # a marker without a reason
        "<!-- not run: a sketch -->\n```python\nraise SystemExit\n```\n"
        "```python\nx = 3\n```\n"
        "```pycon\n>>> x + 1\n4\n```\n")
    errors = doc_blocks.convention_errors(doc)
    assert [e.split(": ", 1)[0] for e in errors] == [f"{doc}:{n}" for n in (2, 5, 10)]
    assert doc_blocks.run_document(doc)["x"] == 3  # the marked blocks did not run
