"""docs/debugging.md runs as written, top to bottom, and does what its text says.

The conventions are those of `doc_blocks`; the pycon blocks are doctests, so the values and
errors they show are the ones the debugger gives.
"""

import pathlib

import jax
import numpy as np

import doc_blocks

DOC = pathlib.Path(__file__).parents[2] / "docs" / "debugging.md"


def _finite(tree) -> bool:
    return all(bool(np.all(np.isfinite(g))) for g in jax.tree_util.tree_leaves(tree))


def test_blocks_follow_the_convention():
    assert doc_blocks.convention_errors(DOC) == []
    assert sum(b.runs for b in doc_blocks.blocks(DOC)) >= 8


def _symptom(ns):
    assert not np.isfinite(ns["half_loss"](ns["variables"], ns["x"]))


def _fixed(ns):
    reference = ns["loss_fn"](ns["variables"], ns["x"])
    assert _finite(ns["grads"]) and abs(ns["value"] - reference) <= 1e-2 * abs(reference)


def _scales(ns):
    report = ns["scales"]
    assert report.gradient_underflow > 0.5 and report.suggested_loss_scale > 1
    assert "suggested initial loss scale 2^" in report.summary()


CHECKS = {
    "print(loss_fn(variables, x), jax.jit(half_loss)": _symptom,
    "fixed_loss = jamp.autocast": _fixed,
    "scales = precision_report(": _scales,
}


def test_blocks_run_and_do_what_the_text_says():
    doc_blocks.run_document(DOC, checks=CHECKS)
