"""docs/autograd.md runs top to bottom, does what it says, and maps every torch.autograd name
of the seed document to a name of jamp's (or to JAX's own, where it is not ported)."""

import functools
import pathlib
import re

import chex
import jax

import doc_blocks
import jamp

ROOT = pathlib.Path(__file__).parents[2]
DOC = ROOT / "docs" / "autograd.md"
SEED = next((ROOT.parent / "shared" / "seeds").glob("001_*.txt"), None)
# The torch.autograd names seed 001 documents (also checked against the seed when present).
SEED_NAMES = {
    "torch.autograd.Function", "torch.autograd.detect_anomaly",
    "torch.autograd.set_detect_anomaly", "torch.autograd.graph.saved_tensors_hooks",
    "torch.autograd.graph.save_on_cpu", "torch.autograd.graph.disable_saved_tensors_hooks",
    "torch.autograd.gradcheck", "torch.autograd.backward", "torch.autograd.grad",
    "torch.autograd.profiler.profile", "torch.autograd.profiler.emit_nvtx",
    "torch.autograd.profiler.emit_itt", "torch.autograd.profiler.load_nvprof",
}
# What JAX does itself (`jax.grad`, `jax.vjp` for backward and grad) or is retired (nvprof):
# docs/autograd.md's table says so beside each.
NOT_PORTED = {"torch.autograd.backward", "torch.autograd.grad",
              "torch.autograd.profiler.load_nvprof"}


def _saved_tensors(ns):
    assert ns["stored_bytes"] * 2 == ns["plain_bytes"]
    by_hand = jax.grad(ns["by_hand"])(ns["params"], ns["x"])
    compact = jax.grad(ns["compact"])(ns["params"], ns["x"])
    chex.assert_trees_all_equal(by_hand, compact)  # the two-function recipe is save_as's


def test_blocks_follow_the_convention():
    assert doc_blocks.convention_errors(DOC) == []


def test_blocks_run_and_do_what_the_text_says():
    doc_blocks.run_document(DOC, checks={"by_hand = saved_tensors_hooks(": _saved_tensors})


def test_every_seed_name_is_mapped():
    if SEED is not None:
        assert SEED_NAMES <= set(re.findall(r"torch\.autograd\.[A-Za-z_.]*[A-Za-z_]",
                                            SEED.read_text()))
    for name in SEED_NAMES - NOT_PORTED:
        value = jamp.autograd
        for part in name.removeprefix("torch.autograd.").split("."):
            value = getattr(value, part, None)
        assert callable(value), f"{name} has no counterpart in jamp.autograd"
    for name in NOT_PORTED:
        path = name.removeprefix("torch.autograd.").split(".")
        parent = functools.reduce(getattr, path[:-1], jamp.autograd)
        assert not hasattr(parent, path[-1]), f"{name} is ported now: map it above"
