"""docs/distributed.md's code runs top to bottom on the tests' 8 CPU devices and does what its
text says."""

import pathlib
import tempfile

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import doc_blocks
from helpers import assert_trees_equal

DOC = pathlib.Path(__file__).parents[1] / "docs" / "distributed.md"

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
pytest.importorskip("orbax.checkpoint")  # the `checkpoint` extra: the document saves with it


def _data_parallel(ns):
    kernel = ns["params"]["Dense_0"]["kernel"]
    assert kernel.sharding.is_fully_replicated and len(kernel.sharding.device_set) == 8
    assert int(ns["opt_state"].skipped_steps) == 0


def _fsdp(ns):
    mu = ns["opt_state"].inner_state.inner_state[0].mu["Dense_0"]["kernel"]
    assert mu.sharding.spec in (P("data"), P("data", None)) and len(mu.sharding.device_set) == 8


def _resumed(ns):
    # The run that stopped after step 5 and resumed equals the one that never stopped.
    ns["directory"] = tempfile.mkdtemp()
    straight = ns["train"](6)
    assert_trees_equal(ns["resumed"], straight)
    assert int(ns["resumed"]["step"]) == 6


def _moved(ns):
    assert_trees_equal(ns["moved"], ns["resumed"])
    for leaf in jax.tree_util.tree_leaves(ns["moved"]):
        assert leaf.sharding.device_set == set(jax.devices()[:4])


CHECKS = {
    "opt_state = jax.device_put(tx.init(params), replicated)": _data_parallel,
    "opt_state = fsdp(tx.init(params))": _fsdp,
    "resumed = train(6)": _resumed,
    "moved = jamp.restore_checkpoint(manager, fsdp(resumed, four))": _moved,
}


def test_document_runs_and_does_what_it_says():
    assert not doc_blocks.convention_errors(DOC)
    doc_blocks.run_document(DOC, checks=CHECKS)
