"""docs/fp8.md runs as written, top to bottom, and does what its text says (the conventions are
those of `doc_blocks`)."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import doc_blocks

DOC = pathlib.Path(__file__).parents[2] / "docs" / "fp8.md"


def _saturates(ns):
    np.testing.assert_array_equal(ns["cast"].astype(jnp.float32), [448.0, -448.0, 3.0, np.nan])


def _bfloat16_grads(ns):
    assert ns["grads"].dtype == jnp.bfloat16 and ns["grads"].shape == (32, 16)
    assert bool(jnp.all(jnp.isfinite(ns["grads"].astype(jnp.float32))))


def _state_moves(ns):
    state = ns["state"]
    # Three steps: three amaxes in each history, the scales computed from them.
    for history in (state.input_amax_history, state.kernel_amax_history,
                    state.output_grad_amax_history):
        assert int(jnp.sum(history > 0)) == 3
    assert float(state.input_scale[0]) != 1.0 and float(state.output_grad_scale[0]) != 1.0


def _autocast_state_moves(ns):
    state = ns["fp8_state"]
    assert list(state) == [f"Net/Block_{i}/Dense_{j}" for i in range(2) for j in range(2)]
    for site in state.values():
        assert int(jnp.sum(site.output_grad_amax_history > 0)) == 3
        assert float(site.input_scale[0]) != 1.0


def _resumes_as_uninterrupted(ns):
    for resumed, uninterrupted in zip(jax.tree.leaves(ns["resumed"]),
                                      jax.tree.leaves(ns["uninterrupted"]), strict=True):
        np.testing.assert_array_equal(resumed, uninterrupted)


def _blocks_in_fp8(ns):
    assert ns["fp8_casts"] == 8
    assert ns["logits"].dtype == jnp.float32 and ns["logits"].shape == (8, 16)
    assert bool(jnp.all(jnp.isfinite(ns["logits"])))


CHECKS = {
    "logits = jax.jit(apply)(variables, tokens)": _blocks_in_fp8,
    "cast = jax.jit(jamp.fp8.saturating_cast": _saturates,
    "grads = jax.grad(loss)(kernel, x)": _bfloat16_grads,
    "kernel, state = train_step(kernel, state, x)": _state_moves,
    "params, fp8_state = fp8_step(params, fp8_state, tokens)": _autocast_state_moves,
    "uninterrupted = fp8_step(params, fp8_state, tokens)": _resumes_as_uninterrupted,
}


def test_blocks_follow_the_convention():
    assert doc_blocks.convention_errors(DOC) == []


def test_blocks_run_and_do_what_the_text_says():
    doc_blocks.run_document(DOC, checks=CHECKS)
