"""docs/architecture.md's code runs top to bottom and does what its text says."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import doc_blocks

DOC = pathlib.Path(__file__).parents[2] / "docs" / "architecture.md"


def test_blocks_follow_the_convention():
    assert doc_blocks.convention_errors(DOC) == []


def test_blocks_run_and_do_what_the_text_says():
    def doubled(ns):
        x = np.asarray(ns["x"], np.float64)
        expected = 2 * np.sin(2 * np.sin(x).sum())
        np.testing.assert_allclose(ns["doubled"], expected, rtol=1e-6)
        # "computed by a real lax.scan", and it still runs under jit and grad.
        rebuilt = jax.make_jaxpr(lambda x: ns["DoubleSin"]().evaluate(ns["closed"], [x]))(ns["x"])
        assert "scan" in {eqn.primitive.name for eqn in rebuilt.eqns}
        run = lambda x: ns["DoubleSin"]().evaluate(ns["closed"], [x])[0]
        np.testing.assert_allclose(jax.jit(run)(ns["x"]), ns["doubled"], rtol=1e-6)
        assert jnp.all(jnp.isfinite(jax.grad(run)(ns["x"])))

    def counts(ns):
        assert ns["counts"]["sin"] == 4

    doc_blocks.run_document(DOC, checks={
        "doubled = DoubleSin()": doubled,
        "counts[name] = counts.get(name, 0) + site.times": counts,
    })
